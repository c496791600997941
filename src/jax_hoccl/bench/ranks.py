"""The results of a benchmark's workers run as ranks (launch.run_workers): each prints one line
"RESULT" + JSON; the slowest rank's times are the job's."""
from __future__ import annotations

import json
import statistics

from jax_hoccl.bench import paired


def results(runs) -> list:
  """Each rank's JSON from run_workers' (exit status, output) pairs; fails with every rank's
  exit status and output's tail when one printed none."""
  found = [json.loads(out.split("RESULT")[1].splitlines()[0]) for _, out in runs
           if "RESULT" in out]
  if len(found) != len(runs):
    raise RuntimeError("\n".join(f"process {i} (exit {code}):\n{out[-2000:]}"
                                 for i, (code, out) in enumerate(runs)))
  return found


def slowest(rows_per_rank, keys) -> list[dict]:
  """Rank 0's rows with each of `keys` (that a row has) the largest over the ranks (rows in
  the same order)."""
  rows = []
  for per_rank in zip(*rows_per_rank):
    row = dict(per_rank[0])
    for key in keys:
      if key in row:
        row[key] = max(r[key] for r in per_rank)
    rows.append(row)
  return rows


def slowest_by(rows_per_rank, keys) -> list[dict]:
  """For each row (in the same order on every rank), the row of the rank where the first of
  `keys` that the row has is largest: one rank's figures, which belong together."""
  def worst(per_rank):
    key = next(k for k in keys if k in per_rank[0])
    return max(per_rank, key=lambda r: r[key])
  return [worst(per_rank) for per_rank in zip(*rows_per_rank)]


def with_job(rows_per_rank, keys) -> list[dict]:
  """slowest_by's rows, each paired row (paired.paired's, with its rounds) with what the
  program adds to the job as a whole: a round of either program on every rank ends with its
  slowest rank, so each round's slowest time with the collective minus its slowest time
  without ("job_added_us", the median over rounds; "job_added_quartiles_us",
  "job_added_per_round_us"), and every rank's medians ("us_by_rank", "baseline_us_by_rank",
  and its process's CPU time per call: "cpu_us_by_rank", "baseline_cpu_us_by_rank"; where
  the rows have them, its context switches per call, [voluntary, involuntary]:
  "switches_by_rank", "baseline_switches_by_rank", and its time per call until a round's
  last call returned: "dispatch_us_by_rank", "baseline_dispatch_us_by_rank").
  A rank slower on its own than its peers then counts once, not as what the collective adds
  to the others, which wait for it. The rounds' own lists are dropped."""
  rows = []
  for row, per_rank in zip(slowest_by(rows_per_rank, keys), zip(*rows_per_rank)):
    row = {k: v for k, v in row.items()
           if k not in ("us_per_round", "baseline_us_per_round", "cpu_us", "baseline_cpu_us",
                        "switches", "baseline_switches", "dispatch_us",
                        "baseline_dispatch_us")}
    if "us_per_round" in per_rank[0]:
      ours = [max(rounds) for rounds in zip(*(r["us_per_round"] for r in per_rank))]
      theirs = [max(rounds) for rounds in zip(*(r["baseline_us_per_round"] for r in per_rank))]
      added = [a - b for a, b in zip(ours, theirs)]
      row.update(job_added_us=statistics.median(added),
                 job_added_quartiles_us=paired.quartiles(added), job_added_per_round_us=added,
                 us_by_rank=[statistics.median(r["us_per_round"]) for r in per_rank],
                 baseline_us_by_rank=[statistics.median(r["baseline_us_per_round"])
                                      for r in per_rank],
                 cpu_us_by_rank=[r["cpu_us"] for r in per_rank],
                 baseline_cpu_us_by_rank=[r["baseline_cpu_us"] for r in per_rank])
      if "switches" in per_rank[0]:
        row.update(switches_by_rank=[r["switches"] for r in per_rank],
                   baseline_switches_by_rank=[r["baseline_switches"] for r in per_rank])
      if "dispatch_us" in per_rank[0]:
        row.update(dispatch_us_by_rank=[r["dispatch_us"] for r in per_rank],
                   baseline_dispatch_us_by_rank=[r["baseline_dispatch_us"] for r in per_rank])
    rows.append(row)
  return rows
