"""The schedule shared by the fused ops that compute a block per destination rank.

    for k in 1..n-1:  compute the block for rank (r+k) % n, start sending it (shift by k)
    compute my own block while the last blocks are in flight
    wait for everything

Each compute after a start reads its inputs through `after_start` (an optimization barrier
with the start's token), meant to keep it after the start so that the copy engines move block
k while the SMs compute block k+1. On CPU that holds; on GPU XLA removes barriers before it
schedules, so the order of XLA's compute against the start is XLA's choice (values are right
either way; see README "Ordering on GPU").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_hoccl._src.ops import async_collectives as ac


def compute_and_send(compute, inputs, axes, n):
  """compute(j, inputs) -> the block destined for rank j (j traced).

  Returns (mine, received): my own block and a list whose k-1-th entry is the block rank
  (r - k) % n computed for me, k = 1..n-1."""
  r = jax.lax.axis_index(axes[0] if len(axes) == 1 else axes)
  pending = []
  for k in range(1, n):
    if pending:
      inputs = pending[-1].after_start(inputs)
    block = compute((r + k) % n, inputs)
    pending.append(ac.ppermute_start(block, axes, [(i, (i + k) % n) for i in range(n)]))
  if pending:
    inputs = pending[-1].after_start(inputs)
  mine = compute(r, inputs)
  received = []
  for p in pending:
    got, mine = ac.done(p, mine)
    received.append(got)
  return mine, received


def in_rank_order(mine, received, n, axes):
  """Stack blocks so that index i holds rank i's block: mine is rank r's, received[k-1]
  is rank (r-k)'s."""
  r = jax.lax.axis_index(axes[0] if len(axes) == 1 else axes)
  stacked = jnp.stack([mine, *received])  # index k holds rank (r - k) % n's block
  return jnp.take(stacked, (r - jnp.arange(n)) % n, axis=0)
