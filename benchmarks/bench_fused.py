"""Fused matmul-collective ops vs their unfused jax.lax forms, the ppermute "collective
matmul" recipe, and the local GEMM alone (the floor a perfectly hidden exchange reaches).
Imported by bench.py; rows: {"op", "impl", "shape", "time_ms", "gemm_only_ms"}.

Each timing runs the op 10 times in a fori_loop inside one jit (the output feeds one element
of the next input, an in-place update), median of 5 calls, divided by 10.
"""
from __future__ import annotations

import time

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl

ITERS = 10


def _timed(mesh, body, args, in_specs, repeats=5):
  """ms per call of body(*args) -> array, chained ITERS times through args[0][0, ...]."""

  def loop(*args):
    def step(_, carry):
      out = body(*carry)
      first = carry[0]
      idx = (0,) * first.ndim
      return (first.at[idx].set(out.reshape(-1)[0].astype(first.dtype)), *carry[1:])
    return jax.lax.fori_loop(0, ITERS, step, args)[0]

  f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=in_specs, out_specs=in_specs[0]))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) / ITERS * 1e3


def _ring_collective_matmul(x, w, n):
  """jax's documented recipe: multiply the block in hand while ppermuting it to the next."""
  r = jax.lax.axis_index("x")
  m = x.shape[0]
  out = jnp.zeros((n, m, w.shape[1]), x.dtype)
  cur = x
  for k in range(n):
    out = jax.lax.dynamic_update_index_in_dim(out, cur @ w, (r + k) % n, axis=0)
    if k < n - 1:
      cur = jax.lax.ppermute(cur, "x", [(i, (i - 1) % n) for i in range(n)])
  return out.reshape(n * m, -1)


