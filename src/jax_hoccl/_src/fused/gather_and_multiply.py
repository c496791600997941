"""all_gather(x, tiled=True) @ w with the gather behind the GEMM: all_gather_matmul's forward
pass and matmul_reduce_scatter's backward (all_gather_matmul.py says why it is built so): one
flagged GEMM where it applies (gather_into_gemm.py), else a gather beside row GEMMs."""
from __future__ import annotations

import jax.numpy as jnp

from jax_hoccl._src.fused import exchanges as ex
from jax_hoccl._src.fused import gather_into_gemm as flagged
from jax_hoccl._src.fused.rows_matmul import rows_matmul, runs_on_cublaslt
from jax_hoccl._src.ops import async_collectives as ac
from jax_hoccl._src.ops import common


def gather_and_multiply(x, w, axes, n, *, with_rows=False):
  """Returns all_gather(x) @ w and, with_rows, the gathered rows of x in rank order (the
  backward pass's; else None)."""
  if n == 1:
    return x @ w, (x if with_rows else None)
  k = x.shape[-1]
  if flagged.applies(x.reshape(-1, k), w, n):  # one flagged GEMM, fed as the rows land
    out, others = flagged.gather_into_gemm(x.reshape(-1, k), w, axes, n)
    out = out.reshape(n * x.shape[0], *x.shape[1:-1], w.shape[-1])
    if not with_rows:
      return out, None
    r = common.rank(axes)
    gathered = jnp.roll(jnp.concatenate([x[None], others.reshape(n - 1, *x.shape)]), r, axis=0)
    return out, gathered.reshape(-1, *x.shape[1:])
  gemm = runs_on_cublaslt(x.dtype, k, w.shape[-1])
  # [n-1, m, ..., K], ranks r+1, r+2, ...; XLA's dot needs pending.input to follow the start,
  # the rows_matmul GEMM takes the token (and x is read again below: no alias, no copy)
  pending = ac.all_gather_start(x, axes, peers_only=True, order_input=not gemm)
  r = common.rank(axes)
  if gemm:
    # Every GEMM writes its rows straight into their rank's slot of the output: assembling
    # it afterwards (concatenate + roll) was a copy of the whole output, ~75 us of the 88 us
    # over the GEMM at M = 16384 on 2x H200.
    m = x.size // k  # rows of x as 2-D
    slot = dict(out_block_rows=m, out_rows=n * m)
    out = rows_matmul(x.reshape(m, k), w, axes, n, shift=0, block_rows=0, piece_row0=0,
                      rows=m, after=(pending.token,), **slot)
    others = ex.done_after(pending, pending.token, out)  # after the GEMM, not above it
    flat = others.reshape(-1, k)
    for j in range(1, n):  # rank r+j's rows, from others[j-1]
      out = rows_matmul(flat, w, axes, n, shift=0, block_rows=0, piece_row0=(j - 1) * m,
                        rows=m, into=out, out_shift=j, **slot)
    out = out.reshape(n * x.shape[0], *x.shape[1:-1], w.shape[-1])
  else:
    x = pending.input
    mine = x @ w
    others, mine = ac.done(pending, mine)
    theirs = (others.reshape(-1, k) @ w).reshape(*others.shape[:-1], w.shape[-1])
    out = jnp.roll(jnp.concatenate([mine[None], theirs]), r, axis=0)  # index j: rank j's rows
    out = out.reshape(-1, *out.shape[2:])
  if not with_rows:
    return out, None
  gathered = jnp.roll(jnp.concatenate([x[None], others]), r, axis=0)
  return out, gathered.reshape(-1, *x.shape[1:])
