"""Orders GEMMs against async exchanges by data dependencies only. It computes nothing:

    Overlap().done(pending) == done(pending)[0], ordered after the latest GEMM
"""
from __future__ import annotations

from jax_hoccl._src.fused.row_pieces import exchanges
from jax_hoccl._src.ops import async_collectives


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

  def start(self, pending: async_collectives.Pending) -> async_collectives.Pending:
    """Records a start that sends the latest GEMM's result: its token follows that GEMM, so
    the next done or wait needs only the token. (Also taking the result would make XLA copy
    it when the start donates it, as an in-place gather does; and the async copies would then
    write into the buffer XLA dropped.)"""
    self.token, self.last = pending.token, None
    return pending

  def _wait_after(self) -> tuple:
    return tuple(a for a in (self.token, self.last) if a is not None)

  def done(self, pending: async_collectives.Pending):
    after = self._wait_after()
    return exchanges.done_after(pending, *after) if after else async_collectives.done(pending)[0]

  def wait(self, pending: async_collectives.Pending):
    """done for a start whose buffer went on to a later start of an `into` chain: what
    comes after (the next wait, the final done) is ordered after it."""
    self.token = exchanges.wait_after(pending, *self._wait_after())
