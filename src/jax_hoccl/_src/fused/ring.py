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

from jax_hoccl._src.fused.rows_matmul import rows_matmul
from jax_hoccl._src.fused import exchanges as ex
from jax_hoccl._src.ops import async_collectives as ac

# Every piece costs a ppermute and an all-gather on the async stream, each ~30-60 us of fixed
# handshakes, and small GEMMs lose efficiency; too few pieces expose a big last transfer.
# Measured on 2x H200 with rows_matmul's cuBLASLt GEMMs, K/n=4096, N=8192 bf16
# (benchmarks/results/raw/2026-11-30-2xH200-fused-4b04e51.log and -fused-66dfbb6.log, two interleaved runs): a 32 MiB block in 2 / 4 / 8 pieces
# took 1.27-1.29 / 1.23-1.27 / 1.61x the GEMM, a 128 MiB block 1.29-1.30 / 1.26 / 1.25-1.26x;
# so pieces of ~8 MiB, at most 8.
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


class Overlap:
  """Orders GEMMs (rows_matmul custom calls) against async exchanges by data dependencies
  only, so that nothing is copied: a GEMM takes the latest start's token as an operand it
  never reads (it runs after that start, overlapping the copies), and a done or wait takes the
  token and the latest GEMM's result the same way (it runs after that GEMM instead of being
  hoisted above it, where it would stall XLA's stream). Optimization barriers do not do this
  on GPU: XLA removes them before scheduling (measured: GEMMs above their starts, dones above
  their GEMMs)."""

  def __init__(self):
    self.token = None
    self.last = None

  def gemm_after(self) -> tuple:
    """What the next GEMM must follow (its `after` operands)."""
    return () if self.token is None else (self.token,)

  def computed(self, result):
    """Records `result` (a GEMM just issued): the next done or wait follows it."""
    self.last = result
    return result

  def start(self, pending: ac.Pending) -> ac.Pending:
    """Records a start that sends the latest GEMM's result: its token follows that GEMM, so
    the next done or wait needs only the token. (Also taking the result would make XLA copy
    it when the start donates it, as an in-place gather does; and the async copies would then
    write into the buffer XLA dropped.)"""
    self.token, self.last = pending.token, None
    return pending

  def _wait_after(self) -> tuple:
    return tuple(a for a in (self.token, self.last) if a is not None)

  def done(self, pending: ac.Pending):
    after = self._wait_after()
    return ex.done_after(pending, *after) if after else ac.done(pending)[0]

  def wait(self, pending: ac.Pending):
    """done for a start whose buffer went on to a later start of an `into` chain: what
    comes after (the next wait, the final done) is ordered after it."""
    self.token = ex.wait_after(pending, *self._wait_after())


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
        in_flight[p] = ov.start(ac.ppermute_start(part, axes, to_next, order_input=False))
        continue
      out_rows, row0, slot_rows = out_layout(p)
      out = ov.computed(rows_matmul(x, w, axes, n, into=out, out_rows=out_rows,
                                    out_row0=row0, out_block_rows=slot_rows, **args))
      if on_sum is not None:
        out = on_sum(p, out, ov)
  return out, ov
