"""The flagged GEMM: out = a @ b (+ c) on a Hopper GPU as one persistent Pallas Mosaic GPU kernel
that tells the copy engines which rows are done, and can wait for rows that the copy engines
bring in.

- Producer flags: once every tile of a block of `flag_rows` output rows is stored (the TMA
  stores completed, then a system-scope release), `flags[block]` has been raised by
  `flag_target(...)`. A copy-engine stream that waits on it with `cuStreamWaitValue32(GEQ)` may
  copy those rows while the kernel works on later ones.
- Consumer flags: with `ready`, a tile of rows [r, r + 128) waits (system-scope acquire) until
  `ready[r // ready_rows] >= ready_value` before it loads its rows of `a` and of `c`: rows the
  copy engines are still bringing in (`cuStreamWriteValue32` after the copy, on the copying
  stream) are multiplied as they land.

Why our own kernel: cuBLAS cannot say which tiles are done (CUDA 13 removed its progress
counters), and cutting a cuBLAS GEMM into row pieces costs 4-13% per piece (docs/design.md).

Layout of the work: CTA tiles of 128 x 256 output elements (two compute warpgroups side by side
on N, one warpgroup issuing TMA loads), walked in bands of BAND_TILES row tiles (all columns of
a band before the next band, rows minor inside it), so blocks of rows finish in order and the
band's slice of `a` stays in L2. The kernel writes `out` and `flags` in place: both are
inputs (their addresses must be known to the copy-engine streams before the kernel runs), and
the kernel returns only a small token that orders their readers after it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

TILE_M = 128          # rows of a CTA tile (and the granularity of flags)
TILE_N = 128          # columns per compute warpgroup; a CTA tile is 2 * TILE_N wide
TILE_K = 64
EPI = 64              # epilogue sub-tile (rows and columns) staged through shared memory
PIPELINE_STEPS = 4    # k-steps of a and b in flight
BAND_TILES = 8        # row tiles per band of the walk (best of 4/8/16 on H200, docs/design.md)
COMPUTE_WGS = 2
# Scope of a flag's release. The readers are copy engines (of this GPU, or a peer's pulling
# over NVLink), which read through this GPU's L2, so "gpu" orders the rows before the flag for
# them; "sys" (host-visible ordering) costs ~1.5% of the GEMM's time on H200.
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
  if m % TILE_M or n % (COMPUTE_WGS * TILE_N) or k % TILE_K:
    return (f"shape M={m} K={k} N={n} (needs M % {TILE_M}, N % {COMPUTE_WGS * TILE_N}, "
            f"K % {TILE_K} == 0)")
  if not _on_hopper():
    return "not a Hopper GPU"
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


def flag_target(n: int, flag_rows: int) -> int:
  """The value flags[block] reaches when the block's `flag_rows` rows are stored: one raise per
  compute warpgroup per CTA tile."""
  return (flag_rows // TILE_M) * (n // (COMPUTE_WGS * TILE_N)) * COMPUTE_WGS


def _raise_flag(flag_ref, ordered: bool):
  """flags += 1 from one thread of this warpgroup, after all its stores are in memory.

  ordered=False: raised before the tile is even computed, only by the test that proves the
  ordering matters (a copy started on such a flag sees stale rows)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu

  if ordered:
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # TMA writes complete, not just read

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def signal(_, ref):
    mgpu.utils.warpgroup_barrier()  # the thread that issued the stores has waited for them
    # order the async proxy's (TMA's) writes before the release below
    mgpu.utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
    mgpu.utils.SemaphoreRef(mgpu.utils.memref_ptr(ref)).signal(1, memory_scope=FLAG_SCOPE)

  signal(flag_ref)


def _await_flag(flag_ref, value):
  """Waits (system-scope acquire) until flag >= value; TMA loads issued after it see the data
  the flag announced."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def wait(_, ref):
    mgpu.utils.SemaphoreRef(mgpu.utils.memref_ptr(ref)).wait(
        value, decrement=False, memory_scope="sys")
    mgpu.utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

  wait(flag_ref)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What the kernel reads and writes (static: one compiled kernel per layout)."""
  m: int                # rows of the walk (and of the output)
  k: int
  n: int
  own_rows: int         # rows [0, own_rows) of the walk come from `own` (0: all from `a`)
  blocks: int           # with `rank`: the output holds `blocks` blocks of own_rows rows
  has_rank: bool
  has_c: bool
  into: bool            # write into a given `out` (else it is the kernel's output)
  flag_rows: int        # 0: no producer flags
  ready_rows: int       # 0: no consumer waits
  ready_value: int
  ordered: bool


