"""The flagged GEMM:

    walk_matmul(w, operands, walk, R, ...) == for each walk block j (R rows):
                                                  out_j = a_j @ w   (add: out_j += a_j @ w)

x @ w (or out += x @ w) on a Hopper GPU as one persistent Pallas Mosaic GPU kernel that tells
the copy engines which rows are done, and waits for rows that the copy engines bring in. The fused ops (all_gather_matmul, matmul_reduce_scatter, matmul_psum) are
walks of it.

- A walk: the output rows are computed block after block (R rows each, WalkBlock), each
  block's rows of `a` and of the output taken from any operand's block, fixed or chosen by
  this rank (block + rank) % blocks, so one kernel serves every rank of a ring. A block may
  add its product into the output rows (out += a @ w: the TMA stores reduce in L2, so the
  rows already there are never loaded into the SMs).
- Producer flags: once every tile of `flag_rows` rows of a block with `flag` is stored (the TMA
  stores completed, then a GPU-scope release), flags[walk row // flag_rows] has reached
  `flag_target(...)` (walk rows: block j's rows are j * R ...). A copy-engine stream that
  waits on it with `cuStreamWaitValue32(GEQ)` may copy those rows while the kernel works on
  later ones.
- Consumer flags: a tile of a block with `wait` waits (system-scope acquire) until the low word
  of its uint64 flag in `ready` (written by stream memory operations after the copies:
  cc/cuda/cuda_executor.h, Announce) is >= ready_value, before it reads the rows: its rows of `a`
  (before its mainloop) or the output rows it adds into (before its stores). Flag
  (ready_block * R + row in the block) // ready_rows.

Why our own kernel: cuBLAS cannot say which tiles are done (CUDA 13 removed its progress
counters), and cutting a cuBLAS GEMM into row pieces costs 4-13% per piece (docs/design.md).

Forward progress (docs/design.md): a CTA that waits only ever waits for rows of earlier tiles of
the walk order (no band of the walk holds tiles of two blocks), brought by copy engines. Tiles
are claimed in walk order from a counter (tile t is taken only once tiles 0..t-1 were taken by
CTAs that are running), each CTA's memory warpgroup claiming its next tile while the compute
warpgroups finish the last one and handing it to them through shared memory and two mbarriers,
so whatever holds the other SMs (another kernel, MPS clients, a grid larger than the SMs left),
a running CTA waits for rows whose producer has started: a peer's running CTA, whose own waits
are on still earlier tiles. Where ranks share a GPU their copies are kernels that need the SMs a
spinning CTA holds, so the fused ops do not take walks that wait there (peer_wait_reason).

Layout of the work: CTA tiles of 128 x 256 output elements (two compute warpgroups of 64 x 256
one above the other, one warpgroup issuing TMA loads, one wgmma left in flight behind the one
issued), walked in bands of BAND_TILES row tiles (all columns of a band before the next band,
rows minor inside it), so blocks of rows finish in order and the band's slice of `a` stays in
L2. A block whose rows copy engines read is written in place into an operand (the addresses must
be known to the copy-engine streams before the kernel runs); the kernel's own result (or a
token) orders every later reader after it.
"""
from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src import job
from jax_hoccl._src.ops import common

