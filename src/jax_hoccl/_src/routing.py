"""jax_hoccl.route_collectives(): one switch that puts jax.lax's collectives on jax_hoccl, the ones
the user wrote (in code they do not want to edit: a Flax model, a library) and the ones JAX
makes by itself: the sum that is the transpose of an implicit pvary (a data-parallel loop's
gradient all-reduce of replicated parameters, which never passes through user code), the
reduce-scatter that is the transpose of an all_gather, and so on. Each jax.lax collective
is a primitive; the switch gives it, inside shard_map, a lowering that runs the jax_hoccl op
of the same meaning (jax_internals.LAX_COLLECTIVES). Programs lowered before the switch keep
what they were compiled with.

In the branches of a cond (of which each rank may take another), a routed collective is
first made a `hoccl_routed` equation with a call site of its own (in_branches), so that
branches.py pairs it across the branches and keeps the branch's collectives in program order
as it does jax_hoccl's own.

Where jax_hoccl has nothing to add or cannot take the call, the collective stays XLA's: no
concrete mesh (pmap, a nested shard_map), axes that are not mesh axes, or an input the
jax_hoccl op refuses at trace time (a sub-byte dtype, say). jax_hoccl's own ops fall back on
jax.lax themselves in places (a one-device axis, the part of an axis between nodes): those
inner collectives lower with XLA's rule, never back here.
"""
from __future__ import annotations

import contextlib
import threading

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import branches
from jax_hoccl._src import jax_internals as ji

_lock = threading.Lock()
_restore = []        # while the switch is on: what puts jax's lowerings back
_xla = {}            # primitive name -> old(platform): jax's own rule
_inside = threading.local()  # lowering one of our routed calls (its inner jax.lax: XLA's)


def _ops():
  """name -> (multiple_results, fn(*xs, **params) -> the jax_hoccl op's result(s))."""
  import jax_hoccl as hc

  def reduce(op):
    return True, lambda *xs, axes, axis_index_groups=None: [
        op(x, tuple(axes), axis_index_groups=axis_index_groups) for x in xs]

  def gather(to):
    def fn(x, *, all_gather_dimension, axis_name, axis_size, tiled, axis_index_groups=None):
      del axis_size
      return hc.all_gather(x, axis_name, axis_index_groups=axis_index_groups,
                           axis=all_gather_dimension, tiled=tiled, to=to)
    return False, fn

  def scatter(x, *, scatter_dimension, axis_name, axis_size, tiled, axis_index_groups=None):
    del axis_size
    return hc.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled,
                           axis_index_groups=axis_index_groups)

  def all_to_all(x, *, split_axis, concat_axis, axis_name, tiled, axis_index_groups=None):
    # jax.lax.all_to_all(tiled=False) binds the primitive after inserting the concat axis, on
    # which a tiled exchange means the same (split axis of size n into n blocks of one)
    del tiled
    return hc.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True,
                         axis_index_groups=axis_index_groups)

  def ppermute(x, *, axis_name, perm):
    return hc.ppermute(x, axis_name, perm)

  return {"psum": reduce(hc.psum), "psum_invariant": reduce(hc.psum),
          "pmax": reduce(hc.pmax), "pmin": reduce(hc.pmin),
          "all_gather": gather("varying"), "all_gather_invariant": gather("invarying"),
          "reduce_scatter": (False, scatter), "all_to_all": (False, all_to_all),
          "ppermute": (False, ppermute)}


def _axis_names(params) -> tuple:
  names = params.get("axes", params.get("axis_name"))
  return tuple(names) if isinstance(names, (tuple, list)) else (names,)


@contextlib.contextmanager
def _routing():
  _inside.depth = getattr(_inside, "depth", 0) + 1
  try:
    yield
  finally:
    _inside.depth -= 1


def _lowering_for(name, multiple, fn):
  def lowering(ctx, *args, **params):
    params.pop("platform", None)  # jax's own platform-specific rules take it
    params.pop("is_async", None)
    xla = _xla[name](ctx.module_context.platforms[0])
    if getattr(_inside, "depth", 0):
      return xla(ctx, *args, **params)
    try:
      mesh = ji.concrete_mesh_from_lowering(ctx, name)
    except NotImplementedError:  # no concrete mesh here (nested shard_map, pmap)
      mesh = None
    if mesh is None or not all(a in mesh.axis_names for a in _axis_names(params)):
      return xla(ctx, *args, **params)
    def routed(*xs):
      out = fn(*xs, **params)
      types = [o.dtype for o in (out if multiple else [out])]
      if types != [a.dtype for a in ctx.avals_out]:  # (psum_scatter of bool: jax.lax refuses)
        raise TypeError(f"jax_hoccl gives {types} for jax.lax's {name} of {ctx.avals_out}")
      return out

    with _routing():
      try:
        return ji.lower_fun(routed, multiple_results=multiple)(ctx, *args)
      except (ValueError, TypeError, NotImplementedError):
        # refused at trace time by the jax_hoccl op, or of another type than jax.lax's result
        # (nothing was emitted): XLA's, as before
        return xla(ctx, *args, **params)
  return lowering


# A routed collective inside a cond's branch: the jax.lax primitive `name` with its `params`
# (sorted items) and a call site, which branches.py shares across the branches. Made only
# while lowering a cond (in_branches); it lowers as the routed primitive would, its sites
# made in the scope of its own.
routed_p = ji.Primitive("hoccl_routed")
routed_p.multiple_results = True


def _routed_abstract_eval(*avals, name, params, site):
  del site
  out, effects = ji.lax_collective_primitives()[name].abstract_eval(*avals, **dict(params))
  return (list(out) if isinstance(out, (list, tuple)) else [out]), effects


routed_p.def_effectful_abstract_eval(_routed_abstract_eval)


def _routed_lowering(ctx, *args, name, params, site):
  multiple, fn = _ops()[name]
  with axes_lib.user_op(name, site):
    return _lowering_for(name, multiple, fn)(ctx, *args, **dict(params))


ji.register_lowering_as_is(routed_p, _routed_lowering)


def in_branches(branch):
  """The branch (a closed jaxpr) with each routed collective a routed_p equation of a site of
  its own; as it was while the switch is off."""
  if not _restore:
    return branch
  names = {prim: name for name, prim in ji.lax_collective_primitives().items() if name in _xla}

  def wrap(eqn):
    if eqn.primitive not in names:
      return eqn
    params = tuple(sorted(eqn.params.items()))
    return eqn.replace(primitive=routed_p, params={
        "name": names[eqn.primitive], "params": params, "site": axes_lib.new_site()})

  return ji.map_eqns(branch, wrap, skip=(ji.cond_primitive(),))


def route_collectives(enabled: bool = True) -> bool:
  """Routes (enabled=True) or stops routing jax.lax's collectives inside shard_map, the ones in
  user code and the ones JAX inserts (gradient sums, transposes), through jax_hoccl; returns
  whether they were routed before. Applies to programs lowered afterwards."""
  with _lock:
    was = bool(_restore)
    if enabled and not was:
      branches.register(routed_p, rewrite=in_branches)
      prims = ji.lax_collective_primitives()
      for name, (multiple, fn) in _ops().items():
        _xla[name], restore = ji.swap_lowering(prims[name], _lowering_for(name, multiple, fn))
        _restore.append(restore)
    elif not enabled and was:
      for restore in _restore:
        restore()
      _restore.clear()
      _xla.clear()
    return was
