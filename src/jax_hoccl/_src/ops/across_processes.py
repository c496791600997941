"""Collectives whose groups span nodes: jax_hoccl's engines inside each node (one process
or several, cc/node_rendezvous.h), XLA's own collectives (NCCL on GPUs, gloo on CPUs)
between nodes, on as few bytes as the math allows (docs/design.md, "Several nodes"). Each
mover's lowering calls `lowering_for` first; each op registers its composition here
(`register`), so this module imports none of them. Which processes share a node: job.py.

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

import numpy as np
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji


def split(mesh, axes, op):
  """(local axes, cross axes, {axis: size}); local is () when only XLA can do the op."""
  cross = tuple(a for a in axes if axes_lib.spans_nodes(mesh, (a,), op))
  local = tuple(a for a in axes if a not in cross)
  if local and axes_lib.spans_nodes(mesh, local, op):
    local, cross = (), tuple(axes)
  return local, cross, {a: int(mesh.shape[a]) for a in axes}


# op -> its composition across nodes, registered by the op's own module (so this module
# imports none of them): fn(x, *, axes, local, cross, sizes, mesh_order, **op params).
_ACROSS = {}


def register(op: str, fn) -> None:
  _ACROSS[op] = fn


def size_of(axes, sizes):
  return int(np.prod([sizes[a] for a in axes], dtype=np.int64))


def reorder(y, src, dst, sizes):
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
  groups = params.pop("groups", None)
  if not axes_lib.spans_nodes(mesh, params["axes"], op):
    return None
  if groups is not None:
    raise NotImplementedError(
        f"jax_hoccl.{op}: axis_index_groups over axes {params['axes']} whose groups span "
        "nodes is not supported; use mesh axes whose groups stay inside a node.")
  local, cross, sizes = split(mesh, tuple(params.pop("axes")), op)
  fn = _ACROSS[op]
  return ji.lower_fun(fn, multiple_results=False)(
      ctx, x, axes=tuple(a for a in sizes), local=local, cross=cross,
      sizes=tuple(sizes.items()), mesh_order=tuple(mesh.axis_names), **params)


