"""vmap of a fused op as more rows of one call:

    batch_as_rows(fn, x, w) == fn(x, w), and under jax.vmap == jax.vmap(fn)(x, w)

Batched primitive by primitive, a fused op's GEMMs would become XLA's ops (rows_matmul's
batching rule) writing into a buffer that async copies are still filling (matmul_psum's
in-place gathers, matmul_all_to_all's received blocks), and XLA may copy such a buffer:
the copies in flight would then land in the dropped one. So the fused ops' vmap moves the
batch in among the rows their pipeline already handles and runs the op once, unbatched
(also one cuBLASLt GEMM per piece instead of XLA's per-example ops). A weight per example
runs the op once per example.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.custom_batching  # noqa: F401 (jax.custom_batching.custom_vmap)
import jax.numpy as jnp

from jax_hoccl._src import explicit_axes


def batch_as_rows(fn: Callable, x, w, *, axis: int | None = 1, merge: bool = False):
  """fn(x, w); under vmap x's batch goes to `axis` of x (merged into the axis behind it with
  merge=True), fn runs once, and the output's batch comes back from the same place. fn must
  treat that axis as more rows: its result keeps x's leading axes. axis=None: one call per
  example."""
  @jax.custom_batching.custom_vmap
  def f(x, w):
    return fn(x, w)

  @f.def_vmap
  def rule(axis_size, in_batched, x, w):
    x_batched, w_batched = in_batched
    # A batch sharded over an Explicit axis: slices and reshapes of it need it whole first;
    # the result's batch is sharded as x's again (as jax.lax's would be).
    batch_spec = explicit_axes.leading_spec(x if x_batched else w)
    x, w = explicit_axes.unsharded((x, w))
    y, batched = batched_rule(axis_size, x_batched, w_batched, x, w)
    return explicit_axes.with_leading_spec(y, batch_spec), batched

  def batched_rule(axis_size, x_batched, w_batched, x, w):
    if w_batched or axis is None:  # one call per example
      xs = x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
      return jnp.stack([f(xs[i], w[i]) for i in range(axis_size)]), True
    xb = jnp.moveaxis(x, 0, axis)
    if merge:
      xb = xb.reshape(*xb.shape[:axis], -1, *xb.shape[axis + 2:])
    y = f(xb, w)
    if merge:
      y = y.reshape(*y.shape[:axis], axis_size, -1, *y.shape[axis + 1:])
    return jnp.moveaxis(y, axis, 0), True

  return f(x, w)
