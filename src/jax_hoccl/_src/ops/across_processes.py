"""Collectives whose groups span nodes: jax_hoccl's engines inside each node (one process
or several, cc/node_rendezvous.h), XLA's own collectives (NCCL on GPUs, gloo on CPUs)
between nodes, on as few bytes as the math allows (docs/design.md, "Several nodes"). Each
mover's lowering calls `lowering_for` first. Which processes share a node: job.py.

The axes split into `local` ones (each group stays inside one node) and `cross` ones:
  psum           reduce-scatter inside, psum across on 1/n_local of the bytes, gather inside
  pmax, pmin     inside, then across on the result
  reduce_scatter reduce-scatter inside on the whole input, then across on 1/n_local of it
  all_gather     gather across on the input, then inside on n_cross times more
  all_to_all, ppermute   XLA's across the whole group (their pairs cross nodes anyway)
The stacked forms order blocks by the combined index over `axes` in the order given, so the
gathered/scattered blocks are transposed between that order and (cross..., local...).
If the local axes alone still span nodes (one axis over several nodes), everything goes to
XLA.
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji


def split(mesh, axes):
  """(local axes, cross axes, {axis: size}); local is () when only XLA can do the op."""
  cross = tuple(a for a in axes if axes_lib.spans_nodes(mesh, (a,)))
  local = tuple(a for a in axes if a not in cross)
  if local and axes_lib.spans_nodes(mesh, local):
    local, cross = (), tuple(axes)
  return local, cross, {a: int(mesh.shape[a]) for a in axes}


def _size(axes, sizes):
  return int(np.prod([sizes[a] for a in axes], dtype=np.int64))


def _reorder(y, src, dst, sizes):
  """y's leading axis holds blocks by combined index over `src` axes; returns them by
  combined index over `dst` (the same axes in another order)."""
  if tuple(src) == tuple(dst):
    return y
  rest = y.shape[1:]
  y = y.reshape(*[sizes[a] for a in src], *rest)
  y = jnp.transpose(y, [src.index(a) for a in dst] + list(range(len(src), y.ndim)))
  return y.reshape(-1, *rest)


def lowering_for(op: str, ctx, x, **params):
  """The lowering of mover `op` (params: the primitive's) when its group spans processes,
  else None."""
  mesh = ji.concrete_mesh_from_lowering(ctx, op)
  if not axes_lib.spans_nodes(mesh, params["axes"]):
    return None
  local, cross, sizes = split(mesh, tuple(params.pop("axes")))
  fn = {"psum": _psum, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
        "all_to_all": _all_to_all, "ppermute": _ppermute,
        "pmax": functools.partial(_extremum, op="pmax"),
        "pmin": functools.partial(_extremum, op="pmin")}[op]
  return ji.lower_fun(fn, multiple_results=False)(
      ctx, x, axes=tuple(a for a in sizes), local=local, cross=cross,
      sizes=tuple(sizes.items()), mesh_order=tuple(mesh.axis_names), **params)


def _psum(x, *, axes, local, cross, sizes, **_):
  from jax_hoccl._src.ops.psum import two_step
  if not local:
    return jax.lax.psum(x, cross)
  return two_step(x, local, _size(local, dict(sizes)), across=lambda p: jax.lax.psum(p, cross))


def _extremum(x, *, axes, local, cross, sizes, op, **_):
  """pmax / pmin: inside with jax_hoccl, then across with jax.lax on the local result."""
  across = jax.lax.pmax if op == "pmax" else jax.lax.pmin
  if local:
    from jax_hoccl._src.ops.pmax import extremum_p
    x = extremum_p.bind(x, axes=local, axis_size=_size(local, dict(sizes)), op=op,
                        site=axes_lib.new_site())
  return across(x, cross)


def _all_gather(x, *, axes, local, cross, sizes, invariant, **_):
  """x -> [n, *x.shape], block k from the rank of combined index k over axes."""
  from jax_hoccl._src.ops.all_gather import gather_stacked
  sizes = dict(sizes)
  y = jax.lax.all_gather(x, cross if len(cross) > 1 else cross[0], axis=0,
                         to="invarying" if invariant else "varying")  # [n_cross, ...]
  if local:
    y = gather_stacked(y, local, _size(local, sizes), invariant)  # [n_local, n_cross, ...]
    y = y.reshape(-1, *x.shape)
  return _reorder(y, local + cross, axes, sizes)


def _reduce_scatter(x, *, axes, local, cross, sizes, **_):
  """x[n, ...] -> [...]: the sum over ranks of their block for my combined index."""
  from jax_hoccl._src.ops.psum_scatter import reduce_scatter_stacked
  sizes = dict(sizes)
  x = _reorder(x, axes, local + cross, sizes)  # block (l, c) at l * n_cross + c
  n_cross = _size(cross, sizes)
  if local:
    n_local = _size(local, sizes)
    x = reduce_scatter_stacked(x.reshape(n_local, n_cross, *x.shape[1:]), local, n_local)
  return jax.lax.psum_scatter(x, cross if len(cross) > 1 else cross[0], scatter_dimension=0,
                              tiled=False)


def _all_to_all(x, *, axes, **_):
  return jax.lax.all_to_all(x, axes if len(axes) > 1 else axes[0], 0, 0)


def _ppermute(x, *, axes, perm, mesh_order, sizes, **_):
  # jax.lax.ppermute wants the axes in the mesh's order: renumber the pairs into it.
  sizes = dict(sizes)
  ordered = tuple(a for a in mesh_order if a in axes)
  shape = [sizes[a] for a in axes]

  def renumber(i):
    coords = dict(zip(axes, np.unravel_index(i, shape)))
    return int(np.ravel_multi_index([coords[a] for a in ordered], [sizes[a] for a in ordered]))

  perm = [(renumber(s), renumber(d)) for s, d in perm]
  return jax.lax.ppermute(x, ordered if len(ordered) > 1 else ordered[0], perm)
