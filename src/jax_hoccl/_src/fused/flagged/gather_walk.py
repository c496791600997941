"""The flagged GEMM walking the rows of an all_gather as they land:

    gemm_as_rows_land(x, w, axes, n) == all_gather(x, axes, tiled=True) @ w

One flagged GEMM (the consumer side of flagged/flagged_gemm.py) that multiplies the peers'
rows as they land: all_gather_matmul's forward pass, and matmul_reduce_scatter's backward,
on Hopper GPUs.

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

import jax.numpy as jnp
import numpy as np

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import ffi_lower
from jax_hoccl._src.fused.flagged import flagged_gemm
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops import async_collectives
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
  ready = ji.with_type(x, (flagged_gemm.ready_words(rows // ready_rows),), vma).update(
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
  """Whether the flagged GEMM takes all_gather(x) @ w (x [m, ..., K] per rank)."""
  x = x.reshape(-1, x.shape[-1])
  m, k = x.shape
  return (n > 1 and m % READY_ROWS == 0
          and flagged_gemm.unsupported_reason(n * m, k, w.shape[1], x.dtype, None, w.dtype)
          is None
          and flagged_gemm.peer_wait_reason(OP) is None)


def walk(n):
  """My rows first (nothing to wait for), then the peers' (ranks r+1, ...) as they land; walk
  block j is rank (r + j)'s rows of the output."""
  Rows, WalkBlock, RESULT = flagged_gemm.Rows, flagged_gemm.WalkBlock, flagged_gemm.RESULT
  return [WalkBlock(a=Rows(0, 0), out=Rows(RESULT, 0, by_rank=True))] + [
      WalkBlock(a=Rows(1, j - 1), out=Rows(RESULT, j, by_rank=True), wait="a",
                ready_block=j - 1)
      for j in range(1, n)]


def gemm_as_rows_land(x, w, axes, n, *, with_rows=False):
  """Returns all_gather(x) @ w in rank order, [n*m, ..., N], and, with_rows, the gathered
  rows of x in rank order (the backward pass's; else None). x is [m, ..., K]; applies(x, w, n)
  must hold."""
  x_nd, x = x, x.reshape(-1, x.shape[-1])
  x = common.ensure_varying(x, axes, OP)
  with axes_lib.user_op(OP):  # errors name the op the user called
    site = axes_lib.new_site()
  gathered, ready, token = announced_gather_start_p.bind(
      x, axes=tuple(axes), axis_size=int(n), ready_rows=READY_ROWS, site=site)
  out = flagged_gemm.walk_matmul(w, [x, gathered.reshape(-1, x.shape[1])], walk(n), x.shape[0],
                                 result=(n * x.shape[0], x.dtype), rank=common.rank(axes),
                                 ready=ready, ready_rows=READY_ROWS)
  # the peers' rows [n-1, m, K], rotated as peers_only; the done after the GEMM
  peers, out = async_collectives.done(Pending(gathered, x, token, site, lambda b: b), out)
  out = out.reshape(n * x_nd.shape[0], *x_nd.shape[1:-1], w.shape[-1])
  if not with_rows:
    return out, None
  r = common.rank(axes)
  rows = jnp.roll(jnp.concatenate([x_nd[None], peers.reshape(n - 1, *x_nd.shape)]), r, axis=0)
  return out, rows.reshape(-1, *x_nd.shape[1:])
