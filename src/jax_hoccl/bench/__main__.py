"""jax_hoccl against jax.lax, side by side in one run, on whatever devices exist.

    python -m jax_hoccl.bench                  # every section, writes <out>/<date>-<machine>.json
    python -m jax_hoccl.bench --quick          # 64 KiB and 1 MiB, a small fused section
    python -m jax_hoccl.bench --ops psum,all_gather --sizes 1,16 --dtype bfloat16
    python -m jax_hoccl.bench --processes      # one process per device against one process
    python -m jax_hoccl.bench --overlap        # fused ops, two ranks on one GPU under MPS
    python -m jax_hoccl.bench --steps          # steps of small layers, decode, across processes
    python -m jax_hoccl.bench --plot DIR RESULTS.json   # PNG figures (needs matplotlib)
    python -m jax_hoccl.bench --model RESULTS.json ... # fit the cost model, no devices needed
    python -m jax_hoccl.bench --model                  # measure the collectives here, then fit

Without a GPU it runs on 8 virtual CPU devices: that checks the benchmark, but CPU timings
say nothing about GPUs. The table printed last puts the ratios first.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys


def _gpu_present() -> bool:
  import glob
  return bool(glob.glob("/dev/nvidia[0-9]*"))


class Progress:
  """A one-line progress bar on stderr."""

  def __init__(self, total: int):
    self.total, self.done = max(1, total), 0

  def __call__(self, label: str) -> None:
    self.done += 1
    filled = int(30 * self.done / self.total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                     f"{label:<40.40s}")
    if self.done >= self.total:
      sys.stderr.write("\n")
    sys.stderr.flush()


def _commit() -> str:
  # A device machine may get the working tree with a stale .git: JAX_HOCCL_COMMIT wins.
  if os.environ.get("JAX_HOCCL_COMMIT"):
    return os.environ["JAX_HOCCL_COMMIT"]
  try:
    return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                   stderr=subprocess.DEVNULL).strip()
  except Exception:
    return "unknown"


def parse_args(argv):
  ap = argparse.ArgumentParser(prog="python -m jax_hoccl.bench", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="64 KiB and 1 MiB only, small fused shapes")
  ap.add_argument("--ops", default="", help="comma-separated collectives (default: all five)")
  ap.add_argument("--sizes", default="", help="comma-separated sizes per device in MiB")
  ap.add_argument("--dtype", default="float32", help="dtype the collectives move")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--no-interference", action="store_true", help="skip the GEMM-beside-op runs")
  ap.add_argument("--no-fused", action="store_true")
  ap.add_argument("--fused-only", action="store_true", help="only the fused-op section")
  ap.add_argument("--gemm-only", action="store_true",
                  help="only the flagged GEMM against XLA's dot (one Hopper GPU is enough)")
  ap.add_argument("--overlap", action="store_true",
                  help="fused ops against their reference, two ranks sharing one GPU under MPS "
                       "with the SMs split")
  ap.add_argument("--processes", action="store_true",
                  help="host time per call across processes against inside one")
  ap.add_argument("--settings", default="",
                  help="with --processes: comma-separated settings (default: all; names in "
                       "jax_hoccl/bench/processes.py, settings)")
  ap.add_argument("--steps", action="store_true",
                  help="steps of small layers and decode's GEMV + psum across processes, "
                       "command buffers on and off; the device time of chained collectives")
  ap.add_argument("--decode", action="store_true",
                  help="with --steps: only decode's GEMV + psum, 2 ranks, in CUDA graphs, the "
                       "GEMV inside the exchange and not")
  ap.add_argument("--out", default="benchmarks/results", help="folder of the results JSON")
  ap.add_argument("--plot", metavar="DIR", help="write PNG figures of RESULTS.json to DIR")
  ap.add_argument("--model", action="store_true",
                  help="fit the cost model to RESULTS.json files (or to a collectives run here) "
                       "and print predicted vs measured, and the 8 / 64 / 512 GPU projection")
  ap.add_argument("results", nargs="*", help="with --plot: the results JSON to draw; with "
                  "--model: the results JSONs to fit")
  a = ap.parse_args(argv)
  if a.plot and len(a.results) != 1:
    ap.error("--plot DIR needs one results JSON")
  if a.results and not (a.plot or a.model):
    ap.error("a results JSON goes with --plot or --model")
  if a.decode and not a.steps:
    ap.error("--decode goes with --steps")
  if a.settings and not a.processes:
    ap.error("--settings goes with --processes")
  if a.model and not a.results:  # the model needs the collectives section only, >= 1 MiB
    a.no_fused, a.no_interference = True, True
    a.sizes = a.sizes or "1,4,16"
  return a


def main(argv=None) -> int:
  a = parse_args(argv)
  if a.plot:
    from jax_hoccl.bench import plot, report
    with open(a.results[0]) as f:
      result = json.load(f)
    report.validate(result)
    for path in plot.plot(result, a.plot):
      print("wrote", path)
    return 0
  if a.model and a.results:
    from jax_hoccl.bench import model
    return model.main(a.results)
  if a.overlap:
    from jax_hoccl.bench import overlap
    print("wrote", overlap.run(a.out, _commit()))
    return 0
  if a.steps:
    from jax_hoccl.bench import steps
    print("wrote", steps.run(a.out, _commit(), decode_only=a.decode))
    return 0
  if a.processes:
    from jax_hoccl.bench import processes
    print("wrote", processes.run(a.out, _commit(), [n for n in a.settings.split(",") if n]
                                 or None))
    return 0

  gpu = _gpu_present()
  if not gpu:  # before jax starts its backends
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("PJRT_NPROC", "16")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # room for torch's GEMM
  os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

  import jax
  import jax.numpy as jnp
  from jax_hoccl.bench import collectives as C
  from jax_hoccl.bench import report

  devices = jax.devices()
  on_gpu = devices[0].platform == "gpu"
  if not on_gpu:
    print("warning: no GPU: running on CPU devices; CPU timings say nothing about GPUs",
          file=sys.stderr)
  mesh = jax.make_mesh((len(devices),), ("x",))
  sizes = [64 * C.KIB, 1 * C.MIB] if a.quick else C.SIZES
  if a.sizes:
    sizes = [int(float(s) * C.MIB) for s in a.sizes.split(",")]
  ops = [o for o in a.ops.split(",") if o] or C.OPS
  unknown = set(ops) - set(C.OPS)
  if unknown:
    raise SystemExit(f"unknown op(s) {sorted(unknown)}; choose from {C.OPS}")
  dtype = jnp.dtype(a.dtype)
  print(f"jax_hoccl benchmark: {len(devices)} x {devices[0].device_kind}, jax {jax.__version__}",
        flush=True)
  result = dict(
      machine=f"{socket.gethostname()} ({C.machine_name()})", gpus=len(devices) if on_gpu else 0,
      devices=[str(d.device_kind) for d in devices], jax=jax.__version__,
      date=datetime.date.today().isoformat(), commit=_commit(), python=platform.python_version(),
      dtype=dtype.name, collectives=[], interference=[], fused=[], device_latency=[], gemm=[],
      flag_latency=[])
  if on_gpu:
    from jax_hoccl.bench.gemm import bench_flag_latency, bench_gemm
    print("== flagged GEMM vs XLA's dot", flush=True)
    result["gemm"] = bench_gemm()
    result["flag_latency"] = bench_flag_latency()
  if a.gemm_only:
    a.fused_only, a.no_fused = True, True
  if not a.fused_only:
    progress = Progress(len(sizes) * len(ops) * len(C.IMPLS))
    result["collectives"] = C.bench_collectives(mesh, sizes, a.repeats, dtype, ops, progress)
  if on_gpu and len(devices) >= 2 and not a.fused_only:
    result["collectives"] += C.bench_raw_copy(sizes, a.repeats)
    if not a.quick and not a.no_interference:
      print("== interference", flush=True)
      result["interference"] = C.bench_interference(mesh)
    print("== small-op device time (host hidden)", flush=True)
    result["device_latency"] = C.bench_device_latency(mesh)
  if not a.no_fused:
    from jax_hoccl.bench.fused import bench_fused
    print("== fused", flush=True)
    result["fused"] = bench_fused(mesh, quick=a.quick or not on_gpu)
  report.validate(result)
  os.makedirs(a.out, exist_ok=True)
  # a partial run keeps the full run's file
  suffix = "-gemm" if a.gemm_only else "-fused" if a.fused_only else ""
  path = os.path.join(a.out, f"{result['date']}-{C.machine_name()}{suffix}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {path}")
  print(report.table(result))
  if a.model:
    from jax_hoccl.bench import model
    print(model.report({os.path.basename(path): result}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
