"""The schedule shared by the fused ops that compute a block per destination rank (an
all_to_all of computed blocks, split by shift):

    compute_all_to_all(compute, select, axes, n)
        == all_to_all(stack([compute(select(j)) for j in range(n)]), axes, 0, 0)

    for k in 1..n-1:  compute the block for rank (r+k) % n, start sending it (shift by k)
    compute my own block, into my slot of the output, while the last blocks are in flight
    wait for everything

Every start is a ppermute_into_start: the received block lands in its sender's slot of one
output buffer that the starts pass along (an `into` chain), so the output needs no stack or
gather afterwards (which cost a large part of matmul_all_to_all's overhead: docs/design.md).

Order by data dependencies only (async_collectives explains why): the compute after a start
takes its token (a rows_matmul operand, or its inputs through `after`), and the wait takes the
token of the last start and the output the own block was written into.
"""
from __future__ import annotations

from typing import Callable

import jax

from jax_hoccl._src.fused.row_pieces import exchanges
from jax_hoccl._src.fused.row_pieces.overlap import Overlap
from jax_hoccl._src.ops import async_collectives
from jax_hoccl._src.ops import common


def all_to_all_by_shifts(peer_block: Callable, own_into: Callable, axes, n: int,
                         out_shape: tuple):
  """The all_to_all of computed blocks, as [n * rows, ...]: slot i (rows [i * rows, ...))
  holds rank i's block for me.

  peer_block(k, after) -> the [rows, ...] block for rank (r + k) % n, computed after `after`
  (a tuple of tokens, empty for the first). own_into(buffer, after) -> buffer with my own
  block written into slot r (buffer: the output the starts fill, donated)."""
  ov = Overlap()
  starts, buf = [], out_shape
  for k in range(1, n):
    block = ov.computed(peer_block(k, ov.gemm_after()))
    shift = [(i, (i + k) % n) for i in range(n)]
    starts.append(ov.start(exchanges.ppermute_into_start(block, axes, shift, buf)))
    buf = starts[-1].buffer
  out = ov.computed(own_into(buf, ov.gemm_after()))
  for p in starts[:-1]:  # waits after my own block, so XLA's stream computes it first
    ov.wait(p)
  last = starts[-1]  # its done returns the buffer: my block, and every received one
  pending = async_collectives.Pending(out, last.input, last.token, last.site, last.finish)
  return exchanges.done_after(pending, ov.token)


def own_by_update(compute: Callable, select: Callable, axes):
  """own_into for XLA compute: my block computed from select(r) (passed through `after`) and
  written into my slot with a dynamic_update_slice, which XLA does in place (and fuses the
  compute into where it can)."""
  def own_into(buf, after):
    r = common.rank(axes)
    mine = compute(async_collectives.after(after[0], select(r)) if after else select(r))
    return jax.lax.dynamic_update_slice_in_dim(buf, mine.astype(buf.dtype),
                                               r * mine.shape[0], axis=0)
  return own_into


def peer_by_compute(compute: Callable, select: Callable, axes, n: int):
  """peer_block for XLA compute: compute(select((r + k) % n)), its input passed through
  `after` (select should return a fresh array, such as a dynamic slice: an input still read
  elsewhere would be copied first)."""
  def peer_block(k, after):
    r = common.rank(axes)
    sel = select((r + k) % n)
    return compute(async_collectives.after(after[0], sel) if after else sel)
  return peer_block


def compute_all_to_all(compute, select, axes, n):
  """all_to_all over the leading axis of compute(select(j)), block j computed for rank j
  (select(j): block j's input, a fresh array such as a dynamic slice), with XLA's ops."""
  if n == 1:
    return compute(select(0))[None]
  block = jax.eval_shape(lambda: compute(select(0)))
  out = all_to_all_by_shifts(
      peer_by_compute(compute, select, axes, n),
      own_by_update(compute, select, axes), axes, n,
      (n * block.shape[0], *block.shape[1:]))
  return out.reshape(n, *block.shape)
