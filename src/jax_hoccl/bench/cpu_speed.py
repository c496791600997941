"""Whether every CPU of this machine runs alike: the time of one fixed loop on each CPU in
turn (this process pinned to it), over several passes, as wall time and as this thread's CPU
time (a loop that took longer in both ran on a slower CPU; one whose CPU time stayed short
waited for other work on that CPU), and each CPU's steal time over the probe (the time a
hypervisor ran something else while this VM's CPU wanted to run).

On a VM a rank whose threads land on a CPU that runs slow for a while dispatches its calls
slower, and its peers wait for it: bench --processes' spells (docs/design.md, "The staged
path"). bench --processes and --steps run it before and after their jobs ("cpu_speed" in
their results).

    python -m jax_hoccl.bench.cpu_speed [--passes 10] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

LOOP = 300_000  # sum(range(LOOP)): a few milliseconds of one core, no memory traffic
AROUND_JOBS = 3  # the passes a benchmark runs before its jobs and after


def steal_by_cpu() -> dict[int, int]:
  """Each CPU's steal time so far, in clock ticks (/proc/stat; {} where it is not there)."""
  out = {}
  try:
    with open("/proc/stat") as f:
      for line in f:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu" and len(fields) > 7:
          out[int(name[3:])] = int(fields[7])
  except OSError:
    pass
  return out


def loop_us(tries: int = 5) -> tuple[float, float]:
  """The fixed loop's median wall time and median CPU time on the CPU this process runs on,
  in us."""
  wall, cpu = [], []
  for _ in range(tries):
    t0, c0 = time.perf_counter(), time.thread_time()
    sum(range(LOOP))
    wall.append((time.perf_counter() - t0) * 1e6)
    cpu.append((time.thread_time() - c0) * 1e6)
  return statistics.median(wall), statistics.median(cpu)


def probe(passes: int) -> dict:
  """{"cpus", "loop_us" and "loop_cpu_us": [per pass: [per CPU]], "slowest_over_fastest"
  (wall) per pass, "steal_ticks": per CPU over the probe, "ticks_per_s"}."""
  cpus = sorted(os.sched_getaffinity(0))
  before, t0 = steal_by_cpu(), time.time()
  table, cpu_table = [], []
  try:
    for _ in range(passes):
      row, cpu_row = [], []
      for cpu in cpus:
        os.sched_setaffinity(0, {cpu})
        wall, on_cpu = loop_us()
        row.append(round(wall, 1))
        cpu_row.append(round(on_cpu, 1))
      table.append(row)
      cpu_table.append(cpu_row)
  finally:
    os.sched_setaffinity(0, cpus)
  after = steal_by_cpu()
  return {"cpus": cpus, "loop_us": table, "loop_cpu_us": cpu_table,
          "seconds": round(time.time() - t0, 2),
          "slowest_over_fastest": [round(max(r) / min(r), 3) for r in table],
          "steal_ticks": [after.get(c, 0) - before.get(c, 0) for c in cpus],
          "ticks_per_s": os.sysconf("SC_CLK_TCK")}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--passes", type=int, default=10)
  ap.add_argument("--json", help="also write the result here")
  a = ap.parse_args()
  result = probe(a.passes)
  print("loop time per CPU, wall / CPU (us), one line per pass; last: slowest / fastest wall")
  print("cpu   " + " ".join(f"{c:>11}" for c in result["cpus"]))
  for i, (row, cpu_row) in enumerate(zip(result["loop_us"], result["loop_cpu_us"])):
    print(f"p{i:<4} " + " ".join(f"{v:5.0f}/{c:5.0f}" for v, c in zip(row, cpu_row))
          + f"  {result['slowest_over_fastest'][i]:.2f}")
  print("steal " + " ".join(f"{s:>11}" for s in result["steal_ticks"])
        + f"  (ticks of 1/{result['ticks_per_s']} s over {result['seconds']} s)")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
