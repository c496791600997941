"""An all_gather beside row GEMMs:

    gather_beside_gemms(x, w, axes, n) == all_gather(x, axes, tiled=True) @ w

all_gather_matmul's forward pass and matmul_reduce_scatter's backward where the flagged GEMM
(flagged/gather_walk.py) does not apply: the copy engines bring the peers' rows while the SMs
multiply this rank's own, then the peers' rows are multiplied.

The GEMM on this rank's rows must run between start and done: XLA moves its dot on x above the
start on GPU even behind an optimization barrier, and the copies then wait for that GEMM. So
where rows_matmul runs on cuBLASLt (bf16/f16) that GEMM is one that takes the start's token
as an operand; elsewhere XLA's dot reads pending.input (the start's output): data
dependencies both. The rows_matmul GEMMs also write their rows straight into their rank's
slot of the output (no concatenate + roll afterwards, a copy of the whole output).
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_hoccl._src.fused.row_pieces import exchanges
from jax_hoccl._src.fused.row_pieces.rows_matmul import rows_matmul, runs_on_cublaslt
from jax_hoccl._src.ops import async_collectives
from jax_hoccl._src.ops import common


def gather_beside_gemms(x, w, axes, n, *, with_rows=False):
  """Returns all_gather(x) @ w and, with_rows, the gathered rows of x in rank order (the
  backward pass's; else None)."""
  if n == 1:
    return x @ w, (x if with_rows else None)
  gemm = runs_on_cublaslt(x.dtype, x.shape[-1], w.shape[-1])
  # [n-1, m, ..., K], ranks r+1, r+2, ...; XLA's dot needs pending.input to follow the start,
  # the rows_matmul GEMM takes the token (and x is read again below: no alias, no copy)
  pending = async_collectives.all_gather_start(x, axes, peers_only=True, order_input=not gemm)
  r = common.rank(axes)
  if gemm:
    # Every GEMM writes its rows straight into their rank's slot of the output: assembling
    # it afterwards (concatenate + roll) would copy the whole output.
    x2 = common.as_rows(x)
    m = x2.shape[0]
    slot = dict(out_block_rows=m, out_rows=n * m)
    out = rows_matmul(x2, w, axes, n, shift=0, block_rows=0, piece_row0=0,
                      rows=m, after=(pending.token,), **slot)
    others = exchanges.done_after(pending, pending.token, out)  # after the GEMM, not above it
    flat = common.as_rows(others)
    for j in range(1, n):  # rank r+j's rows, from others[j-1]
      out = rows_matmul(flat, w, axes, n, shift=0, block_rows=0, piece_row0=(j - 1) * m,
                        rows=m, into=out, out_shift=j, **slot)
    out = out.reshape(n * x.shape[0], *x.shape[1:-1], w.shape[-1])
  else:
    x = pending.input
    mine = x @ w
    others, mine = async_collectives.done(pending, mine)
    theirs = (common.as_rows(others) @ w).reshape(*others.shape[:-1], w.shape[-1])
    out = jnp.roll(jnp.concatenate([mine[None], theirs]), r, axis=0)  # index j: rank j's rows
    out = out.reshape(n * out.shape[1], *out.shape[2:])
  if not with_rows:
    return out, None
  gathered = jnp.roll(jnp.concatenate([x[None], others]), r, axis=0)
  return out, gathered.reshape(n * x.shape[0], *x.shape[1:])
