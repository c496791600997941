"""Helpers shared by the collectives: summing received blocks, pytree mapping, pvary."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji


def sum_leading(x):
  """Sum over axis 0 as a left fold in rank order (x[0] + x[1] + ...), which XLA fuses into
  one elementwise pass. bf16/f16 (and float8) accumulate in f32 and round once. The fixed
  order makes the result identical on every rank and every run, and bitwise equal to XLA:CPU's
  own psum."""
  dt = np.dtype(x.dtype)
  low_precision = bool(jnp.issubdtype(dt, jnp.floating)) and dt.itemsize < 4
  acc = x[0].astype(jnp.float32) if low_precision else x[0]
  for i in range(1, x.shape[0]):
    acc = acc + (x[i].astype(jnp.float32) if low_precision else x[i])
  return acc.astype(dt)


def with_own(received, own, axes, groups=None):
  """`received` [n, ...], whose slot `rank` the mover left unwritten (skip_own), with that
  slot taken from `own`: what a reduction over the ranks reads, without copying my own block
  into `received` first (XLA fuses the select into the reduction)."""
  n = received.shape[0]
  mine = (jnp.arange(n) == rank(axes, groups)).reshape((n,) + (1,) * own.ndim)
  return jnp.where(mine, own[None], received)


def sum_leading_with_own(received, own, axes, groups=None):
  """sum_leading of with_own(received, own, axes): the same rank-order sum, bitwise."""
  return sum_leading(with_own(received, own, axes, groups))


def fold_my_group(every, axes, groups, combine):
  """every [n, ...] (every index's block along the axes) folded with `combine` over the
  members of my group, in the order the group lists them: the reduction over axis_index_groups
  of unequal sizes, where no mover of one group size fits every group. bf16/f16 (and float8)
  accumulate in f32 and round once, like sum_leading."""
  n = every.shape[0]
  width = max(len(g) for g in groups)
  members = np.full((len(groups), width), -1, np.int32)
  group_of = np.zeros(n, np.int32)
  for k, g in enumerate(groups):
    members[k, :len(g)] = g
    group_of[list(g)] = k
  mine = jnp.asarray(members)[jnp.asarray(group_of)[jax.lax.axis_index(axis_name_arg(axes))]]
  dt = np.dtype(every.dtype)
  low_precision = bool(jnp.issubdtype(dt, jnp.floating)) and dt.itemsize < 4
  take = lambda i: jax.lax.dynamic_index_in_dim(  # noqa: E731
      every, jnp.maximum(i, 0), axis=0, keepdims=False).astype(
          jnp.float32 if low_precision else dt)
  acc = take(mine[0])
  for k in range(1, width):
    acc = jnp.where(mine[k] >= 0, combine(acc, take(mine[k])), acc)
  return acc.astype(dt)


def summable(x, op):
  """x as an array psum-like ops add: a supported dtype, bools as int32 (as jax.lax)."""
  x = jnp.asarray(x)
  axes_lib.check_dtype(x, op, summable=True)
  return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def reduced_type(x, axes, op):
  """The type of an all-reduce's result (psum, pmax): x's, invariant over `axes`, which x
  must vary over (check_vma=True)."""
  vma = ji.varying_axes(x)
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl {op}: input must be varying over {axes}, got {set(vma)}")
  return ji.with_type(x, x.shape, vma - set(axes))


def ensure_varying(x, axes):
  """Like jax.lax's collectives: an input invariant over `axes` is first made varying, so a
  psum of a replicated value sums n copies (check_vma=True only; a no-op otherwise)."""
  if not ji.check_vma_enabled():
    return x
  missing = tuple(a for a in axes if a not in ji.varying_axes(jax.typeof(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def axis_name_arg(axes):
  return axes[0] if len(axes) == 1 else axes


def rank_blocks(x, axis: int, n: int, tiled: bool, axes, op: str, what: str):
  """x with `axis` split into n rank blocks and the block index moved to the front:
  [n, ..., size/n, ...]. Sizes checked like jax.lax: tiled needs size % n == 0, untiled
  size == n."""
  size = x.shape[axis]
  if tiled and size % n:
    raise ValueError(f"jax_hoccl.{op}: {what} {axis} has size {size}, which does not "
                     f"divide by the axis size {n} of {axes}.")
  if not tiled and size != n:
    raise ValueError(f"jax_hoccl.{op}: with tiled=False {what} {axis} must have size "
                     f"{n} (the size of {axes}), got {size}.")
  shape = list(x.shape)
  shape[axis:axis + 1] = [n, size // n]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def canonical_axis(axis: int, ndim: int, op: str, what: str) -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(f"jax_hoccl.{op}: {what}={axis} is out of range for an array of rank {ndim}.")
  return axis % ndim


def rank(axes, groups=None):
  """My rank along `axes`, or in my group of axis_index_groups."""
  index = jax.lax.axis_index(axis_name_arg(axes))
  if groups is None:
    return index
  n = sum(len(g) for g in groups)
  return jnp.asarray(axes_lib.rank_in_group(groups, n))[index]


def grouped_type(x, axes, op):
  """The type of an all-reduce's result over axis_index_groups: x's, still varying over
  `axes` (the groups' results differ), which x must vary over (check_vma=True). jax.lax's
  pmax/pmin type it invariant, which out_specs=P() would then accept silently."""
  vma = ji.varying_axes(x)
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl {op}: input must be varying over {axes}, got {set(vma)}")
  return ji.with_type(x, x.shape, vma)