def bench_fused(mesh, quick=False):
  n = mesh.shape["x"]
  rng = np.random.default_rng(0)
  bf16 = jnp.bfloat16
  rows = []

  def rnd(*shape, dtype=bf16):
    return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(dtype)

  def record(op, shape, impls, gemm_ms):
    for impl, ms in impls.items():
      rows.append(dict(op=op, impl=impl, shape=shape, time_ms=ms, gemm_only_ms=gemm_ms))
      print(f"  {op:22s} {impl:30s} {shape:26s} {ms:8.3f} ms  (GEMM only {gemm_ms:.3f}, "
            f"x{ms / gemm_ms:.2f})", flush=True)

  k_dim = n_dim = 1024 if quick else 8192
  for m_total in ([256] if quick else [4096, 16384]):
    shape = f"M={m_total},K={k_dim},N={n_dim}"
    # Column-parallel: x rows sharded, w columns sharded; per device [M, K] @ [K, N/n].
    x = rnd(m_total, k_dim)
    w = rnd(k_dim, n_dim)
    specs = (P("x"), P(None, "x"))
    gemm = _timed(mesh, lambda xf, w: xf @ w, (np.tile(x, (n, 1)), w), specs)
    record("all_gather_matmul", shape, {
        "jax_hoccl.all_gather_matmul": _timed(
            mesh, lambda x, w: jax_hoccl.all_gather_matmul(x, w, "x"), (x, w), specs),
        "jax.lax all_gather+matmul": _timed(
            mesh, lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w, (x, w), specs),
        "jax.lax ppermute ring recipe": _timed(
            mesh, lambda x, w: _ring_collective_matmul(x, w, n), (x, w), specs),
    }, gemm)
    # Row-parallel: x columns sharded, w rows sharded; per device [M, K/n] @ [K/n, N].
    x = rnd(m_total, k_dim)
    w = rnd(k_dim, n_dim)
    specs = (P(None, "x"), P("x"))
    gemm = _timed(mesh, lambda x, w: x @ w, (x, w), specs)
    # matmul_psum's default piece schedule, and equal pieces for comparison (per rank block).
    sweep = [] if quick else [2, 4, 8]
    # GEMM alone: the mean of a run before and after these rows (H200 clocks drift by up to
    # 10% over a minute of GEMMs at M=16384; both runs are printed).
    impls_rs = {
        "jax_hoccl.matmul_reduce_scatter": _timed(
            mesh, lambda x, w: jax_hoccl.matmul_reduce_scatter(x, w, "x"), (x, w), specs),
        "jax.lax matmul+psum_scatter": _timed(
            mesh, lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True), (x, w), specs),
    }
    impls_ps = {
        "jax_hoccl.matmul_psum": _timed(
            mesh, lambda x, w: jax_hoccl.matmul_psum(x, w, "x"), (x, w), specs),
        **{f"jax_hoccl.matmul_psum chunks={c}": _timed(
            mesh, lambda x, w, c=c: jax_hoccl.matmul_psum(x, w, "x", chunks=c),
            (x, w), specs) for c in sweep},
        **({} if quick else {"jax_hoccl.matmul_psum chunks=1/2,1/4,1/8,1/8": _timed(
            mesh, lambda x, w, b=m_total // n: jax_hoccl.matmul_psum(
                x, w, "x", chunks=(b // 2, b // 4, b // 8, b // 8)), (x, w), specs)}),
        "jax.lax matmul+psum": _timed(
            mesh, lambda x, w: jax.lax.psum(x @ w, "x"), (x, w), specs),
    }
    gemm_after = _timed(mesh, lambda x, w: x @ w, (x, w), specs)
    print(f"  GEMM only before/after: {gemm:.3f} / {gemm_after:.3f} ms", flush=True)
    gemm = (gemm + gemm_after) / 2
    record("matmul_reduce_scatter", shape, impls_rs, gemm)
    record("matmul_psum", shape, impls_ps, gemm)


  # GEMV shapes (decode): psum of a [M, K/n] @ [K/n, N] partial product.
  for m in ([1, 16] if quick else [1, 16, 64]):
    x, w = rnd(m, k_dim), rnd(k_dim, n_dim)
    specs = (P(None, "x"), P("x"))
    gemm = _timed(mesh, lambda x, w: x @ w, (x, w), specs)
    record("matmul_psum", f"GEMV M={m},K={k_dim},N={n_dim}", {
        "jax_hoccl.matmul_psum": _timed(
            mesh, lambda x, w: jax_hoccl.matmul_psum(x, w, "x"), (x, w), specs),
        "jax.lax matmul+psum": _timed(
            mesh, lambda x, w: jax.lax.psum(x @ w, "x"), (x, w), specs),
    }, gemm)

  # MoE combine: per device x [n, E, C, H] (tokens of every rank for my E experts), w [E, H, D].
  e, c, h, d = (2, 64, 256, 256) if quick else (4, 2048, 4096, 4096)
  x, w = rnd(n * n, e, c, h), rnd(n * e, h, d)
  specs = (P("x"), P("x"))
  shape = f"E={e}/dev,C={c},H={h},D={d}"
  gemm = _timed(mesh, lambda x, w: jnp.matmul(x, w), (x, w), specs)
  record("matmul_all_to_all", shape, {
      "jax_hoccl.matmul_all_to_all": _timed(
          mesh, lambda x, w: jax_hoccl.matmul_all_to_all(x, w, "x"), (x, w), specs),
      "jax.lax matmul+all_to_all": _timed(
          mesh, lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w), "x", 0, 0, tiled=True), (x, w),
          specs),
  }, gemm)

  # DLRM embeddings: per device a table [V, D] f32 and ids [n, B, L] of every rank's samples.
  v, dim, b, l = (1000, 16, 64, 4) if quick else (1 << 20, 128, 65536, 20)
  table = rng.standard_normal((n * v, dim), dtype=np.float32)
  ids = rng.integers(0, v, (n * n, b, l)).astype(np.int32)
  specs = (P("x"), P("x"))
  shape = f"V={v},D={dim},B={b},L={l}"
  lookup = lambda t, i: jnp.take(t, i, axis=0).sum(-2)
  gemm = _timed(mesh, lookup, (table, ids), specs)  # "GEMM only" = the local lookup alone
  record("embedding_all_to_all", shape, {
      "jax_hoccl.embedding_all_to_all": _timed(
          mesh, lambda t, i: jax_hoccl.embedding_all_to_all(t, i, "x"), (table, ids), specs),
      "jax.lax lookup+all_to_all": _timed(
          mesh, lambda t, i: jax.lax.all_to_all(lookup(t, i), "x", 0, 0, tiled=True),
          (table, ids), specs),
  }, gemm)
  return rows
