"""One run on one Hopper GPU that checks the flagged GEMM's claims and measures what the walks
cost, in under five minutes:

  1. tests/test_gpu_flagged_gemm.py (values, flags, claims, the held-SMs walk);
  2. benchmarks/probe_walk_cost.py at M = 4096 and 16384, 2 and 4 ranks ("walk_cost" rows),
     comparing bands of 8 and 16 row tiles (flagged_gemm.BAND_TILES) at M = 4096, and the ring
     walks there with their partial sums just written (--warm-partials); then the
     same walks with each call beside XLA's dot in one jit (--paired: "paired" rows);
  3. `python -m jax_hoccl.bench --gemm-only`: the flagged GEMM against XLA's dot at its three
     shapes ("gemm" rows);
  4. tile configurations of the flagged GEMM at 4096x4096x8192, side by side: the band
     height (flagged_gemm.BAND_TILES), and a whole tile staged for the epilogue with a k-step
     less in flight (EPI_SLOTS = 4, PIPELINE_STEPS = 3: the stores no longer wait for smem).

Each step runs in its own process under its own time limit (a hang costs only its step).
Everything lands in --out (default benchmarks/results/raw): the steps' logs, their JSONs, and
DATE-1xGPU-walk-cost.json with all rows, machine, versions and commit; where $OUT is set, all
of it also as one archive, $OUT/walk_cost_check.tar.gz. Prints a
table last, and which band height and configuration won. From the repository root, with the
extension built into src/jax_hoccl/:

  PYTHONPATH=src python benchmarks/walk_cost_check.py
"""
import argparse
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 295
COMPARED = ("BAND_TILES=8,16",)  # probe_walk_cost --compare
# the module's own first
CONFIGS = ({}, {"BAND_TILES": 8}, {"EPI_SLOTS": 4, "PIPELINE_STEPS": 3})
CONFIG_SHAPE = (4096, 4096, 8192)


def run_step(name, argv, limit_s, out):
  """Runs argv with limit_s seconds; returns (rc, seconds, log path). rc 124: timed out."""
  log = os.path.join(out, f"{name}.log")
  t0 = time.monotonic()
  with open(log, "w") as f:
    try:
      rc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                          timeout=max(limit_s, 1)).returncode
    except subprocess.TimeoutExpired:
      rc = 124
  took = time.monotonic() - t0
  with open(log) as f:
    tail = f.read().splitlines()[-25:]
  print(f"== {name}: rc={rc} in {took:.0f} s (limit {limit_s:.0f} s)", flush=True)
  print("\n".join("   " + line for line in tail), flush=True)
  return rc, took, log


def config_name(config):
  return ", ".join(f"{k}={v}" for k, v in config.items()) or "as committed"


