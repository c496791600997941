"""jax_hoccl.route_psums(): one switch that puts the sums JAX makes on jax_hoccl too: every
`jax.lax.psum` under check_vma=True and every sum JAX inserts by itself (the transpose of an
implicit pvary: a data-parallel loop's gradient all-reduce of replicated parameters, which
never passes through user code). Both are one primitive, `psum_invariant`; the switch gives
it jax_hoccl's psum as its lowering inside shard_map. Programs lowered before the switch
keep what they were compiled with."""
from __future__ import annotations

import threading

import numpy as np

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ops import psum as psum_lib

_lock = threading.Lock()
_xla_rule = None  # the lowering jax had, while the switch is on
_restore = None


def _lowering(ctx, *args, axes, axis_index_groups=None, **params):
  try:
    mesh = ji.concrete_mesh_from_lowering(ctx, "psum")
  except NotImplementedError:  # no concrete mesh here (nested shard_map, pmap): jax's own
    mesh = None
  if mesh is None or axis_index_groups is not None or not axes:
    return _xla_rule(ctx, *args, axes=axes, axis_index_groups=axis_index_groups, **params)
  axes = tuple(axes)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  # One device: nothing to move. Across nodes: XLA's, which is also what jax_hoccl's own
  # composition across nodes binds (so it must not come back here).
  if n == 1 or axes_lib.spans_nodes(mesh, axes):
    return _xla_rule(ctx, *args, axes=axes, axis_index_groups=axis_index_groups, **params)

  def sums(*xs):
    with axes_lib.user_op("psum"):
      return [psum_lib.psum_p.bind(
          x, axes=axes, axis_size=n, unreduced=False, site=axes_lib.new_site(), groups=None,
          algorithm=psum_lib.choose_algorithm(x.size * x.dtype.itemsize, n)) for x in xs]

  return ji.lower_fun(sums, multiple_results=True)(ctx, *args)


def route_psums(enabled: bool = True) -> bool:
  """Routes (enabled=True) or stops routing jax.lax's psums inside shard_map, explicit and
  implicit, through jax_hoccl; returns whether they were routed before. Applies to programs
  lowered afterwards."""
  global _xla_rule, _restore
  with _lock:
    prim = ji.psum_invariant_primitive()
    was = _xla_rule is not None
    if enabled and not was:
      _xla_rule, _restore = ji.swap_lowering(prim, _lowering)
    elif not enabled and was:
      _restore()
      _xla_rule = _restore = None
    return was
