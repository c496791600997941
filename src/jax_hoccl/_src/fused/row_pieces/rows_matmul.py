"""rows_matmul: the GEMM of a range of rows,

    rows_matmul(x, w, ...) == out.at[y_row0 : y_row0 + rows].set(
                                  x[x_row0 : x_row0 + rows] @ w (+ c))

the GEMM the fused ops' pipelines are built from; x_row0 = ((rank + shift) % n) * block_rows +
piece_row0 picks this rank's rows, y_row0 = out_row0 + ((rank + out_shift) % n) *
out_block_rows the output's. With w [B, K, N] it is a batch of B such GEMMs over consecutive
`rows`-row ranges of x and out (matmul_all_to_all: one per MoE expert).

On GPU, for bf16/f16, it is one cuBLASLt call (cc/cuda/fused/rows_matmul_cuda.cc) that reads
x's rows and writes the output's rows through pointer offsets: no copy of x's rows, `+ c` (a received
partial sum) in the GEMM's epilogue instead of a kernel, and optionally the rows written in
place into a buffer chained from call to call (`into`, so pieces need no concatenate:
matmul_reduce_scatter's ring writes its output that way).
With XLA's own dot matmul_psum paid for the copies and the adds (most of its overhead over
the GEMM alone: docs/design.md). Otherwise (JAX_HOCCL_CUBLASLT=0; CPU; f32 and other
dtypes) it lowers to XLA's dynamic_slice, dot, add and dynamic_update_slice: the same values.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import ffi_lower
from jax_hoccl._src.ops import async_collectives

rows_matmul_p = ji.Primitive("hoccl_rows_matmul")
# f32 stays with XLA's dot: its precision (TF32 or not) is XLA's choice, which a cuBLASLt call
# of ours would not follow; bf16/f16 accumulate in f32 either way.
CUBLASLT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def _abstract_eval(x, w, *rest, axes, axis_size, shift, block_rows, piece_row0, rows, out_rows,
                   out_row0, out_shift, out_block_rows, has_c, has_into, n_after):
  vma = set().union(*(ji.varying_axes(a) for a in (x, w, *rest)))
  if has_into:
    into = rest[int(has_c)]
    return ji.with_type(into, into.shape, vma)
  return ji.with_type(x, (out_rows, w.shape[-1]), vma)


def _reference(x, w, *rest, axes, axis_size, shift, block_rows, piece_row0, rows, out_rows,
               out_row0, out_shift, out_block_rows, has_c, has_into, n_after):
  r = jax.lax.axis_index(axes[0] if len(axes) == 1 else axes)
  start = ((r + shift) % axis_size) * block_rows + piece_row0
  batch = w.shape[0] if w.ndim == 3 else 1
  xs = jax.lax.dynamic_slice_in_dim(x, start, batch * rows, axis=0)
  for token in rest[len(rest) - n_after:]:  # XLA's dot after them: its rows go through `after`
    xs = async_collectives.after(token, xs)
  y = (jnp.matmul(xs.reshape(batch, rows, -1), w).reshape(batch * rows, -1) if w.ndim == 3
       else xs @ w)
  if has_c:
    y = y + rest[0]
  y_row0 = out_row0 + ((r + out_shift) % axis_size) * out_block_rows
  out = rest[int(has_c)] if has_into else jnp.zeros((out_rows, y.shape[1]), y.dtype)
  return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), y_row0, axis=0)


def cublaslt_enabled() -> bool:
  """On unless JAX_HOCCL_CUBLASLT=0 (read when a program is lowered). With XLA's dot + add
  instead, XLA copies x's row slices, runs the adds as separate kernels and merges pieces
  back together (the comparison: docs/design.md, "Row pieces")."""
  return os.environ.get("JAX_HOCCL_CUBLASLT", "1") not in ("", "0")


def runs_on_cublaslt(dtype, k: int, n: int) -> bool:
  """Whether a rows_matmul of x [., k] (dtype) @ w [k, n] is one cuBLASLt call on GPU (rows
  of 16-byte multiples keep every offset row aligned for cuBLASLt's kernels)."""
  return cublaslt_enabled() and np.dtype(dtype) in CUBLASLT_DTYPES and k % 8 == 0 and n % 8 == 0


@functools.cache
def _preload_cublaslt() -> None:
  """cc/cuda/fused/rows_matmul_cuda.cc finds cuBLASLt in the process by soname. XLA loads it for its own
  GEMMs, but a program of ours may run first: load the copy from jax's nvidia wheels (not on
  the default library path) so that it is there. (jax's CUDA plugin needs cuBLASLt, so any
  machine that runs the GPU program has one; the handler says so clearly if not.)"""
  import ctypes
  import glob
  import site
  for root in site.getsitepackages() + [site.getusersitepackages()]:
    for path in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcublasLt.so.*"),
                                 recursive=True)):
      try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        return
      except OSError:
        continue


