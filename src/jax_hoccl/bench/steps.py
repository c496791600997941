"""A training step of small layers and a decode step across processes, with and without
jax_hoccl's collectives, with XLA's command buffers (CUDA graphs) on and off; and the device
time per collective in a chain inside one jit. On one GPU, 2 and 4 processes share it under an
MPS daemon of their own (benchmarks/README.md says which figures transfer to several GPUs);
without a GPU, 2 processes of one CPU device each.

    python -m jax_hoccl.bench --steps [--staged-floor-us US] [--out DIR]

Rows (the slowest rank's):
  "step": {"op", "layers", "ranks", "mps", "command_buffers", "us_per_step",
           "baseline_us_per_step", "per_collective_us", "floor_us"}: L = 12 layers
           (64 x 1024 @ 1024 x 1024 bf16, gelu; 128 wide without a GPU), a collective after
           each (or none: the baseline);
           per_collective_us = (step - baseline) / L.
  "device_latency": {"op", "bytes_per_rank", "ranks", "mps", "us_per_op", "floor_us"}: K = 50
           dependent collectives in one jit, divided by K.
  "decode": {"op": "matmul_psum", "rows", "k", "n", "ranks", "mps", "us_per_call",
           "gemv_us_per_call"}: the fused GEMV + psum (weights split by rows, K = N = 8192; 512
           without a GPU) beside the GEMV.
floor_us: the staged one-hop exchange's device-bound floor measured beside this run, if given.
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import platform
import textwrap

from jax_hoccl.bench import ranks
from jax_hoccl.launch import mps_daemon, run_workers

LAYERS = 12
CHAIN = 50

WORKER = textwrap.dedent("""
    import json, os, sys, time
    addr, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import jax
    kw = {"local_device_ids": [0]} if os.environ.get("BENCH_GPU") else {}
    jax.distributed.initialize(addr, num_processes=n, process_id=me, **kw)
    import numpy as np, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    mesh = jax.make_mesh((n,), ("x",))
    L, K, D, KD = (int(os.environ[v]) for v in ("LAYERS", "CHAIN", "WIDTH", "DECODE_K"))
    shift = [(i, (i + 1) % n) for i in range(n)]
    after = {
        "none": lambda h: h,
        "psum": lambda h: jax_hoccl.psum(h, "x"),
        "all_gather": lambda h: jax_hoccl.all_gather(h, "x", tiled=True)[:h.shape[0]],
        "ppermute": lambda h: jax_hoccl.ppermute(h, "x", shift),
    }

    def local(shape, dtype, seed=0, spec=P("x")):  # this rank's block of a global array
        v = np.random.default_rng(seed + me).standard_normal(shape) / np.sqrt(shape[-1])
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), v.astype(dtype))

    def timed(f, *args):  # median of 5 rounds of 200 calls back to back (output -> input)
        y = f(*args).block_until_ready()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                y = f(y, *args[1:])
            y.block_until_ready()
            rounds.append((time.perf_counter() - t0) / 200 * 1e6)
        return sorted(rounds)[2]

    rows = []
    w = local((1, D, D), jnp.bfloat16, 7)  # one layer's weight, reused by every layer
    for op, coll in after.items():
        def step(h, w, coll=coll):
            for _ in range(L):
                h = coll(jax.nn.gelu(h @ w[0]))
            return h
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"),
                                  check_vma=False))
        rows.append(dict(kind="step", op=op, us=timed(f, local((64, D), jnp.bfloat16), w)))
    if os.environ.get("CHAINS"):
        for op in ("psum", "all_gather"):
            def chain(v, op=op):
                for _ in range(K):
                    v = after[op](v) * 0.5
                return v
            f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                      check_vma=False))
            x = local((1, 16384), np.float32)  # 64 KiB per rank
            for _ in range(3):  # the first calls run eagerly, then XLA records its graphs
                x = f(x).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(20):
                x = f(x)
            x.block_until_ready()
            rows.append(dict(kind="device_latency", op=op, bytes_per_rank=65536,
                             us=(time.perf_counter() - t0) / 20 / K * 1e6))
        kdim = KD
        wd = local((kdim // n, kdim), jnp.bfloat16, 3)
        specs = dict(mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P(None, "x"),
                     check_vma=False)
        for m in (1, 8, 64):  # (the result feeds the next call: x's shape, through a * 0)
            xd = local((m, kdim // n), jnp.bfloat16, 5, P(None, "x"))
            fused = jax.jit(jax.shard_map(
                lambda v, w: jax_hoccl.matmul_psum(v, w, "x")[:, :v.shape[1]] * 0 + v, **specs))
            gemv = jax.jit(jax.shard_map(lambda v, w: (v @ w)[:, :v.shape[1]] * 0 + v, **specs))
            rows.append(dict(kind="decode", op="matmul_psum", rows=m, us=timed(fused, xd, wd),
                             gemv_us=timed(gemv, xd, wd)))
    print("RESULT" + json.dumps({"rows": rows, "platform": jax.devices()[0].platform}), flush=True)
    os._exit(0)
""")


def _job(n: int, env: dict) -> tuple[list, str]:
  found = ranks.results(run_workers(WORKER, n, {**env, "PYTHONFAULTHANDLER": "1"}, 600))
  return ranks.slowest([f["rows"] for f in found], ["us", "gemv_us"]), found[0]["platform"]


def run(out_dir: str, commit: str, floor_us: float | None = None) -> str:
  """Runs the jobs; writes and returns the results JSON's path."""
  base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_HOCCL_NODE")}
  base.setdefault("PJRT_NPROC", "16")
  base.setdefault("JAX_HOCCL_TIMEOUT_S", "60")
  gpu = bool(glob.glob("/dev/nvidia[0-9]*"))
  # (without a GPU: narrower layers and a smaller GEMV, which checks the benchmark itself)
  width, decode_k = (1024, 8192) if gpu else (128, 512)
  base.update(LAYERS=str(LAYERS), CHAIN=str(CHAIN), WIDTH=str(width), DECODE_K=str(decode_k))
  steps, latency, decode = [], [], []
  for n in ((2, 4) if gpu else (2,)):
    for buffers in ((True, False) if gpu else (False,)):
      with contextlib.ExitStack() as stack:
        if gpu:
          flags = "--xla_gpu_shard_autotuning=false"
          if not buffers:
            flags += " --xla_gpu_enable_command_buffer="
          env = {**base, **stack.enter_context(mps_daemon()), "BENCH_GPU": "1",
                 "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.6 / n:.2f}", "XLA_FLAGS": flags}
        else:
          env = {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
        if buffers or not gpu:
          env["CHAINS"] = "1"
        rows, plat = _job(n, env)
      common = dict(ranks=n, mps=gpu)
      none = next(r["us"] for r in rows if r["kind"] == "step" and r["op"] == "none")
      for r in rows:
        if r["kind"] == "step" and r["op"] != "none":
          steps.append(dict(op=r["op"], layers=LAYERS, command_buffers=buffers, **common,
                            us_per_step=r["us"], baseline_us_per_step=none,
                            per_collective_us=(r["us"] - none) / LAYERS, floor_us=floor_us))
        elif r["kind"] == "device_latency":
          latency.append(dict(op=r["op"], bytes_per_rank=r["bytes_per_rank"], **common,
                              us_per_op=r["us"], floor_us=floor_us))
        elif r["kind"] == "decode":
          decode.append(dict(op=r["op"], rows=r["rows"], k=decode_k, n=decode_k, **common,
                             us_per_call=r["us"], gemv_us_per_call=r["gemv_us"]))
  import jax
  result = {"what": "steps of small layers with and without collectives, device time per "
                    "collective in a chain, decode's GEMV + psum (jax_hoccl/bench/steps.py)",
            "platform": plat,
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
            "jax": jax.__version__, "commit": commit, "date": str(datetime.date.today()),
            "step": steps, "device_latency": latency, "decode": decode}
  for r in steps:
    print(f"step {r['op']:<10} ranks {r['ranks']} graphs {str(r['command_buffers']):<5} "
          f"{r['us_per_step']:8.1f} us, without {r['baseline_us_per_step']:8.1f}, "
          f"{r['per_collective_us']:6.1f} us per collective")
  for r in latency:
    print(f"chain {r['op']:<10} ranks {r['ranks']} {r['us_per_op']:8.1f} us per op "
          f"(floor {r['floor_us']})")
  for r in decode:
    print(f"decode matmul_psum rows {r['rows']:<3} ranks {r['ranks']} {r['us_per_call']:8.1f} us, "
          f"GEMV alone {r['gemv_us_per_call']:8.1f} us")
  os.makedirs(out_dir, exist_ok=True)
  name = os.path.join(out_dir, f"{result['date']}-{'1xH200' if gpu else 'cpu'}-steps.json")
  with open(name, "w") as f:
    json.dump(result, f, indent=1)
  return name
