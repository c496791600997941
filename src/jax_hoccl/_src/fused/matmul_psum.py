"""matmul_psum(x, w, axis) == psum(x @ w, axis): a reduce-scatter around the ring, the sums
added to the GEMMs' results (row_pieces/ring.py), each summed piece written by its GEMM
straight into its rank's slot of the output, then all-gathered in place by the copy engines
(`all_gather_in_place_start`: no copy of my own piece, no concatenate) while the SMs multiply
the next pieces. Only the last piece's all-gather is exposed; it runs on XLA's stream, with
no hops between streams. (With XLA's dots, f32 or JAX_HOCCL_CUBLASLT=0, each summed piece is
an array of its own, gathered into the output by `all_gather_into_start`.)

Rows are laid out so that a piece's all-gather is contiguous in the output: piece p of rank
b's block is rows [n * O_p + b * r_p, n * O_p + (b + 1) * r_p), O_p being the rows of the
pieces before p. GEMV shapes (decode: M = 1..64) have no pieces to pipeline: one synchronous
one-shot psum, which on CUDA for a few rows multiplies inside its own exchange
(gemv_psum.py). On Hopper GPUs (bf16/f16, shapes that tile, chunks=None) it is one flagged
GEMM walking the ring, each summed band all-gathered as it is stored
(flagged/reduce_scatter_walk.py).
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import explicit_axes
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.cotangents import cotangent_like
from jax_hoccl._src.fused.flagged import reduce_scatter_walk
from jax_hoccl._src.fused.gemv_psum import gemv_psum
from jax_hoccl._src.fused.row_pieces import exchanges, ring
from jax_hoccl._src.fused.row_pieces.batch_as_rows import batch_as_rows
from jax_hoccl._src.fused.row_pieces.rows_matmul import runs_on_cublaslt
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops.psum import psum


def multiply_and_sum(x, w, axes, n, chunks):
  m = x.shape[0]
  if n == 1:
    return x @ w
  if chunks == 1 or m % n:
    return gemv_psum(x, w, axes, n)
  x2 = common.as_rows(x)
  if chunks is None and reduce_scatter_walk.applies(x2, w, n, "matmul_psum"):  # one flagged GEMM
    return reduce_scatter_walk.gemm_psum(x2, w, axes, n).reshape(*x.shape[:-1], w.shape[1])
  inner = int(np.prod(x.shape[1:-1], dtype=np.int64))  # rows of x2 per row of x
  row_bytes = inner * w.shape[1] * x.dtype.itemsize
  pieces = ring.row_pieces(m // n, row_bytes, chunks, "matmul_psum")
  if chunks is None and len(pieces) == 1:
    return gemv_psum(x, w, axes, n)
  starts = np.concatenate([[0], np.cumsum(pieces)[:-1]]) * n
  last = len(pieces) - 1
  # Where the GEMMs are our cuBLASLt calls, each writes its summed piece straight into its
  # rank's slot of the output, gathered in place (no copy of my own piece). XLA's dot (the
  # fallback) writes a piece of its own, gathered into the output: XLA may copy a buffer that a
  # dynamic_update_slice writes into, and the copies in flight would land in the dropped one.
  in_place = runs_on_cublaslt(x.dtype, *w.shape)
  gathers = []

  def gather(p, out, ov):
    # the last exchange runs on XLA's stream: nothing is left to overlap it with
    row0, rows = int(starts[p]) * inner, pieces[p] * inner
    if in_place:
      pending = exchanges.all_gather_in_place_start(out, axes, row0, rows, to="invariant",
                                             sync=p == last)
    else:
      into = gathers[-1].buffer if gathers else (m * inner, w.shape[1])
      pending = exchanges.all_gather_into_start(out, axes, into, row0, to="invariant", sync=p == last)
    gathers.append(ov.start(pending))
    return pending.buffer if in_place else None

  # piece p of block b: x rows [n * O_p + b * r_p, ...) (times `inner` rows of x2), and the
  # same rows of the output
  _, ov = ring.reduce_scatter_ring(
      common.as_rows(x), w, axes, n, [r * inner for r in pieces],
      lambda p: (pieces[p] * inner, int(starts[p]) * inner),
      lambda p: ((m * inner, int(starts[p]) * inner, pieces[p] * inner) if in_place
                 else (pieces[p] * inner, 0, 0)), on_sum=gather)
  for g in gathers[:-1]:
    ov.wait(g)
  return ov.done(gathers[-1]).reshape(*x.shape[:-1], w.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mmps(x, w, axis_name, chunks):
  axes, n = axes_lib.check_axes(axis_name, "matmul_psum")
  return batch_as_rows(lambda x, w: multiply_and_sum(x, w, axes, n, chunks), x, w)


def _mmps_fwd(x, w, axis_name, chunks):
  return _mmps(x, w, axis_name, chunks), (x, w)


@axes_lib.names_errors("matmul_psum")
def _mmps_bwd(axis_name, chunks, res, ct):
  x, w = res
  axes, _ = axes_lib.check_axes(axis_name, "matmul_psum")
  # psum's transpose: a typed-invariant cotangent is the same everywhere (pbroadcast);
  # an untyped one may differ per rank and must be summed (docs/design.md).
  ct = jax.lax.pcast(ct, tuple(axes), to="varying") if ji.check_vma_enabled() else psum(ct, axes)
  dx = ct @ w.T
  dw = common.as_rows(x).T @ common.as_rows(ct)
  return cotangent_like(dx, x), cotangent_like(dw, w)


_mmps.defvjp(_mmps_fwd, _mmps_bwd)


@explicit_axes.typed_like()
@axes_lib.names_errors("matmul_psum")
def matmul_psum(x, w, axis_name, *, chunks=None):
  """psum(x @ w, axis_name) for x [M, ..., K] (K sharded over the axis) and w [K, N];
  returns [M, ..., N], invariant over the axis. Call inside shard_map.

  Runs as one flagged GEMM (the ring, then each summed band all-gathered as it is stored;
  flagged/reduce_scatter_walk.py) on Hopper GPUs for bf16/f16 with M/n (times the inner dims)
  % 256 == 0, K % 64 == 0, N % 256 == 0 and chunks=None, unless ranks share a GPU (its
  in-kernel waits would then wait for copies that need its SMs); else as row-piece GEMMs
  pipelined with the exchanges.

  chunks: how each rank's M/n-row block is cut for the row-piece pipeline: None (by size;
  GEMV shapes get one synchronous psum), 1 (no pipelining: one synchronous psum), an int c
  (c equal pieces) or a sequence of row counts summing to M/n."""
  axes, n = axes_lib.check_axes(axis_name, "matmul_psum")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"jax_hoccl.matmul_psum: needs x [M, ..., K] and w [K, N], got "
                     f"{x.shape} and {w.shape}.")
  x, w = axes_lib.matmul_operands(x, w, "matmul_psum")
  if x.ndim == 1:
    return matmul_psum(x[None], w, axis_name, chunks=chunks)[0]
  if chunks is not None and chunks != 1:
    if x.shape[0] % n:
      raise ValueError(f"jax_hoccl.matmul_psum: chunks={chunks} needs M={x.shape[0]} to divide "
                       f"by the axis size {n} of {axes}.")
    chunks = ring.checked_chunks(chunks, x.shape[0] // n, "matmul_psum")
  return _mmps(common.ensure_varying(x, axes, "matmul_psum"), w, axes, chunks)
