"""Every use of jax's private APIs in jax_hoccl, in one place.

A collective that behaves like jax.lax's inside shard_map needs its own primitive: an abstract
eval that sets the varying-manual-axes type, a lowering that sees the concrete mesh (for the
device ids of each group), transpose and batching rules. jax exposes none of that publicly;
when jax changes, this is the file to fix. Checked against jax 0.11.2.
"""
from __future__ import annotations

import os

import jax
from jax._src import config as _config
from jax._src import core
from jax._src.interpreters import ad, batching, mlir
from jax._src.sharding_impls import SPMDAxisContext

Primitive = core.Primitive
deflinear2 = ad.deflinear2
lower_fun = mlir.lower_fun
primitive_batchers = batching.primitive_batchers
primitive_jvps = ad.primitive_jvps
Zero = ad.Zero  # a symbolic zero tangent
zero_tangent = ad.p2tz  # the symbolic zero tangent of a primal value
not_mapped = None  # a batching rule's output dim for an unbatched result


def register_lowering(prim, rule, platform=None):
  """Registers prim's lowering so that it always runs fully manual.

  Inside a partial-manual shard_map (axis_names a subset of the mesh's axes) the SPMD
  partitioner owns the other ("auto") axes, and it refuses a side-effecting custom call there
  (UNIMPLEMENTED: Side-effect ops cannot be replicated). So, as jax lowers axis_index in that
  case, the rule runs inside a shard_map over the auto axes with replicated specs: the
  partitioner gives every device the whole value over the auto axes (gathering it first if it
  sharded it) and leaves the call alone. Each device then meets the devices of its own group,
  which differ from it along the manual axes only (axes.group_table)."""
  multiple = prim.multiple_results

  def lowering(ctx, *args, **params):
    auto = auto_axes(ctx)
    if not auto:
      return rule(ctx, *args, **params)
    from jax._src.shard_map import shard_map  # the inner one must not check vma: see below

    def body(*xs):
      return prim.bind(*xs, **params)

    # check_vma=False: the outer body's types were checked when it was traced; the inner
    # shard_map only makes the auto axes manual for the lowering.
    whole = jax.P()
    wrapped = shard_map(body, in_specs=(whole,) * len(args),
                        out_specs=[whole] * len(ctx.avals_out) if multiple else whole,
                        axis_names=frozenset(auto), check_vma=False)
    _outer_meshes.append(ctx.module_context.axis_context.mesh)
    try:
      return mlir.lower_fun(wrapped, multiple_results=multiple)(ctx, *args)
    finally:
      _outer_meshes.pop()

  mlir.register_lowering(prim, lowering, platform=platform)


# The concrete meshes of the partial-manual bodies being lowered through register_lowering's
# inner shard_map, whose own lowering context only has the abstract mesh.
_outer_meshes: list = []


def auto_axes(ctx) -> tuple:
  """The mesh axes a lowering's shard_map body leaves to the partitioner (none: fully manual,
  or outside shard_map)."""
  axis_ctx = ctx.module_context.axis_context
  if not isinstance(axis_ctx, SPMDAxisContext) or not axis_ctx.manual_axes:
    return ()
  return tuple(a for a in axis_ctx.mesh.axis_names if a not in axis_ctx.manual_axes)


def check_vma_enabled() -> bool:
  """True inside shard_map(check_vma=True): values carry varying-manual-axes types."""
  return bool(_config._check_vma.value)


def varying_axes(aval) -> frozenset:
  return frozenset(aval.mat.varying)


def spec_of(aval) -> tuple:
  """aval's sharding spec over the mesh's non-manual axes, one entry per dimension."""
  spec = tuple(aval.sharding.spec)
  return spec + (None,) * (aval.ndim - len(spec))


def unreduced_axes(aval) -> frozenset:
  """Axes over which `aval` holds one addend per device of a sum (or max, min) not yet taken:
  jax.lax.pcast(x, axes, to="unreduced"), or an unreduced in_spec on an Explicit mesh."""
  return frozenset(aval.mat.unreduced)


