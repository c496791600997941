"""Fused matmul-collective ops vs their unfused jax.lax forms, the ppermute "collective
matmul" recipe, and the local GEMM alone (the floor a perfectly hidden exchange reaches).
The fused section of `python -m jax_hoccl.bench`; rows: {"op", "impl", "shape", "time_ms", "gemm_only_ms", "ratio"}.

Each timing runs the op 10 times in a fori_loop inside one jit (the output feeds one element
of the next input, an in-place update), divided by 10. The GEMM alone and every variant of a
shape are timed in interleaved rounds (GEMM, A, B, ..., GEMM, A, B, ...): H200 clocks drift by
up to 10% over a minute of GEMMs, so `ratio` is the median over rounds of (variant / the GEMM
of the same round), and the times are medians over rounds.
"""
from __future__ import annotations

import functools
import os
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl
from jax_hoccl._src.ops import common

ITERS = 10
ROUNDS = 7
# per device: MoE x [n, E, C, H] (tokens of every rank for my E experts) @ w [E, H, D];
# DLRM: a table shard [V, D] f32, ids [n, B, L] (L ids per sample) of every rank's samples
MOE_ECHD = (4, 2048, 4096, 4096)
EMBEDDING_VDBL = (1 << 20, 128, 65536, 20)


def embedding_lookup(table, ids):
  """The local pooled lookup (embedding_all_to_all's compute, jax.numpy only)."""
  return jnp.take(table, ids, axis=0).sum(-2)


def looped(mesh, body, in_specs):
  """jit of body chained ITERS times through args[0][0, ...] (each call depends on the last).
  Every call's whole output is carried to the next iteration and the last one returned: with
  only the element that feeds the next call used, XLA shrank an op's trailing elementwise work
  (matmul_reduce_scatter's sum) to that one element, and its cost vanished from the timing."""

  varying = functools.partial(common.ensure_varying, axes=tuple(mesh.axis_names), op="bench")

  def loop(*args):
    def step(_, carry):
      args, _ = carry
      out = body(*args)
      first = args[0]
      idx = (0,) * first.ndim
      return (first.at[idx].set(out.reshape(-1)[0].astype(first.dtype)), *args[1:]), varying(out)
    shape = jax.eval_shape(body, *args)
    init = varying(jnp.zeros(shape.shape, shape.dtype))
    _, out = jax.lax.fori_loop(0, ITERS, step, (args, init))
    return out[None]  # one per device

  return jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=in_specs,
                               out_specs=P(tuple(mesh.axis_names))))


def _compiled(mesh, body, args, in_specs):
  """A no-argument callable: one timed call (seconds) of body chained ITERS times through
  args[0][0, ...], compiled and warmed up."""
  f = looped(mesh, body, in_specs)
  # each process makes its own shards (device_put of a host array across processes would check
  # it with a collective of XLA's, which refuses ranks sharing a GPU)
  args = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, s), lambda i, a=a: a[i])
          for a, s in zip(args, in_specs)]
  jax.block_until_ready(f(*args))

  def once():
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0
  return once


