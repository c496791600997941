"""Time per call of a jitted program beside a baseline program, in paired rounds: each round
times both (in alternating order, so a slow spell or a drift hits both alike), and what the
program adds is the median of the rounds' differences. Imported by the benchmarks' workers
(processes.py, steps.py), each a rank of a job.

A round of a program that exchanges with peers starts with one call waited for: that call ends
only once every rank has made it, so the ranks' timed calls start together, whatever the
baseline round before took on each."""
from __future__ import annotations

import resource
import statistics
import time

ROUNDS = 12
CALLS = 200


def _switches() -> tuple[int, int]:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_nvcsw, usage.ru_nivcsw


def _round_us(f, args, calls: int) -> tuple[float, float, float, float, float]:
  """Wall time, the process's CPU time, its voluntary and involuntary context switches, and
  the time until the last call returned (dispatched, not waited for), per call of `calls`
  calls back to back (each call's output the next one's first argument), waited for at the
  end; after one call waited for (see the module's doc). The CPU time and the switches count
  every thread of the process (its CPU time ran at about twice the wall time on a GPU under
  MPS): a thread that blocks switches voluntarily, one the kernel takes the CPU from switches
  involuntarily. A round whose dispatch takes its whole time was held by the host; one that
  dispatches early and then waits, by the device."""
  y = f(*args).block_until_ready()
  t0, c0, (v0, i0) = time.perf_counter(), time.process_time(), _switches()
  for _ in range(calls):
    y = f(y, *args[1:])
  dispatched = time.perf_counter()
  y.block_until_ready()
  v1, i1 = _switches()
  return ((time.perf_counter() - t0) / calls * 1e6, (time.process_time() - c0) / calls * 1e6,
          (v1 - v0) / calls, (i1 - i0) / calls, (dispatched - t0) / calls * 1e6)


def calls_made(rounds: int, calls: int) -> int:
  """How many times paired() calls its program: once to compile it, then in each round once
  waited for and `calls` times timed."""
  return 1 + rounds * (1 + calls)


def quartiles(values) -> list[float]:
  """The lower and upper quartiles of `values` (both the value itself for one)."""
  if len(values) == 1:
    return [values[0], values[0]]
  q = statistics.quantiles(values, n=4, method="inclusive")
  return [q[0], q[2]]


def paired(f, baseline, args, rounds: int = ROUNDS, calls: int = CALLS) -> dict:
  """{"us", "baseline_us": medians over the rounds; "added_us": the median of the rounds'
  differences; "added_quartiles_us", "added_per_round_us"; "us_per_round",
  "baseline_us_per_round"; "cpu_us", "baseline_cpu_us": the medians of the process's CPU time
  per call; "switches", "baseline_switches": the medians of its voluntary and involuntary
  context switches per call; "dispatch_us", "baseline_dispatch_us": the medians of the time
  per call until the round's last call returned} for `f` and `baseline` called on the same
  `args` (both compiled by a first call here)."""
  f(*args).block_until_ready()
  baseline(*args).block_until_ready()
  timed = ([], [])  # (wall, CPU, switches) per round: f's, the baseline's
  for i in range(rounds):
    for j in ((0, 1) if i % 2 else (1, 0)):
      timed[j].append(_round_us((f, baseline)[j], args, calls))
  ours, theirs = [t[0] for t in timed[0]], [t[0] for t in timed[1]]

  def switches(rounds):
    return [statistics.median(t[2] for t in rounds), statistics.median(t[3] for t in rounds)]

  added = [a - b for a, b in zip(ours, theirs)]
  return {"us": statistics.median(ours), "baseline_us": statistics.median(theirs),
          "added_us": statistics.median(added), "added_quartiles_us": quartiles(added),
          "added_per_round_us": added, "us_per_round": ours, "baseline_us_per_round": theirs,
          "cpu_us": statistics.median(t[1] for t in timed[0]),
          "baseline_cpu_us": statistics.median(t[1] for t in timed[1]),
          "switches": switches(timed[0]), "baseline_switches": switches(timed[1]),
          "dispatch_us": statistics.median(t[4] for t in timed[0]),
          "baseline_dispatch_us": statistics.median(t[4] for t in timed[1])}
