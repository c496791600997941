"""all_gather: every rank's shard lands in every rank's output.

The primitive `hoccl_all_gather` is the mover: x -> out[n, *x.shape], out[k] = rank k's x,
a copy per peer, no arithmetic. `all_gather` (jax.lax's signature) places that stacked axis
where the user asked. With invariant=True the output is typed invariant over the axes
(jax.lax.all_gather_invariant; psum uses it); with reduced=True typed reduced over them
(all_gather(..., to="reduced"): the same on every rank, its cotangent unreduced, transposed
to psum_scatter of an unreduced input). With skip_own=True my own slot out[rank] is
left unwritten: psum sums my block from its input instead (no local copy).
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

all_gather_p = ji.Primitive("hoccl_all_gather")


def _abstract_eval(x, *, axes, axis_size, invariant, reduced, skip_own, site, groups):
  vma = ji.varying_axes(x)
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl all_gather: input must be varying over {axes}, got {set(vma)}")
  if reduced:  # jax.lax's all_gather_reduced
    if ji.unreduced_axes(x):
      common.check_unreduced_kind(x, axes, "all_gather", "sum")
    return ji.with_type(x, (axis_size, *x.shape), vma - set(axes),
                        reduced=ji.reduced_axes(x) | set(axes))
  # Over axis_index_groups each group gathers its own blocks: varying over the axes.
  out_vma = vma - set(axes) if invariant and groups is None else vma
  return ji.with_type(x, (axis_size, *x.shape), out_vma, (None, *ji.spec_of(x)))


def _lowering(ctx, x, *, axes, axis_size, invariant, reduced, skip_own, site, groups):
  # (Across processes every slot is written, my own too: a superset of skip_own's result.)
  # A reduced result moves the same bytes as an invariant one.
  across = across_processes.lowering_for("all_gather", ctx, x, axes=axes,
                                         invariant=invariant or reduced, groups=groups)
  if across is not None:
    return across
  attrs = axes_lib.ffi_group_attrs(ctx, axes, "all_gather", site, groups)
  return ffi_lower(mover_target("hoccl_all_gather", ctx, attrs), "all_gather", ctx, x,
                   skip_own=np.int64(skip_own), **attrs)


def _batch(args, dims, **params):
  (x,), (d,) = args, dims
  out = all_gather_p.bind(x, **params)
  return out, (None if d is None else d + 1)  # the stacked axis is new and leading


all_gather_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(all_gather_p, _lowering)
# Its transpose, a reduce-scatter, is registered in psum_scatter.py (which imports this module).
ji.primitive_batchers[all_gather_p] = _batch
branches.register(all_gather_p)


def gather_stacked(x, axes, axis_size, invariant=False, skip_own=False, reduced=False,
                   groups=None):
  """x -> [axis_size, *x.shape] over `axes`, or over my group of (even) axis_index_groups
  (axis_size is then the group size)."""
  return all_gather_p.bind(x, axes=tuple(axes), axis_size=int(axis_size), invariant=invariant,
                           reduced=bool(reduced), skip_own=bool(skip_own),
                           site=axes_lib.new_site(), groups=groups)


@explicit_axes.typed_like(jax.lax.all_gather)
def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying"):
  """jax.lax.all_gather on copy engines. Works on pytrees (leaves of one dtype and type in
  one exchange per bucket, buckets.py). `to="invarying"` (jax.lax's spelling; "invariant" is
  accepted too) types the output invariant over the axes, like jax.lax.all_gather_invariant;
  `to="reduced"` types it reduced over them (check_vma=True; its cotangent is unreduced and
  goes back through psum_scatter), like jax.lax's."""
  if to not in ("varying", "invarying", "invariant", "reduced"):
    raise ValueError(f"jax_hoccl.all_gather: to must be 'varying', 'invarying' or 'reduced', "
                     f"got {to!r}")
  if to == "reduced" and not ji.check_vma_enabled():
    raise ValueError("jax_hoccl.all_gather: to='reduced' needs shard_map(check_vma=True): "
                     "reduced is a type, which values carry only under check_vma.")
  if common.lax_takes(axis_name, "all_gather"):  # a vmap axis (see axes.py), or none
    return jax.lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                              tiled=tiled, to="invarying" if to == "invariant" else to)
  axes, n = axes_lib.check_axes(axis_name, "all_gather")
  groups = axes_lib.check_groups(axis_index_groups, n, "all_gather", even=True)
  n = axes_lib.group_size(groups, n)
  if n == 1:  # nothing to exchange (a one-device axis): jax.lax's costs nothing
    return jax.lax.all_gather(x, axis_name, axis_index_groups=groups, axis=axis, tiled=tiled,
                              to="invarying" if to == "invariant" else to)

  invariant, reduced = to in ("invarying", "invariant"), to == "reduced"

  def prepare(leaf):
    leaf = jnp.asarray(leaf)
    axes_lib.check_dtype(leaf, "all_gather")
    common.canonical_axis(axis, leaf.ndim if tiled else leaf.ndim + 1, "all_gather", "axis")
    if tiled and leaf.ndim == 0:
      raise ValueError("jax_hoccl.all_gather: tiled=True needs an input of rank >= 1.")
    return common.ensure_varying(leaf, axes, "all_gather")

  def place(y, leaf):  # y [n, *leaf.shape] -> the layout jax.lax.all_gather returns
    nd = leaf.ndim
    ax = common.canonical_axis(axis, nd if tiled else nd + 1, "all_gather", "axis")
    y = jnp.moveaxis(y, 0, ax)  # [.., n, d_ax, ..]
    if tiled:
      shape = list(leaf.shape)
      shape[ax] *= n
      y = y.reshape(shape)
    return y

  leaves, tree = jax.tree.flatten(x)
  leaves = [prepare(leaf) for leaf in leaves]
  gather = lambda v: gather_stacked(v, axes, n, invariant=invariant, reduced=reduced,  # noqa: E731
                                    groups=groups)
  out = buckets.combined(
      leaves, lambda leaf: place(gather(leaf), leaf), pack=lambda leaf: leaf.reshape(-1),
      exchange=gather, unpack=lambda part, leaf: place(part.reshape(n, *leaf.shape), leaf))
  return jax.tree.unflatten(tree, out)


def _across_nodes(x, *, axes, local, cross, sizes, invariant, **_):
  """x -> [n, *x.shape] over axes that span nodes, block k from the rank of combined index k:
  XLA's gather across nodes first, then jax_hoccl's inside on n_cross times more."""
  sizes = dict(sizes)
  y = jax.lax.all_gather(x, cross if len(cross) > 1 else cross[0], axis=0,
                         to="invarying" if invariant else "varying")  # [n_cross, ...]
  if local:
    y = gather_stacked(y, local, across_processes.size_of(local, sizes), invariant)
    y = y.reshape(-1, *x.shape)  # [n_local * n_cross, ...]
  return across_processes.reorder(y, local + cross, axes, sizes)


across_processes.register("all_gather", _across_nodes)
