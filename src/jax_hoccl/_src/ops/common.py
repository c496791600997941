"""Helpers shared by the collectives: summing received blocks, pvary, manual-axis types."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji


def as_rows(x):
  """x [..., K] as the [rows, K] of its matmul (the rows counted: reshape(-1, K) cannot size
  an empty array)."""
  return x.reshape(int(np.prod(x.shape[:-1], dtype=np.int64)), x.shape[-1])


def split_vmap_axes(axis_name, op: str) -> tuple[tuple, tuple]:
  """axes.split_vmap_axes: (vmap axes, mesh axes) of axis_name; with a vmap axis inside a
  shard_map under check_vma=True, a clear error. jax.lax's collectives fail there too (over a
  vmap and a mesh axis a ValueError, the input being varying over one and invariant over the
  other; over a vmap axis alone an AssertionError)."""
  vmapped, mesh_axes = axes_lib.split_vmap_axes(axis_name)
  manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ()
  if vmapped and manual and ji.check_vma_enabled():
    names = ", ".join(repr(a) for a in vmapped)
    raise ValueError(
        f"jax_hoccl.{op}: axis_name {axis_name!r} names the jax.vmap axis {names}, which inside "
        "shard_map(..., check_vma=True) no collective can take: the input's type is varying "
        "or invariant over mesh axes only, and jax.lax's collectives fail there as well. Use "
        "shard_map(..., check_vma=False), or reduce over the batch dimension outside the vmap.")
  return vmapped, mesh_axes


def lax_takes(axis_name, op: str) -> bool:
  """Whether jax.lax's collective serves this call whole (split_vmap_axes checked): the
  axes name a vmap axis (the batch stays on the device), or no axis at all (jax.lax returns
  the input)."""
  vmapped, mesh_axes = split_vmap_axes(axis_name, op)
  return bool(vmapped) or not mesh_axes


def sum_leading(x):
  """Sum over axis 0 as a left fold in rank order (x[0] + x[1] + ...), which XLA fuses into
  one elementwise pass. bf16/f16 (and float8) accumulate in f32 and round once. The fixed
  order makes the result identical on every rank and every run, and bitwise equal to XLA:CPU's
  own psum. Written with lax's primitives, not jnp's operators: this runs at every lowering
  of psum and psum_scatter, where jnp's indexing and promotion cost ~4x the time
  (benchmarks/README.md, "Compile cost")."""
  dt = np.dtype(x.dtype)
  low_precision = bool(jnp.issubdtype(dt, jnp.floating)) and dt.itemsize < 4

  # One split into [1, ...] blocks and one reshape at the end: n + 1 ops, not 3n.
  blocks = jax.lax.split(x, (1,) * x.shape[0], axis=0)
  if low_precision:
    blocks = [jax.lax.convert_element_type(b, np.float32) for b in blocks]
  acc = blocks[0]
  for b in blocks[1:]:
    acc = jax.lax.add(acc, b)
  acc = jax.lax.reshape(acc, x.shape[1:])
  return jax.lax.convert_element_type(acc, dt) if low_precision else acc


def with_own(received, own, axes, groups=None):
  """`received` [n, ...], whose slot `rank` the mover left unwritten (skip_own), with that
  slot taken from `own`: what a reduction over the ranks reads, without copying my own block
  into `received` first (XLA fuses the select into the reduction). lax's primitives, as in
  sum_leading."""
  n, shape = received.shape[0], received.shape
  mine = jax.lax.eq(jax.lax.iota(np.int32, n),
                    jax.lax.broadcast(jax.lax.convert_element_type(rank(axes, groups), np.int32), (n,)))
  return jax.lax.select(jax.lax.broadcast_in_dim(mine, shape, (0,)),
                        jax.lax.broadcast_in_dim(own, shape, tuple(range(1, len(shape)))),
                        received)


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
  must vary over (check_vma=True). As jax.lax's, weakly typed only under check_vma=True."""
  vma = ji.varying_axes(x)
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl {op}: input must be varying over {axes}, got {set(vma)}")
  out = ji.with_type(x, x.shape, vma - set(axes))
  return out if ji.check_vma_enabled() else out.update(weak_type=False)


