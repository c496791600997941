"""rows_matmul (cuBLASLt through pointer offsets) against XLA's dot on one GPU: the whole GEMM,
and the fused ring's last step (pieces of x's rows, each plus a received partial, written
into one output) done both ways. Ratios to XLA's whole GEMM, interleaved rounds.

    python3 benchmarks/probe_rows_matmul.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax_hoccl.bench.fused import _paired  # noqa: E402
from jax_hoccl._src.fused.row_pieces.rows_matmul import rows_matmul  # noqa: E402


def main():
  os.environ["JAX_HOCCL_CUBLASLT"] = "1"
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  rng = np.random.default_rng(0)
  quick = "--quick" in sys.argv  # tiny shapes: checks the script itself (CPU)
  k, n = (64, 128) if quick else (4096, 8192)
  for m in ((256,) if quick else (4096, 16384)):
    x = (rng.standard_normal((m, k), dtype=np.float32) * 0.05).astype(jnp.bfloat16)
    w = (rng.standard_normal((k, n), dtype=np.float32) * 0.05).astype(jnp.bfloat16)
    c = (rng.standard_normal((m, n), dtype=np.float32)).astype(jnp.bfloat16)
    specs = (P("x"), P(), P())  # x varying over the (1-device) axis, as in the fused ops

    def ours_pieces(p):
      r = m // p

      def f(x, w, c):
        out = None
        for i in range(p):
          out = rows_matmul(x, w, ("x",), 1, shift=0, block_rows=m, piece_row0=i * r, rows=r,
                            c=c[i * r:(i + 1) * r] if i else c[:r], into=out, out_rows=m,
                            out_row0=i * r)
        return out
      return f

    def xla_pieces(p):
      r = m // p

      def f(x, w, c):
        i0 = jax.lax.axis_index("x")  # traced offsets, as the ring's (always 0 here)
        return jnp.concatenate([
            jax.lax.dynamic_slice_in_dim(x, i0 + i * r, r) @ w + c[i * r:(i + 1) * r]
            for i in range(p)])
      return f

    impls = {"rows_matmul whole": lambda x, w, c: rows_matmul(
        x, w, ("x",), 1, shift=0, block_rows=m, piece_row0=0, rows=m)}
    for p in (2, 4, 8):
      impls[f"rows_matmul {p} pieces +c into"] = ours_pieces(p)
      impls[f"XLA {p} pieces +c concat"] = xla_pieces(p)
    res, gemm = _paired(mesh, lambda x, w, c: x @ w, (x, w, c), impls, (x, w, c), specs)
    print(f"M={m} K={k} N={n} bf16: XLA GEMM {gemm:.3f} ms", flush=True)
    for name, (ms, ratio) in res.items():
      print(f"  {name:32s} {ms:8.3f} ms  x{ratio:.3f}", flush=True)


if __name__ == "__main__":
  main()
