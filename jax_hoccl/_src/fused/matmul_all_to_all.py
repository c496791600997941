"""matmul_all_to_all(x, w, axis) == all_to_all(x @ w, axis, 0, 0, tiled=True) for x
[n, ..., K] whose block j is destined for rank j: the MoE combine, where each rank's experts
process tokens from every rank and the outputs go back to the tokens' owners. The block for
rank j is sent (copy engines) while XLA computes the next block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.fused import pipeline
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops.all_to_all import all_to_all


def compute_all_to_all(compute, operands, axes, n):
  """all_to_all over the leading axis of compute(j, operands) computed block by block."""
  if n == 1:
    return compute(0, operands)[None]
  mine, received = pipeline.compute_and_send(compute, operands, axes, n)
  return pipeline.in_rank_order(mine, received, n, axes)


def vary_alike(*arrays):
  """Casts the arrays to vary over the union of their varying manual axes (check_vma=True
  only). A jax.vjp taken over them then holds no implicit pvary, whose transpose would be
  jax.lax.psum, i.e. XLA's all-reduce; common.cotangent_like sums with jax_hoccl.psum."""
  if not ji.check_vma_enabled():
    return arrays
  union = frozenset().union(*(ji.varying_axes(jax.typeof(a)) for a in arrays))
  out = []
  for a in arrays:
    missing = tuple(sorted(union - ji.varying_axes(jax.typeof(a)), key=str))
    out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
  return tuple(out)


def _block_matmul(j, operands):
  x, w = operands
  return jnp.matmul(jax.lax.dynamic_index_in_dim(x, j, axis=0, keepdims=False), w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mma2a(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "matmul_all_to_all")
  return compute_all_to_all(_block_matmul, (x, w), axes, n)


def _mma2a_fwd(x, w, axis_name):
  return _mma2a(x, w, axis_name), (x, w)


def _mma2a_bwd(axis_name, res, ct):
  x, w = res
  ct = all_to_all(ct, axis_name, 0, 0, tiled=True)  # all_to_all is its own transpose
  xv, wv, ct = vary_alike(x, w, ct)
  _, vjp = jax.vjp(jnp.matmul, xv, wv)
  dx, dw = vjp(ct)
  return common.cotangent_like(dx, x), common.cotangent_like(dw, w)


_mma2a.defvjp(_mma2a_fwd, _mma2a_bwd)


def matmul_all_to_all(x, w, axis_name):
  """all_to_all(jnp.matmul(x, w), axis_name, 0, 0, tiled=True) for x [n, ..., K] (block j
  for rank j) and w [..., K, N] (broadcast like jnp.matmul, e.g. [E, K, N] per-expert
  weights with x [n, E, C, K]). Returns [n, ..., N]: block i came from rank i."""
  axes, n = axes_lib.check_axes(axis_name, "matmul_all_to_all")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 2 or x.shape[0] != n or w.ndim < 2 or x.shape[-1] != w.shape[-2]:
    raise ValueError(f"jax_hoccl.matmul_all_to_all: needs x [n={n}, ..., K] and w [..., K, N],"
                     f" got {x.shape} and {w.shape}.")
  axes_lib.check_dtype(x, "matmul_all_to_all", summable=True)
  return _mma2a(common.ensure_varying(x, axes), w, axes)
