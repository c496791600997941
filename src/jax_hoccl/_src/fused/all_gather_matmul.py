"""all_gather_matmul(x, w, axis) == all_gather(x, axis, tiled=True) @ w, with the gather
hidden behind the matmul: the peers' rows are pulled by copy engines while XLA multiplies
this rank's own rows (the column-parallel linear layer of sequence-parallel Megatron).

The GEMM on this rank's rows must run between start and done. When it was XLA's dot on x
behind an optimization barrier, XLA moved it above the start on GPU: the copies then waited
for that GEMM, and the op took 1.28-1.35x the GEMM (2x H200, device timeline in
benchmarks/probe_fused.py). So where rows_matmul runs on cuBLASLt (bf16/f16) that GEMM is one
that takes the start's token as an operand; elsewhere XLA's dot reads pending.input (the
start's output): data dependencies both. The rows_matmul GEMMs also write their rows straight
into their rank's slot of the output (no concatenate + roll afterwards, a copy of the whole
output).

Backward: dx = matmul_reduce_scatter(ct, w.T) (overlapped the same way), dw from the rows
gathered in the forward pass.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src.fused.rows_matmul import rows_matmul, runs_on_cublaslt
from jax_hoccl._src.fused import exchanges as ex
from jax_hoccl._src.ops import async_collectives as ac
from jax_hoccl._src.ops import common


def gather_and_multiply(x, w, axes, n, *, with_rows=False):
  """Returns all_gather(x) @ w and, with_rows, the gathered rows of x in rank order (the
  backward pass's; else None)."""
  if n == 1:
    return x @ w, (x if with_rows else None)
  k = x.shape[-1]
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _agmm(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  return gather_and_multiply(x, w, axes, n)[0]


def _agmm_fwd(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  out, gathered = gather_and_multiply(x, w, axes, n, with_rows=True)
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