def reduced_axes(aval) -> frozenset:
  """Axes over which `aval` is the same on every device but its cotangent is unreduced
  (all_gather(..., to="reduced"), jax.lax.pcast(x, axes, to="reduced"))."""
  return frozenset(aval.mat.reduced)


def unreduced_kind(aval):
  """The reduction an unreduced `aval` is waiting for: "sum", "max", "min"; None if none."""
  kind = aval.mat.unreduced_kind
  return None if kind is None else kind.name


def with_type(aval, shape, varying, spec=None, unreduced=None, reduced=None) -> core.ShapedArray:
  """`aval` with a new shape, set of varying manual axes, sharding spec (over the mesh's
  non-manual axes: Explicit ones are part of the type) and unreduced / reduced manual axes
  (unchanged when None; an aval unreduced over no axis has no unreduced kind). spec=None keeps
  aval's spec when the shape is unchanged and leaves every dimension unsharded otherwise: a
  spec kept across a change of rank names the wrong dimensions (a stacked axis in front of a
  dimension sharded over "x" gave P('x', 'x', ...), a DuplicateSpecError)."""
  shape = tuple(shape)
  if spec is None:
    spec = spec_of(aval) if shape == tuple(aval.shape) else (None,) * len(shape)
  if len(spec) != len(shape):
    raise ValueError(f"jax_hoccl internal error: spec {spec} for shape {shape}")
  mat = aval.mat
  unreduced = mat.unreduced if unreduced is None else frozenset(unreduced)
  reduced = mat.reduced if reduced is None else frozenset(reduced)
  kind = mat.unreduced_kind if unreduced else None
  return aval.update(shape=shape, sharding=aval.sharding.update(spec=jax.P(*spec)),
                     manual_axis_type=mat.update(varying=frozenset(varying), unreduced=unreduced,
                                                 reduced=reduced, unreduced_kind=kind))


def lower_with_avals(ctx, avals_in, rule, *args, **params):
  """rule(ctx, *args, **params) with ctx's input types replaced by `avals_in`: a lowering
  whose implementation is written for other manual-axis types than its primitive's (an
  unreduced input summed by the code for a varying one; HLO carries no such types)."""
  sub = ctx.replace(avals_in=tuple(avals_in), tokens_out=None)
  out = rule(sub, *args, **params)
  if sub.tokens_out is not None:
    ctx.set_tokens_out(sub.tokens_out)
  return out


# jax.lax's collectives inside shard_map, by primitive name: what route_collectives lowers
# through jax_hoccl (routing.py). The reduced/unreduced variants and jax's own async
# start/done pairs are not among them.
LAX_COLLECTIVES = ("psum", "psum_invariant", "pmax", "pmin", "all_gather",
                   "all_gather_invariant", "reduce_scatter", "all_to_all", "ppermute")


def lax_collective_primitives() -> dict:
  """{name: primitive} of LAX_COLLECTIVES, each with a lowering; fails loudly if this jax
  lacks one (route_collectives would silently leave it on XLA)."""
  from jax._src.lax import parallel
  prims = {}
  for name in LAX_COLLECTIVES:
    prim = getattr(parallel, f"{name}_p", None)
    if prim is None or prim not in mlir._lowerings:
      raise RuntimeError(f"jax {jax.__version__} has no {name} primitive with a lowering as "
                         "jax 0.11.2 has: jax_hoccl.route_collectives cannot take it over.")
    prims[name] = prim
  return prims


def register_lowering_as_is(prim, rule):
  """Registers prim's lowering on every platform as it is (the routed collectives' rules,
  which choose between jax_hoccl and XLA themselves)."""
  mlir.register_lowering(prim, rule)