def configs_step(out):
  """Writes OUT/gemm_configs.json: gemm rows at CONFIG_SHAPE for each of CONFIGS."""
  from jax_hoccl.bench.gemm import bench_gemm
  from probe_walk_cost import flagged_gemm_settings  # (this script's folder)
  rows = []
  for config in CONFIGS:
    try:
      with flagged_gemm_settings(config):
        got = bench_gemm([CONFIG_SHAPE])
    except Exception as e:  # a configuration that does not fit is reported, the others run
      print(f"   {config_name(config)}: {e!r}", flush=True)
      continue
    for r in got:
      rows.append(dict(r, config=config_name(config)))
      if r["impl"] != "xla":
        print(f"   {config_name(config):32s} {r['speed_vs_xla']:.3f}x XLA's dot speed "
              f"(spread {r['spread']:.1%})", flush=True)
  with open(os.path.join(out, "gemm_configs.json"), "w") as f:
    json.dump(rows, f, indent=1)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "raw"))
  ap.add_argument("--rounds", type=int, default=12, help="probe_walk_cost rounds")
  ap.add_argument("--configs-only", action="store_true", help="step 4 alone (its own process)")
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  if a.configs_only:
    configs_step(a.out)
    return 0
  start = time.monotonic()
  left = lambda reserve: BUDGET_S - reserve - (time.monotonic() - start)
  py = sys.executable
  steps = {}
  steps["tests"] = run_step(
      "tests", [py, "-m", "pytest", "tests/test_gpu_flagged_gemm.py", "-q", "-x",
                "-p", "no:cacheprovider"], min(100, left(100)), a.out)
  walk_json = os.path.join(a.out, "walk_cost.json")
  steps["walk_cost"] = run_step(
      "walk_cost", [py, os.path.join("benchmarks", "probe_walk_cost.py"), "--m", "4096,16384",
                    "--ranks", "2,4", "--rounds", str(a.rounds),
                    *[x for c in COMPARED for x in ("--compare", c)], "--warm-partials",
                    "--compare-at", "4096", "--json", walk_json], min(120, left(60)), a.out)
  paired_json = os.path.join(a.out, "walk_cost_paired.json")
  steps["walk_cost_paired"] = run_step(
      "walk_cost_paired", [py, os.path.join("benchmarks", "probe_walk_cost.py"), "--m",
                           "4096,16384", "--ranks", "2,4", "--rounds", str(a.rounds),
                           "--paired", "--json", paired_json], min(120, left(45)), a.out)
  steps["gemm"] = run_step(
      "gemm", [py, "-m", "jax_hoccl.bench", "--gemm-only", "--out", a.out],
      min(75, left(15)), a.out)
  steps["configs"] = run_step(
      "configs", [py, os.path.abspath(__file__), "--configs-only", "--out", a.out], left(0),
      a.out)
  configs_json = os.path.join(a.out, "gemm_configs.json")
  configs = json.load(open(configs_json)) if os.path.exists(configs_json) else []

  walk = json.load(open(walk_json)) if os.path.exists(walk_json) else {}
  paired = json.load(open(paired_json)) if os.path.exists(paired_json) else {}
  gemm_files = sorted(glob.glob(os.path.join(a.out, "*-gemm.json")))
  gemm = json.load(open(gemm_files[-1])) if gemm_files else {}
  meta = {k: walk.get(k, gemm.get(k)) for k in ("machine", "gpus", "devices", "jax", "date",
                                                  "commit", "python")}
  meta["date"] = meta["date"] or datetime.date.today().isoformat()
  result = dict(meta, dtype="bfloat16",
                walk_cost=walk.get("walk_cost", []) + paired.get("walk_cost", []),
                gemm=gemm.get("gemm", []),
                gemm_configs=configs,
                steps={k: dict(rc=rc, seconds=round(s, 1)) for k, (rc, s, _) in steps.items()})
  kind = (meta.get("devices") or ["GPU"])[0].replace(" ", "-")
  path = os.path.join(a.out, f"{meta['date']}-1x{kind}-walk-cost.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  if os.environ.get("OUT"):  # a device call brings back a few files: all of them as one
    with tarfile.open(os.path.join(os.environ["OUT"], "walk_cost_check.tar.gz"), "w:gz") as tar:
      tar.add(a.out, arcname=".")

  print(f"\n== summary ({time.monotonic() - start:.0f} s, commit {meta.get('commit')}, "
        f"{platform.node()}); wrote {path}")
  for k, (rc, s, _) in steps.items():
    print(f"step {k:10s} rc={rc} {s:5.0f} s" + ("  FAILED" if rc else ""))
  print("gemm (speed vs XLA's dot, >= 0.99 wanted):")
  for r in result["gemm"]:
    if r["impl"] != "xla":
      first = r.get("paired_speed_by_order") or [0, 0]
      print(f"  {r['m']}x{r['k']}x{r['n']:<6} {r['speed_vs_xla']:.3f}  (spread "
            f"{r.get('spread', 0):.1%}); paired {r.get('paired_speed_vs_xla', 0):.3f}  (spread "
            f"{r.get('paired_spread', 0):.1%}; dot first {first[0]:.3f}, GEMM first "
            f"{first[1]:.3f})")
  print("walk_cost (time vs XLA's dot; <= 1.02 at M=4096, <= 1.03 at M=16384 wanted):")
  for r in result["walk_cost"]:
    print(f"  M={r['m']:<6} ranks={r['ranks']} B={r.get('band_tiles')!s:4} {r['op']:22s} "
          f"{r['ratio_to_xla_dot']:.3f}  (spread {r['spread']:.1%})"
          + ("  paired (dot first {:.3f}, program first {:.3f})".format(*r["order_ratios"])
             if r.get("paired") else "")
          + ("  partials warm" if r.get("warm_partials") else ""))
  by_band = {}
  for r in result["walk_cost"]:
    if (r.get("band_tiles") is not None and r["m"] == 4096 and not r.get("paired")
        and not r.get("warm_partials")):
      by_band.setdefault(r["band_tiles"], []).append(r["ratio_to_xla_dot"])
  if len(by_band) > 1:
    means = {b: statistics.mean(v) for b, v in by_band.items()}
    best = min(means, key=means.get)
    print("band at M=4096 (mean walk ratio): " + ", ".join(
        f"B={b}: {v:.4f}" for b, v in sorted(means.items())) + f"  -> best BAND_TILES = {best}")
  speeds = {r["config"]: r["speed_vs_xla"] for r in configs if r["impl"] != "xla"}
  if speeds:
    best = max(speeds, key=speeds.get)
    print(f"configs at {'x'.join(map(str, CONFIG_SHAPE))}: " + ", ".join(
        f"{c}: {v:.3f}" for c, v in speeds.items()) + f"  -> best: {best}")
  return 0 if not any(rc for rc, _, _ in steps.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
