"""Reduce-scatter of a matmul's partial products around the ring (matmul_psum's first half).

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

import jax

from jax_hoccl._src.fused.rows_matmul import rows_matmul
from jax_hoccl._src.ops import async_collectives as ac

# Every piece costs a ppermute and an all-gather on the async stream, each ~30-60 us of fixed
# handshakes, and small GEMMs lose efficiency; too few pieces expose a big last transfer.
# Measured on 2x H200 with rows_matmul's cuBLASLt GEMMs, K/n=4096, N=8192 bf16
# (benchmarks/results/2026-11-30-2xNVIDIA-H200-fused.json and raw/*session3-fused*, two
# interleaved runs): a 32 MiB block in 2 / 4 / 8 pieces took 1.27-1.29 / 1.23-1.27 / 1.61x
# the GEMM, a 128 MiB block 1.29-1.30 / 1.26 / 1.25-1.26x; so pieces of ~8 MiB, at most 8.
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


class Overlap:
  """Orders XLA's compute against async exchanges with the latest start's token, so that
  nothing is copied: compute reads its inputs through an optimization barrier with it (it runs
  after that start, overlapping the copies), and a done reads it (it runs after the compute
  before that start, not hoisted above it)."""

  def __init__(self):
    self.token = None

  def inputs(self, tree):
    if self.token is None:
      return tree
    tree, self.token = jax.lax.optimization_barrier((tree, self.token))
    return tree

  def start(self, pending: ac.Pending) -> ac.Pending:
    self.token = pending.token
    return pending

  def done(self, pending: ac.Pending):
    if self.token is None:
      return ac.done(pending)[0]
    return ac.done_after(pending, self.token)

  def wait(self, pending: ac.Pending):
    """done for a start whose buffer went on to a later start of an `into` chain: what
    comes after (the next wait, the final done) is ordered after it."""
    self.token = ac.wait_after(pending, self.token)


def reduce_scatter_ring(x, w, axes, n: int, pieces: Sequence[int], layout: Callable,
                        on_sum: Callable | None = None):
  """My block of x @ w summed over the ranks, in pieces.

  x is 2-D [M, K]. layout(p) -> (block_rows, piece_row0): piece p (pieces[p] rows) of block b
  starts at x's row b * block_rows + piece_row0. Each summed piece is its own array, passed to
  on_sum(p, summed, overlap) as it is ready (to start sending it) and returned in a list.
  Also returns the Overlap (for what follows)."""
  ov = Overlap()
  to_next = [(i, (i + 1) % n) for i in range(n)]
  in_flight, mine = {}, []
  for s in range(n):
    for p, rows in enumerate(pieces):
      block_rows, piece_row0 = layout(p)
      received = ov.done(in_flight.pop(p)) if s > 0 else None  # added in the GEMM's epilogue
      args = dict(shift=n - s - 1, block_rows=block_rows, piece_row0=piece_row0, rows=rows,
                  c=received)
      part = rows_matmul(ov.inputs(x), w, axes, n, **args)
      if s < n - 1:
        in_flight[p] = ov.start(ac.ppermute_start(part, axes, to_next))
      else:
        mine.append(part)
        if on_sum is not None:
          on_sum(p, part, ov)
  return mine, ov