def swap_lowering(prim, rule):
  """Replaces prim's lowering on every platform (the generic one and the platform-specific
  ones jax registers, e.g. all_gather's for cuda); returns (old(platform): the rule it had
  there, a function that puts every old one back). jax keeps each rule in an entry object
  with the callable as .rule."""
  generic = mlir._lowerings[prim]
  specific = {p: table[prim] for p, table in mlir._platform_specific_lowerings.items()
              if prim in table}
  mlir.register_lowering(prim, rule)
  for platform in specific:
    mlir.register_lowering(prim, rule, platform=platform)

  def old(platform):
    entry = specific.get(platform, generic)
    return getattr(entry, "rule", entry)

  def restore():
    mlir._lowerings[prim] = generic
    for platform, entry in specific.items():
      mlir._platform_specific_lowerings[platform][prim] = entry

  return old, restore


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


def barrier_eqn(x, after):
  """An equation passing x (a variable) and the values of the equation `after` through an
  optimization barrier; the x it yields (whatever reads it runs after `after`), and
  {value of `after`: the one it yields}. Readers of `after`'s values must read the yielded
  ones: an output nobody reads, XLA may drop from the barrier, and its order with it."""
  from jax._src.lax import lax as lax_internal
  values = [v for v in after.outvars if not isinstance(v, core.DropVar)]
  out, passed = core.Var(x.aval), [core.Var(v.aval) for v in values]
  eqn = core.new_jaxpr_eqn([x, *values], [out, *passed], lax_internal.optimization_barrier_p,
                           {}, core.no_effects)
  return eqn, out, dict(zip(values, passed))


def is_variable(x) -> bool:
  """Whether an equation's operand is a variable (not a literal)."""
  return isinstance(x, core.Var)


def with_eqns(closed_jaxpr, eqns, outvars=None):
  """closed_jaxpr with these equations (and outputs) instead of its own."""
  jaxpr = closed_jaxpr.jaxpr.replace(eqns=eqns)
  if outvars is not None:
    jaxpr = jaxpr.replace(outvars=outvars)
  return core.ClosedJaxpr(jaxpr, closed_jaxpr.consts)


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
  if np_ids is None and _outer_meshes and mesh is not None:
    outer = _outer_meshes[-1]
    if tuple(outer.shape.items()) == tuple(mesh.shape.items()):
      return outer
  if np_ids is None:
    raise NotImplementedError(
        f"jax_hoccl.{op_name} needs the device ids of its mesh at lowering, but this "
        f"shard_map body is lowered for {type(mesh).__name__ if mesh is not None else type(axis_ctx).__name__}"
        " without them (a shard_map nested inside another one). Use one jax.shard_map over "
        "all the axes, or jax.lax collectives inside the nested one.")
  return mesh


def module_state(ctx, key, default):
  """State kept for the module being lowered (shared by every rule and nested function of it,
  gone with it): its lowering cache's entry `key`, set to `default` first."""
  return ctx.module_context.cached_primitive_lowerings.setdefault(key, default)


def module_name(ctx) -> str:
  """The name of the module being lowered (jit_f for jax.jit(f))."""
  return mlir.ir.StringAttr(ctx.module_context.module.operation.attributes["sym_name"]).value


def user_line(skip: str) -> str:
  """Where the user's code made what is being traced, transposed or lowered now (jax keeps
  the equation's own traceback current while it transposes or lowers it): file name,
  function and line of the innermost frame outside jax, the standard library and `skip` (a
  package folder); "" where jax kept none."""
  from jax._src import source_info_util
  for f in source_info_util.user_frames(source_info_util.current().traceback):
    if not f.file_name.startswith(skip):
      return f"{os.path.basename(f.file_name)}:{f.function_name}:{f.start_line}"
  return ""


def hashable_array(a):
  """An array that jax.ffi.ffi_call can hash as (part of) an attribute, as a dictionary
  attribute holding an array must be when a handler is called directly."""
  from jax._src.hashable_array import HashableArray
  return HashableArray(a)
