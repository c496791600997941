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


@functools.lru_cache(maxsize=None)
def _on_hopper() -> bool:
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


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


def _kernel_body(m, k, n, flag_rows, ready_rows, ready_value, has_c, ordered, *refs):
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  refs = list(refs)
  a_gmem, b_gmem = refs.pop(0), refs.pop(0)
  c_gmem = refs.pop(0) if has_c else None
  out_gmem, flags_gmem = refs.pop(0), refs.pop(0)
  ready_gmem = refs.pop(0) if ready_rows else None
  # refs[0] is the token output: never written, it only orders readers after the kernel
  dtype, out_dtype = a_gmem.dtype, out_gmem.dtype
  in_swizzle = plgpu.find_swizzle(TILE_K * jnp.dtype(dtype).itemsize * 8)
  in_transforms = (plgpu.TilingTransform((8, in_swizzle // jnp.dtype(dtype).itemsize)),
                   plgpu.SwizzleTransform(in_swizzle))
  out_swizzle = plgpu.find_swizzle(EPI * jnp.dtype(out_dtype).itemsize * 8)
  out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
                    plgpu.SwizzleTransform(out_swizzle))
  cta_n = COMPUTE_WGS * TILE_N
  m_tiles, n_tiles, k_steps = m // TILE_M, n // cta_n, k // TILE_K
  band = min(BAND_TILES, m_tiles)
  epi_tiles = [(i, j) for i in range(TILE_M // EPI) for j in range(TILE_N // EPI)]

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
      c_arrived=plgpu.Barrier(num_barriers=2 * COMPUTE_WGS) if has_c else None,
      collective_axes="wg")
  def _scope(allocs, stage, c_arrived):
    wg = lax.axis_index("wg")

    # A tile's flag is raised (after its stores complete) at the start of the next tile's
    # epilogue, once its mainloop gave the stores time to land: raising it right after the
    # stores makes the warpgroup wait for them, ~1.5% of the GEMM's time on H200. With
    # `ready` it is raised at once: a deferred flag could wait for a tile that waits for a
    # peer that waits for this flag.
    defer = ordered and ready_gmem is None

    def flag_at(block):
      return flags_gmem.at[pl.ds(block, 1)]

    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm", init_carry=jnp.int32(-1))
    def last_block(info, carry):
      (t,) = info.index
      mi, ni = plgpu.planar_snake(t, (m_tiles, n_tiles), 0, band)
      rows = pl.ds(mi * TILE_M, TILE_M)
      cols = pl.ds(ni * cta_n + wg * TILE_N, TILE_N)   # this warpgroup's half (compute wgs)
      block = (mi * TILE_M) // flag_rows
      if ready_gmem is not None:
        _await_flag(ready_gmem.at[pl.ds((mi * TILE_M) // ready_rows, 1)], ready_value)

      def epilogue(run_mainloop):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE_M, TILE_N), jnp.float32))
        def _acc(acc):
          if not ordered:
            _raise_flag(flag_at(block), ordered=False)
          run_mainloop(acc)
          result = acc[...].astype(out_dtype)
          if defer:
            @pl.when(carry >= 0)
            def _previous_tile():
              _raise_flag(flag_at(carry), ordered=True)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores left smem
          for e, (i, j) in enumerate(epi_tiles):
            slot = e % 2
            sub = (slice(i * EPI, (i + 1) * EPI), slice(j * EPI, (j + 1) * EPI))
            dst = out_gmem.at[rows, cols].at[sub]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            if c_gmem is None:
              stage[wg, slot] = result[sub]
            else:
              bar = c_arrived.at[wg * 2 + slot]
              plgpu.copy_gmem_to_smem(c_gmem.at[rows, cols].at[sub], stage.at[wg, slot], bar)
              plgpu.barrier_wait(bar)
              stage[wg, slot] += result[sub]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage.at[wg, slot], dst)
          if ordered and not defer:
            _raise_flag(flag_at(block), ordered=True)

      def mma(_, a_smem, b_smem, acc):
        plgpu.wgmma(acc, a_smem, b_smem.at[:, pl.ds(wg * TILE_N, TILE_N)])
        plgpu.wgmma_wait(0)
        return acc

      pipeline(mma, epilogue)(a_gmem.at[rows, :], b_gmem.at[:, pl.ds(ni * cta_n, cta_n)],
                              allocations=allocs)
      return block

    if defer:  # this CTA's last tile (the memory warpgroup, last, raises nothing)
      @pl.when((wg < COMPUTE_WGS) & (last_block >= 0))
      def _last_tile():
        _raise_flag(flag_at(last_block), ordered=True)

  plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def flagged_matmul_into(a, b, out, flags, *, c=None, flag_rows=TILE_M, ready=None,
                        ready_rows=TILE_M, ready_value=1, _ordered=True):
  """Runs the kernel: writes a @ b (+ c) into `out` [M, N] and raises `flags` [M // flag_rows]
  (int32) per finished block of rows; returns a token (int32 [128]) that later readers of
  `out`/`flags` must depend on. `out` and `flags` are written in place: pass buffers that no
  one else reads before the token (e.g. fresh ones from a jax_hoccl start).
  ready: int32 [M // ready_rows]; tile rows wait for ready[row // ready_rows] >= ready_value."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  m, k = a.shape
  n = b.shape[1]
  reason = unsupported_reason(m, k, n, a.dtype, out.dtype, b.dtype)
  if reason:
    raise ValueError(f"jax_hoccl flagged GEMM: unsupported {reason}")
  if flag_rows % TILE_M or m % flag_rows:
    raise ValueError(f"jax_hoccl flagged GEMM: flag_rows={flag_rows} must be a multiple of "
                     f"{TILE_M} dividing M={m}")
  if ready is not None and (ready_rows % TILE_M or m % ready_rows):
    raise ValueError(f"jax_hoccl flagged GEMM: ready_rows={ready_rows} must be a multiple of "
                     f"{TILE_M} dividing M={m}")
  body = functools.partial(_kernel_body, m, k, n, flag_rows,
                           ready_rows if ready is not None else 0, ready_value, c is not None,
                           _ordered)
  sms = jax.devices()[0].core_count
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((128,), jnp.int32),
      grid=(sms,), grid_names=("sm",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  operands = [a, b] + ([c] if c is not None else []) + [out, flags]
  if ready is not None:
    operands.append(ready)
  return kernel(*operands)
