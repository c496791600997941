"""Host time per call of jax_hoccl's rendezvous across processes against the one inside a
process, on whatever devices exist (CPU: 2 devices in one process vs 2 processes of 1 device;
one GPU: 2 processes sharing it, reported alone). jit calls of a psum of 64 KiB dispatched
back to back and waited for at the end; the median of 5 rounds of 200 calls.

    python -m jax_hoccl.bench --processes [--out DIR]
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import subprocess
import sys
import textwrap

from jax_hoccl.launch import local_address

WORKER = textwrap.dedent("""
    import os, sys, time, json
    n_proc, me, addr, local = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    import jax
    if n_proc > 1:
        kw = {"local_device_ids": [0]} if os.environ.get("BENCH_GPU") else {}
        jax.distributed.initialize(addr, num_processes=n_proc, process_id=me, **kw)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    devs = jax.devices()[:2]
    mesh = jax.make_mesh((2,), ("x",), devices=devs)
    f = jax.jit(jax.shard_map(lambda v: jax_hoccl.psum(v, "x") * 0.5, mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    local_rows = 2 // n_proc
    y = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                               np.ones((local_rows, 16384), np.float32))
    f(y).block_until_ready()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            y = f(y)
        y.block_until_ready()
        rounds.append((time.perf_counter() - t0) / 200 * 1e6)
    print("RESULT" + json.dumps({"us_per_call": sorted(rounds)[2], "platform": devs[0].platform}))
    os._exit(0)
""")


def _run(n_proc, env):
  addr = local_address()
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(n_proc), str(i), addr, "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(n_proc)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  results = [json.loads(o.split("RESULT")[1].splitlines()[0]) for o in outs if "RESULT" in o]
  if len(results) != n_proc:
    raise RuntimeError("\n".join(o[-2000:] for o in outs))
  return max(r["us_per_call"] for r in results), results[0]["platform"]


def run(out_dir: str, commit: str) -> str:
  """Runs the comparison; writes and returns the results JSON's path."""
  base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_HOCCL_NODE")}
  # XLA:CPU hangs with many launches in flight and few threads (docs/design.md, section 3).
  base.setdefault("PJRT_NPROC", "16")
  base.setdefault("JAX_HOCCL_TIMEOUT_S", "60")
  gpu = bool(glob.glob("/dev/nvidia[0-9]*"))
  rows = {}
  if gpu:
    env = {**base, "BENCH_GPU": "1", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
    rows["2 processes, 1 GPU"], plat = _run(2, env)
  else:
    rows["1 process, 2 CPU devices"], plat = _run(
        1, {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    rows["2 processes, 1 CPU device each"], _ = _run(
        2, {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  import jax
  result = {"what": "host time per jit call of a 64 KiB psum (median of 5 x 200 calls)",
            "platform": plat, "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
            "jax": jax.__version__, "commit": commit, "date": str(datetime.date.today()),
            "us_per_call": rows}
  print(f"{'setup':<34} us per call")
  for k, v in rows.items():
    print(f"{k:<34} {v:10.1f}")
  os.makedirs(out_dir, exist_ok=True)
  name = os.path.join(out_dir, f"{result['date']}-{'1xH200' if gpu else 'cpu'}-processes.json")
  with open(name, "w") as f:
    json.dump(result, f, indent=1)
  return name