def _cuda_lowering(ctx, x, w, *rest, axes, axis_size, shift, block_rows, piece_row0, rows,
                   out_rows, out_row0, out_shift, out_block_rows, has_c, has_into, n_after):
  params = dict(axes=axes, axis_size=axis_size, shift=shift, block_rows=block_rows,
                piece_row0=piece_row0, rows=rows, out_rows=out_rows, out_row0=out_row0,
                out_shift=out_shift, out_block_rows=out_block_rows, has_c=has_c,
                has_into=has_into, n_after=n_after)
  k, n_out = ctx.avals_in[1].shape[-2:]
  if not runs_on_cublaslt(ctx.avals_in[0].dtype, k, n_out):
    return ji.lower_fun(_reference, multiple_results=False)(ctx, x, w, *rest, **params)
  _preload_cublaslt()
  attrs = axes_lib.ffi_group_attrs(ctx, axes, "rows_matmul", 0)  # site 0: names no user op
  aliases = {2 + int(has_c): 0} if has_into else {}
  return ffi_lower("hoccl_rows_matmul", "rows_matmul", ctx, x, w, *rest, **attrs,
                   shift=np.int64(shift), block_rows=np.int64(block_rows),
                   piece_row0=np.int64(piece_row0), rows=np.int64(rows),
                   out_row0=np.int64(out_row0), out_shift=np.int64(out_shift),
                   out_block_rows=np.int64(out_block_rows), has_c=np.int64(has_c),
                   lowering_args=dict(operand_output_aliases=aliases))


def _batch(args, dims, **params):
  # Under vmap the rows of one example are not one range of a 2-D x: XLA's ops per example.
  return jax.vmap(functools.partial(_reference, **params), in_axes=tuple(dims))(*args), 0


rows_matmul_p.def_abstract_eval(_abstract_eval)
ji.primitive_batchers[rows_matmul_p] = _batch
ji.register_lowering(rows_matmul_p, ji.lower_fun(_reference, multiple_results=False))
ji.register_lowering(rows_matmul_p, _cuda_lowering, platform="cuda")


def rows_matmul(x, w, axes, n, *, shift, block_rows, piece_row0, rows, c=None, into=None,
                out_rows=None, out_row0=0, out_shift=0, out_block_rows=0, after=()):
  """x [M, K] (2-D), w [K, N] or [B, K, N] (B GEMMs of `rows` rows each). Returns `into`
  with rows [y_row0, y_row0 + B * rows) set (into is donated), or a new [out_rows or B * rows,
  N] array with only those rows defined.

  after: arrays (async starts' tokens) the GEMM is ordered after. They are operands of the
  custom call that it never reads: a data dependency, which no XLA pass drops. (An
  optimization barrier is not one on GPU: XLA removes barriers before it schedules, and it
  hoisted GEMMs above the starts they were meant to follow.)"""
  rest = tuple(a for a in (c, into) if a is not None) + tuple(after)
  batch = w.shape[0] if w.ndim == 3 else 1
  return rows_matmul_p.bind(
      x, w, *rest, axes=tuple(axes), axis_size=int(n), shift=int(shift) % int(n),
      block_rows=int(block_rows), piece_row0=int(piece_row0), rows=int(rows),
      out_rows=int(into.shape[0] if into is not None else (out_rows or batch * rows)),
      out_row0=int(out_row0), out_shift=int(out_shift) % int(n),
      out_block_rows=int(out_block_rows), has_c=c is not None, has_into=into is not None,
      n_after=len(after))
