"""all_gather(x) @ w as one flagged GEMM that multiplies the peers' rows as they land (the
consumer side of fused/flagged_gemm.py): all_gather_matmul's forward pass on Hopper GPUs.

  start   the copy engines pull the peers' rows (ranks r+1, r+2, ... as all_gather's
          peers_only) into a buffer in chunks of READY_ROWS rows, each followed on the copying
          stream by a write of 1 into its uint64 flag (cc/cuda/cuda_executor.h: Announce), the flags
          zeroed first on XLA's stream;
  GEMM    one kernel walks my own rows (x, nothing to wait for) then the peers' buffer, a tile
          waiting in-kernel for its chunk's flag; walk block j is written to output block
          (r + j) % n, so the output is in rank order with no copy;
  done    ordered after the GEMM: the peers finished reading my x before XLA may reuse it.
"""
from __future__ import annotations

import numpy as np

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import ffi_lower
from jax_hoccl._src.fused import flagged_gemm as fg
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops import async_collectives as ac
from jax_hoccl._src.ops.async_collectives import Pending, start_attrs

# Rows per announced chunk: small enough that the first peer tile waits little after my own
# rows, large enough that the per-copy costs stay small (a chunk of K = 8192 bf16 is 8 MiB).
READY_ROWS = 512

OP = "all_gather_matmul"
announced_gather_start_p = ji.Primitive("hoccl_announced_gather_start")
announced_gather_start_p.multiple_results = True


def _abstract_eval(x, *, axes, axis_size, ready_rows, site):
  vma = ji.varying_axes(x)
  rows = (axis_size - 1) * x.shape[0]
  gathered = ji.with_type(x, (axis_size - 1, *x.shape), vma)
  ready = ji.with_type(x, (fg.ready_words(rows // ready_rows),), vma).update(
      dtype=np.dtype(np.int32), weak_type=False)
  token = ji.with_type(x, (), vma).update(dtype=np.dtype(np.int32), weak_type=False)
  return [gathered, ready, token]


def _lowering(ctx, x, *, axes, axis_size, ready_rows, site):
  row_bytes = int(np.prod(ctx.avals_in[0].shape[1:], dtype=np.int64)) * np.dtype(
      ctx.avals_in[0].dtype).itemsize
  return ffi_lower("hoccl_announced_gather_start", OP, ctx, x, **start_attrs(ctx, axes, OP, site),
                   announce_bytes=np.int64(ready_rows * row_bytes))


announced_gather_start_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(announced_gather_start_p, _lowering, platform="cuda")


def applies(x, w, n) -> bool:
  """Whether the flagged GEMM takes all_gather_matmul(x, w) (x 2-D [m, K] per rank)."""
  m, k = x.shape
  return (n > 1 and m % READY_ROWS == 0
          and fg.unsupported_reason(n * m, k, w.shape[1], x.dtype, None, w.dtype) is None
          and fg.peer_wait_reason(OP) is None)


def walk(n):
  """My rows first (nothing to wait for), then the peers' (ranks r+1, ...) as they land; walk
  block j is rank (r + j)'s rows of the output."""
  return [fg.WalkBlock(a=fg.Rows(0, 0), out=fg.Rows(fg.RESULT, 0, by_rank=True))] + [
      fg.WalkBlock(a=fg.Rows(1, j - 1), out=fg.Rows(fg.RESULT, j, by_rank=True), wait="a",
                   ready_block=j - 1)
      for j in range(1, n)]


def gather_into_gemm(x, w, axes, n):
  """(all_gather(x) @ w in rank order, the peers' rows [n-1, m, K] rotated as peers_only).
  x is 2-D [m, K]; applies(x, w, n) must hold."""
  x = common.ensure_varying(x, axes, OP)
  with axes_lib.user_op(OP):  # errors name the op the user called
    site = axes_lib.new_site()
  gathered, ready, token = announced_gather_start_p.bind(
      x, axes=tuple(axes), axis_size=int(n), ready_rows=READY_ROWS, site=site)
  out = fg.walk_matmul(w, [x, gathered.reshape(-1, x.shape[1])], walk(n), x.shape[0],
                       result=(n * x.shape[0], x.dtype), rank=common.rank(axes), ready=ready,
                       ready_rows=READY_ROWS)
  peers, out = ac.done(Pending(gathered, x, token, site, lambda b: b), out)  # after the GEMM
  return out, peers
