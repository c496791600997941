"""all_gather_matmul(x, w, axis) == all_gather(x, axis, tiled=True) @ w, with the gather
hidden behind the matmul: the peers' rows are pulled by copy engines while the SMs multiply
this rank's own rows (the column-parallel linear layer of sequence-parallel Megatron).

On Hopper GPUs (bf16/f16, shapes that tile) it is one flagged GEMM that multiplies the peers'
rows as they land (gather_into_gemm.py). Elsewhere, as follows.

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
from jax_hoccl._src import explicit_axes
from jax_hoccl._src.fused.cotangent import cotangent_like
from jax_hoccl._src.fused.gather_and_multiply import gather_and_multiply
from jax_hoccl._src.fused.matmul_reduce_scatter import matmul_reduce_scatter
from jax_hoccl._src.ops import common


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _agmm(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  return gather_and_multiply(x, w, axes, n)[0]


def _agmm_fwd(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  out, gathered = gather_and_multiply(x, w, axes, n, with_rows=True)
  return out, (gathered, x, w)


@axes_lib.names_errors("all_gather_matmul")
def _agmm_bwd(axis_name, res, ct):
  gathered, x, w = res
  dx = matmul_reduce_scatter(ct, w.T, axis_name)
  k, nout = w.shape
  dw = gathered.reshape(-1, k).T @ ct.reshape(-1, nout)
  return cotangent_like(dx, x), cotangent_like(dw, w)


_agmm.defvjp(_agmm_fwd, _agmm_bwd)


@explicit_axes.typed_like()
@axes_lib.names_errors("all_gather_matmul")
def all_gather_matmul(x, w, axis_name):
  """all_gather(x, axis_name, tiled=True) @ w for x [m, ..., K] (rows sharded over the axis)
  and w [K, N]; returns [n*m, ..., N]. Call inside shard_map.

  Runs as one flagged GEMM fed as the peers' rows land (gather_into_gemm.py) on Hopper GPUs
  for bf16/f16 with m (times the inner dims) % 512 == 0, K % 64 == 0, N % 256 == 0, unless
  ranks share a GPU (its in-kernel waits would then wait for copies that need its SMs); else
  as a gather beside row GEMMs (cuBLASLt for bf16/f16 on GPU, XLA's dot otherwise)."""
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"jax_hoccl.all_gather_matmul: needs x [m, ..., K] and w [K, N], got "
                     f"{x.shape} and {w.shape}.")
  axes_lib.check_dtype(x, "all_gather_matmul", summable=True)
  return _agmm(common.ensure_varying(x, axes, "all_gather_matmul"), w, axes)
