"""Cotangents typed like their primals, for the fused ops' custom_vjp backward passes.

    cotangent_like(ct, primal) == psum(ct, the axes ct varies over and primal does not)
                                  (unreduced over those primal is reduced over)
    vary_alike(*arrays)        == arrays (cast to vary over the union of their varying axes)
"""
from __future__ import annotations

import jax

from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ops.psum import psum


def cotangent_like(ct, primal):
  """A custom_vjp backward must return cotangents typed like the primals. Where a primal was
  invariant over an axis but its cotangent came out varying (a replicated weight used by
  every rank), the true cotangent is the sum over that axis. Where the primal was reduced
  over it (an FSDP weight, pcast to="reduced"), the cotangent is that sum not yet taken:
  typed unreduced, as jax.lax's transposes leave it (the pcast's transpose then sums it)."""
  if not ji.check_vma_enabled():
    return ct
  p = jax.typeof(primal)
  # sorted: every process must trace the same psum (a frozenset's order may differ)
  extra = sorted(ji.varying_axes(jax.typeof(ct)) - ji.varying_axes(p), key=str)
  pending = tuple(a for a in extra if a in ji.reduced_axes(p))
  if pending:
    ct = jax.lax.pcast(ct, pending, to="unreduced")
  summed = tuple(a for a in extra if a not in ji.reduced_axes(p))
  return psum(ct, summed) if summed else ct


def vary_alike(*arrays):
  """Casts the arrays to vary over the union of their varying manual axes (check_vma=True
  only). A jax.vjp taken over them then holds no implicit pvary, whose transpose would be
  jax.lax.psum, i.e. XLA's all-reduce; cotangent_like sums with jax_hoccl.psum."""
  if not ji.check_vma_enabled():
    return arrays
  union = frozenset().union(*(ji.varying_axes(jax.typeof(a)) for a in arrays))
  out = []
  for a in arrays:
    missing = tuple(sorted(union - ji.varying_axes(jax.typeof(a)), key=str))
    out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
  return tuple(out)
