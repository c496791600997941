"""The results of a benchmark's workers run as ranks (launch.run_workers): each prints one line
"RESULT" + JSON; the slowest rank's times are the job's."""
from __future__ import annotations

import json


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
