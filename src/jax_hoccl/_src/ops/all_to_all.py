"""all_to_all: chunk j of rank i lands as chunk i of rank j.

The primitive `hoccl_all_to_all` is the mover on a stacked layout x[n, ...] (block j goes to
rank j); it is its own transpose. `all_to_all` (jax.lax's signature) reshapes split_axis /
concat_axis into and out of that layout. With skip_own=True my own slot stays unwritten:
psum_scatter sums my block from its input instead (no local copy).
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import branches
from jax_hoccl._src import explicit_axes
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import ffi_lower, mover_target
from jax_hoccl._src.ops import across_processes, buckets, common

all_to_all_p = ji.Primitive("hoccl_all_to_all")


def _abstract_eval(x, *, axes, axis_size, skip_own, site, groups):
  vma = ji.varying_axes(x)
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl all_to_all: input must be varying over {axes}, got {set(vma)}")
  if not x.shape or x.shape[0] != axis_size:
    raise ValueError(f"jax_hoccl all_to_all: leading dim must be {axis_size}, got {x.shape}")
  return ji.with_type(x, x.shape, vma)


def _lowering(ctx, x, *, axes, axis_size, skip_own, site, groups):
  across = across_processes.lowering_for("all_to_all", ctx, x, axes=axes, groups=groups)
  if across is not None:
    return across
  attrs = axes_lib.ffi_group_attrs(ctx, axes, "all_to_all", site, groups)
  target = mover_target("hoccl_all_to_all", ctx, attrs, parts=int(attrs["group"]["group_size"]))
  return ffi_lower(target, "all_to_all", ctx, x, skip_own=np.int64(skip_own), **attrs)


def _transpose(ct, x, *, axes, axis_size, skip_own, site, groups):
  assert not skip_own, "skip_own is for psum_scatter's lowering only, never differentiated"
  return [exchange_stacked(ct, axes, axis_size, groups=groups)]


def _batch(args, dims, **params):
  (x,), (d,) = args, dims
  if d == 0:  # keep the rank-block axis leading: move the batch axis behind it
    x, d = jnp.moveaxis(x, 0, 1), 1
  return all_to_all_p.bind(x, **params), d


all_to_all_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(all_to_all_p, _lowering)
ji.deflinear2(all_to_all_p, _transpose)
ji.primitive_batchers[all_to_all_p] = _batch
branches.register(all_to_all_p)


def exchange_stacked(x, axes, axis_size, skip_own=False, groups=None):
  """x[axis_size, ...] -> block j to rank j of `axes`, or of my group of (even)
  axis_index_groups (axis_size is then the group size)."""
  return all_to_all_p.bind(x, axes=tuple(axes), axis_size=int(axis_size),
                           skip_own=bool(skip_own), site=axes_lib.new_site(), groups=groups)


@explicit_axes.typed_like(jax.lax.all_to_all)
def all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False):
  """jax.lax.all_to_all on copy engines. Works on pytrees (leaves of one dtype and type in
  one exchange per bucket, buckets.py)."""
  if common.lax_takes(axis_name, "all_to_all"):  # a vmap axis (see axes.py), or none
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis,
                              axis_index_groups=axis_index_groups, tiled=tiled)
  axes, n = axes_lib.check_axes(axis_name, "all_to_all")
  groups = axes_lib.check_groups(axis_index_groups, n, "all_to_all", even=True)
  n = axes_lib.group_size(groups, n)
  if n == 1:  # nothing to exchange (a one-device axis): jax.lax's costs nothing
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, axis_index_groups=groups,
                              tiled=tiled)

  def axes_of(nd):
    return (common.canonical_axis(split_axis, nd, "all_to_all", "split_axis"),
            common.canonical_axis(concat_axis, nd, "all_to_all", "concat_axis"))

  def blocks_of(leaf):  # [n, ...]: block j goes to rank j
    leaf = jnp.asarray(leaf)
    axes_lib.check_dtype(leaf, "all_to_all")
    if leaf.ndim == 0:
      raise ValueError("jax_hoccl.all_to_all: input must have rank >= 1.")
    s, _ = axes_of(leaf.ndim)
    return common.rank_blocks(common.ensure_varying(leaf, axes, "all_to_all"), s, n, tiled, axes,
                              "all_to_all", "split_axis")

  def place(got):  # got[j] = rank j's block for me -> jax.lax's layout
    s, c = axes_of(got.ndim - 1)
    rest = list(got.shape[1:])  # the input shape with split axis size/n
    if tiled:
      y = jnp.moveaxis(got, 0, c)  # [.., n, d_c, ..]
      rest[c] *= n
      return y.reshape(rest)
    # Untiled: the split axis (now size 1) disappears, a new axis of size n appears at c.
    return jnp.moveaxis(jnp.squeeze(got, axis=1 + s), 0, c)

  leaves, tree = jax.tree.flatten(x)
  blocks = [blocks_of(leaf) for leaf in leaves]
  exchange = lambda b: exchange_stacked(b, axes, n, groups=groups)  # noqa: E731
  out = buckets.combined(
      blocks, lambda b: place(exchange(b)), pack=lambda b: b.reshape(n, -1), exchange=exchange,
      unpack=lambda part, b: place(part.reshape(b.shape)))
  return jax.tree.unflatten(tree, out)


def _across_nodes(x, *, axes, **_):
  # Every pair of an all_to_all over nodes crosses them anyway: XLA's whole.
  return jax.lax.all_to_all(x, axes if len(axes) > 1 else axes[0], 0, 0)


across_processes.register("all_to_all", _across_nodes)
