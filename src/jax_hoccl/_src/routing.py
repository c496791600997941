"""jax_hoccl.route_collectives(): one switch that puts jax.lax's collectives on jax_hoccl, the ones
the user wrote (in code they do not want to edit: a Flax model, a library) and the ones JAX
makes by itself: the sum that is the transpose of an implicit pvary (a data-parallel loop's
gradient all-reduce of replicated parameters, which never passes through user code), the
reduce-scatter that is the transpose of an all_gather, and so on. Each jax.lax collective
is a primitive; the switch gives it, inside shard_map, a lowering that runs the jax_hoccl op
of the same meaning (jax_internals.LAX_COLLECTIVES). Programs lowered before the switch keep
what they were compiled with.

Where jax_hoccl has nothing to add or cannot take the call, the collective stays XLA's: no
concrete mesh (pmap, a nested shard_map), axes that are not mesh axes, or an input the
jax_hoccl op refuses at trace time (a sub-byte dtype, say). jax_hoccl's own ops fall back on
jax.lax themselves in places (a one-device axis, the part of an axis between nodes): those
inner collectives lower with XLA's rule, never back here.
"""
from __future__ import annotations

import contextlib
import threading

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
    with _routing():
      try:
        return ji.lower_fun(lambda *xs: fn(*xs, **params), multiple_results=multiple)(ctx, *args)
      except (ValueError, TypeError, NotImplementedError):
        # refused at trace time by the jax_hoccl op (nothing was emitted): XLA's, as before
        return xla(ctx, *args, **params)
  return lowering


def route_collectives(enabled: bool = True) -> bool:
  """Routes (enabled=True) or stops routing jax.lax's collectives inside shard_map, the ones in
  user code and the ones JAX inserts (gradient sums, transposes), through jax_hoccl; returns
  whether they were routed before. Applies to programs lowered afterwards."""
  with _lock:
    was = bool(_restore)
    if enabled and not was:
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
