"""The collectives section of `python -m jax_hoccl.bench`: jax_hoccl and jax.lax side by side.

  collectives  : device time per op (K dependent ops in one jitted function, so JAX's ~100 us
                 per-call host overhead is amortised) and bus bandwidth (nccl-tests formulas),
                 for jax_hoccl, jax.lax and, on GPU, a raw copy-engine peer copy (the ceiling).
  interference : an 8192^3 bf16 GEMM's throughput (PyTorch, its own CUDA stream, GPU 0) while
                 JAX runs a continuous chain of each collective, over its solo throughput.
  device time  : small ops behind GEMMs, so the host's per-op cost is hidden.
Sizes are per device: all_gather's is its output (the full buffer, as nccl-tests count it),
the others' their input.
"""
from __future__ import annotations

import time

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl
from jax_hoccl._src.ops import psum as psum_lib

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SIZES = [64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1 * GIB]
OPS = ["psum", "all_gather", "psum_scatter", "all_to_all", "ppermute"]
IMPLS = {"jax_hoccl": jax_hoccl, "jax.lax": jax.lax}


def busbw_factor(op: str, n: int) -> float:
  return {"psum": 2 * (n - 1) / n, "ppermute": 1.0}.get(op, (n - 1) / n)


def ops_per_call(nbytes: int) -> int:
  # Enough ops per jitted call that host overhead is noise, few enough to compile quickly.
  return 100 if nbytes <= 1 * MIB else 40 if nbytes <= 16 * MIB else 20 if nbytes <= 64 * MIB \
      else 10 if nbytes <= 256 * MIB else 5


def chain_fn(mod, op: str, n: int, k: int):
  """A per-device function applying `op` k times, each depending on the previous result.
  The dependency for ops that change the shape is a one-element in-place update."""
  perm = [(i, (i + 1) % n) for i in range(n)]

  def step(x):
    if op == "psum":
      return mod.psum(x, "x")
    if op == "ppermute":
      return mod.ppermute(x, "x", perm)
    if op == "all_gather":
      y = mod.all_gather(x, "x", tiled=True)
    elif op == "psum_scatter":
      y = mod.psum_scatter(x, "x", tiled=True)
    else:
      y = mod.all_to_all(x, "x", 0, 0, tiled=True)
    return x.at[0].add(y[1])

  def body(x):
    for _ in range(k):
      x = step(x)
    return x

  return body


def per_device_input_elems(op: str, nbytes: int, n: int, itemsize: int) -> int:
  elems = nbytes // itemsize
  if op == "all_gather":
    elems //= n
  return max(n, elems - elems % n)


def time_call(f, x, repeats: int) -> float:
  jax.block_until_ready(f(x))  # compile + warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def bench_collectives(mesh, sizes, repeats, dtype=jnp.float32, ops=OPS, progress=None):
  """Rows {op, impl, dtype, bytes_per_device, time_us, busbw_gbps}; progress(label) after each."""
  n = mesh.shape["x"]
  rows = []
  rng = np.random.default_rng(0)
  for nbytes in sizes:
    k = ops_per_call(nbytes)
    for op in ops:
      elems = per_device_input_elems(op, nbytes, n, np.dtype(dtype).itemsize)
      host = rng.standard_normal(elems * n, dtype=np.float32).astype(dtype)
      x = jax.device_put(host, NamedSharding(mesh, P("x")))
      for impl, mod in IMPLS.items():
        f = jax.jit(jax.shard_map(chain_fn(mod, op, n, k), mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x")))
        t = time_call(f, x, repeats) / k
        rows.append(dict(op=op, impl=impl, dtype=np.dtype(dtype).name, bytes_per_device=nbytes,
                         time_us=t * 1e6, busbw_gbps=nbytes / t * busbw_factor(op, n) / 1e9))
        if (op, impl) == ("psum", "jax_hoccl"):  # what the cost model's fit needs to know
          rows[-1]["algorithm"] = psum_lib.choose_algorithm(elems * np.dtype(dtype).itemsize, n)
        if progress:
          progress(f"{op} {impl} {fmt_bytes(nbytes)}")
      del x
  return rows


def bench_raw_copy(sizes, repeats):
  """cudaMemcpyPeerAsync GPU0 -> GPU1 chained on one stream: the copy-engine ceiling."""
  import cupy as cp
  rows = []
  for nbytes in sizes:
    k = ops_per_call(nbytes)
    with cp.cuda.Device(1):
      dst = cp.empty(nbytes, cp.uint8)
    with cp.cuda.Device(0):
      src = cp.empty(nbytes, cp.uint8)
      stream = cp.cuda.Stream(non_blocking=True)
      start, stop = cp.cuda.Event(), cp.cuda.Event()
      times = []
      for _ in range(repeats + 1):
        start.record(stream)
        for _ in range(k):
          cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, 1, src.data.ptr, 0, nbytes, stream.ptr)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3 / k)
      t = float(np.median(times[1:]))
    rows.append(dict(op="copy", impl="copy_engine_raw", bytes_per_device=nbytes,
                     time_us=t * 1e6, busbw_gbps=nbytes / t / 1e9))
    del src, dst
  return rows


