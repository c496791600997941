"""psum_scatter: rank r gets the sum over ranks of everybody's r-th block.

Composition (docs/design.md, "Collectives on the three movers"): the all_to_all mover delivers the n blocks destined for me, then XLA
sums them (a fusion; bf16/f16 accumulate in f32). `hoccl_reduce_scatter` is the stacked form
x[n, ...] -> [...]; its own primitive so that its transpose is the all_gather mover (moving
n times fewer bytes than transposing the all_to_all would). With unreduced=True its input
is typed unreduced over the axes (jax.lax's psum_scatter of an unreduced value: the output
varying over them), transposed to all_gather(..., to="reduced").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import branches
from jax_hoccl._src import explicit_axes
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import lower_staged_sum
from jax_hoccl._src.ops import across_processes, buckets, common
from jax_hoccl._src.ops.all_gather import all_gather_p, gather_stacked
from jax_hoccl._src.ops.all_to_all import exchange_stacked

reduce_scatter_p = ji.Primitive("hoccl_reduce_scatter")


def _abstract_eval(x, *, axes, axis_size, unreduced, site, groups):
  vma = ji.varying_axes(x)
  if unreduced:  # jax.lax's unreduced_psum_scatter
    if not x.shape or x.shape[0] != axis_size:
      raise ValueError(f"jax_hoccl psum_scatter: leading dim must be {axis_size}, got {x.shape}")
    out = common.unreduced_result_type(x, axes, "psum_scatter", "sum", shape=x.shape[1:])
    return ji.with_type(out, out.shape, vma | set(axes))
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl psum_scatter: input must be varying over {axes}, got {set(vma)}")
  if not x.shape or x.shape[0] != axis_size:
    raise ValueError(f"jax_hoccl psum_scatter: leading dim must be {axis_size}, got {x.shape}")
  return ji.with_type(x, x.shape[1:], vma, ji.spec_of(x)[1:])


def _impl(x, *, axes, axis_size, unreduced, site, groups):
  # got[j]: rank j's block for me
  got = exchange_stacked(x, axes, axis_size, skip_own=True, groups=groups)
  own = jax.lax.dynamic_index_in_dim(x, common.rank(axes, groups), axis=0, keepdims=False)
  return common.sum_leading_with_own(got, own, axes, groups)


def _transpose(ct, x, *, axes, axis_size, unreduced, site, groups):
  return [gather_stacked(ct, axes, axis_size, reduced=unreduced, groups=groups)]


def _batch(args, dims, **params):
  (x,), (d,) = args, dims
  if d == 0:
    x, d = jnp.moveaxis(x, 0, 1), 1
  return reduce_scatter_p.bind(x, **params), d - 1


def _lowering(ctx, x, *, axes, axis_size, unreduced, site, groups):
  # An unreduced input, or one unreduced or reduced over other axes (a cotangent): summed by
  # the code for a varying input (the same bytes).
  if unreduced or common.typed_as_not_varying(ctx.avals_in[0]):
    return ji.lower_with_avals(ctx, [common.as_varying(ctx.avals_in[0], axes)], _lowering, x,
                               axes=axes, axis_size=axis_size, unreduced=False, site=site,
                               groups=groups)
  with axes_lib.user_op("psum_scatter", site):
    across = across_processes.lowering_for("reduce_scatter", ctx, x, axes=axes, groups=groups)
    if across is not None:
      return across
    # A staged block on CUDA: the exchange kernel sums as it copies out (one launch). Its site
    # is made here, as the mover's would be, so errors name the op the user called.
    staged = lower_staged_sum(
        "hoccl_psum_scatter_staged", "hoccl_all_to_all", "psum_scatter", ctx, x,
        lambda: axes_lib.ffi_group_attrs(ctx, axes, "psum_scatter", axes_lib.new_site(), groups),
        blocks=True)
    if staged is not None:
      return staged
    return ji.lower_fun(_impl, multiple_results=False)(ctx, x, axes=axes, axis_size=axis_size,
                                                        unreduced=False, site=site,
                                                        groups=groups)


reduce_scatter_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(reduce_scatter_p, _lowering)
ji.deflinear2(reduce_scatter_p, _transpose)


def _all_gather_transpose(ct, x, *, axes, axis_size, invariant, reduced, skip_own, site,
                          groups):
  assert not skip_own, "skip_own is for psum's lowering only, never differentiated"
  if reduced:  # the cotangent of a reduced value is unreduced: sum it, as jax.lax does
    return [reduce_scatter_stacked(ct, axes, axis_size, unreduced=True, groups=groups)]
  if invariant and ji.check_vma_enabled() and groups is None:
    # The cotangent of an invariant output is the same on every rank: take my block.
    rank = jax.lax.axis_index(common.axis_name_arg(axes))
    return [jax.lax.dynamic_index_in_dim(ct, rank, axis=0, keepdims=False)]
  return [reduce_scatter_stacked(ct, axes, axis_size, groups=groups)]


# all_gather <-> reduce-scatter transpose into each other; both rules live here.
ji.deflinear2(all_gather_p, _all_gather_transpose)
ji.primitive_batchers[reduce_scatter_p] = _batch
branches.register(reduce_scatter_p)


def reduce_scatter_stacked(x, axes, axis_size, unreduced=False, groups=None):
  # `site` only makes each bind distinct, so lowerings are not shared between call sites.
  return reduce_scatter_p.bind(x, axes=tuple(axes), axis_size=int(axis_size),
                               unreduced=bool(unreduced), site=axes_lib.new_site(),
                               groups=groups)


def scatter_blocks(x, axes, n, scatter_dimension, tiled, op):
  """x (checked, bools as int32) split into its n rank blocks, [n, ...]: block j goes to rank
  j. Shared with psum_scatter_start."""
  x = common.summable(x, op)
  if x.ndim == 0:
    raise ValueError(f"jax_hoccl.{op}: input must have rank >= 1.")
  d = common.canonical_axis(scatter_dimension, x.ndim, op, "scatter_dimension")
  if common.input_state(x, axes, op) == "unreduced":
    common.check_unreduced_kind(jax.typeof(x), axes, op, "sum")
  else:
    x = common.ensure_varying(x, axes, op)
  return common.rank_blocks(x, d, n, tiled, axes, op, "scatter_dimension")


def scatter_result(y, scatter_dimension, tiled):
  """My summed block (the input's rank, the scattered axis 1/n long) in jax.lax's layout."""
  return y if tiled else jnp.squeeze(y, axis=scatter_dimension % y.ndim)


@explicit_axes.typed_like(jax.lax.psum_scatter)
def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False):
  """jax.lax.psum_scatter with copy-engine data movement. Works on pytrees (leaves of one
  dtype and type in one exchange per bucket, buckets.py)."""
  if common.lax_takes(axis_name, "psum_scatter"):  # a vmap axis (see axes.py), or none
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                                axis_index_groups=axis_index_groups, tiled=tiled)
  axes, n = axes_lib.check_axes(axis_name, "psum_scatter")
  groups = axes_lib.check_groups(axis_index_groups, n, "psum_scatter", even=True)
  n = axes_lib.group_size(groups, n)
  if n == 1:  # nothing to exchange (a one-device axis): jax.lax's costs nothing
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                                axis_index_groups=groups, tiled=tiled)
  finish = lambda y: scatter_result(y, scatter_dimension, tiled)  # noqa: E731

  leaves, tree = jax.tree.flatten(x)
  blocks = [scatter_blocks(leaf, axes, n, scatter_dimension, tiled, "psum_scatter")
            for leaf in leaves]
  scatter = lambda b: reduce_scatter_stacked(  # noqa: E731
      b, axes, n, unreduced=common.input_state(b, axes, "psum_scatter") == "unreduced",
      groups=groups)
  out = buckets.combined(
      blocks, lambda b: finish(scatter(b)), pack=lambda b: b.reshape(n, -1), exchange=scatter,
      unpack=lambda part, b: finish(part.reshape(b.shape[1:])))
  return jax.tree.unflatten(tree, out)


def _across_nodes(x, *, axes, local, cross, sizes, **_):
  """x[n, ...] -> [...] over axes that span nodes: the sum over ranks of their block for my
  combined index; jax_hoccl's reduce-scatter inside, then XLA's across on 1/n_local."""
  sizes = dict(sizes)
  x = across_processes.reorder(x, axes, local + cross, sizes)  # block (l, c) at l * n_cross + c
  n_cross = across_processes.size_of(cross, sizes)
  if local:
    n_local = across_processes.size_of(local, sizes)
    x = reduce_scatter_stacked(x.reshape(n_local, n_cross, *x.shape[1:]), local, n_local)
  return jax.lax.psum_scatter(x, cross if len(cross) > 1 else cross[0], scatter_dimension=0,
                              tiled=False)


across_processes.register("reduce_scatter", _across_nodes)