TILE_M = 128          # rows of a CTA tile (and the granularity of flags)
TILE_N = 256          # columns of a CTA tile
TILE_K = 64
EPI = 64              # epilogue sub-tile (rows and columns) staged through shared memory
EPI_SLOTS = 2         # sub-tiles staged at once per compute warpgroup (4: a whole tile)
PIPELINE_STEPS = 4    # k-steps of a and b in flight (4 with 2 slots fills shared memory)
BAND_TILES = 16       # row tiles per band of the walk (docs/design.md, section 8)
# Compute warpgroups, one above the other in a CTA tile: each computes TILE_M / COMPUTE_WGS
# rows by TILE_N (one m64n256 wgmma per k16 from its half of a's slot and all of w's; side by
# side on N, two m64n128 per k16, was slower: benchmarks/README.md).
COMPUTE_WGS = 2
# k-steps whose wgmma may still run when the next is issued (their a and w stay in shared
# memory that long). One hides the flags' cost; clusters of two CTAs sharing w by multicast,
# and raising the flag early in the next tile's mainloop, were slower (the measurements:
# benchmarks/README.md, "The flagged GEMM on one GPU").
WGMMA_IN_FLIGHT = 1
# Scope of a flag's release. The readers are copy engines (of this GPU, or a peer's pulling
# over NVLink), which read through this GPU's L2, so "gpu" orders the rows before the flag for
# them; "sys" (host-visible ordering) costs more of the GEMM's time (benchmarks/README.md).
FLAG_SCOPE = "gpu"
DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def unsupported_reason(m, k, n, dtype, out_dtype=None, b_dtype=None) -> str | None:
  """Why the kernel cannot run this GEMM (None: it can). Callers fall back to XLA's dot."""
  if b_dtype is not None and np.dtype(b_dtype) != np.dtype(dtype):
    return f"dtypes {np.dtype(dtype).name} @ {np.dtype(b_dtype).name} (must match)"
  if np.dtype(dtype) not in DTYPES:
    return f"dtype {np.dtype(dtype).name} (the kernel is bf16/f16)"
  if out_dtype is not None and np.dtype(out_dtype) not in DTYPES + (np.dtype(jnp.float32),):
    return f"output dtype {np.dtype(out_dtype).name}"
  if m % TILE_M or n % TILE_N or k % TILE_K:
    return (f"shape M={m} K={k} N={n} (needs M % {TILE_M}, N % {TILE_N}, "
            f"K % {TILE_K} == 0)")
  if not _on_hopper():
    return "not a Hopper GPU"
  return None


def peer_wait_reason(op: str = "flagged GEMM") -> str | None:
  """Why a walk that waits in-kernel for rows copied from peers could stall in this job (None:
  it cannot). `op`: the user's op that asks."""
  if job.gpus_shared(op):
    return ("ranks share a GPU: the copies between them are kernels that need the SMs the "
            "walk's waiting CTAs hold")
  return None


