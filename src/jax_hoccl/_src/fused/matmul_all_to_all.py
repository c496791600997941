"""matmul_all_to_all(x, w, axis) == all_to_all(x @ w, axis, 0, 0, tiled=True) for x
[n, ..., K] whose block j is destined for rank j: the MoE combine, where each rank's experts
process tokens from every rank and the outputs go back to the tokens' owners. The block for
rank j is sent (copy engines) while the SMs compute the next block (row_pieces/pipeline.py).

The blocks are rows_matmul GEMMs when x @ w is one ([n, ..., K] @ [K, N], or per-expert
[n, E, C, K] @ [E, K, N] as a strided batch): they read x's block in place and the own block
is written straight into its slot of the output. XLA's dot instead needed a copy of each
block of x and a copy into the output (docs/design.md).
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import explicit_axes
from jax_hoccl._src.cotangents import cotangent_like, vary_alike
from jax_hoccl._src.fused.row_pieces import pipeline
from jax_hoccl._src.fused.row_pieces.batch_as_rows import batch_as_rows
from jax_hoccl._src.fused.row_pieces.rows_matmul import rows_matmul
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops.all_to_all import all_to_all


def _gemm_rows(x, w):
  """(rows per GEMM, rows per block) when x's blocks @ w are rows_matmul GEMMs, else None."""
  if w.ndim == 2:
    rows = int(np.prod(x.shape[1:-1], dtype=np.int64))
    return rows, rows
  if w.ndim == 3 and x.ndim == 4 and x.shape[1] == w.shape[0]:  # per-expert weights
    return x.shape[2], x.shape[1] * x.shape[2]
  return None


def _multiply_all_to_all(x, w, axes, n):
  shape = jax.eval_shape(jnp.matmul, x, w).shape
  gemm = _gemm_rows(x, w)
  if n == 1 or gemm is None or 0 in shape:
    return pipeline.compute_all_to_all(
        lambda xb: jnp.matmul(xb, w),
        lambda j: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), axes, n)
  rows, block_rows = gemm
  x2 = x.reshape(n * block_rows, x.shape[-1])
  args = dict(block_rows=block_rows, piece_row0=0, rows=rows)
  out = pipeline.all_to_all_by_shifts(
      lambda k, after: rows_matmul(x2, w, axes, n, shift=k, after=after, **args),
      lambda buf, after: rows_matmul(x2, w, axes, n, shift=0, into=buf, out_shift=0,
                                     out_block_rows=block_rows, after=after, **args),
      axes, n, (n * block_rows, w.shape[-1]))
  return out.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mma2a(x, w, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "matmul_all_to_all")
  # vmapped: the batch behind the blocks' leading axis, or among each expert's tokens (other
  # broadcasts of w would change meaning with an axis more: one call per example)
  per_expert = w.ndim == 3 and _gemm_rows(x, w) is not None
  axis = 1 if w.ndim == 2 else 2 if per_expert else None
  return batch_as_rows(lambda x, w: _multiply_all_to_all(x, w, axes, n), x, w, axis=axis,
                       merge=per_expert)


def _mma2a_fwd(x, w, axis_name):
  return _mma2a(x, w, axis_name), (x, w)


@axes_lib.names_errors("matmul_all_to_all")
def _mma2a_bwd(axis_name, res, ct):
  x, w = res
  ct = all_to_all(ct, axis_name, 0, 0, tiled=True)  # all_to_all is its own transpose
  xv, wv, ct = vary_alike(x, w, ct)
  _, vjp = jax.vjp(jnp.matmul, xv, wv)
  dx, dw = vjp(ct)
  return cotangent_like(dx, x), cotangent_like(dw, w)


_mma2a.defvjp(_mma2a_fwd, _mma2a_bwd)


@explicit_axes.typed_like()
@axes_lib.names_errors("matmul_all_to_all")
def matmul_all_to_all(x, w, axis_name):
  """all_to_all(jnp.matmul(x, w), axis_name, 0, 0, tiled=True) for x [n, ..., K] (block j
  for rank j) and w [..., K, N] (broadcast like jnp.matmul, e.g. [E, K, N] per-expert
  weights with x [n, E, C, K]). Returns [n, ..., N]: block i came from rank i."""
  axes, n = axes_lib.check_axes(axis_name, "matmul_all_to_all")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 2 or x.shape[0] != n or w.ndim < 2 or x.shape[-1] != w.shape[-2]:
    raise ValueError(f"jax_hoccl.matmul_all_to_all: needs x [n={n}, ..., K] and w [..., K, N],"
                     f" got {x.shape} and {w.shape}.")
  x, w = axes_lib.matmul_operands(x, w, "matmul_all_to_all")
  return _mma2a(common.ensure_varying(x, axes, "matmul_all_to_all"), w, axes)
