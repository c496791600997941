"""psum: every rank gets the sum over ranks.

Two algorithms, both compositions of the movers with an XLA sum (on CUDA a staged one_shot
block is summed inside the exchange kernel instead: one launch):
  one_shot : all_gather everything, sum locally. One round of copies: best for small inputs.
  two_step : psum_scatter then all_gather (each rank sums 1/n). Moves 2(n-1)/n of the bytes
             instead of (n-1): best for large inputs.
(A third, two_step in chunks whose sums overlap the next chunk's copies, was slower than
two_step and is gone: docs/design.md.)
"auto" picks the one the cost model (_src/cost_model.py, fitted to the 2x H200 benchmark)
predicts faster for the size and group: one_shot for small inputs and, with two ranks, up
to hundreds of MiB; two_step above. Override with the env var JAX_HOCCL_PSUM_ALGORITHM or `with jax_hoccl.psum_algorithm(
"two_step"):` around the tracing of your function.
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import branches
from jax_hoccl._src import cost_model
from jax_hoccl._src import explicit_axes
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import lower_staged_sum
from jax_hoccl._src.ops import across_processes, buckets, common
from jax_hoccl._src.ops.all_gather import gather_stacked
from jax_hoccl._src.ops.psum_scatter import reduce_scatter_stacked

ALGORITHMS = ("auto",) + cost_model.PSUM_ALGORITHMS
_local = threading.local()

psum_p = ji.Primitive("hoccl_psum")


def choose_algorithm(nbytes: int, n: int) -> str:
  algo = getattr(_local, "algorithm", None) or os.environ.get("JAX_HOCCL_PSUM_ALGORITHM", "auto")
  if algo not in ALGORITHMS:
    raise ValueError(f"jax_hoccl.psum: algorithm must be one of {ALGORITHMS}, got {algo!r}")
  if algo == "auto":
    # one_shot pulls (n-1) x the bytes in one exchange, two_step 2(n-1)/n x in two: the model
    # weighs the second exchange's fixed cost against the bytes saved. A pure function of
    # (nbytes, n), so every rank tracing the program picks the same.
    algo = cost_model.choose_psum(nbytes, n)
  return algo


@contextlib.contextmanager
def psum_algorithm(name: str):
  """Force psum's algorithm for functions traced inside this block."""
  if name not in ALGORITHMS:
    raise ValueError(f"psum_algorithm must be one of {ALGORITHMS}, got {name!r}")
  prev = getattr(_local, "algorithm", None)
  _local.algorithm = name
  try:
    yield
  finally:
    _local.algorithm = prev


def _abstract_eval(x, *, axes, axis_size, algorithm, unreduced, site, groups):
  if unreduced:  # jax.lax's unreduced_psum: unreduced over axes -> invariant over them
    return common.unreduced_result_type(x, axes, "psum", "sum")
  if groups is not None:
    return common.grouped_type(x, axes, "psum")
  return common.reduced_type(x, axes, "psum")


def _impl(x, *, axes, axis_size, algorithm, unreduced, site, groups):
  if not axes_lib.groups_even(groups):
    # Groups of unequal sizes: every block along the axes, summed over my group's members.
    every = gather_stacked(x, axes, axis_size)
    return common.fold_my_group(every, axes, groups, lambda a, b: a + b)
  n = axes_lib.group_size(groups, axis_size)
  if algorithm == "one_shot":
    got = gather_stacked(x, axes, n, invariant=True, skip_own=True, groups=groups)
    return common.sum_leading_with_own(got, x, axes, groups)
  return two_step(x, axes, n, groups=groups)


