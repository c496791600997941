"""Where a staged collective's device time goes inside CUDA graphs: 2 (or 4) processes share
GPU 0 under an MPS daemon of their own; each jits K chained (collective, * 0.5) at 4 KiB and 64 KiB
per rank (psum, all_gather, ppermute; and `v + 1` alone), XLA's command buffers on. Prints,
per rank, the wall time per op (20 calls back to back) and every kernel's CUPTI duration
(jax's Mosaic GPU profiler, 5 calls): how many per op, the median, and the total per op (a
total far above the median: a few waits on a late peer). The exchange kernel's median against
a plain fusion's says what the protocol costs on the device.

    PYTHONPATH=src python benchmarks/probe_chain_kernels.py [--sums 0,1] [--ranks 2,4] [--decode]

--sums: JAX_HOCCL_STAGED_SUM settings to run (psum summed by XLA, or inside the kernel);
--ranks: the numbers of processes to run it with; --decode: decode's layers (matmul_psum at
1, 8 and 64 rows beside the GEMVs alone, per layer) instead of the chains. Other JAX_HOCCL_*
variables pass through (JAX_HOCCL_GEMV_PSUM=1: decode's GEMV inside the psum's exchange).
"""
from __future__ import annotations

import argparse
import json
import os
import textwrap

from jax_hoccl.launch import mps_daemon, run_workers

WORKER = textwrap.dedent("""
    import collections, json, os, statistics, sys, time
    addr, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import jax
    jax.distributed.initialize(addr, num_processes=n, process_id=me, local_device_ids=[0])
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax.experimental.mosaic.gpu import profiler
    import jax_hoccl
    import jax.numpy as jnp
    K, L, CALLS, PROFILED = 50, 12, 20, 5
    mesh = jax.make_mesh((n,), ("x",))
    shift = [(i, (i + 1) % n) for i in range(n)]
    ops = {"psum": lambda v: jax_hoccl.psum(v, "x"),
           "all_gather": lambda v: jax_hoccl.all_gather(v, "x", tiled=True)[:v.shape[0]],
           "ppermute": lambda v: jax_hoccl.ppermute(v, "x", shift),
           "none": lambda v: v + 1.0}
    out = {}

    def measure(name, f, y, rest, per_call):  # y = f(y, *rest) per call, per_call ops in it:
        for _ in range(5):  # wall time and CUPTI kernels per op; eager first, then graphs
            y = f(y, *rest).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            y = f(y, *rest)
        y.block_until_ready()
        wall = (time.perf_counter() - t0) / CALLS / per_call * 1e6
        _, timings = profiler.measure(f, aggregate=False, iterations=PROFILED)(y, *rest)
        per = collections.defaultdict(list)
        for call in timings:
            for kernel, ms in call:
                per[kernel[:60]].append(ms * 1e3)
        out[name] = dict(
            wall_us_per_op=wall,
            kernels={k: [len(v) / PROFILED / per_call, statistics.median(v),
                         sum(v) / PROFILED / per_call] for k, v in per.items()})

    if os.environ.get("DECODE"):  # L layers of GEMV + psum (weights split by rows), or GEMV
        kd = 8192
        w = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("x")),
            (np.random.default_rng(me).standard_normal((kd // n, kd)) / 90).astype(jnp.bfloat16))
        layers = {"matmul_psum": lambda v, w: jax_hoccl.matmul_psum(v, w, "x"),
                  "gemv": lambda v, w: v @ w}
        for rows in (1, 8, 64):
            x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(None, "x")),
                                                       np.ones((rows, kd // n), jnp.bfloat16))
            for name, layer in layers.items():
                def body(v, w, layer=layer):
                    for _ in range(L):
                        v = layer(v, w)[:, :v.shape[1]]
                    return v
                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x")),
                                          out_specs=P(None, "x"), check_vma=False))
                measure(f"{name} rows {rows}", f, x, (w,), L)
    for nbytes in (() if os.environ.get("DECODE") else (4096, 65536)):
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                                   np.ones((1, nbytes // 4), np.float32))
        for name, op in ops.items():
            def chain(v, op=op):
                for _ in range(K):
                    v = op(v) * 0.5
                return v
            f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                      check_vma=False))
            measure(f"{name} {nbytes}", f, x, (), K)
    print("RESULT" + json.dumps(out), flush=True)
    os._exit(0)
""")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sums", default="0,1", help="JAX_HOCCL_STAGED_SUM settings to run")
  ap.add_argument("--ranks", default="2", help="numbers of processes, comma-separated")
  ap.add_argument("--decode", action="store_true",
                  help="decode's layers instead of the chains: L = 12 matmul_psum (K = N = "
                       "8192, bf16, weights split by rows) at 1, 8 and 64 rows, beside the GEMVs")
  a = ap.parse_args(argv)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_HOCCL_NODE")}
  env.update(PJRT_NPROC="16", JAX_HOCCL_TIMEOUT_S="60",
             XLA_FLAGS="--xla_gpu_shard_autotuning=false")
  failed = 0
  for n, summed in [(int(n), s) for n in a.ranks.split(",") for s in a.sums.split(",")]:
    with mps_daemon() as mps:
      found = run_workers(WORKER, n, {**env, **mps, "JAX_HOCCL_STAGED_SUM": summed,
                                      "DECODE": "1" if a.decode else "",
                                      "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.6 / n:.2f}"}, 300)
    for rank, (code, text) in enumerate(found):
      lines = [line for line in text.splitlines() if line.startswith("RESULT")]
      if not lines:
        print(f"rank {rank} failed (exit {code}):\n{text[-2000:]}")
        failed += 1
        continue
      print(f"== {n} ranks, JAX_HOCCL_STAGED_SUM={summed}, rank {rank}")
      for name, row in json.loads(lines[0][len("RESULT"):]).items():
        print(f"  {name:18s} wall {row['wall_us_per_op']:6.1f} us per op")
        for kernel, (count, median, total) in sorted(row["kernels"].items(),
                                                     key=lambda kv: -kv[1][2]):
          print(f"      {kernel:60s} x{count:4.2f} per op  median {median:6.2f} us  "
                f"total per op {total:6.2f} us")
  return 1 if failed else 0


if __name__ == "__main__":
  raise SystemExit(main())
