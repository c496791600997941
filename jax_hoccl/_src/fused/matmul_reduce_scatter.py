"""matmul_reduce_scatter(x, w, axis) == psum_scatter(x @ w, axis, scatter_dimension=0,
tiled=True) (the row-parallel linear layer): the partial products are summed around the
ring (ring.py) while the copy engines carry them, each multiplication a rows_matmul that
reads x's rows in place and adds the received partial in its epilogue, the last step's
pieces written in place into the output (no slice copies, no sum kernel, no concatenate).

Backward: dx = all_gather_matmul(ct, w.T) (overlapped), dw = x.T @ all_gather(ct).
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src.fused import ring
from jax_hoccl._src.ops import common


def multiply_and_scatter(x, w, axes, n, chunks):
  if n == 1:
    return x @ w
  rows = x.shape[0] // n
  inner = int(np.prod(x.shape[1:-1], dtype=np.int64))  # rows of x2 per row of x
  pieces = ring.row_pieces(rows, inner * w.shape[1] * x.dtype.itemsize, chunks,
                           "matmul_reduce_scatter")
  starts = np.concatenate([[0], np.cumsum(pieces)[:-1]])
  x2 = x.reshape(-1, x.shape[-1])
  out, _ = ring.reduce_scatter_ring(
      x2, w, axes, n, [r * inner for r in pieces],
      lambda p: (rows * inner, int(starts[p]) * inner), final_rows=rows * inner)
  return out.reshape(rows, *x.shape[1:-1], w.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mmrs(x, w, axis_name, chunks):
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  return multiply_and_scatter(x, w, axes, n, chunks)


def _mmrs_fwd(x, w, axis_name, chunks):
  return _mmrs(x, w, axis_name, chunks), (x, w)


def _mmrs_bwd(axis_name, chunks, res, ct):
  from jax_hoccl._src.fused.all_gather_matmul import gather_and_multiply
  x, w = res
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  dx, ct_gathered = gather_and_multiply(common.ensure_varying(ct, axes), w.T, axes, n)
  k, nout = w.shape
  dw = x.reshape(-1, k).T @ ct_gathered.reshape(-1, nout)
  return common.cotangent_like(dx, x), common.cotangent_like(dw, w)


_mmrs.defvjp(_mmrs_fwd, _mmrs_bwd)


def matmul_reduce_scatter(x, w, axis_name, *, chunks=None):
  """psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True) for x [M, ..., K]
  (K sharded over the axis: each rank holds a partial product) and w [K, N]; returns
  [M/n, ..., N]. Call inside shard_map.

  chunks: how each rank's M/n-row block is cut for pipelining: None (by size), an int c
  (c equal pieces) or a sequence of row counts summing to M/n."""
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"jax_hoccl.matmul_reduce_scatter: needs x [M, ..., K] and w [K, N], "
                     f"got {x.shape} and {w.shape}.")
  if x.shape[0] % n:
    raise ValueError(f"jax_hoccl.matmul_reduce_scatter: x's leading dim {x.shape[0]} does not "
                     f"divide by the axis size {n} of {axes}.")
  axes_lib.check_dtype(x, "matmul_reduce_scatter", summable=True)
  if chunks is not None:
    chunks = chunks if isinstance(chunks, int) else tuple(int(c) for c in chunks)
    ring.row_pieces(x.shape[0] // n, 1, chunks, "matmul_reduce_scatter")  # checks, at trace time
  return _mmrs(common.ensure_varying(x, axes), w, axes, chunks)