# Manual-axis types (check_vma=True) of a collective's input over its axes, as jax.lax names
# them: varying (one value per device), invariant (the same everywhere), unreduced (one addend
# per device of a reduction not yet taken) and reduced (the same everywhere, its cotangent
# unreduced). jax.lax's all-reduces and psum_scatter take unreduced inputs (and only the
# reduction their unreduced kind names); all_gather(to="reduced") makes reduced outputs.
def input_state(x, axes, op: str) -> str:
  """"varying", "invariant", "unreduced" or "reduced": x's type over `axes` ("varying"
  without check_vma, where values carry no types). Unreduced or reduced over some of the axes
  and not all is an error, as in jax.lax (a mix of varying and invariant is made varying)."""
  if not ji.check_vma_enabled():
    return "varying"
  aval = jax.typeof(x)
  states = set()
  for a in axes:
    if a in ji.varying_axes(aval):
      states.add("varying")
    elif a in ji.unreduced_axes(aval):
      states.add("unreduced")
    elif a in ji.reduced_axes(aval):
      states.add("reduced")
    else:
      states.add("invariant")
  if states == {"varying", "invariant"}:
    return "varying"
  if len(states) > 1:
    raise ValueError(
        f"jax_hoccl.{op}: the input {aval.str_short(True)} is {' and '.join(sorted(states))} "
        f"over different axes of {tuple(axes)}; like jax.lax.{op}, the axes must all be "
        "unreduced, all reduced, or all varying/invariant.")
  return states.pop()


def check_unreduced_kind(x, axes, op: str, kind: str) -> None:
  """An unreduced input waits for one reduction (jax.sharding.UnreducedKind): `op` may take
  it only if that is `kind`, as jax.lax's unreduced psum / pmax / pmin check."""
  got = ji.unreduced_kind(x)
  if got != kind:
    raise ValueError(
        f"jax_hoccl.{op}: the input {x.str_short(True)} is unreduced over {tuple(axes)} "
        f"waiting for a {got} (unreduced_kind={got}); {op} takes unreduced inputs of "
        f"unreduced_kind={kind} only, like jax.lax.{op}.")


def unreduced_result_type(x, axes, op: str, kind: str, shape=None):
  """The type of an all-reduce's or psum_scatter's result on an input unreduced over `axes`
  (check_vma=True): no longer unreduced over them, nothing else changes (psum_scatter adds
  them to the varying axes itself)."""
  if not set(axes) <= ji.unreduced_axes(x):
    raise ValueError(f"jax_hoccl {op}: input must be unreduced over {axes}, got "
                     f"{x.str_short(True)}")
  check_unreduced_kind(x, axes, op, kind)
  return ji.with_type(x, x.shape if shape is None else shape, ji.varying_axes(x),
                      unreduced=ji.unreduced_axes(x) - set(axes))


def typed_as_not_varying(aval) -> bool:
  """Whether `aval` is unreduced or reduced over some axis: a lowering traces its
  implementation for as_varying(aval) instead."""
  return bool(ji.unreduced_axes(aval) or ji.reduced_axes(aval))


def as_varying(aval, axes):
  """`aval` typed varying over `axes` and over every axis it is unreduced or reduced over:
  the type the implementation of a collective is traced for at lowering (its bytes are the
  same; only jax's checks see types). Not only `axes`: an input unreduced over other axes
  too (the cotangent of an FSDP gather) would stop the implementation's dynamic_slice,
  which has no unreduced rule."""
  return ji.with_type(aval, aval.shape,
                      ji.varying_axes(aval) | set(axes) | ji.unreduced_axes(aval) |
                      ji.reduced_axes(aval), unreduced=(), reduced=())


def ensure_varying(x, axes, op: str):
  """Like jax.lax's collectives: an input invariant over `axes` is first made varying, so a
  psum of a replicated value sums n copies (check_vma=True only; a no-op otherwise). An input
  unreduced or reduced over them is an error naming `op` (the ops that take unreduced
  inputs check input_state first)."""
  if not ji.check_vma_enabled():
    return x
  state = input_state(x, axes, op)
  if state in ("unreduced", "reduced"):
    what = ("unreduced inputs over its axes are taken by psum, pmean, pmax, pmin and "
            "psum_scatter only" if state == "unreduced" else
            "a reduced value is already the same on every device; jax.lax.pcast(x, axes, "
            "to='varying') makes it varying")
    raise ValueError(f"jax_hoccl.{op}: the input {jax.typeof(x).str_short(True)} is {state} "
                     f"over {tuple(axes)}, which {op} does not take, like jax.lax.{op} "
                     f"({what}).")
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
