"""matmul_psum(x, w, axis) == psum(x @ w, axis), pipelined over row chunks: the partial
product of chunk i is gathered from every rank (copy engines) while XLA computes chunk i+1,
then summed in a fixed order (f32 accumulation for bf16/f16). One chunk for GEMV shapes
(decode: M = 1..64), where the cost is the handshake latency, not bandwidth.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src.ops import async_collectives as ac
from jax_hoccl._src.ops import common

MIN_CHUNK_BYTES = 4 << 20  # below this a chunk's copies are latency-bound: don't split


def default_chunks(rows: int, out_row_bytes: int) -> int:
  for c in (4, 2):
    if rows % c == 0 and rows // c * out_row_bytes >= MIN_CHUNK_BYTES:
      return c
  return 1


def multiply_and_sum(x, w, axes, n, chunks):
  if chunks == 1:
    # Nothing to overlap (GEMV / small shapes): the synchronous one-shot psum moves the same
    # bytes without the async stream's fork and events.
    from jax_hoccl._src.ops.psum import psum, psum_algorithm
    with psum_algorithm("one_shot"):
      return psum(x @ w, axes)
  rows = x.shape[0] // chunks
  sums, previous = [], None
  for i in range(chunks):
    xi = x[i * rows:(i + 1) * rows]
    if previous is not None:
      xi = previous.after_start(xi)  # multiply chunk i while chunk i-1 is in flight
    part = xi @ w
    if previous is not None:
      got, part = ac.done(previous, part)
      sums.append(common.sum_leading(got))
    previous = ac.all_gather_start(part, axes, to="invariant")  # [n, rows, ..., N], rank order
  got, = ac.done(previous)
  sums.append(common.sum_leading(got))
  return sums[0] if chunks == 1 else jnp.concatenate(sums, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mmps(x, w, axis_name, chunks):
  axes, n = axes_lib.check_axes(axis_name, "matmul_psum")
  return multiply_and_sum(x, w, axes, n, chunks)


def _mmps_fwd(x, w, axis_name, chunks):
  return _mmps(x, w, axis_name, chunks), (x, w)


def _mmps_bwd(axis_name, chunks, res, ct):
  x, w = res
  axes, _ = axes_lib.check_axes(axis_name, "matmul_psum")
  from jax_hoccl._src import jax_internals as ji
  from jax_hoccl._src.ops.psum import psum
  # psum's transpose: a typed-invariant cotangent is the same everywhere (pbroadcast);
  # an untyped one may differ per rank and must be summed (DESIGN.md).
  ct = jax.lax.pcast(ct, tuple(axes), to="varying") if ji.check_vma_enabled() else psum(ct, axes)
  k, nout = w.shape
  dx = ct @ w.T
  dw = x.reshape(-1, k).T @ ct.reshape(-1, nout)
  return common.cotangent_like(dx, x), common.cotangent_like(dw, w)


_mmps.defvjp(_mmps_fwd, _mmps_bwd)


def matmul_psum(x, w, axis_name, *, chunks=None):
  """psum(x @ w, axis_name) for x [M, ..., K] (K sharded over the axis) and w [K, N];
  returns [M, ..., N], invariant over the axis. `chunks` splits M for pipelining (default:
  by size; 1 for small/GEMV shapes). Call inside shard_map."""
  axes, n = axes_lib.check_axes(axis_name, "matmul_psum")
  x, w = jnp.asarray(x), jnp.asarray(w)
  if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"jax_hoccl.matmul_psum: needs x [M, ..., K] and w [K, N], got "
                     f"{x.shape} and {w.shape}.")
  axes_lib.check_dtype(x, "matmul_psum", summable=True)
  if x.ndim == 1:
    return matmul_psum(x[None], w, axis_name, chunks=chunks)[0]
  out_row_bytes = int(jnp.dtype(x.dtype).itemsize) * w.shape[1] * int(
      functools.reduce(lambda a, b: a * b, x.shape[1:-1], 1))
  chunks = chunks or default_chunks(x.shape[0], out_row_bytes)
  if x.shape[0] % chunks:
    raise ValueError(f"jax_hoccl.matmul_psum: chunks={chunks} does not divide M={x.shape[0]}.")
  return _mmps(common.ensure_varying(x, axes), w, axes, int(chunks))