def _kernel_body(lay: _Layout, *refs):
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  refs = list(refs)
  own_gmem = refs.pop(0) if lay.own_rows else None
  a_gmem, b_gmem = refs.pop(0), refs.pop(0)
  c_gmem = refs.pop(0) if lay.has_c else None
  rank_gmem = refs.pop(0) if lay.has_rank else None
  ready_gmem = refs.pop(0) if lay.ready_rows else None
  if lay.into:
    out_gmem = refs.pop(0)
  flags_gmem = refs.pop(0) if lay.flag_rows else None
  if not lay.into:
    out_gmem = refs.pop(0)
  # what is left is the token output of `into`: never written, it orders readers after us
  dtype, out_dtype = a_gmem.dtype, out_gmem.dtype
  in_swizzle = plgpu.find_swizzle(TILE_K * jnp.dtype(dtype).itemsize * 8)
  in_transforms = (plgpu.TilingTransform((8, in_swizzle // jnp.dtype(dtype).itemsize)),
                   plgpu.SwizzleTransform(in_swizzle))
  out_swizzle = plgpu.find_swizzle(EPI * jnp.dtype(out_dtype).itemsize * 8)
  out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
                    plgpu.SwizzleTransform(out_swizzle))
  cta_n = COMPUTE_WGS * TILE_N
  m_tiles, n_tiles, k_steps = lay.m // TILE_M, lay.n // cta_n, lay.k // TILE_K
  own_tiles = lay.own_rows // TILE_M
  band = min(BAND_TILES, m_tiles)
  epi_tiles = [(i, j) for i in range(TILE_M // EPI) for j in range(TILE_N // EPI)]
  ordered = lay.ordered

  def pipeline(mma, epilogue):
    return plgpu.emit_pipeline_warp_specialized(
        mma, grid=(k_steps,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((TILE_M, TILE_K), lambda s: (0, s), transforms=in_transforms,
                                  memory_space=plgpu.SMEM),
                  plgpu.BlockSpec((TILE_K, cta_n), lambda s: (s, 0), transforms=in_transforms,
                                  memory_space=plgpu.SMEM)],
        wg_axis="wg", num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=PIPELINE_STEPS,
        compute_context=epilogue)

  nothing = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(nothing, nothing).get_allocations(a_gmem, b_gmem),
      stage=plgpu.SMEM((COMPUTE_WGS, 2, EPI, EPI), out_dtype, transforms=out_transforms),
      c_arrived=plgpu.Barrier(num_barriers=2 * COMPUTE_WGS) if lay.has_c else None,
      collective_axes="wg")
  def _scope(allocs, stage, c_arrived):
    wg = lax.axis_index("wg")
    rank = rank_gmem[0] if rank_gmem is not None else None
    # A tile's flag is raised (after its stores complete) at the start of the next tile's
    # epilogue, once its mainloop gave the stores time to land: raising it right after the
    # stores makes the warpgroup wait for them, ~1.5% of the GEMM's time on H200. With
    # `ready` it is raised at once: a deferred flag could wait for a tile that waits for a
    # peer that waits for this flag.
    defer = ordered and lay.ready_rows == 0

    def flag_at(block):
      return flags_gmem.at[pl.ds(block, 1)]

    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm", init_carry=jnp.int32(-1))
    def last_block(info, carry):
      (t,) = info.index
      mi, ni = plgpu.planar_snake(t, (m_tiles, n_tiles), 0, band)
      out_mi = mi
      if rank is not None:  # walk block j is the output's block (j + rank) % blocks
        out_mi = lax.rem(mi // own_tiles + rank, lay.blocks) * own_tiles + lax.rem(mi, own_tiles)
      out_rows = pl.ds(out_mi * TILE_M, TILE_M)
      cols = pl.ds(ni * cta_n + wg * TILE_N, TILE_N)   # this warpgroup's half (compute wgs)
      block = (mi * TILE_M) // max(lay.flag_rows, 1)
      a_row = (mi - own_tiles) * TILE_M  # row of `a` (rows past the own ones)
      if ready_gmem is not None:
        @pl.when(mi >= own_tiles)
        def _wait_rows():  # one uint64 flag per block of ready rows; its low word
          _await_flag(ready_gmem.at[pl.ds(2 * (a_row // lay.ready_rows), 1)], lay.ready_value)

      def epilogue(run_mainloop):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE_M, TILE_N), jnp.float32))
        def _acc(acc):
          if flags_gmem is not None and not ordered:
            _raise_flag(flag_at(block), ordered=False)
          run_mainloop(acc)
          result = acc[...].astype(out_dtype)
          if flags_gmem is not None and defer:
            @pl.when(carry >= 0)
            def _previous_tile():
              _raise_flag(flag_at(carry), ordered=True)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores left smem
          for e, (i, j) in enumerate(epi_tiles):
            slot = e % 2
            sub = (slice(i * EPI, (i + 1) * EPI), slice(j * EPI, (j + 1) * EPI))
            dst = out_gmem.at[out_rows, cols].at[sub]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            if c_gmem is None:
              stage[wg, slot] = result[sub]
            else:
              bar = c_arrived.at[wg * 2 + slot]
              plgpu.copy_gmem_to_smem(c_gmem.at[out_rows, cols].at[sub], stage.at[wg, slot], bar)
              plgpu.barrier_wait(bar)
              stage[wg, slot] += result[sub]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage.at[wg, slot], dst)
          if flags_gmem is not None and ordered and not defer:
            _raise_flag(flag_at(block), ordered=True)

      def mma(_, a_smem, b_smem, acc):
        plgpu.wgmma(acc, a_smem, b_smem.at[:, pl.ds(wg * TILE_N, TILE_N)])
        plgpu.wgmma_wait(0)
        return acc

      b_cols = b_gmem.at[:, pl.ds(ni * cta_n, cta_n)]
      if own_gmem is None:
        pipeline(mma, epilogue)(a_gmem.at[pl.ds(mi * TILE_M, TILE_M), :], b_cols,
                                allocations=allocs)
      else:
        @pl.when(mi < own_tiles)
        def _own_rows():
          pipeline(mma, epilogue)(own_gmem.at[pl.ds(mi * TILE_M, TILE_M), :], b_cols,
                                  allocations=allocs)

        @pl.when(mi >= own_tiles)
        def _other_rows():
          pipeline(mma, epilogue)(a_gmem.at[pl.ds(a_row, TILE_M), :], b_cols,
                                  allocations=allocs)
      return block

    if flags_gmem is not None and defer:  # this CTA's last tile (memory warpgroup: last)
      @pl.when((wg < COMPUTE_WGS) & (last_block >= 0))
      def _last_tile():
        _raise_flag(flag_at(last_block), ordered=True)

  plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def flagged_matmul(a, b, *, c=None, out=None, flags=None, flag_rows=TILE_M, own=None,
                   rank=None, ready=None, ready_rows=TILE_M, ready_value=1, _ordered=True):
  """a @ b (+ c) by the kernel. Returns the product [M, N], or with `out` a token.

  Producer: `flags` int32 [M // flag_rows], zero, raised per finished block of rows (to
  flag_target(N, flag_rows)). Then `out` [M, N] should be given too: the product is written
  into it in place, and the returned token (int32 [128]) must order every later reader of
  `out`/`flags` after the kernel (pass buffers nobody else reads before it, e.g. a jax_hoccl
  start's outputs), since their addresses must be known before the kernel runs.
  Consumer: the rows of the walk are `own` [R, K] (if given) then `a`; a tile of a's rows
  waits until the low word of ready[2 * (row // ready_rows)] (int32 pairs: uint64 flags) is
  >= ready_value. rank: int32 [1]; walk block j (of R rows) goes to output block
  (j + rank) % (M // R)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  rows_a, k = a.shape
  n = b.shape[1]
  own_rows = 0 if own is None else own.shape[0]
  m = own_rows + rows_a
  out_dtype = (out.dtype if out is not None else c.dtype if c is not None else a.dtype)
  reason = unsupported_reason(m, k, n, a.dtype, out_dtype, b.dtype)
  if reason or (own is not None and (own.shape[1] != k or own.dtype != a.dtype
                                     or own_rows % TILE_M or m % own_rows)):
    raise ValueError(f"jax_hoccl flagged GEMM: unsupported {reason or 'own rows ' + str(own.shape)}")
  for name, rows, base in (("flag_rows", flag_rows if flags is not None else TILE_M, m),
                           ("ready_rows", ready_rows if ready is not None else TILE_M, rows_a)):
    if rows % TILE_M or base % rows:
      raise ValueError(f"jax_hoccl flagged GEMM: {name}={rows} must be a multiple of {TILE_M} "
                       f"dividing {base}")
  lay = _Layout(m=m, k=k, n=n, own_rows=own_rows, blocks=m // own_rows if own_rows else 1,
                has_rank=rank is not None, has_c=c is not None, into=out is not None,
                flag_rows=flag_rows if flags is not None else 0,
                ready_rows=ready_rows if ready is not None else 0, ready_value=int(ready_value),
                ordered=bool(_ordered))
  if lay.has_rank and not own_rows:
    raise ValueError("jax_hoccl flagged GEMM: rank places blocks of own rows; give own")
  out_types = []
  if flags is None and out is not None:
    raise ValueError("jax_hoccl flagged GEMM: out is for producer flags; give flags too")
  if out is None:
    out_types.append(jax.ShapeDtypeStruct((m, n), out_dtype))
  else:
    out_types.append(jax.ShapeDtypeStruct((128,), jnp.int32))  # the token
  sms = _sm_count()
  kernel = plgpu.kernel(
      functools.partial(_kernel_body, lay), out_type=out_types[0],
      grid=(sms,), grid_names=("sm",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  operands = ([own] if own is not None else []) + [a, b] + ([c] if c is not None else [])
  operands += ([rank] if rank is not None else []) + ([ready] if ready is not None else [])
  operands += ([out] if out is not None else []) + ([flags] if flags is not None else [])
  return kernel(*operands)
