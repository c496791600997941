"""matmul_psum's GEMV: psum(x @ w) for x of a few rows (decode), as one kernel on CUDA.

The staged psum's packed exchange multiplies its own block (cc/cuda/staged/gemv_psum_kernel.h):
no launch of its own for the GEMV, no product written out and read back, and each column slab
of the product travels to the peers as soon as its CTA has it. Off unless JAX_HOCCL_GEMV_PSUM=1
(docs/design.md, "Decode: the GEMV inside the psum's exchange", says why). Its target,
hoccl_matmul_psum_staged, is picked where the kernel and the packed exchange serve: on CUDA,
bf16 or f16, x [M, K] of at most GEMV_MAX_ROWS rows, K a multiple of 4, N of 64, a block
(M N elements) of at most the packed crossover, a group of at most 16 ranks inside a node,
the sum inside the exchange on (JAX_HOCCL_STAGED_SUM, JAX_HOCCL_STAGED_KERNEL). Elsewhere:
XLA's dot, then the one-shot psum.
"""
from __future__ import annotations

import os

import numpy as np
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import branches
from jax_hoccl._src import ffi_targets
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops.psum import psum_p

# What the kernel multiplies (cc/cuda/staged/gemv_psum_kernel.h: kGemvMaxRows, kGemvSlabCols,
# GemvPsumRefuses).
GEMV_MAX_ROWS = 8
SLAB_COLS = 64
GEMV_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))

gemv_psum_p = ji.Primitive("hoccl_gemv_psum")


def _abstract_eval(x, w, *, axes, axis_size, site):
  product = ji.with_type(x, (x.shape[0], w.shape[1]), ji.varying_axes(x) | ji.varying_axes(w),
                         spec=(ji.spec_of(x)[0], ji.spec_of(w)[1]))
  return common.reduced_type(product, axes, "matmul_psum")


def _unfused(x, w, *, axes, axis_size, site):
  return psum_p.bind(x @ w, axes=axes, axis_size=axis_size, algorithm="one_shot",
                     unreduced=False, site=site, groups=None)


def kernel_takes(ctx, x_aval, w_aval, axes, n) -> bool:
  """Whether hoccl_matmul_psum_staged multiplies these operands in this lowering (the C++
  handler checks the same and refuses the rest)."""
  if os.environ.get("JAX_HOCCL_GEMV_PSUM", "0") != "1":
    return False
  if tuple(ctx.module_context.platforms) != ("cuda",) or not ffi_targets.staged_sums_in_kernel():
    return False
  dtype = np.dtype(x_aval.dtype)
  if dtype not in GEMV_DTYPES or np.dtype(w_aval.dtype) != dtype:
    return False
  (m, k), cols = x_aval.shape, w_aval.shape[1]
  if not all(ji.is_static(d) for d in (m, k, cols)):
    return False
  if not (1 <= m <= GEMV_MAX_ROWS and k % 4 == 0 and cols >= SLAB_COLS and cols % SLAB_COLS == 0):
    return False
  if not 2 <= n <= ffi_targets.KERNEL_MAX_RANKS:
    return False
  block = m * cols * dtype.itemsize
  if block > ffi_targets.packed_limit():  # (at most the staged crossover)
    return False
  mesh = ji.concrete_mesh_from_lowering(ctx, "matmul_psum")
  return not axes_lib.spans_nodes(mesh, axes, "matmul_psum")


def _lowering(ctx, x, w, *, axes, axis_size, site):
  x_aval, w_aval = ctx.avals_in
  with axes_lib.user_op("matmul_psum", site):
    if kernel_takes(ctx, x_aval, w_aval, axes, axis_size):
      attrs = axes_lib.ffi_group_attrs(ctx, axes, "matmul_psum", axes_lib.new_site())
      return ffi_targets.ffi_lower("hoccl_matmul_psum_staged", "matmul_psum", ctx, x, w, **attrs)
  return ji.lower_fun(_unfused, multiple_results=False)(ctx, x, w, axes=axes,
                                                        axis_size=axis_size, site=site)


gemv_psum_p.def_abstract_eval(_abstract_eval)
ji.register_lowering(gemv_psum_p, _lowering)
branches.register(gemv_psum_p)


def gemv_psum(x, w, axes, n):
  """psum(x @ w, axes) for x [M, ..., K] varying over `axes` (n ranks) and w [K, N]."""
  x2 = common.as_rows(x)
  out = gemv_psum_p.bind(x2, w, axes=tuple(axes), axis_size=n, site=axes_lib.new_site())
  return out.reshape(*x.shape[:-1], w.shape[1])
