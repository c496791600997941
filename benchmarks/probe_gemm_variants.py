"""The flagged GEMM's tuning constants swept against XLA's dot on one GPU (CUPTI kernel time;
three interleaved rounds of 20 calls, medians): wgmma kept in flight across k-steps, a cluster
of two CTAs sharing w by multicast, and where the previous tile's flag is raised. `--lower`
only lowers every variant for CUDA (no GPU needed)."""
import statistics, sys
import numpy as np, jax, jax.numpy as jnp
from jax_hoccl._src.fused import flagged_gemm as fg

VARIANTS = {  # name: (WGMMA_IN_FLIGHT, CLUSTER_M, FLAG_STEP, flags)
    "base": (0, 1, None, True), "base noflags": (0, 1, None, False),
    "inflight1": (1, 1, None, True), "inflight1 noflags": (1, 1, None, False),
    "inflight1 step2": (1, 1, 2, True), "inflight1 step8": (1, 1, 8, True),
    "cluster2": (0, 2, None, True), "cluster2 inflight1": (1, 2, None, True),
    "cluster2 inflight1 step8": (1, 2, 8, True), "cluster2 inflight1 noflags": (1, 2, None, False),
}
SHAPES = [(4096, 8192, 8192), (16384, 8192, 8192), (4096, 4096, 8192)]


def build(variant, m):
  inflight, cluster, step, flags = VARIANTS[variant]
  saved = fg.WGMMA_IN_FLIGHT, fg.CLUSTER_M, fg.FLAG_STEP, fg._raise_flag
  fg.WGMMA_IN_FLIGHT, fg.CLUSTER_M, fg.FLAG_STEP = inflight, cluster, step
  if not flags:
    fg._raise_flag = lambda *a, **k: None
  f = jax.jit(lambda a, b, o, fl: fg.flagged_matmul(a, b, out=o, flags=fl, flag_rows=1024))
  return f, saved


def restore(saved):
  fg.WGMMA_IN_FLIGHT, fg.CLUSTER_M, fg.FLAG_STEP, fg._raise_flag = saved


def lower_only():
  fg._on_hopper = lambda: True
  fg._sm_count = lambda: 132
  for v in VARIANTS:
    f, saved = build(v, 4096)
    s = jax.ShapeDtypeStruct
    f.trace(s((1024, 512), jnp.bfloat16), s((512, 512), jnp.bfloat16),
            s((1024, 512), jnp.bfloat16), s((1,), jnp.int32)).lower(lowering_platforms=("cuda",))
    restore(saved)
    print("lowered", v)


def main():
  from jax.experimental.mosaic.gpu import profiler
  t = lambda f, *args: statistics.median(profiler.measure(f, iterations=20)(*args)[1]) * 1e3
  for m, k, n in SHAPES:
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    xla = jax.jit(lambda a, b: a @ b)
    ref = xla(a, b).astype(jnp.float32)
    fns = {}
    for v in VARIANTS:
      out = jnp.zeros((m, n), jnp.bfloat16); flags = jnp.zeros((m // 1024,), jnp.int32)
      f, saved = build(v, m)
      try:
        f(a, b, out, flags).block_until_ready()
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
        fns[v] = (f, out, flags, err)
      except Exception as e:  # a variant that does not compile is reported, not fatal
        print(f"  {v}: failed: {str(e).splitlines()[0][:200]}", flush=True)
      restore(saved)
    times = {v: [] for v in ["xla", *fns]}
    for _ in range(3):
      times["xla"].append(t(xla, a, b))
      for v, (f, out, flags, _) in fns.items():
        times[v].append(t(f, a, b, out, jnp.zeros_like(flags)))
    x = statistics.median(times["xla"])
    print(f"M={m} K={k} N={n}: xla {x:.1f} us", flush=True)
    for v, (_, _, _, err) in fns.items():
      tv = statistics.median(times[v])
      spread = (max(times[v]) - min(times[v])) / tv
      print(f"  {v:28s} {tv:8.1f} us  {x / tv:.3f}x xla  (rounds spread {spread:.1%}, "
            f"max|diff| {err:.3g})", flush=True)


if __name__ == "__main__":
  lower_only() if "--lower" in sys.argv else main()
