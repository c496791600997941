"""Where a fused op's time goes on GPU: its time next to the GEMM alone, and the order XLA
scheduled its instructions in (custom calls, GEMMs, copies, fusions), one line each.

    python3 benchmarks/probe_fused.py matmul_psum 2      # op, chunks
"""
from __future__ import annotations

import os
import re
import sys

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_hoccl  # noqa: E402
from bench_fused import _paired  # noqa: E402


def schedule(text):
  """The scheduled ops of the biggest computation, compressed to kind:name lines."""
  comps, cur = {}, None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m:
      cur = comps.setdefault(m.group(1), [])
      continue
    if cur is not None and " = " in line:
      rest = line.split(" = ", 1)[1]
      if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
          depth += ch == "("
          depth -= ch == ")"
          if depth == 0:
            break
        shape, rest = rest[:i + 1], rest[i + 1:]
      else:
        shape, _, rest = rest.partition(" ")
      op = re.match(r"\s*([\w\-]+)\(", rest)
      tgt = re.search(r'custom_call_target="([^"]+)"', line)
      if op and op.group(1) not in ("parameter", "get-tuple-element", "constant", "tuple",
                                    "bitcast", "opt-barrier"):
        name = line.split(" = ", 1)[0].split()[-1]
        cur.append(f"{op.group(1)}:{tgt.group(1) if tgt else ''} {shape} {name}")
  return max(comps.values(), key=lambda c: sum("custom-call" in l for l in c))


def main():
  op, chunks = sys.argv[1], eval(sys.argv[2]) if len(sys.argv) > 2 else None
  m_total = int(os.environ.get("PROBE_M", 4096))
  k = int(os.environ.get("PROBE_K", 8192))
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",))
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((m_total, k), dtype=np.float32) * 0.05).astype(jnp.bfloat16)
  w = (rng.standard_normal((k, k), dtype=np.float32) * 0.05).astype(jnp.bfloat16)
  specs = (P(None, "x"), P("x"))
  fn = getattr(jax_hoccl, op)
  kw = {"chunks": chunks} if op == "matmul_psum" else {}
  body = lambda x, w: fn(x, w, "x", **kw)  # noqa: E731
  (res, gemm), = [_paired(mesh, lambda x, w: x @ w, (x, w), {"op": body}, (x, w), specs)]
  ms, ratio = res["op"]
  print(f"{op} chunks={chunks} M={m_total}: {ms:.3f} ms, GEMM {gemm:.3f} ms, x{ratio:.3f}")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()
                            if op == "matmul_psum" else P("x"), check_vma=False))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  text = f.lower(*args).compile().as_text()
  if os.environ.get("JAX_HOCCL_PROFILE"):  # host time in the handlers, per call of the op
    import time
    from jax_hoccl import _hoccl
    jax.block_until_ready(f(*args))
    _hoccl.host_profile(reset=True)
    t0, calls = time.perf_counter(), 10
    for _ in range(calls):
      jax.block_until_ready(f(*args))
    wall = (time.perf_counter() - t0) / calls
    prof = _hoccl.host_profile(reset=True)
    print(f"  host per call ({wall * 1e6:.0f} us wall, per device): " + "  ".join(
        f"{ph}={c // (calls * len(devices))}x{ns / 1e3 / c:.1f}us" for ph, c, ns in prof))
  for line in schedule(text):
    print("   ", line)


if __name__ == "__main__":
  main()
