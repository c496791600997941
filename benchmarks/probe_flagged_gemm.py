"""The flagged GEMM alone against XLA's dot on one GPU (CUPTI kernel time, median of 20), and
the stream memory-op reaction time (a cuStreamWaitValue32 released by a write on another
stream), which is how long after a block's flag its copy can start."""
import statistics, sys
import numpy as np, jax, jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler
from jax_hoccl._src.fused import flagged_gemm as fg

def t(f, *args, it=20):
  out, ts = profiler.measure(f, iterations=it)(*args)
  return statistics.median(ts) * 1e3, out   # us

shapes = [(4096, 8192, 8192), (16384, 8192, 8192), (4096, 4096, 8192)]
if len(sys.argv) > 1: shapes = shapes[:int(sys.argv[1])]
for m, k, n in shapes:
  a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16) / np.sqrt(k)
  tx, ref = t(jax.jit(lambda a, b: a @ b), a, b)
  out = jnp.zeros((m, n), jnp.bfloat16); flags = jnp.zeros((m // 1024,), jnp.int32)
  f = jax.jit(lambda a, b, o, fl: fg.flagged_matmul_into(a, b, o, fl, flag_rows=1024))
  tf, _ = t(f, a, b, out, flags)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  print(f"GEMM M={m} K={k} N={n}: xla {tx:.1f} us, flagged {tf:.1f} us, speed {tx/tf:.3f}x xla, max err {err:.3f}", flush=True)