def _on_hopper() -> bool:
  """Whether the devices being traced for are Hopper GPUs: the mesh's (inside shard_map; a
  CPU mesh on a GPU machine is not), else the default backend's."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  if device is not None and device.platform != "gpu":
    return False
  return _gpu_compute_capability() == "9.0"


@functools.lru_cache(maxsize=None)
def _gpu_compute_capability() -> str:
  try:
    return getattr(jax.devices("gpu")[0], "compute_capability", "")
  except RuntimeError:
    return ""


def _sm_count() -> int:
  device = jax.sharding.get_abstract_mesh().abstract_device
  if device is not None and device.num_cores:
    return device.num_cores
  return jax.devices("gpu")[0].core_count


# Claim words after the ready flags: the tile counter (two words, keeping the uint64 flags
# aligned).
CLAIM_WORDS = 2
# Tiles per claim (consecutive in the walk order). One: the claim's
# atomic is taken by the memory warpgroup while the compute warpgroups finish a tile, so
# groups would only widen the span of tiles in flight (less of a and w shared in L2).
CLAIM_GROUP = 1


def ready_words(flags: int) -> int:
  """int32 words of a walk's `ready` operand for `flags` uint64 ready flags (plus the tile
  claims), all zero before the kernel."""
  return 2 * flags + CLAIM_WORDS


def band_tiles(block_tiles: int, blocks: int) -> int:
  """Row tiles per band of the walk order: BAND_TILES, or in a walk of several blocks the
  largest divisor of a block's row tiles up to it, so that no band holds tiles of two blocks
  and every tile of a block comes before every tile of the next (docs/design.md, "Forward
  progress", rule 1)."""
  if blocks == 1:
    return min(BAND_TILES, block_tiles)
  return max(d for d in range(1, min(BAND_TILES, block_tiles) + 1) if block_tiles % d == 0)


def flag_target(n: int, flag_rows: int) -> int:
  """The value flags[block] reaches when the block's `flag_rows` rows are stored: one raise per
  CTA tile."""
  return (flag_rows // TILE_M) * (n // TILE_N)


# Named barrier (bar.sync id) joining the compute warpgroups once per tile (before a flag where
# there is one); Mosaic GPU uses id 0 for the CTA and 1 + warpgroup for each warpgroup's own.
_COMPUTE_BARRIER = 8
_MEET_COMPUTE = f"bar.sync {_COMPUTE_BARRIER}, {COMPUTE_WGS * 128};"  # 128: a warpgroup


def _raise_flag(flag_ref, ordered: bool):
  """flags += 1 for this CTA tile, after both compute warpgroups' stores are in memory: each
  waits for its TMA stores and fences the async proxy, the two meet at a named barrier, and
  one thread releases the add. (One release per CTA tile rather than per warpgroup, because
  the release is what costs; a relaxed add would cost nothing but orders nothing:
  benchmarks/README.md, benchmarks/probe_flag_cost.py.)

  ordered=False: raised before the tile is even computed, only by the test that proves the
  ordering matters (a copy started on such a flag sees stale rows)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu

  if ordered:
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # TMA writes complete, not just read

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def signal(_, ref):
    u = mgpu.utils
    # order this warpgroup's async-proxy (TMA) writes, which its issuing thread has waited
    # for, before what follows; then both compute warpgroups meet
    u.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
    u.inline_ptx(_MEET_COMPUTE, has_side_effects=True)
    # one thread of the CTA (of warpgroup 0: the memory warpgroup, last, never gets here)
    one = u.single_thread_predicate(u.ThreadSubset.BLOCK)
    u.SemaphoreRef(u.memref_ptr(ref)).signal(1, predicate=one, memory_scope=FLAG_SCOPE)

  signal(flag_ref)


def _meet_compute():
  """A tile that raises no flag: the two compute warpgroups meet (a named barrier) and one
  thread fences at GPU scope, as a flag's raise has them do (its release); the kernel runs
  faster so than left to drift apart, and faster with the fence than without
  (benchmarks/README.md)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu

  @plgpu.inline_mgpu(arg_types=())
  def meet(_):
    u = mgpu.utils
    u.inline_ptx(_MEET_COMPUTE, has_side_effects=True)
    one = u.single_thread_predicate(u.ThreadSubset.BLOCK)
    u.inline_ptx("fence.acq_rel.gpu;", predicate=one, has_side_effects=True)

  meet()


def _publish_tile(counter_ref, slot_ref, candidate, group: int):
  """Memory warpgroup: writes the CTA's next tile into its shared-memory slot, seen by the
  whole warpgroup once this returns. The next tile is `candidate` (the one after the last)
  inside a group of `group` consecutive tiles, else the first of a group claimed from the
  counter: one thread's atomic add, so tiles are claimed in walk order."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT))
  def publish(_, counter, slot, cand):
    u = mgpu.utils
    one = u.single_thread_predicate(u.ThreadSubset.WARPGROUP)
    # q: this thread claims (candidate % group == 0 starts a new group)
    claim = " mov.pred q, $3;\n" if group == 1 else (
        f" rem.u32 r, $2, {group};\n setp.eq.u32 q, r, 0;\n and.pred q, q, $3;\n")
    u.inline_ptx(
        "{\n .reg .u32 t, r;\n .reg .pred q;\n mov.u32 t, $2;\n" + claim +
        f" @q atom.relaxed.gpu.global.add.u32 t, [$0], {group};\n"
        " @$3 st.shared.u32 [$1], t;\n"
        f" bar.sync $4, {u.WARPGROUP_SIZE};\n}}",
        u.memref_ptr(counter), u.memref_ptr(slot), cand.registers.item(), one,
        u.warpgroup_barrier_idx(sync=False), has_side_effects=True, convergent=True)

  publish(counter_ref, slot_ref, candidate)


def _read_tile(slot_ref):
  """The tile the memory warpgroup wrote into the shared-memory slot."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu
  from jax._src.lib.mlir import ir

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct((), jnp.int32, plgpu.Layout.WG_SPLAT))
  def read(_, slot):
    u = mgpu.utils
    tile = u.inline_ptx("ld.shared.u32 $0, [$1];", u.memref_ptr(slot),
                        result_types=ir.IntegerType.get_signless(32), has_side_effects=True)
    return mgpu.FragmentedArray.splat(tile, (), is_signed=True)

  return read(slot_ref)


def _await_flag(flag_ref, value, memory_scope="sys"):
  """Waits (an acquire at `memory_scope`: copy engines of a peer GPU write the data) until
  flag >= value; TMA loads issued after it see the data the flag announced."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def wait(_, ref):
    mgpu.utils.SemaphoreRef(mgpu.utils.memref_ptr(ref)).wait(
        value, decrement=False, memory_scope=memory_scope)
    mgpu.utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

  wait(flag_ref)


RESULT = -1  # Rows.ref of the kernel's own result


@dataclasses.dataclass(frozen=True)
class Rows:
  """R rows of operand `ref` (an index into the operands, or RESULT): its block `block`, or
  with by_rank its block (block + rank) % (its rows // R)."""
  ref: int
  block: int
  by_rank: bool = False


@dataclasses.dataclass(frozen=True)
class WalkBlock:
  a: Rows
  out: Rows
  add: bool = False         # out += a @ w (out must be an operand)
  wait: str | None = None   # "a" or "out": its tiles wait for those rows' ready flags,
  ready_block: int = 0      # those of block `ready_block` of R rows
  flag: bool = False        # raise flags for its output rows (out must be an operand)


@dataclasses.dataclass(frozen=True)
class _Layout:
  walk: tuple
  rows: int             # R
  k: int
  n: int
  blocks_of: tuple      # operand index -> its rows // R (RESULT last)
  has_rank: bool
  flag_rows: int        # 0: no producer flags
  ready_rows: int
  ready_flags: int      # uint64 ready flags before the claim words
  ready_value: int
  ordered: bool
  n_operands: int
  has_result: bool
  claim_group: int = 1


def _alike_blocks(walk) -> list[tuple[int, ...]]:
  """The walk's blocks in groups that differ only in their block numbers (Rows.block,
  ready_block): the kernel runs each group by one copy of the pipeline and its epilogue, the
  numbers chosen at run time, so a walk of n blocks holds a few copies of that code, not n."""
  groups = {}
  for j, blk in enumerate(walk):
    key = dataclasses.replace(blk, a=dataclasses.replace(blk.a, block=0),
                              out=dataclasses.replace(blk.out, block=0), ready_block=0)
    groups.setdefault(key, []).append(j)
  return [tuple(js) for js in groups.values()]


def _block_of_group(walk, js, jb):
  """The WalkBlock of walk block jb (a traced index among the group js), its block numbers
  picked at run time where the group's members differ."""
  def pick(number):
    values = [number(walk[j]) for j in js]
    if len(set(values)) == 1:
      return values[0]
    picked = values[-1]
    for j, v in zip(js[:-1], values[:-1]):
      picked = jnp.where(jb == j, v, picked)
    return picked

  blk = walk[js[0]]
  return dataclasses.replace(
      blk, a=dataclasses.replace(blk.a, block=pick(lambda b: b.a.block)),
      out=dataclasses.replace(blk.out, block=pick(lambda b: b.out.block)),
      ready_block=pick(lambda b: b.ready_block))


def _kernel_body(lay: _Layout, *refs):
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  refs = list(refs)
  w_gmem = refs.pop(0)
  operands = [refs.pop(0) for _ in range(lay.n_operands)]
  rank_gmem = refs.pop(0) if lay.has_rank else None
  ready_gmem = refs.pop(0)
  flags_gmem = refs.pop(0) if lay.flag_rows else None
  if lay.has_result:
    operands.append(refs.pop(0))  # operands[RESULT]
  # what may be left is the token output: never written, it orders readers after the kernel
  first = lay.walk[0]
  a0 = operands[first.a.ref]
  dtype = a0.dtype
  out_dtype = operands[first.out.ref].dtype
  in_swizzle = plgpu.find_swizzle(TILE_K * jnp.dtype(dtype).itemsize * 8)
  in_transforms = (plgpu.TilingTransform((8, in_swizzle // jnp.dtype(dtype).itemsize)),
                   plgpu.SwizzleTransform(in_swizzle))
  out_swizzle = plgpu.find_swizzle(EPI * jnp.dtype(out_dtype).itemsize * 8)
  out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
                    plgpu.SwizzleTransform(out_swizzle))
  wg_m = TILE_M // COMPUTE_WGS  # a compute warpgroup's rows of the tile
  block_tiles = lay.rows // TILE_M
  m_tiles, n_tiles, k_steps = len(lay.walk) * block_tiles, lay.n // TILE_N, lay.k // TILE_K
  band = band_tiles(block_tiles, len(lay.walk))
  epi_tiles = [(slice(i * EPI, (i + 1) * EPI), slice(j * EPI, (j + 1) * EPI))
               for i in range(wg_m // EPI) for j in range(TILE_N // EPI)]
  ordered = lay.ordered

  # The compute warpgroups release each k-step's slots by hand once its wgmma is done (the last
  # ones after the epilogue waits for the accumulator), and the memory warpgroup runs on from
  # one tile's loads to the next tile's as slots free (steady: no prologue, no drain per
  # tile). A slot is never reloaded while a wgmma may read it, and the next tile's loads start
  # while this one's last k-steps run (docs/design.md, "The pipeline across tiles").
  slots = min(PIPELINE_STEPS, k_steps)
  steady = k_steps % slots == 0  # else each tile fills and drains the pipeline

  def pipeline(mma, epilogue):
    return plgpu.emit_pipeline_warp_specialized(
        mma, grid=(k_steps,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((TILE_M, TILE_K), lambda s: (0, s), transforms=in_transforms,
                                  memory_space=plgpu.SMEM),
                  plgpu.BlockSpec((TILE_K, TILE_N), lambda s: (s, 0), transforms=in_transforms,
                                  memory_space=plgpu.SMEM)],
        wg_axis="wg", num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=slots,
        compute_context=epilogue, manual_consumed_barriers=True,
        pipeline_state=plgpu.PipelinePipeline.STEADY if steady else None)

  nothing = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(nothing, nothing).get_allocations(a0, w_gmem),
      stage=plgpu.SMEM((COMPUTE_WGS, EPI_SLOTS, EPI, EPI), out_dtype, transforms=out_transforms),
      # the claimed tiles, handed from the memory warpgroup to the others
      tiles=plgpu.SMEM((2,), jnp.int32),
      full=plgpu.Barrier(num_arrivals=1, num_barriers=2),
      empty=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2),
      collective_axes="wg")
  def _scope(allocs, stage, tiles, full, empty):
    wg = lax.axis_index("wg")

    def release(step):  # compute warpgroup: k-step `step`'s wgmma is done with its slots
      for barrier in allocs["flat_consumed_barrier_refs"]:
        plgpu.barrier_arrive(barrier.at[lax.rem(step, slots)])

    if steady:  # every slot starts free: the memory warpgroup's first waits pass
      @pl.when(wg < COMPUTE_WGS)
      def _free_slots():
        for step in range(slots):
          release(step)

    rank = rank_gmem[0] if rank_gmem is not None else None
    # A tile's flag is raised (after its stores complete) at the start of the next tile's
    # epilogue, once its mainloop gave the stores time to land: raising it right after the
    # stores makes the warpgroup wait for them (benchmarks/README.md). It is raised
    # before anything in that epilogue waits (a flag held behind a wait could wait for a peer
    # that waits for this flag); in a walk whose tiles wait for rows of `a`, before their
    # mainloop, it is raised at once.
    defer = flags_gmem is not None and ordered and not any(b.wait == "a" for b in lay.walk)

    def flag_at(index):
      return flags_gmem.at[pl.ds(index, 1)]

    def row_of(spec: Rows, i):
      """The first row of tile i (of this block) in operand spec.ref."""
      block = spec.block
      if spec.by_rank:
        block = lax.rem(block + rank, lay.blocks_of[spec.ref])
      return block * lay.rows + i * TILE_M

    def tile(t, carry):
      mi, ni = plgpu.planar_snake(t, (m_tiles, n_tiles), 0, band)
      i = lax.rem(mi, block_tiles)
      cols = pl.ds(ni * TILE_N, TILE_N)
      w_cols = w_gmem.at[:, cols]
      # flags count the walk's rows (rank-independent, one array for every flagged block)
      flag = (mi * TILE_M) // max(lay.flag_rows, 1)
      if not all(blk.flag for blk in lay.walk):
        flagged = jnp.bool_(False)
        for j, blk in enumerate(lay.walk):
          if blk.flag:
            flagged = flagged | (mi // block_tiles == j)
        flag = jnp.where(flagged, flag, -1)

      def run_block(blk: WalkBlock):
        out_rows = pl.ds(row_of(blk.out, i) + wg * wg_m, wg_m)  # this warpgroup's (compute)
        out_gmem = operands[blk.out.ref]

        def await_rows():  # one uint64 flag per ready_rows rows; its low word
          row = blk.ready_block * lay.rows + i * TILE_M
          _await_flag(ready_gmem.at[pl.ds(2 * (row // lay.ready_rows), 1)], lay.ready_value)

        if blk.wait == "a":  # only the memory warpgroup loads a: the others go on
          pl.when(wg == COMPUTE_WGS)(await_rows)

        def epilogue(run_mainloop):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((wg_m, TILE_N), jnp.float32))
          def _acc(acc):
            if blk.flag and not ordered:
              _raise_flag(flag_at(flag), ordered=False)
            run_mainloop(acc)
            result = acc[...].astype(out_dtype)  # waits for every wgmma
            for step in range(k_steps - WGMMA_IN_FLIGHT, k_steps):
              release(step)
            if defer:  # (the raise meets the compute warpgroups too)
              pl.when(carry >= 0)(lambda: _raise_flag(flag_at(carry), ordered=True))
            else:
              _meet_compute()
            if blk.wait == "out":
              await_rows()
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores left smem
            for e, sub in enumerate(epi_tiles):
              slot = e % EPI_SLOTS
              plgpu.wait_smem_to_gmem(EPI_SLOTS - 1, wait_read_only=True)
              stage[wg, slot] = result[sub]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(stage.at[wg, slot], out_gmem.at[out_rows, cols].at[sub],
                                      reduction_op="add" if blk.add else None)
            if blk.flag and ordered and not defer:
              _raise_flag(flag_at(flag), ordered=True)

        def mma(idx, a_smem, b_smem, _a_consumed, _b_consumed, acc):
          plgpu.wgmma(acc, a_smem.at[pl.ds(wg * wg_m, wg_m)], b_smem)
          plgpu.wgmma_wait(WGMMA_IN_FLIGHT)
          step = idx[0]
          pl.when(step >= WGMMA_IN_FLIGHT)(lambda: release(step - WGMMA_IN_FLIGHT))
          return acc

        a_rows = pl.ds(row_of(blk.a, i), TILE_M)
        pipeline(mma, epilogue)(operands[blk.a.ref].at[a_rows, :], w_cols, allocations=allocs)

      jb = mi // block_tiles  # the walk block of this tile
      groups = _alike_blocks(lay.walk)
      for js in groups:
        blk = _block_of_group(lay.walk, js, jb)
        if len(groups) == 1:
          run_block(blk)
        else:
          pl.when(functools.reduce(operator.or_, [jb == j for j in js]))(
              functools.partial(run_block, blk))
      return flag if flags_gmem is not None else carry

    # Tiles are claimed in walk order from a counter (a walk that waits must: docs/design.md,
    # "Forward progress"; one that does not runs faster so than with tiles by index: a CTA
    # that runs slower takes fewer tiles).
    total = m_tiles * n_tiles
    counter = ready_gmem.at[pl.ds(2 * lay.ready_flags, 1)]
    is_memory = wg == COMPUTE_WGS

    def next_tile(t, i):
      """The CTA's i-th tile (after tile t): the memory warpgroup claims it and hands it to
      the compute warpgroups through slot i % 2 (full: written, empty: read by both), so it
      never waits for their epilogue."""
      s = lax.rem(i, 2)

      @pl.when(is_memory)
      def _claim():
        pl.when(i >= 2)(lambda: plgpu.barrier_wait(empty.at[s]))
        _publish_tile(counter, tiles.at[pl.ds(s, 1)], t + 1, lay.claim_group)
        plgpu.barrier_arrive(full.at[s])

      pl.when(~is_memory)(lambda: plgpu.barrier_wait(full.at[s]))
      nt = _read_tile(tiles.at[pl.ds(s, 1)])
      pl.when(~is_memory)(lambda: plgpu.barrier_arrive(empty.at[s]))
      return nt

    def claimed(c):
      t, i, carry = c
      carry = tile(t, carry)
      return next_tile(t, i + 1), i + 1, carry

    _, _, last_flag = lax.while_loop(
        lambda c: c[0] < total, claimed,
        (next_tile(jnp.int32(-1), jnp.int32(0)), jnp.int32(0), jnp.int32(-1)))

    if defer:  # this CTA's last tile (memory warpgroup: last)
      @pl.when((wg < COMPUTE_WGS) & (last_flag >= 0))
      def _last_tile():
        _raise_flag(flag_at(last_flag), ordered=True)

  plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def walk_matmul(w, operands, walk, rows, *, ready, result=None, rank=None,
                ready_rows=TILE_M, ready_value=1, flags=None, flag_rows=TILE_M, _ordered=True):
  """Runs a walk (module docstring): every WalkBlock's R = `rows` rows of out = a @ w (or
  out += a @ w). operands: arrays [., K] (a) or [., N] (out, written in place); result: (rows, dtype) of
  the kernel's own result (Rows.ref RESULT), or None. Returns the result (typed varying as
  its operands are), or a token (int32 [128]) when there is none: every later reader of an
  operand written in place (and of `flags`) must depend on it. rank: this rank (an int32
  scalar, e.g. axis_index), for Rows.by_rank. ready: int32 [ready_words(flags)], zero before
  the kernel: a uint64 flag per ready_rows rows of the blocks waited for
  (WalkBlock.ready_block), then the tile claims (ready_words(0): the claims alone, in a walk
  that waits for nothing). flags: int32
  [len(walk) * rows // flag_rows], per flag_rows rows of the walk (those of blocks with
  `flag` are raised), zero before the kernel."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  k, n = w.shape
  walk = tuple(walk)
  first = walk[0]
  a_dtype = operands[first.a.ref].dtype
  out_dtype = result[1] if first.out.ref == RESULT else operands[first.out.ref].dtype
  reason = unsupported_reason(len(walk) * rows, k, n, a_dtype, out_dtype, w.dtype)
  if reason:
    raise ValueError(f"jax_hoccl flagged GEMM: unsupported {reason}")
  blocks_of = [x.shape[0] // rows for x in operands] + ([result[0] // rows] if result else [])
  for name, x in enumerate(operands):
    if x.shape[0] % rows:
      raise ValueError(f"jax_hoccl flagged GEMM: operand {name} has {x.shape[0]} rows, not a "
                       f"multiple of R={rows}")
  for name, r, used in (("flag_rows", flag_rows, flags is not None),
                        ("ready_rows", ready_rows, True)):
    if used and (r % TILE_M or rows % r):
      raise ValueError(f"jax_hoccl flagged GEMM: {name}={r} must be a multiple of {TILE_M} "
                       f"dividing R={rows}")
  if ready.shape[0] < CLAIM_WORDS or ready.shape[0] % 2:
    raise ValueError(f"jax_hoccl flagged GEMM: ready must have ready_words(flags) = "
                     f"{CLAIM_WORDS} + 2 * flags words, got {ready.shape[0]}")
  if any(b.add and b.out.ref == RESULT for b in walk):
    raise ValueError("jax_hoccl flagged GEMM: a block adds into an operand, not the result")
  if any(b.flag for b in walk) != (flags is not None):
    raise ValueError("jax_hoccl flagged GEMM: flags must be given exactly when the walk "
                     "raises them")
  lay = _Layout(walk=walk, rows=rows, k=k, n=n, blocks_of=tuple(blocks_of),
                has_rank=rank is not None, flag_rows=flag_rows if flags is not None else 0,
                ready_rows=ready_rows, ready_flags=(ready.shape[0] - CLAIM_WORDS) // 2,
                ready_value=int(ready_value),
                ordered=bool(_ordered), n_operands=len(operands), has_result=result is not None,
                claim_group=CLAIM_GROUP)
  out_type = (jax.ShapeDtypeStruct((result[0], n), result[1]) if result is not None
              else jax.ShapeDtypeStruct((128,), jnp.int32))
  kernel = plgpu.kernel(
      functools.partial(_kernel_body, lay), out_type=out_type,
      grid=(_sm_count(),), grid_names=("sm",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  if rank is not None:
    rank = jnp.asarray(rank, jnp.int32).reshape(1)  # read in-kernel from global memory
  extra = [x for x in (rank, ready, flags) if x is not None]  # (ready: always)
  out = kernel(w, *operands, *extra)
  if result is None:
    return out
  # a Pallas kernel's result carries no varying type: it varies as its operands do
  vma = set().union(*(ji.varying_axes(jax.typeof(x)) for x in (w, *operands)))
  return common.ensure_varying(out, tuple(vma), "flagged GEMM")


def flagged_matmul(a, b, *, out=None, add=False, flags=None, flag_rows=TILE_M, _ordered=True):
  """a @ b by the kernel, in one block of rows. Returns the product, or with `out` (and
  `flags`, raised per flag_rows rows) the token of walk_matmul, `out` written in place
  (with add: out += a @ b)."""
  m = a.shape[0]
  ready = jnp.zeros((ready_words(0),), jnp.int32)  # the tile claims alone
  operands = [a] + ([out] if out is not None else [])
  out_rows = Rows(1, 0) if out is not None else Rows(RESULT, 0)
  result = None if out is not None else (m, a.dtype)
  walk = [WalkBlock(a=Rows(0, 0), out=out_rows, add=add, flag=flags is not None)]
  return walk_matmul(b, operands, walk, m, result=result, flags=flags, flag_rows=flag_rows,
                     ready=ready, _ordered=_ordered)
