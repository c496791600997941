"""Every use of jax's private APIs in jax_hoccl, in one place.

A collective that behaves like jax.lax's inside shard_map needs its own primitive: an abstract
eval that sets the varying-manual-axes type, a lowering that sees the concrete mesh (for the
device ids of each group), transpose and batching rules. jax exposes none of that publicly;
when jax changes, this is the file to fix. Checked against jax 0.11.2.
"""
from __future__ import annotations

import jax
from jax._src import config as _config
from jax._src import core
from jax._src.interpreters import ad, batching, mlir
from jax._src.sharding_impls import SPMDAxisContext

Primitive = core.Primitive
deflinear2 = ad.deflinear2
register_lowering = mlir.register_lowering
lower_fun = mlir.lower_fun
primitive_batchers = batching.primitive_batchers
primitive_jvps = ad.primitive_jvps
not_mapped = None  # a batching rule's output dim for an unbatched result


def check_vma_enabled() -> bool:
  """True inside shard_map(check_vma=True): values carry varying-manual-axes types."""
  return bool(_config._check_vma.value)


def varying_axes(aval) -> frozenset:
  return frozenset(aval.mat.varying)


def with_type(aval, shape, varying) -> core.ShapedArray:
  """`aval` with a new shape and set of varying manual axes."""
  return aval.update(shape=tuple(shape), manual_axis_type=aval.mat.update(varying=frozenset(varying)))


def psum_invariant_primitive():
  """The primitive jax.lax.psum binds under check_vma=True, and the one JAX inserts itself as
  the transpose of an implicit pvary (the gradient sum of a replicated parameter)."""
  from jax._src.lax import parallel
  prim = getattr(parallel, "psum_invariant_p", None)
  if prim is None or prim not in mlir._lowerings:
    raise RuntimeError(f"jax {jax.__version__} has no psum_invariant primitive with a lowering "
                       "as jax 0.11.2 has: jax_hoccl.route_psums cannot take it over.")
  return prim


def swap_lowering(prim, rule):
  """Replaces prim's lowering (every platform); returns (its old rule, a function that puts
  the old one back). jax keeps each rule in an entry object with the callable as .rule."""
  entry = mlir._lowerings[prim]
  old_rule = getattr(entry, "rule", entry)
  mlir.register_lowering(prim, rule)

  def restore():
    mlir._lowerings[prim] = entry

  return old_rule, restore


def ppermute_axis_order_checked() -> bool:
  """jax.raise_on_ppermute_sort_diff: whether jax.lax.ppermute refuses axis names out of
  mesh order (default True)."""
  return bool(_config.raise_on_ppermute_sort_diff.value)


def cond_primitive():
  """The primitive of jax.lax.cond / jax.lax.switch, whose lowering branches.py wraps."""
  from jax._src.lax.control_flow import conditionals
  prim = getattr(conditionals, "cond_p", None)
  if prim is None or prim not in mlir._lowerings:
    raise RuntimeError(f"jax {jax.__version__} has no cond primitive with a lowering as jax "
                       "0.11.2 has: jax_hoccl cannot pair collectives across cond branches.")
  return prim


def map_eqns(closed_jaxpr, fn, skip=()):
  """closed_jaxpr with every equation e replaced by fn(e) (an equation), depth first in
  program order, sub-jaxprs in params included except those of primitives in `skip`."""
  def sub(v):
    if isinstance(v, core.ClosedJaxpr):
      return map_eqns(v, fn, skip)
    if isinstance(v, core.Jaxpr):
      return map_eqns(core.ClosedJaxpr(v, ()), fn, skip).jaxpr
    if isinstance(v, tuple) and v and all(isinstance(x, (core.Jaxpr, core.ClosedJaxpr)) for x in v):
      return tuple(sub(x) for x in v)
    return v

  eqns = []
  for e in closed_jaxpr.jaxpr.eqns:
    if e.primitive not in skip:
      e = e.replace(params={k: sub(v) for k, v in e.params.items()})
    eqns.append(fn(e))
  return core.ClosedJaxpr(closed_jaxpr.jaxpr.replace(eqns=eqns), closed_jaxpr.consts)


def is_static(dim) -> bool:
  """Whether a dimension is a number, not a jax.export symbol."""
  return bool(core.is_constant_dim(dim))


def bound_axis(name) -> bool:
  """Whether `name` is an axis of the current trace: a shard_map mesh axis or a vmap one."""
  return bool(core.get_axis_env().axis_exists(name))


def distributed_client():
  """jax.distributed's client (its key-value store), or None without jax.distributed."""
  from jax._src import distributed
  return distributed.global_state.client


def concrete_mesh_from_lowering(ctx, op_name: str):
  """The concrete mesh a shard_map body is lowered for (device ids needed for the groups)."""
  axis_ctx = ctx.module_context.axis_context
  mesh = getattr(axis_ctx, "mesh", None) if isinstance(axis_ctx, SPMDAxisContext) else None
  try:
    np_ids = None if mesh is None else mesh.device_ids
  except Exception:  # AbstractMesh raises on device_ids (a nested shard_map)
    np_ids = None
  if np_ids is None:
    raise NotImplementedError(
        f"jax_hoccl.{op_name} needs the device ids of its mesh at lowering, but this "
        f"shard_map body is lowered for {type(mesh).__name__ if mesh is not None else type(axis_ctx).__name__}"
        " without them (a shard_map nested inside another one). Use one jax.shard_map over "
        "all the axes, or jax.lax collectives inside the nested one.")
  return mesh
