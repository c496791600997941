"""Pytrees of many arrays in few exchanges: every collective of a pytree (psum, pmean, pmax,
pmin, psum_scatter, all_gather, all_to_all, ppermute) puts the leaves of one dtype and one
type (varying, unreduced and reduced axes) side by side in one buffer per bucket of up to BUCKET_BYTES and moves it
in one exchange, as XLA combines its own all-reduces, reduce-scatters and all-gathers. A small exchange has a fixed cost (copy-engine and flag
latency, host enqueue; docs/design.md, section 7), which a model's dozens of small gradient or parameter leaves would
otherwise pay one by one. Env JAX_HOCCL_BUCKET_BYTES sets the size (0: one exchange per leaf).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jax_hoccl._src import jax_internals as ji

BUCKET_BYTES = 32 << 20


def bucket_bytes() -> int:
  v = os.environ.get("JAX_HOCCL_BUCKET_BYTES")
  try:
    return BUCKET_BYTES if v is None else int(v)
  except ValueError:
    raise ValueError(f"JAX_HOCCL_BUCKET_BYTES must be an integer, got {v!r}") from None


def buckets(leaves, limit: int):
  """Indices of `leaves` grouped into buckets: leaves of one dtype and type, packed in order
  up to `limit` bytes; a leaf of `limit` bytes or more goes alone."""
  open_, done = {}, []
  for i, leaf in enumerate(leaves):
    nbytes = leaf.size * leaf.dtype.itemsize
    if nbytes >= limit:
      done.append([i])
      continue
    aval = jax.typeof(leaf)
    # Leaves of one type only: varying, unreduced and reduced axes (and unreduced kind).
    mat = ((ji.varying_axes(aval), ji.unreduced_axes(aval), ji.reduced_axes(aval),
            ji.unreduced_kind(aval)) if ji.check_vma_enabled() else ())
    key = (leaf.dtype, mat, aval.weak_type)  # (a weak-typed leaf stays weak, as in jax.lax)
    bucket, size = open_.get(key, ([], 0))
    if size + nbytes > limit and bucket:
      done.append(bucket)
      bucket, size = [], 0
    open_[key] = (bucket + [i], size + nbytes)
  return done + [b for b, _ in open_.values()]


def elementwise(x, prepare, one):
  """`one(leaf)`, a collective that keeps every element where it is (psum, pmax, ppermute),
  on each leaf of the pytree `x` after `prepare(leaf)`, a bucket's leaves flattened into one
  buffer for one call."""
  leaves, tree = jax.tree.flatten(x)
  leaves = [prepare(leaf) for leaf in leaves]
  out = combined(leaves, one, pack=lambda leaf: leaf.reshape(-1), exchange=one,
                 unpack=lambda part, leaf: part.reshape(leaf.shape))
  return jax.tree.unflatten(tree, out)


def combined(leaves, single, pack, exchange, unpack):
  """Each leaf's result, with one `exchange` per bucket of several leaves.

  single(leaf): the result of a leaf alone. pack(leaf): the leaf laid out for the exchange,
  its elements along the last axis; the packed leaves of a bucket are concatenated along it.
  exchange(buffer): the collective on that buffer, the last axis still the packed elements
  (of the same widths). unpack(part, leaf): a leaf's result from its part of that axis."""
  out = [None] * len(leaves)
  for bucket in buckets(leaves, bucket_bytes()):
    if len(bucket) == 1:
      out[bucket[0]] = single(leaves[bucket[0]])
      continue
    packed = [pack(leaves[i]) for i in bucket]
    result = exchange(jnp.concatenate(packed, axis=-1))
    start = 0
    for i, p in zip(bucket, packed):
      width = p.shape[-1]
      out[i] = unpack(result[..., start:start + width], leaves[i])
      start += width
  return out
