"""What a collective adds per eager jit call under other process settings: the per-call jobs of
`bench --processes` (jax_hoccl/bench/processes.py: paired rounds of the op's program and the
same program without it), a few ops at one size, run as whole jobs of 2 and 4 ranks under one
MPS daemon per group size (without a GPU: processes of one CPU device each), the settings
alternating job by job and repeated, so that a slow spell of the machine shows as a spread
across repeats rather than as a difference between settings. Prints each job's figure (what
the op adds to the job: each round's slowest rank with it minus its slowest rank without,
ranks.with_job), then the figures by setting.

    PYTHONPATH=src python benchmarks/probe_per_call_settings.py [--reps 3] [--ranks 2,4]
        [--ops psum,all_gather] [--bytes 65536] [NAME=JSON ...]

Each NAME=JSON is a setting: environment variables for every rank. Beside the variables the
library and bench --processes read (JAX_HOCCL_*, XLA_FLAGS, BENCH_DONATE=1: each call's
input donated), two are read by this probe's ranks: BENCH_CPUS=1 (rank i runs on its own
1/n-th of the CPUs) and BENCH_CREATE (JSON: the PJRT client's create options, e.g.
{"use_tfrt_gpu_client": true}). Without settings it compares the defaults, donation, the TFRT
GPU client, and CPU pinning.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os

from jax_hoccl.bench import processes, ranks
from jax_hoccl.launch import mps_daemon, run_workers

# Read by every rank before jax starts: its CPUs, its client's create options.
PRELUDE = """import json as _json, os as _os, sys as _sys
if _os.environ.get("BENCH_CPUS"):
    _me, _n = int(_sys.argv[2]), int(_sys.argv[3])
    _cpus = sorted(_os.sched_getaffinity(0))
    _k = max(1, len(_cpus) // _n)
    _os.sched_setaffinity(0, _cpus[(_me * _k) % len(_cpus):][:_k])
if _os.environ.get("BENCH_CREATE"):
    import jax as _jax
    _jax.config.update("jax_pjrt_client_create_options", _json.loads(_os.environ["BENCH_CREATE"]))
"""

TFRT = json.dumps({"use_tfrt_gpu_client": True})
DEFAULT_SETTINGS = {"default": {}, "donated": {"BENCH_DONATE": "1"},
                    "tfrt": {"BENCH_CREATE": TFRT}, "pinned": {"BENCH_CPUS": "1"}}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--reps", type=int, default=3, help="jobs per setting and group size")
  ap.add_argument("--ranks", default="2,4")
  ap.add_argument("--ops", default="psum,all_gather")
  ap.add_argument("--bytes", type=int, default=64 << 10, help="bytes per rank")
  ap.add_argument("settings", nargs="*", help="NAME=JSON: environment variables of a setting")
  a = ap.parse_args()
  settings = ({s.split("=", 1)[0]: json.loads(s.split("=", 1)[1]) for s in a.settings}
              or DEFAULT_SETTINGS)
  base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  gpu = bool(glob.glob("/dev/nvidia[0-9]*"))
  base.update(OPS=json.dumps(a.ops.split(",")), BYTES=json.dumps([a.bytes]), ROUNDS="8",
              CALLS=str(processes.CALLS), JAX_HOCCL_TIMEOUT_S="60")
  base.update({"BENCH_GPU": "1", "XLA_FLAGS": "--xla_gpu_shard_autotuning=false"} if gpu else
              {"PJRT_NPROC": "16", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  worker = PRELUDE + processes.WORKER
  found = {}  # (n, setting, op) -> the jobs' figures
  for n in (int(x) for x in a.ranks.split(",")):
    with mps_daemon() if gpu else contextlib.nullcontext({}) as mps:
      env = {**base, **mps, "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.6 / n:.2f}"}
      run_workers(worker, n, {**env, **processes.WARM_UP}, 600)  # its rows dropped
      for rep in range(a.reps):
        for name, setting in settings.items():
          runs = run_workers(worker, n, {**env, **setting}, 600)
          for r in ranks.with_job([x["rows"] for x in ranks.results(runs)],
                                  ["added_us_per_call"]):
            found.setdefault((n, name, r["op"]), []).append(r["job_added_us"])
            print(json.dumps(dict(ranks=n, rep=rep, setting=name, op=r["op"],
                                  job_added_us=round(r["job_added_us"], 1),
                                  quartiles=[round(q, 1) for q in r["job_added_quartiles_us"]],
                                  us_by_rank=[round(u) for u in r["us_by_rank"]],
                                  baseline_us_by_rank=[round(u)
                                                       for u in r["baseline_us_by_rank"]])),
                  flush=True)
  print(f"== what the op adds to the job per call, us ({a.bytes} bytes per rank), job by job")
  for (n, name, op), xs in found.items():
    print(f"{n} ranks  {name:<12} {op:<13} " + "  ".join(f"{x:6.1f}" for x in xs))


if __name__ == "__main__":
  main()
