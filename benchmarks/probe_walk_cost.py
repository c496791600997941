"""What the fused ops' walks of the flagged GEMM cost on one GPU with nothing to wait for: each
walk (fused/flagged/gather_walk.py, fused/flagged/reduce_scatter_walk.py, n = 2 and 4 ranks, rank 0) run with its
ready flags already up, against XLA's dot of the same M x K x N and the plain flagged GEMM
(flags on), and the plain kernel adding into its output (the ring's partial sums). CUPTI kernel time,
three interleaved rounds of 20 calls, medians. What is left over the plain kernel is compute-
side cost that two GPUs cannot hide."""
import statistics
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler
from jax_hoccl._src.fused.flagged import flagged_gemm as fg, gather_walk as gig, reduce_scatter_walk as gr

K = N = 8192
bf = jnp.bfloat16


def t(f, *args):
  return statistics.median(profiler.measure(f, iterations=20)(*args)[1]) * 1e3


def ones_ready(one, count):
  """uint64 flags whose low words are `one` (1), then the tile claims, zero: made inside each
  call from a traced `one`, so every call counts its claims from zero (a constant would be one
  buffer for every call)."""
  return jnp.zeros((fg.ready_words(count),), jnp.int32).at[:2 * count:2].set(one)


def programs(m_total, n):
  key = jax.random.split(jax.random.key(0), 4)
  w = (jax.random.normal(key[0], (K, N), jnp.float32) / np.sqrt(K)).astype(bf)
  x = jax.random.normal(key[1], (m_total, K), bf)
  c = jax.random.normal(key[2], (m_total, N), bf)
  out = jnp.zeros((m_total, N), bf)
  flags = jnp.zeros((m_total // 1024,), jnp.int32)
  p = {"xla dot": (jax.jit(lambda x, w: x @ w), (x, w)),
       "flagged": (jax.jit(lambda x, w, o, f: fg.flagged_matmul(x, w, out=o, flags=f,
                                                                 flag_rows=1024)),
                   (x, w, out, flags)),
       "flagged, adding into out": (jax.jit(lambda x, w, c: fg.flagged_matmul(x, w, out=c,
                                                                               add=True)),
                                    (x, w, c))}
  m = m_total // n
  own, gathered = x[:m], x[m:]
  one = jnp.ones((), jnp.int32)
  count = (n - 1) * m // gig.READY_ROWS
  p[f"all_gather_matmul walk n={n}"] = (jax.jit(
      lambda own, g, w, one: fg.walk_matmul(
          w, [own, g], gig.walk(n), m, result=(n * m, bf), rank=0, ready=ones_ready(one, count),
          ready_rows=gig.READY_ROWS)), (own, gathered, w, one))
  rows = m_total // n
  band = gr.band_rows(rows)
  send = jnp.zeros((rows, N), bf)
  recv = c[:(n - 2) * rows]
  for gather in (False, True):
    name = "matmul_psum" if gather else "matmul_reduce_scatter"
    last = jnp.zeros(((n if gather else 1) * rows, N), bf)
    ring_flags = jnp.zeros((n * rows // band,), jnp.int32)
    bands = (n - 1) * rows // band
    p[f"{name} walk n={n}"] = (jax.jit(
        lambda x, w, s, l, r, f, one, gather=gather: fg.walk_matmul(
            w, [x, s, l] + ([r] if n > 2 else []), gr.walk(n, gather), rows, rank=0,
            ready=ones_ready(one, bands), ready_rows=band, flags=f, flag_rows=band)),
        (x, w, send, last, recv, ring_flags, one))
  return p


def main():
  for m_total in (4096, 16384):
    for n in (2, 4):
      progs = programs(m_total, n)
      if n == 4:  # the plain kernels were measured at n = 2
        progs = {k: v for k, v in progs.items() if "walk" in k or k == "xla dot"}
      for f, args in progs.values():
        jax.block_until_ready(f(*args))
      times = {k: [] for k in progs}
      for _ in range(3):
        for k, (f, args) in progs.items():
          times[k].append(t(f, *args))
      x = statistics.median(times["xla dot"])
      print(f"M={m_total} K={K} N={N}, n={n}:", flush=True)
      for k, v in times.items():
        tv = statistics.median(v)
        print(f"  {k:34s} {tv:8.1f} us  {tv / x:.3f}x XLA's dot time  (rounds spread "
              f"{(max(v) - min(v)) / tv:.1%})", flush=True)


if __name__ == "__main__":
  main()
