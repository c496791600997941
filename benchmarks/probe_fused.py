"""Where a fused op's time goes on GPU: its time next to the GEMM alone, and the order XLA
scheduled its instructions in (custom calls, GEMMs, copies, fusions), one line each.

    python3 benchmarks/probe_fused.py matmul_psum 2      # op, chunks
    python3 benchmarks/probe_fused.py matmul_all_to_all  # or embedding_all_to_all

PROBE_TIMELINE=1 adds device timelines (jax.profiler's trace) of the benchmark's loop of
jax_hoccl.bench.fused.ITERS calls for the GEMM alone, the op and jax.lax's form: every kernel and copy
per GPU and stream in microseconds, then each stream's busy time and the compute stream's idle
time. PROBE_TIMELINE=summary prints only those totals.
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
from jax_hoccl.bench.fused import _paired  # noqa: E402


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


def timeline(f, args, calls=3):
  """Prints the device activity of the last of `calls` calls of f: per GPU, every kernel and
  copy with its start and end (us from the first event of that call on any GPU) and stream;
  then each stream's busy time and the compute stream's idle time inside the span."""
  import glob
  import tempfile
  import time
  from jax.profiler import ProfileData
  jax.block_until_ready(f(*args))
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(calls):
      time.sleep(0.02)  # a gap that separates the calls in the trace
      jax.block_until_ready(f(*args))
    jax.profiler.stop_trace()
    data = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    planes = {}
    for plane in data.planes:
      if "GPU" in plane.name:
        planes[plane.name] = sorted((e.start_ns, e.duration_ns, line.name, e.name)
                                    for line in plane.lines for e in line.events)
    planes = {k: v for k, v in planes.items() if v}
    if not planes:
      return
    for name, events in planes.items():  # the last call: after the last gap over 10 ms
      cut = max((i for i in range(1, len(events))
                 if events[i][0] - events[i - 1][0] - events[i - 1][1] > 10e6), default=0)
      planes[name] = events[cut:]
    t0 = min(events[0][0] for events in planes.values())
    for name, events in planes.items():
      end = max(s + d for s, d, *_ in events)
      print(f"  timeline {name}: {(events[0][0] - t0) / 1e3:.1f} to {(end - t0) / 1e3:.1f} us")
      busy, compute_end, idle = {}, None, 0
      for s, d, line, ev in events:
        busy[line] = busy.get(line, 0) + d
        if "Compute" in line:
          if compute_end is not None:
            idle += max(0, s - compute_end)
          compute_end = max(compute_end or 0, s + d)
        if os.environ.get("PROBE_TIMELINE") != "summary":
          print(f"    {(s - t0) / 1e3:8.1f} {(s + d - t0) / 1e3:8.1f}  {line[:28]:28s} {ev[:60]}")
      for line, b in busy.items():
        print(f"    busy {line[:40]:40s} {b / 1e3:8.1f} us")
      print(f"    compute stream idle between its kernels: {idle / 1e3:.1f} us")


def all_to_all_op(op):
  """matmul_all_to_all / embedding_all_to_all at the benchmark's shapes: time against the
  compute alone and jax.lax's form, the schedule, and with PROBE_TIMELINE the timelines."""
  from jax_hoccl.bench.fused import EMBEDDING_VDBL, ITERS, MOE_ECHD, embedding_lookup, looped
  devices = jax.devices()
  n = len(devices)
  mesh = jax.make_mesh((n,), ("x",))
  rng = np.random.default_rng(0)
  if op == "matmul_all_to_all":
    e, c, h, d = MOE_ECHD
    args = tuple((rng.standard_normal(s, dtype=np.float32) * 0.05).astype(jnp.bfloat16)
                 for s in ((n * n, e, c, h), (n * e, h, d)))
    alone = jnp.matmul
    body = lambda x, w: jax_hoccl.matmul_all_to_all(x, w, "x")  # noqa: E731
  else:
    v, dim, b, l = EMBEDDING_VDBL
    args = (rng.standard_normal((n * v, dim), dtype=np.float32),
            rng.integers(0, v, (n * n, b, l)).astype(np.int32))
    alone = embedding_lookup
    body = lambda t, i: jax_hoccl.embedding_all_to_all(t, i, "x")  # noqa: E731
  lax_body = lambda *a: jax.lax.all_to_all(alone(*a), "x", 0, 0, tiled=True)  # noqa: E731
  specs = (P("x"), P("x"))
  (res, ms_alone), = [_paired(mesh, alone, args, {"op": body, "lax": lax_body}, args, specs)]
  print(f"{op}: {res['op'][0]:.3f} ms, jax.lax {res['lax'][0]:.3f} ms "
        f"({res['op'][0] / res['lax'][0]:.3f}x), compute alone {ms_alone:.3f} ms")
  dev_args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x")))
  for line in schedule(f.lower(*dev_args).compile().as_text()):
    print("   ", line)
  if os.environ.get("PROBE_TIMELINE"):
    for label, b in (("the compute alone", alone), (op, body), (f"jax.lax's {op}", lax_body)):
      print(f"  {label}, {ITERS} calls in a loop:")
      timeline(looped(mesh, b, specs), dev_args)


def main():
  op, chunks = sys.argv[1], eval(sys.argv[2]) if len(sys.argv) > 2 else None
  if op in ("matmul_all_to_all", "embedding_all_to_all"):
    return all_to_all_op(op)
  m_total = int(os.environ.get("PROBE_M", 4096))
  k = int(os.environ.get("PROBE_K", 8192))
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",))
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((m_total, k), dtype=np.float32) * 0.05).astype(jnp.bfloat16)
  w = (rng.standard_normal((k, k), dtype=np.float32) * 0.05).astype(jnp.bfloat16)
  # column-parallel (all_gather_matmul: rows of x sharded, columns of w) or row-parallel
  specs = (P("x"), P(None, "x")) if op == "all_gather_matmul" else (P(None, "x"), P("x"))
  fn = getattr(jax_hoccl, op)
  kw = {"chunks": chunks} if op in ("matmul_psum", "matmul_reduce_scatter") else {}
  body = lambda x, w: fn(x, w, "x", **kw)  # noqa: E731
  # the GEMM alone has the op's whole output: for all_gather_matmul, every rank's rows of x
  gemm_args = (np.tile(x, (len(devices), 1)), w) if op == "all_gather_matmul" else (x, w)
  (res, gemm), = [_paired(mesh, lambda x, w: x @ w, gemm_args, {"op": body}, (x, w), specs)]
  ms, ratio = res["op"]
  print(f"{op} chunks={chunks} M={m_total}: {ms:.3f} ms, GEMM {gemm:.3f} ms, x{ratio:.3f}")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()
                            if op == "matmul_psum" else P("x"), check_vma=False))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  g_args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(gemm_args, specs)]
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
  if os.environ.get("PROBE_TIMELINE"):  # the benchmark's loop of ITERS calls, traced
    from jax_hoccl.bench.fused import ITERS, looped
    lax_body = {"matmul_psum": lambda x, w: jax.lax.psum(x @ w, "x"),
                "matmul_reduce_scatter":
                    lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True),
                "all_gather_matmul":
                    lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w}.get(op)
    for label, b, a in (("the GEMM alone", lambda x, w: x @ w, g_args), (op, body, args),
                        (f"jax.lax's {op}", lax_body, args)):
      if b is not None:
        print(f"  {label}, {ITERS} calls in a loop:")
        timeline(looped(mesh, b, specs), a)

if __name__ == "__main__":
  main()
