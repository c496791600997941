"""embedding_all_to_all(table, ids, axis) == all_to_all(lookup(table, ids), axis, 0, 0,
tiled=True): DLRM-style model-parallel embeddings. Each rank owns a table shard; ids[j]
holds rank j's samples' indices into it; the pooled (summed) embeddings go back to the
rank that owns the samples. The lookup for rank j is sent (copy engines) while XLA looks up
the next block; the lookup of my own block is written into its slot of the output (XLA fuses
it into the dynamic_update_slice, in place), the received ones land in theirs (row_pieces/pipeline.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import explicit_axes
from jax_hoccl._src.cotangents import cotangent_like, vary_alike
from jax_hoccl._src.fused.row_pieces.pipeline import compute_all_to_all
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops.all_to_all import all_to_all


def pooled_lookup(table, ids):
  """Sum of the rows `ids[..., l]` over the last axis (a bag of L ids per sample)."""
  return jnp.take(table, ids, axis=0).sum(axis=-2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ema2a(table, ids, axis_name):
  axes, n = axes_lib.check_axes(axis_name, "embedding_all_to_all")
  # the block for rank j: rank j's ids (a small slice, passed through each start's `after`)
  return compute_all_to_all(lambda ids_j: pooled_lookup(table, ids_j),
                            lambda j: jax.lax.dynamic_index_in_dim(ids, j, keepdims=False),
                            axes, n)


def _ema2a_fwd(table, ids, axis_name):
  return _ema2a(table, ids, axis_name), (table, ids)


@axes_lib.names_errors("embedding_all_to_all")
def _ema2a_bwd(axis_name, res, ct):
  table, ids = res
  ct = all_to_all(ct, axis_name, 0, 0, tiled=True)
  table_v, ids, ct = vary_alike(table, ids, ct)
  _, vjp = jax.vjp(lambda t: pooled_lookup(t, ids), table_v)
  (dtable,) = vjp(ct)
  return cotangent_like(dtable, table), None


_ema2a.defvjp(_ema2a_fwd, _ema2a_bwd)


@explicit_axes.typed_like()
@axes_lib.names_errors("embedding_all_to_all")
def embedding_all_to_all(table, ids, axis_name):
  """all_to_all(table[ids].sum(-2), axis_name, 0, 0, tiled=True) for this rank's table
  shard [V, D] and ids [n, B, L] (ids[j]: rank j's B samples, L ids each). Returns
  [n, B, D]: block i holds rank i's table's pooled embeddings of this rank's samples."""
  axes, n = axes_lib.check_axes(axis_name, "embedding_all_to_all")
  table, ids = jnp.asarray(table), jnp.asarray(ids)
  if table.ndim != 2 or ids.ndim != 3 or ids.shape[0] != n:
    raise ValueError(f"jax_hoccl.embedding_all_to_all: needs table [V, D] and ids [n={n}, B, L],"
                     f" got {table.shape} and {ids.shape}.")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"jax_hoccl.embedding_all_to_all: ids must be integers, got {ids.dtype}.")
  axes_lib.check_dtype(table, "embedding_all_to_all", summable=True)
  return _ema2a(common.ensure_varying(table, axes, "embedding_all_to_all"), ids, axes)
