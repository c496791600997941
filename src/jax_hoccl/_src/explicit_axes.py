"""Ops called in a shard_map that leaves Explicit mesh axes to the partitioner.

Inside a partial-manual shard_map an array's type names how it is split over the Explicit
axes that are not manual, and jax type-checks every reshape and transpose our ops make of it
(ShardingTypeError: "This reshape is not supported ..."). The custom calls see such values
whole anyway (jax_internals.register_lowering), so each op takes its inputs unsharded over
those axes, and gives its results the type jax.lax's op would have (jax.eval_shape of it), or
unsharded where jax.lax has no such op (async starts, fused ops)."""
from __future__ import annotations

import functools

import jax
from jax.sharding import AxisType, PartitionSpec as P


def explicit_auto_axes() -> tuple:
  """The Explicit axes of the enclosing shard_map's mesh that it leaves to the partitioner."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  if not manual:
    return ()
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
               if t == AxisType.Explicit and a not in manual)


def _is_sharded(leaf) -> bool:
  return isinstance(leaf, jax.Array) and any(s is not None for s in jax.typeof(leaf).sharding.spec)


def unsharded(tree):
  """tree's arrays resharded to be unsharded over every non-manual axis (no-op if not)."""
  return jax.tree.map(lambda a: jax.sharding.reshard(a, P()) if _is_sharded(a) else a, tree)


def typed_like(lax_op=None):
  """Decorator for a public op: it runs on inputs unsharded over the Explicit auto axes, and
  its results are resharded to the types of lax_op(*same arguments) (None: left unsharded).
  Outside a partial-manual shard_map, or with no input sharded, it calls the op as is."""

  def decorate(op):
    @functools.wraps(op)
    def wrapped(*args, **kwargs):
      if not explicit_auto_axes() or not any(map(_is_sharded, jax.tree.leaves((args, kwargs)))):
        return op(*args, **kwargs)
      out = op(*unsharded(args), **unsharded(kwargs))
      if lax_op is None:
        return out
      leaves, tree = jax.tree.flatten((args, kwargs))
      arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

      def lax_result(*values):  # lax_op with the arrays abstract, the rest (axis names) as given
        full = list(leaves)
        for i, v in zip(arrays, values):
          full[i] = v
        a, k = jax.tree.unflatten(tree, full)
        return lax_op(*a, **k)

      ref = jax.eval_shape(lax_result, *(leaves[i] for i in arrays))
      return jax.tree.map(lambda o, r: jax.sharding.reshard(o, r.sharding.spec), out, ref)

    return wrapped

  return decorate


def leading_spec(a):
  """How a's leading axis is sharded over the Explicit auto axes (None: not sharded)."""
  spec = tuple(jax.typeof(a).sharding.spec) if explicit_auto_axes() else ()
  return spec[0] if spec else None


def with_leading_spec(a, spec):
  """a resharded so that its leading axis is sharded as `spec` (from leading_spec)."""
  if spec is None:
    return a
  return jax.sharding.reshard(a, P(spec, *([None] * (a.ndim - 1))))
