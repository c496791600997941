"""The flagged GEMM alone against XLA's dot on one GPU (CUPTI kernel time; three interleaved
rounds of 20 calls each, medians), with its flags on and, for reference, with the flag raises
removed (what the flags cost)."""
import statistics
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler
from jax_hoccl._src.fused.flagged import flagged_gemm as fg

def t(f, *args, it=20):
  _, ts = profiler.measure(f, iterations=it)(*args)
  return statistics.median(ts) * 1e3   # us

shapes = [(4096, 8192, 8192), (16384, 8192, 8192), (4096, 4096, 8192)]
for m, k, n in shapes:
  a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  b = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  out = jnp.zeros((m, n), jnp.bfloat16)
  flags = jnp.zeros((m // 1024,), jnp.int32)
  xla = jax.jit(lambda a, b: a @ b)
  flagged = jax.jit(lambda a, b, o, fl: fg.flagged_matmul(a, b, out=o, flags=fl, flag_rows=1024))
  raise_flag = fg._raise_flag
  fg._raise_flag = lambda *a, **k: None
  noflags = jax.jit(lambda a, b, o, fl: fg.flagged_matmul(a, b, out=o, flags=fl, flag_rows=1024))
  noflags(a, b, out, flags).block_until_ready()  # traced while the raises are removed
  fg._raise_flag = raise_flag
  fg.FLAG_SCOPE = "sys"
  sysflags = jax.jit(lambda a, b, o, fl: fg.flagged_matmul(a, b, out=o, flags=fl, flag_rows=1024))
  sysflags(a, b, out, flags).block_until_ready()
  fg.FLAG_SCOPE = "gpu"
  tx, tf, tn, ts = [], [], [], []
  for _ in range(3):
    tx.append(t(xla, a, b))
    tf.append(t(flagged, a, b, out, flags))
    tn.append(t(noflags, a, b, out, flags))
    ts.append(t(sysflags, a, b, out, flags))
  ref = xla(a, b)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  x, f_, n_, s_ = (statistics.median(v) for v in (tx, tf, tn, ts))
  print(f"GEMM M={m} K={k} N={n}: xla {x:.1f} us, flagged {f_:.1f} us = {x/f_:.3f}x xla speed "
        f"(flags removed: {x/n_:.3f}x, sys-scope flags: {x/s_:.3f}x), max |diff| vs xla {err:.3g}", flush=True)
