"""all_gather_matmul(x, w, axis) == all_gather(x, axis, tiled=True) @ w, with the gather
hidden behind the matmul: the peers' rows are pulled by copy engines while XLA multiplies
this rank's own rows (the column-parallel linear layer of sequence-parallel Megatron). For
bf16/f16 on GPU each block's GEMM is a rows_matmul writing its rank's rows of the output in
place (no concatenate).

Backward: dx = matmul_reduce_scatter(ct, w.T) (overlapped the same way), dw from the rows
gathered in the forward pass.
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src.fused.rows_matmul import rows_matmul, runs_on_cublaslt
from jax_hoccl._src.ops import async_collectives as ac
from jax_hoccl._src.ops import common


def gather_and_multiply(x, w, axes, n):
  """Returns (all_gather(x) @ w, the gathered rows of x in rank order)."""
  if n == 1:
    return x @ w, x
  pending = ac.all_gather_start(x, axes, peers_only=True)  # [n-1, m, ..., K], ranks r+1, r+2..
  k, nout = w.shape
  r = common.rank(axes)
  if runs_on_cublaslt(x.dtype, k, nout):
    out, others = _into_rank_rows(x, w, axes, n, pending)
  else:
    mine = pending.input @ w
    others, mine = ac.done(pending, mine)
    theirs = (others.reshape(-1, k) @ w).reshape(*others.shape[:-1], nout)
    out = jnp.roll(jnp.concatenate([mine[None], theirs]), r, axis=0)  # index j = rank j's rows
    out = out.reshape(-1, *out.shape[2:])
  gathered = jnp.roll(jnp.concatenate([x[None], others]), r, axis=0)  # (backward only)
  return out, gathered.reshape(-1, *x.shape[1:])


def _into_rank_rows(x, w, axes, n, pending):
  """Each block's GEMM (rows_matmul) writes straight into its rank's rows of the output: on
  2x H200 the roll + concatenate of XLA's per-block results cost ~5% of the GEMM at
  M = 16384 (a copy of the whole output)."""
  rows = int(np.prod(x.shape[:-1], dtype=np.int64))  # rows of one rank's x, flattened
  k = x.shape[-1]
  out = rows_matmul(pending.input.reshape(rows, k), w, axes, n, shift=0, block_rows=0,
                    piece_row0=0, rows=rows, out_rows=n * rows, out_block_rows=rows)
  others, out = ac.done(pending, out)
  flat = others.reshape((n - 1) * rows, k)
  for j in range(1, n):  # others[j - 1] holds rank r + j's rows
    out = rows_matmul(flat, w, axes, n, shift=0, block_rows=0, piece_row0=(j - 1) * rows,
                      rows=rows, into=out, out_shift=j, out_block_rows=rows)
  return out.reshape(n * x.shape[0], *x.shape[1:-1], w.shape[1]), others


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _agmm(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  return gather_and_multiply(x, w, axes, n)[0]


def _agmm_fwd(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  out, gathered = gather_and_multiply(x, w, axes, n)
  return out, (gathered, x, w)


def _agmm_bwd(axis_name, res, ct):
  from jax_hoccl._src.fused.matmul_reduce_scatter import matmul_reduce_scatter
  gathered, x, w = res
  dx = matmul_reduce_scatter(ct, w.T, axis_name)
  k, nout = w.shape
  dw = gathered.reshape(-1, k).T @ ct.reshape(-1, nout)
  return common.cotangent_like(dx, x), common.cotangent_like(dw, w)


_agmm.defvjp(_agmm_fwd, _agmm_bwd)


def all_gather_matmul(x, w, axis_name):
  """all_gather(x, axis_name, tiled=True) @ w for x [m, ..., K] (rows sharded over the axis)
  and w [K, N]; returns [n*m, ..., N]. Call inside shard_map."""
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"jax_hoccl.all_gather_matmul: needs x [m, ..., K] and w [K, N], got "
                     f"{x.shape} and {w.shape}.")
  axes_lib.check_dtype(x, "all_gather_matmul", summable=True)
  return _agmm(common.ensure_varying(x, axes), w, axes)
