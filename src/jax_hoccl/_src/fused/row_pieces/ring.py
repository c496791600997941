"""Reduce-scatter of a matmul's partial products around the ring, in row pieces:

    reduce_scatter_ring(x, w, axes, n, ...) == psum_scatter(x @ w, axes, tiled=True)

matmul_reduce_scatter's row-piece form, and matmul_psum's first half.

Row block b of x @ w is summed over the ranks by carrying it around the ring: at step s
(0..n-1) rank r multiplies its rows of block (r - s - 1) % n, adds the partial sum rank r-1
sent it, and sends the result on to rank r+1 (copy engines); at step n-1 the block is r's own
and its sum is complete. Per rank the ring moves (n-1)/n of the output, as a reduce-scatter
must (gathering every rank's partial and summing would move n-1 times the output). Every
multiplication is a rows_matmul: one cuBLASLt call that reads x's rows in place and adds the
received partial in its epilogue (XLA's dot + add where cuBLASLt does not apply, or with
JAX_HOCCL_CUBLASLT=0).

Each block is cut into row pieces and the work runs step by step, piece by piece, (s, p) in
lexicographic order: a piece's partial sum travels while the SMs multiply the next pieces, and
is needed only c multiplications later.
"""
from __future__ import annotations

from typing import Callable, Sequence

from jax_hoccl._src.fused.row_pieces.overlap import Overlap
from jax_hoccl._src.fused.row_pieces.rows_matmul import rows_matmul
from jax_hoccl._src.ops import async_collectives

# Every piece costs a ppermute and an all-gather on the async stream, each with fixed
# handshakes, and small GEMMs lose efficiency; too few pieces expose a big last transfer. So
# pieces of ~8 MiB, at most 8 (the measurement: docs/design.md, "Row pieces").
PIECE_BYTES = 8 << 20
MAX_PIECES = 8


def row_pieces(rows: int, row_bytes: int, chunks, op: str) -> tuple[int, ...]:
  """Rows per piece of one rank's block. chunks: None (by size: pieces of ~PIECE_BYTES, 2 to
  MAX_PIECES, one when the block is smaller than two pieces), an int (equal pieces) or a
  sequence of row counts."""
  if chunks is None:
    c = min(MAX_PIECES, rows * row_bytes // PIECE_BYTES)
    while c > 1 and rows % c:
      c -= 1
    return (rows // c,) * c if c >= 2 else (rows,)
  if isinstance(chunks, int):
    if chunks < 1 or rows % chunks:
      raise ValueError(f"jax_hoccl.{op}: chunks={chunks} does not divide the {rows} rows of a "
                       f"rank's block.")
    return (rows // chunks,) * chunks
  pieces = tuple(int(c) for c in chunks)
  if not pieces or min(pieces) < 1 or sum(pieces) != rows:
    raise ValueError(f"jax_hoccl.{op}: chunks={tuple(chunks)} must be positive row counts "
                     f"summing to the {rows} rows of a rank's block.")
  return pieces


def checked_chunks(chunks, rows: int, op: str):
  """A user's `chunks` (not None) as an int or a tuple of ints, checked against a block of
  `rows` rows at trace time (row_pieces raises the error)."""
  chunks = chunks if isinstance(chunks, int) else tuple(int(c) for c in chunks)
  row_pieces(rows, 1, chunks, op)
  return chunks


def reduce_scatter_ring(x, w, axes, n: int, pieces: Sequence[int], layout: Callable,
                        out_layout: Callable, on_sum: Callable | None = None):
  """My block of x @ w summed over the ranks, in pieces. Returns the array the last summed
  piece was written into, and the Overlap (for what follows).

  x is 2-D [M, K]. layout(p) -> (block_rows, piece_row0): piece p (pieces[p] rows) of block b
  starts at x's row b * block_rows + piece_row0. out_layout(p) -> (out_rows, row0, slot_rows):
  my summed piece p goes to rows row0 + rank * slot_rows (slot_rows 0: the same rows on every
  rank) of an [out_rows, N] array, the one the previous piece went into (written in place),
  or a new one for the first piece. on_sum(p, out, overlap), if given, runs as each summed
  piece is written (to start sending it) and returns the array the next piece goes into
  (None: a new one)."""
  ov = Overlap()
  to_next = [(i, (i + 1) % n) for i in range(n)]
  in_flight, out = {}, None
  for s in range(n):
    for p, rows in enumerate(pieces):
      block_rows, piece_row0 = layout(p)
      received = ov.done(in_flight.pop(p)) if s > 0 else None  # added in the GEMM's epilogue
      args = dict(shift=n - s - 1, block_rows=block_rows, piece_row0=piece_row0, rows=rows,
                  c=received, after=ov.gemm_after())
      if s < n - 1:
        part = ov.computed(rows_matmul(x, w, axes, n, **args))
        in_flight[p] = ov.start(async_collectives.ppermute_start(part, axes, to_next, order_input=False))
        continue
      out_rows, row0, slot_rows = out_layout(p)
      out = ov.computed(rows_matmul(x, w, axes, n, into=out, out_rows=out_rows,
                                    out_row0=row0, out_block_rows=slot_rows, **args))
      if on_sum is not None:
        out = on_sum(p, out, ov)
  return out, ov
