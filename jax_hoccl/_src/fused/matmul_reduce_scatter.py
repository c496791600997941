"""matmul_reduce_scatter(x, w, axis) == psum_scatter(x @ w, axis, scatter_dimension=0,
tiled=True), with the exchange hidden behind the matmul: the partial product for rank j is
computed and sent (copy engines) while XLA computes the next one; this rank's own partial
is computed last, then the received partials are summed (the row-parallel linear layer).

(A ring of pieces whose GEMMs add the received partial in their epilogue, ring.py with
rows_matmul's cuBLASLt GEMMs, was measured on 2x H200 against this form in one run: 1.10x /
1.13x the GEMM at M = 4096 / 16384 against this form's 1.11x / 1.10x, so it was dropped; its
code, with the ordering its last step needs, is commit 4b04e51.)

Backward: dx = all_gather_matmul(ct, w.T) (overlapped), dw = x.T @ all_gather(ct).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src.fused import pipeline
from jax_hoccl._src.ops import common


def multiply_and_scatter(x, w, axes, n):
  if n == 1:
    return x @ w
  rows = x.shape[0] // n

  def partial_for(j, x):
    return jax.lax.dynamic_slice_in_dim(x, j * rows, rows, axis=0) @ w

  mine, received = pipeline.compute_and_send(partial_for, x, axes, n)
  return common.sum_leading(jnp.stack([mine, *received]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mmrs(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  return multiply_and_scatter(x, w, axes, n)


def _mmrs_fwd(x, w, axis_name):
  return _mmrs(x, w, axis_name), (x, w)


def _mmrs_bwd(axis_name, res, ct):
  from jax_hoccl._src.fused.all_gather_matmul import gather_and_multiply
  x, w = res
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  dx, ct_gathered = gather_and_multiply(common.ensure_varying(ct, axes), w.T, axes, n)
  k, nout = w.shape
  dw = x.reshape(-1, k).T @ ct_gathered.reshape(-1, nout)
  return common.cotangent_like(dx, x), common.cotangent_like(dw, w)


_mmrs.defvjp(_mmrs_fwd, _mmrs_bwd)


def matmul_reduce_scatter(x, w, axis_name):
  """psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True) for x [M, ..., K]
  (K sharded over the axis: each rank holds a partial product) and w [K, N]; returns
  [M/n, ..., N]. Call inside shard_map."""
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"jax_hoccl.matmul_reduce_scatter: needs x [M, ..., K] and w [K, N], "
                     f"got {x.shape} and {w.shape}.")
  if x.shape[0] % n:
    raise ValueError(f"jax_hoccl.matmul_reduce_scatter: x's leading dim {x.shape[0]} does not "
                     f"divide by the axis size {n} of {axes}.")
  axes_lib.check_dtype(x, "matmul_reduce_scatter", summable=True)
  return _mmrs(common.ensure_varying(x, axes), w, axes)
