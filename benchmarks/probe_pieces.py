"""What splitting a GEMM into row pieces costs under XLA on one GPU: the numbers the fused
ops' schedules are designed from (piece count, slicing x, an accumulate epilogue, concat).

    python3 benchmarks/probe_pieces.py      # prints one line per variant, ratio to the full GEMM
"""
from __future__ import annotations

import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

ITERS = 10


def timed(body, *args, repeats=5):
  """ms per call of body(*args) -> list of arrays, chained through args[0][0, 0]."""

  def loop(*args):
    def step(_, carry):
      outs = body(*carry)
      s = sum(o.reshape(-1)[0].astype(jnp.float32) for o in outs)
      return (carry[0].at[0, 0].set(s.astype(carry[0].dtype)), *carry[1:])
    return jax.lax.fori_loop(0, ITERS, step, args)[0]

  f = jax.jit(loop)
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) / ITERS * 1e3, f


def main():
  k, n_out = (256, 512) if "--quick" in sys.argv else (4096, 8192)
  rng = np.random.default_rng(0)
  for m in ((256,) if "--quick" in sys.argv else (4096, 16384)):
    x = jnp.asarray(rng.standard_normal((m, k), np.float32) * 0.05, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n_out), np.float32) * 0.05, jnp.bfloat16)
    acc = jnp.asarray(rng.standard_normal((m, n_out), np.float32), jnp.bfloat16)
    full, _ = timed(lambda x, w: [x @ w], x, w)
    print(f"M={m} K={k} N={n_out}: full GEMM {full:.3f} ms", flush=True)

    def row(name, body, *args):
      ms, f = timed(body, *args)
      hlo = f.lower(*args).compile().as_text()
      kinds = sorted({t for t in ("cublas", "triton_gemm", "__cublas$lt", "custom-call")
                      if t in hlo})
      print(f"  {name:44s} {ms:8.3f} ms  x{ms / full:.3f}  {','.join(kinds)}", flush=True)

    row("full + acc epilogue", lambda x, w, a: [x @ w + a], x, w, acc)
    row("full + concat copy of output", lambda x, w: [jnp.concatenate([x @ w, x[:1] @ w])], x, w)
    for c in (2, 4, 8):
      r = m // c
      xs = [x[i * r:(i + 1) * r] + 0 for i in range(c)]
      row(f"{c} pieces, x pre-split", lambda w, *xs: [xi @ w for xi in xs], w, *xs)
      row(f"{c} pieces, x sliced in jit",
          lambda x, w: [x[i * r:(i + 1) * r] @ w for i in range(c)], x, w)
      row(f"{c} pieces, sliced, concatenated",
          lambda x, w: [jnp.concatenate([x[i * r:(i + 1) * r] @ w for i in range(c)])], x, w)
      row(f"{c} pieces, sliced, + acc piece",
          lambda x, w, a: [x[i * r:(i + 1) * r] @ w + a[i * r:(i + 1) * r] for i in range(c)],
          x, w, acc)
      accs = [acc[i * r:(i + 1) * r] + 0 for i in range(c)]
      row(f"{c} pieces, sliced, + separate acc arrays",
          lambda x, w, *a: [x[i * r:(i + 1) * r] @ w + a[i] for i in range(c)], x, w, *accs)
    geo = [m // 4, m // 4, m // 4, m // 8, m // 16, m // 16]
    offs = np.cumsum([0] + geo)
    row(f"geometric pieces {geo}",
        lambda x, w: [x[offs[i]:offs[i + 1]] @ w for i in range(len(geo))], x, w)
  print(jax.devices()[0].device_kind, jax.__version__, file=sys.stderr)


if __name__ == "__main__":
  main()
