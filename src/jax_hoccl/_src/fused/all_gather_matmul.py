"""all_gather_matmul(x, w, axis) == all_gather(x, axis, tiled=True) @ w, with the gather
hidden behind the matmul: the peers' rows are pulled by copy engines while the SMs multiply
this rank's own rows (the column-parallel linear layer of sequence-parallel Megatron).

On Hopper GPUs (bf16/f16, shapes that tile) it is one flagged GEMM that multiplies the peers'
rows as they land (flagged/gather_walk.py). Elsewhere the gather runs beside row GEMMs
(row_pieces/gather_beside_gemms.py says how the GEMMs are kept between start and done).

Backward: dx = matmul_reduce_scatter(ct, w.T) (overlapped the same way), dw from the rows
gathered in the forward pass. With to="invarying" the result is typed invariant over the axes
(every rank computed the same product), as jax.lax.all_gather(..., to="invarying") @ w is, and
its cotangent is the same on every rank: dx is my rows of ct @ w.T, with no exchange (the
transpose of jax.lax's invariant gather is that slice).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import explicit_axes
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.cotangents import cotangent_like
from jax_hoccl._src.fused.flagged import gather_walk
from jax_hoccl._src.fused.matmul_reduce_scatter import matmul_reduce_scatter
from jax_hoccl._src.fused.row_pieces.gather_beside_gemms import gather_beside_gemms
from jax_hoccl._src.ops import common


def _gather_and_multiply(x, w, axes, n, with_rows=False):
  """(all_gather(x) @ w, the gathered rows of x with with_rows, else None)."""
  if gather_walk.applies(x, w, n):  # one flagged GEMM, fed as the rows land
    return gather_walk.gemm_as_rows_land(x, w, axes, n, with_rows=with_rows)
  return gather_beside_gemms(x, w, axes, n, with_rows=with_rows)


# Typed invariant over `axes` what every rank computed alike (the gathered rows, their product
# with a w invariant over the axes): nothing moves, the type changes as jax.lax's invariant
# gather changes it. Only inside the custom_vjp below, which defines the gradient.
_same_on_every_rank_p = ji.Primitive("hoccl_same_on_every_rank")
_same_on_every_rank_p.def_abstract_eval(
    lambda x, *, axes: ji.with_type(x, x.shape, ji.varying_axes(x) - set(axes)))
ji.register_lowering(_same_on_every_rank_p, lambda ctx, x, *, axes: [x])
ji.primitive_batchers[_same_on_every_rank_p] = lambda args, dims, **params: (
    _same_on_every_rank_p.bind(*args, **params), dims[0])


def _same_on_every_rank(a, axes):
  axes = tuple(ax for ax in axes if ax in ji.varying_axes(jax.typeof(a)))
  return _same_on_every_rank_p.bind(a, axes=axes) if axes else a


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _agmm(x, w, axis_name, invariant):
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  out = _gather_and_multiply(x, w, axes, n)[0]
  return _same_on_every_rank(out, axes) if invariant else out


def _agmm_fwd(x, w, axis_name, invariant):
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  out, gathered = _gather_and_multiply(x, w, axes, n, with_rows=True)
  if invariant:
    out, gathered = _same_on_every_rank(out, axes), _same_on_every_rank(gathered, axes)
  return out, (gathered, x, w)


@axes_lib.names_errors("all_gather_matmul")
def _agmm_bwd(axis_name, invariant, res, ct):
  gathered, x, w = res
  if invariant:  # one cotangent for all ranks: my rows of it
    rows = x.shape[0]
    mine = jax.lax.dynamic_slice_in_dim(ct, common.rank(axis_name) * rows, rows, axis=0)
    dx = mine @ w.T
  else:
    dx = matmul_reduce_scatter(ct, w.T, axis_name)
  dw = common.as_rows(gathered).T @ common.as_rows(ct)
  return cotangent_like(dx, x), cotangent_like(dw, w)


_agmm.defvjp(_agmm_fwd, _agmm_bwd)


@explicit_axes.typed_like()
@axes_lib.names_errors("all_gather_matmul")
def all_gather_matmul(x, w, axis_name, *, to="varying"):
  """all_gather(x, axis_name, tiled=True, to=to) @ w for x [m, ..., K] (rows sharded over the
  axis) and w [K, N]; returns [n*m, ..., N]. Call inside shard_map. `to="invarying"` (or
  "invariant") types the result invariant over the axes where w is (out_specs=P() then works
  under check_vma=True), like jax.lax.all_gather(..., to="invarying") @ w.

  Runs as one flagged GEMM fed as the peers' rows land (flagged/gather_walk.py) on Hopper
  GPUs for bf16/f16 with m (times the inner dims) % 512 == 0, K % 64 == 0, N % 256 == 0,
  unless ranks share a GPU (its in-kernel waits would then wait for copies that need its SMs);
  else as a gather beside row GEMMs (cuBLASLt for bf16/f16 on GPU, XLA's dot otherwise)."""
  axes, n = axes_lib.check_axes(axis_name, "all_gather_matmul")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"jax_hoccl.all_gather_matmul: needs x [m, ..., K] and w [K, N], got "
                     f"{x.shape} and {w.shape}.")
  x, w = axes_lib.matmul_operands(x, w, "all_gather_matmul")
  if to not in ("varying", "invarying", "invariant"):
    raise ValueError(f"jax_hoccl.all_gather_matmul: to must be 'varying' or 'invarying', got "
                     f"{to!r}.")
  invariant = to != "varying"
  if invariant and ji.check_vma_enabled():
    w_varies = [a for a in axes if a in ji.varying_axes(jax.typeof(w))]
    if w_varies and len(w_varies) < len(axes):
      raise NotImplementedError(
          f"jax_hoccl.all_gather_matmul: to='invarying' with w varying over {w_varies}, only "
          f"some of {axes}: gather over those axes in two calls, or pass to='varying'.")
    invariant = not w_varies  # w varying over the axes: so is the product (jax.lax's type)
  return _agmm(common.ensure_varying(x, axes, "all_gather_matmul"), w, axes, invariant)