def bench_interference(mesh, nbytes=256 * MIB, gemm_n=8192, gemms=30):
  """GEMM TFLOP/s beside a continuous chain of each collective, over solo TFLOP/s."""
  import torch
  n = mesh.shape["x"]
  dev = torch.device("cuda:0")
  a = torch.randn(gemm_n, gemm_n, device=dev, dtype=torch.bfloat16)
  b = torch.randn(gemm_n, gemm_n, device=dev, dtype=torch.bfloat16)
  stream = torch.cuda.Stream(device=dev)

  def gemm_loop():
    with torch.cuda.stream(stream):
      e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      e0.record(stream)
      for _ in range(gemms):
        torch.mm(a, b)
      e1.record(stream)
    e1.synchronize()
    return 2 * gemm_n ** 3 * gemms / (e0.elapsed_time(e1) / 1e3) / 1e12

  for _ in range(3):  # warm up clocks and cuBLAS
    gemm_loop()
  solo = float(np.median([gemm_loop() for _ in range(3)]))
  gemm_s = 2 * gemm_n ** 3 * gemms / (solo * 1e12)
  rows = []
  rng = np.random.default_rng(1)
  for op in OPS:
    elems = per_device_input_elems(op, nbytes, n, 4)
    x = jax.device_put(rng.standard_normal(elems * n, dtype=np.float32), NamedSharding(mesh, P("x")))
    for impl, mod in IMPLS.items():
      f1 = jax.jit(jax.shard_map(chain_fn(mod, op, n, 4), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
      t_op = time_call(f1, x, 2) / 4
      k = int(min(600, max(8, 3.0 * gemm_s / t_op)))  # chain outlasts the GEMM loop
      f = jax.jit(jax.shard_map(chain_fn(mod, op, n, k), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
      jax.block_until_ready(f(x))
      torch.cuda.synchronize()
      t0 = time.perf_counter()
      y = f(x)           # async dispatch: the chain runs while the GEMMs run
      time.sleep(0.002)  # let the chain start first
      t1 = time.perf_counter()
      tflops = gemm_loop()
      t2 = time.perf_counter()
      jax.block_until_ready(y)
      t3 = time.perf_counter()
      # The GEMM window [t1, t2] must lie inside the chain [t0, t3] for the ratio to mean
      # anything; chain_ms and gemm_window_ms let a reader check that.
      rows.append(dict(op=op, impl=impl, gemm_ratio=tflops / solo, gemm_tflops=tflops,
                       solo_tflops=solo, chain_ms=(t3 - t0) * 1e3, gemm_window_ms=(t2 - t1) * 1e3,
                       overlapped=bool(t3 - t2 > 0.001)))
      print(f"  GEMM beside {op:13s} {impl:10s} {tflops:7.1f} / {solo:7.1f} TFLOP/s = "
            f"{tflops / solo:.3f} (chain {rows[-1]['chain_ms']:.1f} ms, GEMMs "
            f"{rows[-1]['gemm_window_ms']:.1f} ms)", flush=True)
    del x
  solo_after = float(np.median([gemm_loop() for _ in range(3)]))
  print(f"  solo GEMM before/after: {solo:.1f} / {solo_after:.1f} TFLOP/s", flush=True)
  for r in rows:
    r["solo_tflops_after"] = solo_after
  return rows


def behind_gemms(op_body, k):
  """(x, a) -> k rounds of a GEMM on a, then op_body on x made to wait for it: the host
  enqueues each op while the GPU runs the GEMM before it, so the op's host cost is hidden.
  Each GEMM also waits for the op before it (one element of its output): otherwise XLA runs
  its own collectives asynchronously beside the next GEMM and the chain measured how much
  of jax.lax's op the GEMM hid, not the op's latency (benchmarks/results/raw/2026-11-30-2xH200-probe_op_cost-64KiB-timeline.txt)."""
  def body(x, a):
    for _ in range(k):
      a = (a @ a) * 1e-3 + x.reshape(-1)[0].astype(a.dtype) * 0
      x = op_body(x + a[0, 0].astype(x.dtype) * 0)
    return x, a
  return body


def bench_device_latency(mesh, sizes=(64 * KIB, 1 * MIB), k=50, gemm_n=4096):
  """Device time of small ops with the host's per-op cost hidden: each op follows a GEMM
  long enough that the host enqueues the next op while the GPU computes, so
  (chain of GEMM+op) - (chain of GEMM alone) is what the op costs the GPU."""
  n = mesh.shape["x"]
  rows = []
  rng = np.random.default_rng(2)
  a = jax.device_put(rng.standard_normal((n * gemm_n, gemm_n), dtype=np.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P("x")))

  base = jax.jit(jax.shard_map(behind_gemms(lambda x: x, k), mesh=mesh,
                               in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
  for nbytes in sizes:
    for op in OPS:
      elems = per_device_input_elems(op, nbytes, n, 4)
      x = jax.device_put(rng.standard_normal(elems * n, dtype=np.float32), NamedSharding(mesh, P("x")))
      t_base = time_call(lambda v: base(v, a), x, 3)
      for impl, mod in IMPLS.items():
        one = chain_fn(mod, op, n, 1)
        f = jax.jit(jax.shard_map(behind_gemms(one, k), mesh=mesh, in_specs=(P("x"), P("x")),
                                  out_specs=(P("x"), P("x"))))
        t = (time_call(lambda v: f(v, a), x, 3) - t_base) / k
        rows.append(dict(op=op, impl=impl, bytes_per_device=nbytes, device_time_us=t * 1e6))
  return rows


def fmt_bytes(b: int) -> str:
  return f"{b // GIB} GiB" if b >= GIB else f"{b // MIB} MiB" if b >= MIB else f"{b // KIB} KiB"


def machine_name() -> str:
  d = jax.devices()[0]
  kind = getattr(d, "device_kind", d.platform).replace(" ", "-")
  return f"{len(jax.devices())}x{kind}"
