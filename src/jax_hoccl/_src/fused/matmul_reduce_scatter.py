"""matmul_reduce_scatter(x, w, axis) == psum_scatter(x @ w, axis, scatter_dimension=0,
tiled=True), with the exchange hidden behind the matmul (the row-parallel linear layer).

On Hopper GPUs (bf16/f16, shapes that tile, chunks=None) it is one flagged GEMM walking the
ring (flagged/reduce_scatter_walk.py). Else, for bf16/f16 with K, N multiples of 8
(rows_matmul's cuBLASLt path on GPU) it runs as a ring of row pieces (row_pieces/ring.py):
pieces of the partial sums travel rank to rank, each GEMM a rows_matmul that reads x's rows in
place, adds the received partial in its epilogue and writes the last step's pieces straight
into the output, so nothing follows the last GEMM (no slice copies, no sum kernel, no
concatenate, no transfer). Otherwise the partial product for rank j is computed (XLA's dot)
and sent while the next one is computed, this rank's own partial last, then the received
partials are summed (row_pieces/pipeline.py). (The ring against the send form:
docs/design.md.)

Backward: dx = all_gather_matmul(ct, w.T) (overlapped), dw = x.T @ all_gather(ct).
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import explicit_axes
from jax_hoccl._src.cotangents import cotangent_like
from jax_hoccl._src.fused.flagged import gather_walk, reduce_scatter_walk
from jax_hoccl._src.fused.row_pieces import pipeline, ring
from jax_hoccl._src.fused.row_pieces.gather_beside_gemms import gather_beside_gemms
from jax_hoccl._src.fused.row_pieces.rows_matmul import runs_on_cublaslt
from jax_hoccl._src.ops import common


def _ring(x, w, axes, n, chunks):
  rows = x.shape[0] // n
  inner = int(np.prod(x.shape[1:-1], dtype=np.int64))  # rows of x2 per row of x
  # Two pieces by default: nothing follows the last GEMM, so smaller pieces only cost GEMM
  # efficiency (docs/design.md); one piece would wait for the whole transfer.
  if chunks is None:
    chunks = 2 if rows % 2 == 0 else 1
  pieces = ring.row_pieces(rows, 1, chunks, "matmul_reduce_scatter")
  starts = np.concatenate([[0], np.cumsum(pieces)[:-1]])
  out, _ = ring.reduce_scatter_ring(
      common.as_rows(x), w, axes, n, [r * inner for r in pieces],
      lambda p: (rows * inner, int(starts[p]) * inner),
      lambda p: (rows * inner, int(starts[p]) * inner, 0))
  return out.reshape(rows, *x.shape[1:-1], w.shape[1])


def multiply_and_scatter(x, w, axes, n, chunks=None):
  if n == 1:
    return x @ w
  x2 = common.as_rows(x)
  if chunks is None and reduce_scatter_walk.applies(x2, w, n, "matmul_reduce_scatter"):  # one flagged GEMM, the ring
    out = reduce_scatter_walk.gemm_reduce_scatter(x2, w, axes, n)
    return out.reshape(x.shape[0] // n, *x.shape[1:-1], w.shape[1])
  if runs_on_cublaslt(x.dtype, *w.shape):  # (on CPU too, where its GEMMs are XLA's)
    return _ring(x, w, axes, n, chunks)
  rows = x.shape[0] // n
  # every rank's partial of my rows, in rank order, summed
  partials = pipeline.compute_all_to_all(
      lambda xs: xs @ w, lambda j: jax.lax.dynamic_slice_in_dim(x, j * rows, rows, axis=0),
      axes, n)
  return common.sum_leading(partials)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mmrs(x, w, axis_name, chunks):
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  return multiply_and_scatter(x, w, axes, n, chunks)


def _mmrs_fwd(x, w, axis_name, chunks):
  return _mmrs(x, w, axis_name, chunks), (x, w)


@axes_lib.names_errors("matmul_reduce_scatter")
def _mmrs_bwd(axis_name, chunks, res, ct):
  x, w = res
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  ct = common.ensure_varying(ct, axes, "matmul_reduce_scatter")
  # dx = all_gather(ct) @ w.T, as all_gather_matmul's forward pass
  if gather_walk.applies(ct, w.T, n):
    dx, ct_gathered = gather_walk.gemm_as_rows_land(ct, w.T, axes, n, with_rows=True)
  else:
    dx, ct_gathered = gather_beside_gemms(ct, w.T, axes, n, with_rows=True)
  dw = common.as_rows(x).T @ common.as_rows(ct_gathered)
  return cotangent_like(dx, x), cotangent_like(dw, w)


_mmrs.defvjp(_mmrs_fwd, _mmrs_bwd)


@explicit_axes.typed_like()
@axes_lib.names_errors("matmul_reduce_scatter")
def matmul_reduce_scatter(x, w, axis_name, *, chunks=None):
  """psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True) for x [M, ..., K]
  (K sharded over the axis: each rank holds a partial product) and w [K, N]; returns
  [M/n, ..., N]. Call inside shard_map.

  Runs as one flagged GEMM walking the ring (flagged/reduce_scatter_walk.py) on Hopper GPUs
  for bf16/f16 with M/n (times the inner dims) % 256 == 0, K % 64 == 0, N % 256 == 0 and
  chunks=None, unless ranks share a GPU (its in-kernel waits would then wait for copies that
  need its SMs); else as a ring of row-piece GEMMs (bf16/f16: cuBLASLt on GPU) or, for other
  dtypes, one block sent per rank.

  chunks: how each rank's M/n-row block is cut into the row-piece ring's pieces (bf16/f16):
  None (2), an int c (c equal pieces) or a sequence of row counts summing to M/n.
  Other dtypes send one block per rank and ignore it."""
  axes, n = axes_lib.check_axes(axis_name, "matmul_reduce_scatter")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"jax_hoccl.matmul_reduce_scatter: needs x [M, ..., K] and w [K, N], "
                     f"got {x.shape} and {w.shape}.")
  if x.shape[0] % n:
    raise ValueError(f"jax_hoccl.matmul_reduce_scatter: x's leading dim {x.shape[0]} does not "
                     f"divide by the axis size {n} of {axes}.")
  x, w = axes_lib.matmul_operands(x, w, "matmul_reduce_scatter")
  if chunks is not None:
    chunks = ring.checked_chunks(chunks, x.shape[0] // n, "matmul_reduce_scatter")
  return _mmrs(common.ensure_varying(x, axes, "matmul_reduce_scatter"), w, axes, chunks)
