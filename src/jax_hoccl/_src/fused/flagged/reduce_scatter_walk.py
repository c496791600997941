"""The flagged GEMM walking the reduce-scatter ring:

    gemm_reduce_scatter(x, w, axes, n) == psum_scatter(x @ w, axes, tiled=True)
    gemm_psum(x, w, axes, n)           == psum(x @ w, axes)

One flagged GEMM (flagged/flagged_gemm.py): matmul_reduce_scatter's forward pass on Hopper
GPUs, and with the all-gather of every summed band, matmul_psum's.

Walk block j (R = M/n rows) of rank r is the partial sum of rank (r - 1 - j)'s block of the
output: x's rows of that block times w, added (j >= 1) by the GEMM's stores into the partial
sum rank r-1 computed at its block j-1 for the same rows, once its band has landed. Block 0
goes to `send`, block j in 1..n-2 is summed in place in `recv`, band by band, each raising its
flag; the copy engines (start) pass every band to rank r+1 as soon as its flag is up, and
announce it there. Block n-1 is my own block, the sum of all n partials, summed where rank
r-1's partial landed: `last`, matmul_reduce_scatter's result; or, for matmul_psum, my slot of
the output, raising flags too, and the copy engines send each of its bands to every peer as
it is stored: only the last band's all-gather follows the GEMM. No partial is ever loaded
into the SMs (the TMA stores add in L2).

  start   zeroes the GEMM's flags and the arrival flags, then the bands in order: wait for my
          GEMM's flag, one-band ppermutes (copy engines) (cc/cuda/fused/handlers_fused.cc:
          GemmRingStartCuda);
  GEMM    one kernel, walk(n, gather);
  done    ordered after the GEMM (and the gathers): rank r+1 has read all I send before XLA
          may reuse it.
"""
from __future__ import annotations

import numpy as np

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import ffi_lower
from jax_hoccl._src.fused.flagged import flagged_gemm
from jax_hoccl._src.ops import async_collectives
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops.async_collectives import Pending, start_attrs

# Bands of at most this many per ring step: each is one exchange with its own host
# rendezvous (its host time: docs/design.md, section 8), and the first band's transfer is
# what the next step waits for.
MAX_BANDS_PER_STEP = 8
MIN_BAND_ROWS = 256

gemm_ring_start_p = ji.Primitive("hoccl_gemm_ring_start")
gemm_ring_start_p.multiple_results = True


def _abstract_eval(like, *, axes, axis_size, rows, band_rows, dtype, n_out, gather, site):
  """send [R, N], recv [(n-2) R, N], the GEMM's flags, the arrival flags (uint64), last:
  [R, N] (matmul_reduce_scatter's result) or [n R, N] (matmul_psum's, the same on every rank
  once gathered: invariant over the axes), the token."""
  vma = ji.varying_axes(like)
  n = axis_size
  block = lambda blocks, v=vma: ji.with_type(like, (blocks * rows, n_out), v).update(
      dtype=np.dtype(dtype))
  bands = (n - 1) * rows // band_rows
  i32 = dict(dtype=np.dtype(np.int32), weak_type=False)
  last = block(n, vma - set(axes)) if gather else block(1)
  return [block(1), block(n - 2), ji.with_type(like, (n * rows // band_rows,), vma).update(**i32),
          ji.with_type(like, (flagged_gemm.ready_words(bands),), vma).update(**i32), last,
          ji.with_type(like, (), vma).update(**i32)]


def _lowering(ctx, like, *, axes, axis_size, rows, band_rows, dtype, n_out, gather, site):
  # x is an operand only for the order (and the type): the kernel reads it, not the start
  op = "matmul_psum" if gather else "matmul_reduce_scatter"
  return ffi_lower("hoccl_gemm_ring_start", op, ctx, like, **start_attrs(ctx, axes, op, site),
                   band_bytes=np.int64(band_rows * n_out * np.dtype(dtype).itemsize),
                   flag_target=np.int64(flagged_gemm.flag_target(n_out, band_rows)),
                   gather=np.int64(gather))


gemm_ring_start_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(gemm_ring_start_p, _lowering, platform="cuda")


def band_rows(rows: int) -> int | None:
  """Rows per band for blocks of `rows` rows, or None."""
  for b in range(max(MIN_BAND_ROWS, rows // MAX_BANDS_PER_STEP), rows + 1, flagged_gemm.TILE_M):
    if rows % b == 0:
      return b
  return None


def applies(x, w, n, op) -> bool:
  """Whether the flagged GEMM takes the ring for x [M, K] (per rank) @ w in the user's `op`."""
  m, k = x.shape
  return (n > 1 and m % n == 0 and band_rows(m // n) is not None
          and flagged_gemm.unsupported_reason(m, k, w.shape[1], x.dtype, None, w.dtype) is None
          and flagged_gemm.peer_wait_reason(op) is None)


SEND, LAST, RECV = 1, 2, 3  # the kernel's operands after x (recv only when n > 2)


def walk(n, gather=False):
  """Block j multiplies rank (r - 1 - j)'s rows of x, and from j = 1 adds into where rank
  r-1's partial of those rows landed (recv block j - 1, or last), after its arrival flags
  (ready block j - 1)."""
  Rows, WalkBlock = flagged_gemm.Rows, flagged_gemm.WalkBlock
  blocks = [WalkBlock(a=Rows(0, n - 1, by_rank=True), out=Rows(SEND, 0), flag=True)]
  for j in range(1, n):
    last = j == n - 1
    out = Rows(LAST, 0, by_rank=gather) if last else Rows(RECV, j - 1)
    blocks.append(WalkBlock(a=Rows(0, (-1 - j) % n, by_rank=True), out=out, add=True,
                            wait="out", ready_block=j - 1, flag=not last or gather))
  return blocks


def _ring(x, w, axes, n, gather):
  op = "matmul_psum" if gather else "matmul_reduce_scatter"
  x = common.ensure_varying(x, axes, op)
  rows, nout = x.shape[0] // n, w.shape[1]
  band = band_rows(rows)
  with axes_lib.user_op(op):  # errors name the op the user called
    site = axes_lib.new_site()
  send, recv, flags, ready, last, token = gemm_ring_start_p.bind(
      x, axes=tuple(axes), axis_size=int(n), rows=rows, band_rows=band, dtype=np.dtype(x.dtype),
      n_out=nout, gather=bool(gather), site=site)
  operands = [x, send, last] + ([recv] if n > 2 else [])
  kernel_token = flagged_gemm.walk_matmul(w, operands, walk(n, gather), rows,
                                          rank=common.rank(axes), ready=ready, ready_rows=band,
                                          flags=flags, flag_rows=band)
  # once the GEMM has summed into it (and, for matmul_psum, the peers' blocks have landed)
  out, _ = async_collectives.done(Pending(last, x, token, site, lambda b: b), kernel_token)
  return out


def gemm_reduce_scatter(x, w, axes, n):
  """psum_scatter(x @ w, tiled) for 2-D x [M, K]; applies(x, w, n) must hold."""
  return _ring(x, w, axes, n, gather=False)


def gemm_psum(x, w, axes, n):
  """psum(x @ w) for 2-D x [M, K], invariant over the axes; applies(x, w, n) must hold."""
  return _ring(x, w, axes, n, gather=True)
