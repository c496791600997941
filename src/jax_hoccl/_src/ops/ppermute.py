"""ppermute: rank i's buffer lands at perm(i); ranks nobody sends to get zeros.

One copy per (source, destination) pair; the transpose is the inverse permutation.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import branches
from jax_hoccl._src import explicit_axes
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import ffi_lower, mover_target
from jax_hoccl._src.ops import across_processes, buckets, common

ppermute_p = ji.Primitive("hoccl_ppermute")


def _abstract_eval(x, *, axes, axis_size, perm, site):
  vma = ji.varying_axes(x)
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl ppermute: input must be varying over {axes}, got {set(vma)}")
  return ji.with_type(x, x.shape, vma)


def _lowering(ctx, x, *, axes, axis_size, perm, site):
  across = across_processes.lowering_for("ppermute", ctx, x, axes=axes, perm=perm)
  if across is not None:
    return across
  attrs = axes_lib.ffi_group_attrs(ctx, axes, "ppermute", site)
  return ffi_lower(mover_target("hoccl_ppermute", ctx, attrs), "ppermute", ctx, x,
                   permute_dst=permute_dst(perm, axis_size), **attrs)


def _transpose(ct, x, *, axes, axis_size, perm, site):
  inverse = tuple((d, s) for s, d in perm)
  return [ppermute_p.bind(ct, axes=axes, axis_size=axis_size, perm=inverse,
                          site=axes_lib.new_site())]


def _batch(args, dims, **params):
  (x,), (d,) = args, dims
  return ppermute_p.bind(x, **params), d


ppermute_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(ppermute_p, _lowering)
ji.deflinear2(ppermute_p, _transpose)
ji.primitive_batchers[ppermute_p] = _batch
branches.register(ppermute_p)


def permute_dst(perm, axis_size: int) -> np.ndarray:
  """The handlers' permute_dst attribute: dst[s] = where rank s sends, -1 for nowhere."""
  dst = np.full(axis_size, -1, np.int64)
  for s, d in perm:
    dst[s] = d
  return dst


def check_perm(perm, n, op="ppermute"):
  """Validates `perm` and returns it with indices in [0, n). Like jax.lax.ppermute, indices
  are indices into the axis, so -1 is the last rank."""
  perm = tuple((int(s), int(d)) for s, d in perm)
  for i in (i for pair in perm for i in pair):
    if not -n <= i < n:
      raise ValueError(f"jax_hoccl.{op}: permutation index {i} is out of range for axis size {n}.")
  perm = tuple((s % n, d % n) for s, d in perm)
  srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
  if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
    raise ValueError(f"jax_hoccl.{op}: perm {perm} sends from or to one rank twice.")
  return perm


def check_axis_order(axes, op):
  """As jax.lax.ppermute (jax 0.11.2), which raises unless the check is off, axes must be in
  the mesh's order; with the check off jax_hoccl ranks devices row-major over the axes in the
  order given, as axis_index does."""
  mesh = jax.sharding.get_abstract_mesh()
  moved = [a for a in axes if mesh.shape[a] > 1]  # one-device axes change no device order
  mesh_order = [a for a in mesh.axis_names if a in moved]
  if moved != mesh_order and ji.ppermute_axis_order_checked():
    raise RuntimeError(
        f"jax_hoccl.{op}: axis_name {axes} is not in the order of the mesh's axes "
        f"{tuple(mesh_order)}. Pass them in mesh order or, to permute in the given order, set "
        "jax.config.update('jax_raise_on_ppermute_sort_diff', False) (as for jax.lax.ppermute).")


@explicit_axes.typed_like(jax.lax.ppermute)
def ppermute(x, axis_name, perm):
  """jax.lax.ppermute on copy engines. Works on pytrees (leaves of one dtype and type in one
  exchange per bucket, buckets.py)."""
  if not isinstance(perm, (list, tuple)):  # as jax.lax: a one-shot iterator would be empty on a retrace
    raise TypeError(f"jax_hoccl.ppermute: perm must be a list or a tuple of (source, "
                    f"destination) pairs, got {type(perm).__name__}.")
  if common.lax_takes(axis_name, "ppermute"):  # a vmap axis (see axes.py), or none
    return jax.lax.ppermute(x, axis_name, perm)
  axes, n = axes_lib.check_axes(axis_name, "ppermute")
  check_axis_order(axes, "ppermute")
  if n == 1:  # nothing to exchange (a one-device axis): jax.lax's costs nothing
    return jax.lax.ppermute(x, axis_name, perm)
  perm = check_perm(perm, n)

  def prepare(leaf):
    leaf = jnp.asarray(leaf)
    axes_lib.check_dtype(leaf, "ppermute")
    return common.ensure_varying(leaf, axes, "ppermute")

  def one(leaf):
    out = ppermute_p.bind(leaf, axes=axes, axis_size=n, perm=perm, site=axes_lib.new_site())
    return _unsent_as_zero(out, axes, perm, n)

  return buckets.elementwise(x, prepare, one)


def _unsent_as_zero(out, axes, perm, n):
  """out where a rank receives, else the type's zero as jax.lax writes it (convert(0)). The
  exchange leaves zero bytes, which only a type without a zero reads as another value
  (float8_e8m0fnu: 0 converts to NaN, zero bytes are 2**-127)."""
  receivers = sorted({dst for _, dst in perm})
  if np.asarray(0, out.dtype).tobytes() == bytes(out.dtype.itemsize) or len(receivers) == n:
    return out
  lands = jnp.isin(common.rank(axes), jnp.asarray(receivers))
  return jnp.where(lands, out, jnp.zeros((), out.dtype))


def _across_nodes(x, *, axes, perm, mesh_order, sizes, **_):
  """XLA's ppermute over axes that span nodes. jax.lax.ppermute wants the axes in the mesh's
  order: renumber the pairs into it."""
  sizes = dict(sizes)
  ordered = tuple(a for a in mesh_order if a in axes)
  shape = [sizes[a] for a in axes]

  def renumber(i):
    coords = dict(zip(axes, np.unravel_index(i, shape)))
    return int(np.ravel_multi_index([coords[a] for a in ordered], [sizes[a] for a in ordered]))

  perm = [(renumber(s), renumber(d)) for s, d in perm]
  return jax.lax.ppermute(x, ordered if len(ordered) > 1 else ordered[0], perm)


across_processes.register("ppermute", _across_nodes)