def two_step(x, axes, n, across=None, groups=None):
  """psum_scatter x's flattened (zero-padded) elements over `axes`, then all_gather them;
  across(part), when given, sums each rank's 1/n part over more axes in between (the
  hierarchical psum across processes, ops/across_processes.py)."""
  flat = x.reshape(-1)
  size = flat.shape[0]
  padded = -(-size // n) * n
  if padded != size:
    flat = jnp.pad(flat, (0, padded - size))
  part = reduce_scatter_stacked(flat.reshape(n, padded // n), axes, n, groups=groups)
  if across is not None:
    part = across(part)
  full = gather_stacked(part, axes, n, invariant=True, groups=groups).reshape(-1)
  return full[:size].reshape(x.shape)


def _transpose(ct, x, *, axes, axis_size, algorithm, unreduced, site, groups):
  if unreduced:
    # As jax.lax's unreduced_psum: the invariant cotangent, typed reduced (a no-op cast).
    return [jax.lax.pcast(ct, tuple(axes), to="reduced")]
  if ji.check_vma_enabled():  # (never with groups: psum refuses them under check_vma=True)
    # Typed invariant, the cotangent is the same on every rank: psum is psum + pbroadcast.
    return [jax.lax.pcast(ct, tuple(axes), to="varying")]
  # Without types the cotangent may differ per rank: the true transpose sums it.
  return [psum_p.bind(ct, axes=axes, axis_size=axis_size, algorithm=algorithm,
                      unreduced=False, site=axes_lib.new_site(), groups=groups)]


def _batch(args, dims, **params):
  (x,), (d,) = args, dims
  return psum_p.bind(x, **params), d


def _lowering(ctx, x, *, axes, axis_size, algorithm, unreduced, site, groups):
  # An unreduced input, or one unreduced or reduced over other axes (a cotangent): summed by
  # the code for a varying input (the same bytes).
  if unreduced or common.typed_as_not_varying(ctx.avals_in[0]):
    return ji.lower_with_avals(ctx, [common.as_varying(ctx.avals_in[0], axes)], _lowering, x,
                               axes=axes, axis_size=axis_size, algorithm=algorithm,
                               unreduced=False, site=site, groups=groups)
  with axes_lib.user_op("psum", site):
    # Groups spanning processes: inside with jax_hoccl, across with jax.lax (across_processes).
    across = across_processes.lowering_for("psum", ctx, x, axes=axes, groups=groups)
    if across is not None:
      return across
    if algorithm == "one_shot" and axes_lib.groups_even(groups):
      # A staged block on CUDA: the exchange kernel sums as it copies out (one launch). Its
      # site is made here, as the mover's would be, so errors name the op the user called.
      staged = lower_staged_sum(
          "hoccl_psum_staged", "hoccl_all_gather", "psum", ctx, x,
          lambda: axes_lib.ffi_group_attrs(ctx, axes, "psum", axes_lib.new_site(), groups))
      if staged is not None:
        return staged
    return ji.lower_fun(_impl, multiple_results=False)(
        ctx, x, axes=axes, axis_size=axis_size, algorithm=algorithm, unreduced=False,
        site=site, groups=groups)


psum_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(psum_p, _lowering)
ji.deflinear2(psum_p, _transpose)
ji.primitive_batchers[psum_p] = _batch
branches.register(psum_p)


@explicit_axes.typed_like(jax.lax.psum)
def psum(x, axis_name, *, axis_index_groups=None):
  """jax.lax.psum with copy-engine data movement. Works on pytrees: leaves of one dtype and
  type are summed in one exchange per bucket (buckets.py). axis_index_groups: with
  check_vma=False, like jax.lax (which refuses them under check_vma=True); groups of unequal
  sizes gather every block along the axes and sum my group's."""
  vmapped, axis_name = common.split_vmap_axes(axis_name, "psum")
  if vmapped:  # the vmap part stays on the device: jax.lax's
    x = jax.lax.psum(x, vmapped, axis_index_groups=axis_index_groups)
  if not axis_name:  # psum(x, ()) is x, as in jax.lax
    return x
  axes, n = axes_lib.check_axes(axis_name, "psum")
  groups = axes_lib.check_groups(axis_index_groups, n, "psum")
  leaves = jax.tree.leaves(x)
  if leaves and not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    # Constants only (psum(1, axis) is the idiom for the axis size): jax.lax folds them at
    # trace time into constant * n, Python scalars staying Python scalars, and moves nothing.
    return jax.lax.psum(x, axis_name, axis_index_groups=groups)
  if groups is not None and ji.check_vma_enabled():
    raise NotImplementedError(
        "jax_hoccl.psum: axis_index_groups need shard_map(..., check_vma=False), as "
        "jax.lax.psum's do (it raises NotImplementedError under check_vma=True).")
  if n == 1:  # nothing to exchange: jax.lax's psum over one device is free
    return jax.lax.psum(x, axis_name)

  def prepare(leaf):
    leaf = common.summable(leaf, "psum")
    if common.input_state(leaf, axes, "psum") == "unreduced":
      common.check_unreduced_kind(jax.typeof(leaf), axes, "psum", "sum")
      return leaf
    return common.ensure_varying(leaf, axes, "psum")

  def one(leaf):
    algo = choose_algorithm(leaf.size * leaf.dtype.itemsize, axes_lib.group_size(groups, n)
                            if axes_lib.groups_even(groups) else n)
    unreduced = common.input_state(leaf, axes, "psum") == "unreduced"
    return psum_p.bind(leaf, axes=axes, axis_size=n, algorithm=algo, unreduced=unreduced,
                       site=axes_lib.new_site(), groups=groups)

  return buckets.elementwise(x, prepare, one)


@explicit_axes.typed_like(jax.lax.pmean)
def pmean(x, axis_name, *, axis_index_groups=None):
  """jax.lax.pmean with copy-engine data movement: psum, then a division by the group size,
  as jax.lax does it (integers become floats). Works on pytrees. With axis_index_groups of
  unequal sizes each group divides by its own size (jax.lax 0.11.2 divides every group's sum
  by the first group's size)."""
  vmapped, mesh_axes = common.split_vmap_axes(axis_name, "pmean")
  if not mesh_axes:  # nothing crosses devices (a vmap axis, or no axis): jax.lax's
    return jax.lax.pmean(x, axis_name, axis_index_groups=axis_index_groups)
  axes, n = axes_lib.check_axes(mesh_axes, "pmean")
  groups = axes_lib.check_groups(axis_index_groups, n, "pmean")
  if groups is not None and ji.check_vma_enabled():
    raise NotImplementedError(
        "jax_hoccl.pmean: axis_index_groups need shard_map(..., check_vma=False), as "
        "jax.lax.pmean's do (it raises NotImplementedError under check_vma=True).")
  if groups is not None and axes_lib.groups_even(groups):
    n = axes_lib.group_size(groups, n)
  elif groups is not None:  # my group's size
    sizes = np.zeros(n, np.int32)
    for g in groups:
      sizes[list(g)] = len(g)
    n = jnp.asarray(sizes)[jax.lax.axis_index(common.axis_name_arg(axes))]
  if vmapped:
    for a in vmapped:
      n *= jax.lax.axis_size(a)
  return jax.tree.map(lambda v: v / n, psum(x, axis_name, axis_index_groups=axis_index_groups))


def _across_nodes(x, *, axes, local, cross, sizes, **_):
  """psum over axes that span nodes: reduce-scatter inside, XLA's psum across on 1/n_local of
  the bytes, all-gather inside (across_processes.py)."""
  if not local:
    return jax.lax.psum(x, cross)
  n_local = across_processes.size_of(local, dict(sizes))
  return two_step(x, local, n_local, across=lambda p: jax.lax.psum(p, cross))


across_processes.register("psum", _across_nodes)