def _paired(mesh, gemm_body, gemm_args, impls, args, in_specs, rounds=ROUNDS):
  """({impl: (ms, ratio)}, gemm ms): the GEMM alone and each impl timed in interleaved
  rounds; ratio = median over rounds of impl / GEMM of the same round."""
  gemm = _compiled(mesh, gemm_body, gemm_args, in_specs)
  runs = {}
  for name, body in impls.items():
    env = {}
    if isinstance(body, tuple):  # (body, environment to lower it under)
      body, env = body
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
      runs[name] = _compiled(mesh, body, args, in_specs)
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
  g_t, t = [], {name: [] for name in impls}
  for _ in range(rounds):
    g_t.append(gemm())
    for name, run in runs.items():
      t[name].append(run())
  ms = lambda ts: float(np.median(ts)) / ITERS * 1e3  # noqa: E731
  out = {name: (ms(ts), float(np.median(np.array(ts) / np.array(g_t)))) for name, ts in t.items()}
  return out, ms(g_t)


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

  def record(op, shape, gemm_body, gemm_args, impls, args, specs):
    results, gemm_ms = _paired(mesh, gemm_body, gemm_args, impls, args, specs)
    for impl, (ms, ratio) in results.items():
      rows.append(dict(op=op, impl=impl, shape=shape, time_ms=ms, gemm_only_ms=gemm_ms,
                       ratio=ratio))
      print(f"  {op:22s} {impl:34s} {shape:26s} {ms:8.3f} ms  (GEMM only {gemm_ms:.3f}, "
            f"x{ratio:.2f})", flush=True)

  k_dim = n_dim = 1024 if quick else 8192
  for m_total in ([256] if quick else [4096, 16384]):
    shape = f"M={m_total},K={k_dim},N={n_dim}"
    # Column-parallel: x rows sharded, w columns sharded; per device [M, K] @ [K, N/n].
    x = rnd(m_total, k_dim)
    w = rnd(k_dim, n_dim)
    specs = (P("x"), P(None, "x"))
    record("all_gather_matmul", shape, lambda xf, w: xf @ w, (np.tile(x, (n, 1)), w), {
        "jax_hoccl.all_gather_matmul": lambda x, w: jax_hoccl.all_gather_matmul(x, w, "x"),
        "jax.lax all_gather+matmul": lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w,
        "jax.lax ppermute ring recipe": lambda x, w: _ring_collective_matmul(x, w, n),
    }, (x, w), specs)
    # Row-parallel: x columns sharded, w rows sharded; per device [M, K/n] @ [K/n, N].
    x = rnd(m_total, k_dim)
    w = rnd(k_dim, n_dim)
    specs = (P(None, "x"), P("x"))
    record("matmul_reduce_scatter", shape, lambda x, w: x @ w, (x, w), {
        "jax_hoccl.matmul_reduce_scatter":
            lambda x, w: jax_hoccl.matmul_reduce_scatter(x, w, "x"),
        **({} if quick else {
            f"jax_hoccl.matmul_reduce_scatter chunks={c}":
                lambda x, w, c=c: jax_hoccl.matmul_reduce_scatter(x, w, "x", chunks=c)
            for c in (2, 4)}),
        **({} if quick else {"jax_hoccl.matmul_reduce_scatter JAX_HOCCL_CUBLASLT=0 (send+sum)": (
            lambda x, w: jax_hoccl.matmul_reduce_scatter(x, w, "x"),
            {"JAX_HOCCL_CUBLASLT": "0"})}),
        "jax.lax matmul+psum_scatter": lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True),
    }, (x, w), specs)
    # matmul_psum's default piece schedule, then other schedules for comparison (the rows of
    # a rank's block b = M/n: equal pieces, and halving ones).
    b = m_total // n
    sweep = {} if quick else {"2": 2, "4": 4, "b/2,b/4,b/8,b/8": (b // 2, b // 4, b // 8, b // 8)}
    record("matmul_psum", shape, lambda x, w: x @ w, (x, w), {
        "jax_hoccl.matmul_psum": lambda x, w: jax_hoccl.matmul_psum(x, w, "x"),
        **{f"jax_hoccl.matmul_psum chunks={name}":
           (lambda x, w, c=c: jax_hoccl.matmul_psum(x, w, "x", chunks=c))
           for name, c in sweep.items()},
        **({} if quick else {"jax_hoccl.matmul_psum JAX_HOCCL_CUBLASLT=0 (XLA's dots)": (
            lambda x, w: jax_hoccl.matmul_psum(x, w, "x"),
            {"JAX_HOCCL_CUBLASLT": "0"})}),
        "jax.lax matmul+psum": lambda x, w: jax.lax.psum(x @ w, "x"),
    }, (x, w), specs)

  # GEMV shapes (decode): psum of a [M, K/n] @ [K/n, N] partial product.
  for m in ([1, 16] if quick else [1, 16, 64]):
    x, w = rnd(m, k_dim), rnd(k_dim, n_dim)
    specs = (P(None, "x"), P("x"))
    record("matmul_psum", f"GEMV M={m},K={k_dim},N={n_dim}", lambda x, w: x @ w, (x, w), {
        "jax_hoccl.matmul_psum": lambda x, w: jax_hoccl.matmul_psum(x, w, "x"),
        "jax.lax matmul+psum": lambda x, w: jax.lax.psum(x @ w, "x"),
    }, (x, w), specs)

  # MoE combine: per device x [n, E, C, H] (tokens of every rank for my E experts), w [E, H, D].
  e, c, h, d = (2, 64, 256, 256) if quick else MOE_ECHD
  x, w = rnd(n * n, e, c, h), rnd(n * e, h, d)
  specs = (P("x"), P("x"))
  record("matmul_all_to_all", f"E={e}/dev,C={c},H={h},D={d}",
         lambda x, w: jnp.matmul(x, w), (x, w), {
             "jax_hoccl.matmul_all_to_all": lambda x, w: jax_hoccl.matmul_all_to_all(x, w, "x"),
             "jax.lax matmul+all_to_all": lambda x, w: jax.lax.all_to_all(
                 jnp.matmul(x, w), "x", 0, 0, tiled=True),
         }, (x, w), specs)

  # DLRM embeddings: per device a table [V, D] f32 and ids [n, B, L] of every rank's samples.
  v, dim, b, l = (1000, 16, 64, 4) if quick else EMBEDDING_VDBL
  table = rng.standard_normal((n * v, dim), dtype=np.float32)
  ids = rng.integers(0, v, (n * n, b, l)).astype(np.int32)
  specs = (P("x"), P("x"))
  # "GEMM only" here = the local lookup alone
  record("embedding_all_to_all", f"V={v},D={dim},B={b},L={l}", embedding_lookup, (table, ids), {
      "jax_hoccl.embedding_all_to_all":
          lambda t, i: jax_hoccl.embedding_all_to_all(t, i, "x"),
      "jax.lax lookup+all_to_all":
          lambda t, i: jax.lax.all_to_all(embedding_lookup(t, i), "x", 0, 0, tiled=True),
  }, (table, ids), specs)
  return rows
