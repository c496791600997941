"""A training step of small layers and a decode step across processes, with and without
jax_hoccl's collectives, with XLA's command buffers (CUDA graphs) on and off; and the device
time per collective in a chain inside one jit. On one GPU, 2 and 4 processes share it under an
MPS daemon of their own (benchmarks/README.md says which figures transfer to several GPUs);
without a GPU, 2 processes of one CPU device each.

    python -m jax_hoccl.bench --steps [--decode] [--out DIR]   # --decode: its rows only

Rows (from the rank that the collectives add most to; paired.py: paired rounds of the program
with and without them, "added" the median of the rounds' differences, its quartiles beside),
each with "staged_sum": whether the staged psums were summed inside the exchange kernel
(JAX_HOCCL_STAGED_SUM=1; on a GPU every job runs with it off and on), and "staged_packed":
false where the job turned the packed exchange off (JAX_HOCCL_STAGED_PACKED_BYTES=0; on a
GPU the jobs in CUDA graphs run with it on and off; the CPU engine has no packed exchange),
and "gemv_psum": whether decode's GEMV ran inside the psum's exchange (JAX_HOCCL_GEMV_PSUM=1;
on a GPU one more job in CUDA graphs, the sums in the kernel, packed):
  "step": {"op", "layers", "ranks", "mps", "command_buffers", "us_per_step",
           "baseline_us_per_step", "added_us_per_step", "added_quartiles_us",
           "per_collective_us", "job_added_us_per_step", "job_per_collective_us",
           "baseline_us_per_step_by_rank", "cpu_us_per_step_by_rank",
           "baseline_cpu_us_per_step_by_rank", "recorded_per_call", "floor_us"}: L = 12
           layers (64 x 1024 @ 1024 x 1024 bf16, gelu; 128 wide without a GPU), a collective
           after each (or none: the baseline); per_collective_us = added_us_per_step / L.
  "device_latency": {"op", "bytes_per_rank", "ranks", "mps", "us_per_op", "floor_us"}: K = 50
           dependent collectives in one jit, divided by K.
  "decode": {"op": "matmul_psum", "rows", "k", "n", "layers", "ranks", "mps", "us_per_call",
           "gemv_us_per_call", "added_us_per_call", "added_quartiles_us",
           "job_added_us_per_call", "gemv_us_per_call_by_rank", "cpu_us_per_call_by_rank",
           "recorded_per_call"}:
           a decode step of L layers, each the fused GEMV + psum (weights split by rows,
           K = N = 8192; 512 without a GPU; one weight for every layer), beside the same
           step of GEMVs alone; per layer.
"job_*": what the collectives add to the job, each round's slowest rank with them minus its
slowest rank without (ranks.with_job), "*_by_rank": every rank's median ("cpu_*": its
process's CPU time, every thread's). "recorded_per_call": how many times per collective call
its handler ran under capture (processes.py says when).
floor_us (on a GPU): the device-bound floor of a staged one-hop exchange of the row's size per
rank (a step's activations, 64 x 1024 bf16; a chain's 64 KiB) across as many ranks, raw CUDA
under the same MPS daemon, measured before the jobs (staged_floor.py). "cpu_speed": whether
the machine's CPUs ran alike before the jobs and after (cpu_speed.probe, as in processes.py).
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import platform
import subprocess
import textwrap

from jax_hoccl.bench import cpu_speed, machine, paired, ranks, staged_floor
from jax_hoccl.launch import mps_daemon, run_workers

LAYERS = 12
CHAIN = 50
ROUNDS, CALLS = paired.ROUNDS, paired.CALLS  # paired rounds per row, calls per round

WORKER = textwrap.dedent("""
    import json, os, sys, time
    addr, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import jax
    kw = {"local_device_ids": [0]} if os.environ.get("BENCH_GPU") else {}
    jax.distributed.initialize(addr, num_processes=n, process_id=me, **kw)
    import numpy as np, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    from jax_hoccl import _hoccl
    from jax_hoccl.bench import paired
    mesh = jax.make_mesh((n,), ("x",))
    recorded = getattr(_hoccl, "staged_captured_calls", lambda: 0)  # into CUDA graphs

    def timed(f, baseline, args):  # paired rounds, and the handler's traces per collective call
        before = recorded()
        t = paired.paired(f, baseline, args, R, C)
        calls = L * paired.calls_made(R, C)
        return dict(t, recorded_per_call=round((recorded() - before) / calls, 3))

    L, K, D, KD, R, C = (int(os.environ[v])
                         for v in ("LAYERS", "CHAIN", "WIDTH", "DECODE_K", "ROUNDS", "CALLS"))
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

    rows = []
    decode_only = bool(os.environ.get("DECODE_ONLY"))
    w = local((1, D, D), jnp.bfloat16, 7)  # one layer's weight, reused by every layer
    h = local((64, D), jnp.bfloat16)
    steps = {}
    for op, coll in after.items():
        def step(h, w, coll=coll):
            for _ in range(L):
                h = coll(jax.nn.gelu(h @ w[0]))
            return h
        steps[op] = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"), P("x")),
                                          out_specs=P("x"), check_vma=False))
    for op in () if decode_only else ("psum", "all_gather", "ppermute"):
        rows.append(dict(kind="step", op=op, **timed(steps[op], steps["none"], (h, w))))
    if os.environ.get("CHAINS"):
        for op in () if decode_only else ("psum", "all_gather"):
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
        def decode(layer):  # L layers, each one's result (its first K / n columns) the next's input
            def body(v, w):
                for _ in range(L):
                    v = layer(v, w)[:, :v.shape[1]]
                return v
            return jax.jit(jax.shard_map(body, **specs))
        fused = decode(lambda v, w: jax_hoccl.matmul_psum(v, w, "x"))
        gemv = decode(lambda v, w: v @ w)
        for m in (1, 8, 64):
            xd = local((m, kdim // n), jnp.bfloat16, 5, P(None, "x"))
            rows.append(dict(kind="decode", op="matmul_psum", rows=m,
                             **timed(fused, gemv, (xd, wd))))
    print("RESULT" + json.dumps({"rows": rows, "platform": jax.devices()[0].platform}), flush=True)
    os._exit(0)
""")


def _job(n: int, env: dict) -> tuple[list, str]:
  found = ranks.results(run_workers(WORKER, n, {**env, "PYTHONFAULTHANDLER": "1"}, 600))
  return ranks.with_job([f["rows"] for f in found], ["added_us", "us"]), found[0]["platform"]


def run(out_dir: str, commit: str, decode_only: bool = False) -> str:
  """Runs the jobs; writes and returns the results JSON's path. decode_only: only the decode
  rows, of 2 ranks in CUDA graphs, the GEMV inside the exchange and not (on a GPU)."""
  base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_HOCCL_NODE")}
  base.setdefault("PJRT_NPROC", "16")
  base.setdefault("JAX_HOCCL_TIMEOUT_S", "60")
  gpu = bool(glob.glob("/dev/nvidia[0-9]*"))
  # (without a GPU: narrower layers and a smaller GEMV, which checks the benchmark itself)
  width, decode_k = (1024, 8192) if gpu else (128, 512)
  base.update(LAYERS=str(LAYERS), CHAIN=str(CHAIN), WIDTH=str(width), DECODE_K=str(decode_k),
              ROUNDS=str(ROUNDS), CALLS=str(CALLS))
  steps, latency, decode = [], [], []
  # on a GPU each setting with the staged sums by XLA and inside the exchange kernel, and in
  # graphs also without the packed exchange (the exchange kernel's flags at every size), and
  # decode's GEMV inside the exchange
  jobs = ([(b, s, p, False) for b in (True, False) for p in ((True, False) if b else (True,))
           for s in (False, True)] + [(True, True, True, True)] if gpu
          else [(False, False, True, False)])
  if decode_only:
    base["DECODE_ONLY"] = "1"
    if gpu:  # in graphs, summed, packed; the GEMV inside the exchange and not
      jobs = [j for j in jobs if j[0] and j[1] and j[2]]
  step_bytes, chain_bytes = 64 * width * 2, 65536
  speed = {"before": cpu_speed.probe(cpu_speed.AROUND_JOBS)}  # whether the CPUs ran alike
  for n in ((2, 4) if gpu and not decode_only else (2,)):
    # {bytes: us}, measured once per number of ranks on a GPU (decode's rows have none)
    floor = None if gpu and not decode_only else {}
    for buffers, summed, packed, gemv in jobs:
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
        env["JAX_HOCCL_STAGED_SUM"] = "1" if summed else "0"
        if not packed:
          env["JAX_HOCCL_STAGED_PACKED_BYTES"] = "0"
        env["JAX_HOCCL_GEMV_PSUM"] = "1" if gemv else "0"
        if floor is None:
          try:
            floor = staged_floor.floors(n, (chain_bytes, step_bytes), env)
          except (RuntimeError, subprocess.TimeoutExpired) as e:  # the rows go on without it
            print(f"no staged floor with {n} ranks: {e}")
            floor = {}
        rows, plat = _job(n, env)
      common = dict(ranks=n, mps=gpu, staged_sum=summed, staged_packed=packed, gemv_psum=gemv)
      for r in rows:
        if r["kind"] == "step":
          steps.append(dict(op=r["op"], layers=LAYERS, command_buffers=buffers, **common,
                            us_per_step=r["us"], baseline_us_per_step=r["baseline_us"],
                            added_us_per_step=r["added_us"],
                            added_quartiles_us=r["added_quartiles_us"],
                            per_collective_us=r["added_us"] / LAYERS,
                            job_added_us_per_step=r["job_added_us"],
                            job_per_collective_us=r["job_added_us"] / LAYERS,
                            baseline_us_per_step_by_rank=r["baseline_us_by_rank"],
                            cpu_us_per_step_by_rank=r["cpu_us_by_rank"],
                            baseline_cpu_us_per_step_by_rank=r["baseline_cpu_us_by_rank"],
                            recorded_per_call=r["recorded_per_call"],
                            floor_us=floor.get(step_bytes)))
        elif r["kind"] == "device_latency":
          latency.append(dict(op=r["op"], bytes_per_rank=r["bytes_per_rank"], **common,
                              us_per_op=r["us"], floor_us=floor.get(r["bytes_per_rank"])))
        elif r["kind"] == "decode":
          decode.append(dict(op=r["op"], rows=r["rows"], k=decode_k, n=decode_k, **common,
                             layers=LAYERS, us_per_call=r["us"] / LAYERS,
                             gemv_us_per_call=r["baseline_us"] / LAYERS,
                             added_us_per_call=r["added_us"] / LAYERS,
                             added_quartiles_us=[q / LAYERS for q in r["added_quartiles_us"]],
                             job_added_us_per_call=r["job_added_us"] / LAYERS,
                             gemv_us_per_call_by_rank=[b / LAYERS
                                                       for b in r["baseline_us_by_rank"]],
                             cpu_us_per_call_by_rank=[c / LAYERS for c in r["cpu_us_by_rank"]],
                             recorded_per_call=r["recorded_per_call"]))
  speed["after"] = cpu_speed.probe(cpu_speed.AROUND_JOBS)
  import jax
  result = {"what": "steps of small layers with and without collectives, device time per "
                    "collective in a chain, decode's GEMV + psum (jax_hoccl/bench/steps.py)",
            "platform": plat,
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
            "devices": machine.gpu_names() if gpu else [],
            "jax": jax.__version__, "commit": commit, "date": str(datetime.date.today()),
            "cpu_speed": speed, "step": steps, "device_latency": latency, "decode": decode}
  def against_floor(us, floor):
    return f" ({us / floor:.2f}x the floor, {floor:.1f} us)" if floor else ""

  def summed_by(r):  # who summed the staged psums, whether small blocks went packed, and
    # whether decode's GEMV ran inside the exchange
    return (("kernel" if r["staged_sum"] else "xla") + ("" if r["staged_packed"] else " unpacked")
            + (" gemv" if r["gemv_psum"] else ""))

  for r in steps:
    print(f"step {r['op']:<10} ranks {r['ranks']} graphs {str(r['command_buffers']):<5} "
          f"sum {summed_by(r):<12} "
          f"{r['us_per_step']:8.1f} us, without {r['baseline_us_per_step']:8.1f}, "
          f"{r['per_collective_us']:6.1f} us per collective "
          f"(q1-q3 {r['added_quartiles_us'][0] / LAYERS:.1f}-"
          f"{r['added_quartiles_us'][1] / LAYERS:.1f}; job {r['job_per_collective_us']:.1f}; "
          f"recorded {r['recorded_per_call']:.2f} per call)"
          f"{against_floor(r['per_collective_us'], r['floor_us'])}")
  for r in latency:
    print(f"chain {r['op']:<10} ranks {r['ranks']} sum {summed_by(r):<12} "
          f"{r['us_per_op']:8.1f} us per op{against_floor(r['us_per_op'], r['floor_us'])}")
  for r in decode:
    print(f"decode matmul_psum rows {r['rows']:<3} ranks {r['ranks']} "
          f"sum {summed_by(r):<12} {r['us_per_call']:8.1f} us, "
          f"GEMV alone {r['gemv_us_per_call']:8.1f} us, added {r['added_us_per_call']:6.1f} us "
          f"(q1-q3 {r['added_quartiles_us'][0]:.1f}-{r['added_quartiles_us'][1]:.1f}; "
          f"job {r['job_added_us_per_call']:.1f}; recorded {r['recorded_per_call']:.2f} per call)")
  os.makedirs(out_dir, exist_ok=True)
  name = os.path.join(out_dir, f"{result['date']}-{machine.file_tag(gpu)}-"
                             f"{'decode' if decode_only else 'steps'}.json")
  with open(name, "w") as f:
    json.dump(result, f, indent=1)
  return name
