"""Cotangents typed like their primals, for the fused ops' custom_vjp backward passes."""
from __future__ import annotations

import jax

from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ops.psum import psum


def cotangent_like(ct, primal):
  """A custom_vjp backward must return cotangents typed like the primals. Where a primal was
  invariant over an axis but its cotangent came out varying (a replicated weight used by
  every rank), the true cotangent is the sum over that axis."""
  if not ji.check_vma_enabled():
    return ct
  extra = tuple(ji.varying_axes(jax.typeof(ct)) - ji.varying_axes(jax.typeof(primal)))
  if not extra:
    return ct
  return psum(ct, extra)
