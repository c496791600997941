"""The flagged GEMM (fused/flagged/flagged_gemm.py) on one Hopper GPU (skipped elsewhere): values against
XLA's dot, its producer flags seen mid-kernel by a copy-engine stream with the rows final (and
stale when the flag is raised before the rows are stored: the ordering is what the test sees),
its consumer flags holding tiles back until a copy-engine stream brings their rows, and a walk
whose tiles wait for its own earlier tiles finishing on the few SMs another kernel leaves."""
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_hoccl._src.fused.flagged import flagged_gemm as fg
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
  """out = a @ b (+ c: out holds c and the kernel adds into it), and its flags."""
  m, n = a.shape[0], b.shape[1]
  out = jnp.zeros((m, n), a.dtype) if c is None else jnp.array(c, copy=True)
  flags = jnp.zeros((m // flag_rows,), jnp.int32)
  token = jax.jit(lambda a, b, out, flags: fg.flagged_matmul(
      a, b, out=out, add=c is not None, flags=flags, flag_rows=flag_rows, **kw))(a, b, out, flags)
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


@pytest.mark.parametrize("wait", ["a", "out"])
def test_ready_flags_hold_tiles_until_rows_arrive(wait):
  """The kernel runs on rows that a copy-engine stream brings in only after the host lets it
  (50 ms after the launch), one block of rows after another, each announced by a stream write
  into its uint64 flag of `ready`: the product is right only if tiles waited for them. The
  rows are those of `a` (all_gather_matmul's walk: waited for before the mainloop) or the
  output rows the product is added into (the reduce-scatter ring's: waited for before the
  stores). The walk's first block waits for nothing, and `rank` places the walk's blocks."""
  cu, ck = _driver()
  r, blocks, rows_per_block, k, n, ready_rows = 1, 4, 512, 1024, 1024, 256
  b = _rand((k, n), jnp.bfloat16, 1, 1 / np.sqrt(k))
  ready_blocks = [dict(wait=wait, ready_block=j - 1) for j in range(1, blocks)]
  if wait == "a":  # own rows, then the blocks that arrive; blocks placed by rank in the result
    first = _rand((rows_per_block, k), jnp.bfloat16, 3)
    src = _rand(((blocks - 1) * rows_per_block, k), jnp.bfloat16, 0)
    walk = [fg.WalkBlock(a=fg.Rows(0, 0), out=fg.Rows(fg.RESULT, 0, by_rank=True))] + [
        fg.WalkBlock(a=fg.Rows(1, j), out=fg.Rows(fg.RESULT, j + 1, by_rank=True), **kw)
        for j, kw in enumerate(ready_blocks)]
    result = (blocks * rows_per_block, b.dtype)
  else:  # rows of x taken by rank; block 0 to the result, the others added into what arrives
    first = _rand((blocks * rows_per_block, k), jnp.bfloat16, 0)
    src = _rand(((blocks - 1) * rows_per_block, n), jnp.bfloat16, 4)
    walk = [fg.WalkBlock(a=fg.Rows(0, 0, by_rank=True), out=fg.Rows(fg.RESULT, 0))] + [
        fg.WalkBlock(a=fg.Rows(0, j + 1, by_rank=True), out=fg.Rows(1, j), add=True, **kw)
        for j, kw in enumerate(ready_blocks)]
    result = (rows_per_block, b.dtype)
  dst = jnp.zeros_like(src)
  nflags = src.shape[0] // ready_rows
  ready = jnp.zeros((fg.ready_words(nflags),), jnp.int32)
  gate = jnp.zeros((1,), jnp.int32)
  rank = jnp.array([r], jnp.int32)
  for v in (first, src, dst, ready, gate):
    v.block_until_ready()
  f = jax.jit(lambda first, arriving, b, rank, ready: fg.walk_matmul(
      b, [first, arriving], walk, rows_per_block, result=result, rank=rank, ready=ready,
      ready_rows=ready_rows, ready_value=7))
  f(first, jnp.zeros_like(src), b, rank,
    ready.at[:2 * nflags].set(7)).block_until_ready()  # compile
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
  out = f(first, dst, b, rank, ready)
  time.sleep(0.05)
  ck(cu.cuMemsetD32Async(cu.CUdeviceptr(gp), 1, 1, releaser))
  out.block_until_ready()
  ck(cu.cuStreamSynchronize(copier))
  bf = np.asarray(b, np.float32)
  if wait == "a":
    walked = np.concatenate([np.asarray(first, np.float32), np.asarray(src, np.float32)]) @ bf
    want = np.roll(walked.reshape(blocks, rows_per_block, n), r, axis=0).reshape(-1, n)
    got = np.asarray(out, np.float32)
  else:
    x = np.asarray(first, np.float32).reshape(blocks, rows_per_block, k)
    products = [x[(j + r) % blocks] @ bf for j in range(blocks)]
    want = np.concatenate([products[0]] + [
        products[j] + np.asarray(src, np.float32)[(j - 1) * rows_per_block:j * rows_per_block]
        for j in range(1, blocks)])
    got = np.concatenate([np.asarray(out, np.float32), np.asarray(dst, np.float32)])
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  for s in (copier, releaser):
    ck(cu.cuStreamDestroy(s))
  ck(cu.cuMemFreeHost(host))


# Holds an SM per CTA (its dynamic shared memory leaves no room for a GEMM's CTA) until the
# host writes a nonzero word into mapped pinned memory.
_HOLD_SMS_PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry hold_sms(.param .u64 flag)
{
  .reg .pred p;
  .reg .b32 v, tid;
  .reg .b64 a;
  ld.param.u64 a, [flag];
  mov.u32 tid, %tid.x;
  setp.ne.u32 p, tid, 0;
  @p bra DONE;
SPIN:
  nanosleep.u32 2000;
  ld.relaxed.sys.global.b32 v, [a];
  setp.eq.u32 p, v, 0;
  @p bra SPIN;
DONE:
  bar.sync 0;
  ret;
}
"""


@pytest.mark.parametrize("held", [False, True])
def test_walk_progresses_while_another_kernel_holds_most_sms(held):
  """A walk whose second block's tiles wait for its first block's rows (raised as flags, then
  copied by a copy-engine stream into the rows the second block adds into, as the ring's
  partial sums are) runs while another stream's kernel holds all but 4 SMs until the walk has
  finished. Tiles assigned to CTAs by index would leave the 4 running CTAs waiting for rows of
  CTAs that cannot start; claimed in walk order, the 4 CTAs walk everything. (held=False: the
  same walk with every SM free.)"""
  import ctypes

  cu, ck = _driver()
  sms, free_sms = GPUS[0].core_count, 4
  rows, k, n, band = 8192, 1024, 1024, 256
  x = _rand((2 * rows, k), jnp.bfloat16, 0)
  b = _rand((k, n), jnp.bfloat16, 1, 1 / np.sqrt(k))
  walk = [fg.WalkBlock(a=fg.Rows(0, 0), out=fg.Rows(1, 0), flag=True),
          fg.WalkBlock(a=fg.Rows(0, 1), out=fg.Rows(2, 0), add=True, wait="out", ready_block=0,
                       flag=True)]
  bands = rows // band
  f = jax.jit(lambda x, send, last, ready, flags: fg.walk_matmul(
      b, [x, send, last], walk, rows, ready=ready, ready_rows=band, flags=flags,
      flag_rows=band))
  fresh = lambda: (jnp.zeros((rows, n), jnp.bfloat16), jnp.zeros((rows, n), jnp.bfloat16),
                   jnp.zeros((fg.ready_words(bands),), jnp.int32),
                   jnp.zeros((2 * bands,), jnp.int32))
  send, last, ready, flags = fresh()
  f(x, send, last, ready.at[:2 * bands].set(1), flags).block_until_ready()  # compile
  send, last, ready, flags = fresh()
  for v in (send, last, ready, flags):
    v.block_until_ready()
  sp, lp = send.unsafe_buffer_pointer(), last.unsafe_buffer_pointer()
  rp, fp = ready.unsafe_buffer_pointer(), flags.unsafe_buffer_pointer()
  copier, holder = ck(cu.cuStreamCreate(1)), ck(cu.cuStreamCreate(1))
  nbytes = band * n * 2
  host = ck(cu.cuMemHostAlloc(rows * n * 2, 0))
  # (loading a module or pinning memory may wait for the device to idle: before the waits)
  module = ck(cu.cuModuleLoadData(_HOLD_SMS_PTX + b"\0"))
  hold = ck(cu.cuModuleGetFunction(module, b"hold_sms"))
  smem = 200 * 1024
  ck(cu.cuFuncSetAttribute(
      hold, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
  release = ck(cu.cuMemHostAlloc(4, cu.CU_MEMHOSTALLOC_DEVICEMAP))
  word = ctypes.c_int32.from_address(int(release))
  word.value = 0
  arg = np.array([int(ck(cu.cuMemHostGetDevicePointer(release, 0)))], np.uint64)
  args = np.array([arg.ctypes.data], np.uint64)
  for i in range(bands):  # block 0's band i, once stored, becomes the rows block 1 adds into
    ck(cu.cuStreamWaitValue32(copier, cu.CUdeviceptr(fp + 4 * i), fg.flag_target(n, band),
                              cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))
    ck(cu.cuMemcpyDtoHAsync(int(host) + i * nbytes, cu.CUdeviceptr(sp + i * nbytes), nbytes,
                            copier))
    ck(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(lp + i * nbytes), int(host) + i * nbytes, nbytes,
                            copier))
    ck(cu.cuStreamWriteValue64(copier, cu.CUdeviceptr(rp + 8 * i), 1, 0))
  finished_while_held = False
  try:
    if held:
      ck(cu.cuLaunchKernel(hold, sms - free_sms, 1, 1, 128, 1, 1, smem, holder,
                           args.ctypes.data, 0))
      time.sleep(0.05)  # the holder's CTAs are resident before the walk starts
    token = f(x, send, last, ready, flags)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not token.is_ready():
      time.sleep(0.01)
    finished_while_held = token.is_ready()
  finally:
    word.value = 1  # release the SMs whatever happened, so a stalled walk finishes too
    ck(cu.cuStreamSynchronize(holder))
  token.block_until_ready()
  ck(cu.cuStreamSynchronize(copier))
  assert finished_while_held, "the walk stalled on the SMs another kernel left"
  xf, bf = np.asarray(x, np.float32), np.asarray(b, np.float32)
  np.testing.assert_allclose(np.asarray(last, np.float32), (xf[:rows] + xf[rows:]) @ bf,
                             rtol=3e-2, atol=3e-2)
  for s in (copier, holder):
    ck(cu.cuStreamDestroy(s))
  ck(cu.cuMemFreeHost(host))
  ck(cu.cuMemFreeHost(release))
  ck(cu.cuModuleUnload(module))
