"""The flagged GEMM (fused/flagged_gemm.py) on one Hopper GPU (skipped elsewhere): values against
XLA's dot, its producer flags seen mid-kernel by a copy-engine stream with the rows final (and
stale when the flag is raised before the rows are stored: the ordering is what the test sees),
its consumer flags holding tiles back until a copy-engine stream brings their rows."""
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_hoccl._src.fused import flagged_gemm as fg
from conftest import gpus

GPUS = gpus()
HOPPER = bool(GPUS) and getattr(GPUS[0], "compute_capability", "") == "9.0"
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")


def _driver():
  from jax_hoccl.bench.gemm import cuda_driver
  return cuda_driver()


def _rand(shape, dtype, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def _run(a, b, c=None, flag_rows=fg.TILE_M, **kw):
  m, n = a.shape[0], b.shape[1]
  out = jnp.zeros((m, n), a.dtype if c is None else c.dtype)
  flags = jnp.zeros((m // flag_rows,), jnp.int32)
  token = jax.jit(lambda a, b, c, out, flags: fg.flagged_matmul(
      a, b, out=out, flags=flags, c=c, flag_rows=flag_rows, **kw))(a, b, c, out, flags)
  token.block_until_ready()
  return out, flags


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,n", [(256, 512, 512), (1024, 1024, 2048), (384, 192, 768)])
@pytest.mark.parametrize("with_c", [False, True])
def test_matches_xla_dot(dtype, m, k, n, with_c):
  a, b = _rand((m, k), dtype, 0), _rand((k, n), dtype, 1, 1 / np.sqrt(k))
  c = _rand((m, n), dtype, 2) if with_c else None
  out, flags = _run(a, b, c)
  ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
  if with_c:
    ref = ref + c.astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)
  # every block's flag reached its target exactly once
  np.testing.assert_array_equal(np.asarray(flags), fg.flag_target(n, fg.TILE_M))


def test_unsupported_shapes_and_dtypes_are_named():
  assert fg.unsupported_reason(1024, 1024, 1024, jnp.bfloat16) is None
  assert "shape" in fg.unsupported_reason(100, 1024, 1024, jnp.bfloat16)
  assert "shape" in fg.unsupported_reason(1024, 1000, 1024, jnp.float16)
  assert "shape" in fg.unsupported_reason(1024, 1024, 128, jnp.float16)
  assert "dtype" in fg.unsupported_reason(1024, 1024, 1024, jnp.float32)
  assert "must match" in fg.unsupported_reason(1024, 1024, 1024, jnp.bfloat16, None, jnp.float16)
  with pytest.raises(ValueError, match="unsupported"):
    _run(_rand((100, 64), jnp.bfloat16, 0), _rand((64, 256), jnp.bfloat16, 1))


def _copies_on_flags(ordered, reps=2, m=8192, k=8192, n=4096, flag_rows=1024):
  """A copy-engine stream waits for each block's flag in turn and copies the block to pinned
  host memory as its flag rises, all queued before the kernel exists. (Device-to-host, because
  a copy within one GPU may run as a kernel, which waits for SMs the GEMM holds.) Returns (how
  many copies saw rows that differ from the final output, median ms from each block's copy end
  to the last block's)."""
  import ctypes

  cu, ck = _driver()
  stream = ck(cu.cuStreamCreate(1))
  nb = m // flag_rows
  evs = [ck(cu.cuEventCreate(0)) for _ in range(nb)]
  a, b = _rand((m, k), jnp.bfloat16, 0), _rand((k, n), jnp.bfloat16, 1, 1 / np.sqrt(k))
  target = fg.flag_target(n, flag_rows)
  f = jax.jit(lambda a, b, out, flags: fg.flagged_matmul(
      a, b, out=out, flags=flags, flag_rows=flag_rows, _ordered=ordered))
  f(a, b, jnp.zeros((m, n), jnp.bfloat16), jnp.zeros((nb,), jnp.int32)).block_until_ready()
  block_bytes = flag_rows * n * 2
  host = ck(cu.cuMemHostAlloc(m * n * 2, 0))
  copies = np.frombuffer((ctypes.c_char * (m * n * 2)).from_address(int(host)), np.uint16)
  stale, ends = 0, []
  for _ in range(reps):
    out = jnp.full((m, n), jnp.nan, jnp.bfloat16)
    flags = jnp.zeros((nb,), jnp.int32)
    for x in (out, flags):
      x.block_until_ready()
    fp, op = flags.unsafe_buffer_pointer(), out.unsafe_buffer_pointer()
    for blk in range(nb):
      ck(cu.cuStreamWaitValue32(stream, cu.CUdeviceptr(fp + 4 * blk), target,
                                cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))
      ck(cu.cuMemcpyDtoHAsync(int(host) + blk * block_bytes,
                              cu.CUdeviceptr(op + blk * block_bytes), block_bytes, stream))
      ck(cu.cuEventRecord(evs[blk], stream))
    time.sleep(0.01)  # the waits are queued before the kernel is launched
    f(a, b, out, flags).block_until_ready()
    ck(cu.cuStreamSynchronize(stream))
    ends.append([ck(cu.cuEventElapsedTime(evs[blk], evs[-1])) for blk in range(nb)])
    final = np.asarray(out).view(np.uint16).reshape(nb, -1)
    got = copies.reshape(nb, -1)
    stale += sum(int(not np.array_equal(got[blk], final[blk])) for blk in range(nb))
  ck(cu.cuStreamDestroy(stream))
  ck(cu.cuMemFreeHost(host))
  return stale, np.median(np.asarray(ends), axis=0)


def test_flags_start_copies_mid_gemm_with_final_rows():
  stale, before_last = _copies_on_flags(ordered=True)
  print("TIME flagged GEMM 8192x8192x4096, ms from each block's copy end to the last's: "
        + " ".join(f"{t:.3f}" for t in before_last))
  assert stale == 0
  # the first block's copy ended well before the last block's: it ran mid-kernel
  assert before_last[0] > 0.05


def test_flags_raised_before_the_rows_are_stored_expose_stale_rows():
  """The same copies with the flag raised before the tile is computed see NaNs: the ordering
  of flag after data is what makes the rows final (this fails if that ordering is a no-op)."""
  stale, _ = _copies_on_flags(ordered=False, reps=2)
  assert stale > 0


@pytest.mark.parametrize("wait", ["a", "c"])
def test_ready_flags_hold_tiles_until_rows_arrive(wait):
  """The kernel runs on rows that a copy-engine stream brings in only after the host lets it
  (50 ms after the launch), one block of rows after another, each announced by a stream write
  into its uint64 flag of `ready`: the product is right only if tiles waited for them. The
  rows are those of `a` (all_gather_matmul's walk: waited for before the mainloop) or of the
  added c (the reduce-scatter ring's: waited for in the mainloop, then fetched). The walk's
  first block is not waited for, and `rank` places the walk's blocks."""
  cu, ck = _driver()
  r, blocks, rows_per_block, k, n, ready_rows = 1, 4, 512, 1024, 1024, 256
  own = _rand((rows_per_block, k), jnp.bfloat16, 3)
  b = _rand((k, n), jnp.bfloat16, 1, 1 / np.sqrt(k))
  if wait == "a":  # a: own, then the blocks that arrive
    src = _rand(((blocks - 1) * rows_per_block, k), jnp.bfloat16, 0)
    x = jnp.concatenate([own, src])
    c_ref = 0.0
    walk = [fg.WalkBlock(a=fg.Rows(0, 0), out=fg.Rows(fg.RESULT, 0, by_rank=True))] + [
        fg.WalkBlock(a=fg.Rows(1, j - 1), out=fg.Rows(fg.RESULT, j, by_rank=True), wait="a")
        for j in range(1, blocks)]
  else:  # a fixed, c of every block but the first arrives
    x = _rand((blocks * rows_per_block, k), jnp.bfloat16, 0)
    src = _rand(((blocks - 1) * rows_per_block, n), jnp.bfloat16, 4)
    c_ref = np.concatenate([np.zeros((rows_per_block, n)), np.asarray(src, np.float32)])
    walk = [fg.WalkBlock(a=fg.Rows(0, 0), out=fg.Rows(fg.RESULT, 0, by_rank=True))] + [
        fg.WalkBlock(a=fg.Rows(0, j), c=fg.Rows(1, j - 1),
                     out=fg.Rows(fg.RESULT, j, by_rank=True), wait="c")
        for j in range(1, blocks)]
  first = own if wait == "a" else x
  dst = jnp.zeros_like(src)
  nflags = src.shape[0] // ready_rows
  ready = jnp.zeros((2 * nflags,), jnp.int32)
  gate = jnp.zeros((1,), jnp.int32)
  rank = jnp.array([r], jnp.int32)
  for v in (first, src, dst, ready, gate):
    v.block_until_ready()
  f = jax.jit(lambda first, arriving, b, rank, ready: fg.walk_matmul(
      b, [first, arriving], walk, rows_per_block, result=(blocks * rows_per_block, b.dtype),
      rank=rank, ready=ready, ready_rows=ready_rows, ready_value=7))
  f(first, src, b, rank, jnp.full((2 * nflags,), 7, jnp.int32)).block_until_ready()  # compile
  copier, releaser = ck(cu.cuStreamCreate(1)), ck(cu.cuStreamCreate(1))
  gp, rp = gate.unsafe_buffer_pointer(), ready.unsafe_buffer_pointer()
  sp, dp = src.unsafe_buffer_pointer(), dst.unsafe_buffer_pointer()
  ck(cu.cuStreamWaitValue32(copier, cu.CUdeviceptr(gp), 1,
                            cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))
  nbytes = ready_rows * src.shape[1] * 2
  host = ck(cu.cuMemHostAlloc(nbytes, 0))  # staged through the host: copy engines only
  for blk in range(nflags):
    ck(cu.cuMemcpyDtoHAsync(host, cu.CUdeviceptr(sp + blk * nbytes), nbytes, copier))
    ck(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dp + blk * nbytes), host, nbytes, copier))
    ck(cu.cuStreamWriteValue64(copier, cu.CUdeviceptr(rp + 8 * blk), 7, 0))
  result = f(first, dst, b, rank, ready)
  time.sleep(0.05)
  ck(cu.cuMemsetD32Async(cu.CUdeviceptr(gp), 1, 1, releaser))
  result.block_until_ready()
  ck(cu.cuStreamSynchronize(copier))
  rows = x.astype(jnp.float32) @ b.astype(jnp.float32) + c_ref
  ref = np.roll(np.asarray(rows).reshape(blocks, rows_per_block, n), r, axis=0).reshape(-1, n)
  np.testing.assert_allclose(np.asarray(result, np.float32), ref, rtol=2e-2, atol=2e-2)
  for s in (copier, releaser):
    ck(cu.cuStreamDestroy(s))
  ck(cu.cuMemFreeHost(host))
