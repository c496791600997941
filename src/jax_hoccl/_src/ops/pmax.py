"""pmax / pmin: every rank gets the elementwise maximum / minimum over ranks.

One exchange (like psum's one_shot): the all_gather mover brings the peers' arrays (my own
slot left unwritten, skip_own) and an XLA fusion reduces them with mine. They are usually
called on scalars and small arrays (a global gradient norm's max, a loss-scale overflow flag),
where one exchange is the cheapest. Like jax.lax's, they are not differentiable; vmap works.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import branches
from jax_hoccl._src import explicit_axes
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ops import across_processes, buckets, common
from jax_hoccl._src.ops.all_gather import gather_stacked

extremum_p = ji.Primitive("hoccl_extremum")


_KIND = {"pmax": "max", "pmin": "min"}  # the unreduced kind each takes (jax.lax's)


def _abstract_eval(x, *, axes, axis_size, op, unreduced, site, groups):
  if unreduced:  # jax.lax's unreduced_pmax / unreduced_pmin
    return common.unreduced_result_type(x, axes, op, _KIND[op])
  if groups is not None:
    return common.grouped_type(x, axes, op)
  return common.reduced_type(x, axes, op)


def _impl(x, *, axes, axis_size, op, unreduced, site, groups):
  if not axes_lib.groups_even(groups):
    # Groups of unequal sizes: every block along the axes, reduced over my group's members.
    every = gather_stacked(x, axes, axis_size)
    return common.fold_my_group(every, axes, groups, jnp.maximum if op == "pmax" else jnp.minimum)
  n = axes_lib.group_size(groups, axis_size)
  got = gather_stacked(x, axes, n, invariant=True, skip_own=True, groups=groups)
  return (jnp.max if op == "pmax" else jnp.min)(common.with_own(got, x, axes, groups), axis=0)


def _lowering(ctx, x, *, axes, axis_size, op, unreduced, site, groups):
  # An unreduced input, or one unreduced or reduced over other axes (a cotangent): reduced by
  # the code for a varying input (the same bytes).
  if unreduced or common.typed_as_not_varying(ctx.avals_in[0]):
    return ji.lower_with_avals(ctx, [common.as_varying(ctx.avals_in[0], axes)], _lowering, x,
                               axes=axes, axis_size=axis_size, op=op, unreduced=False,
                               site=site, groups=groups)
  with axes_lib.user_op(op, site):
    across = across_processes.lowering_for(op, ctx, x, axes=axes, groups=groups)
    if across is not None:
      return across
    return ji.lower_fun(_impl, multiple_results=False)(ctx, x, axes=axes, axis_size=axis_size,
                                                        op=op, unreduced=False, site=site,
                                                        groups=groups)


def _batch(args, dims, **params):
  (x,), (d,) = args, dims
  return extremum_p.bind(x, **params), d


extremum_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(extremum_p, _lowering)
ji.primitive_batchers[extremum_p] = _batch
branches.register(extremum_p)


def _extremum(x, axis_name, axis_index_groups, op):
  vmapped, axis_name = common.split_vmap_axes(axis_name, op)
  if vmapped:  # the vmap part stays on the device: jax.lax's
    x = getattr(jax.lax, op)(x, vmapped, axis_index_groups=axis_index_groups)
  if not axis_name:
    return x
  axes, n = axes_lib.check_axes(axis_name, op)
  groups = axes_lib.check_groups(axis_index_groups, n, op)
  if n == 1:  # nothing to exchange (a one-device axis): jax.lax's costs nothing
    return getattr(jax.lax, op)(x, axis_name)

  def prepare(leaf):
    leaf = jnp.asarray(leaf)
    axes_lib.check_dtype(leaf, op)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
      raise TypeError(f"jax_hoccl.{op}: complex numbers have no order ({leaf.dtype}).")
    if common.input_state(leaf, axes, op) == "unreduced":
      common.check_unreduced_kind(jax.typeof(leaf), axes, op, _KIND[op])
      return leaf
    return common.ensure_varying(leaf, axes, op)

  def one(leaf):
    unreduced = common.input_state(leaf, axes, op) == "unreduced"
    return extremum_p.bind(leaf, axes=axes, axis_size=n, op=op, unreduced=unreduced,
                           site=axes_lib.new_site(), groups=groups)

  return buckets.elementwise(x, prepare, one)


@explicit_axes.typed_like(jax.lax.pmax)
def pmax(x, axis_name, *, axis_index_groups=None):
  """jax.lax.pmax with copy-engine data movement. Works on pytrees."""
  return _extremum(x, axis_name, axis_index_groups, "pmax")


@explicit_axes.typed_like(jax.lax.pmin)
def pmin(x, axis_name, *, axis_index_groups=None):
  """jax.lax.pmin with copy-engine data movement. Works on pytrees."""
  return _extremum(x, axis_name, axis_index_groups, "pmin")


def _across_nodes(x, *, axes, local, cross, sizes, op, **_):
  """pmax / pmin over axes that span nodes: inside with jax_hoccl, then across with jax.lax
  on the local result."""
  if local:
    x = extremum_p.bind(x, axes=local, axis_size=across_processes.size_of(local, dict(sizes)),
                        op=op, unreduced=False, site=axes_lib.new_site(), groups=None)
  return (jax.lax.pmax if op == "pmax" else jax.lax.pmin)(x, cross)


for _op in ("pmax", "pmin"):
  across_processes.register(_op, functools.partial(_across_nodes, op=_op))
