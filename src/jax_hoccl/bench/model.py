"""`python -m jax_hoccl.bench --model [RESULTS.json ...]`: fits the cost model
(`src/jax_hoccl/_src/cost_model.py`) to benchmark results, prints every row's prediction
next to its measurement, and projects 8 / 64 / 512 GPUs.

The fit is linear least squares on the relative error of the alpha-beta form, over the
collectives rows of at least `min_bytes` (1 MiB: below it the host's per-op cost dominates
and the single- vs multi-stream paths differ, which the model does not separate):
  jax_hoccl rows -> alpha per op, link_gbps, sum_gbps;
  copy_engine_raw rows -> engine_alpha_us, engine_gbps;
  jax.lax rows -> XLA's alpha and bus bandwidth per op;
  chains of staged calls (`bench --steps`' "device_latency" rows, two ranks on one GPU) ->
  staged_alpha_us and staged_packed_alpha_us (rows with "staged_packed"), which project the
  staged path's device time per call on two GPUs beside jax.lax's measured one (the
  "device_latency" rows of a two-GPU run).
A parameter that no row determines keeps cost_model.FITTED's value.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from jax_hoccl._src import cost_model as cm

MIB = 1 << 20
TARGET = 0.15  # every prediction of a jax_hoccl row >= 1 MiB within 15% of its measurement
# Runs before commit 66dfbb6 picked two_step for psum above 256 KiB at every group size
# (benchmarks/README.md, "Collectives"); later runs before the cost model picked one_shot
# for two ranks. Newer results record each psum row's algorithm.
TWO_STEP_ABOVE_256_KIB_COMMITS = {"e3b99d8"}


def group_size(result) -> int:
  return result["gpus"] or len(result["devices"])


def psum_algorithm(row, result) -> str:
  if "algorithm" in row:
    return row["algorithm"]
  n = group_size(result)
  if result["commit"] in TWO_STEP_ABOVE_256_KIB_COMMITS:
    return "one_shot" if row["bytes_per_device"] <= 256 * 1024 else "two_step"
  return "one_shot" if n <= 2 or row["bytes_per_device"] <= 256 * 1024 else "two_step"


@dataclasses.dataclass
class Row:
  source: str
  op: str
  impl: str
  algorithm: str | None
  nbytes: int
  n: int
  measured_us: float
  predicted_us: float = 0.0

  @property
  def error(self) -> float:
    return self.predicted_us / self.measured_us - 1


def load(results: dict[str, dict]) -> list[Row]:
  rows = []
  for name, result in results.items():
    if "collectives" not in result:  # (a `bench --steps` file: load_chains)
      continue
    n = group_size(result)
    for r in result["collectives"]:
      algo = psum_algorithm(r, result) if (r["op"], r["impl"]) == ("psum", "jax_hoccl") else None
      rows.append(Row(name, r["op"], r["impl"], algo, r["bytes_per_device"], n, r["time_us"]))
  return rows


def _solve(a: np.ndarray, t: np.ndarray) -> np.ndarray:
  """min || (a x - t) / t || over x, columns without data left at 0."""
  used = np.abs(a).sum(0) > 0
  x = np.zeros(a.shape[1])
  sol, *_ = np.linalg.lstsq(a[:, used] / t[:, None], np.ones(len(t)), rcond=None)
  x[used] = sol
  return x


def fit(rows: list[Row], min_bytes: int = MIB, base: cm.Params = cm.FITTED) -> cm.Params:
  p = base
  big = [r for r in rows if r.nbytes >= min_bytes]
  ours = [r for r in big if r.impl == "jax_hoccl" and r.n >= 2]
  if ours:
    a = np.zeros((len(ours), len(cm.OPS) + 2))
    t = np.zeros(len(ours))
    for i, r in enumerate(ours):
      known = 0.0
      for e in cm.exchanges(r.op, r.algorithm, r.nbytes, r.n):
        a[i, cm.OPS.index(e.alpha)] += 1
        a[i, -2] += e.link_bytes / 1e3   # x[-2] = 1 / link_gbps
        a[i, -1] += e.sum_bytes / 1e3    # x[-1] = 1 / sum_gbps
        known += 2 * p.hop_us + (e.copies - 1) * p.copy_issue_us
      t[i] = r.measured_us - known
    x = _solve(a, t)
    alpha = {op: (x[j] if a[:, j].any() else p.alpha_us[op]) for j, op in enumerate(cm.OPS)}
    p = dataclasses.replace(p, alpha_us=alpha, link_gbps=1 / x[-2] if x[-2] > 0 else p.link_gbps,
                            sum_gbps=1 / x[-1] if x[-1] > 0 else p.sum_gbps)
  raw = [r for r in big if r.impl == "copy_engine_raw"]
  if len(raw) >= 2:
    x = _solve(np.array([[1.0, r.nbytes / 1e3] for r in raw]),
               np.array([r.measured_us for r in raw]))
    p = dataclasses.replace(p, engine_alpha_us=x[0], engine_gbps=1 / x[1])
  xa, xb = dict(p.xla_alpha_us), dict(p.xla_busbw_gbps)
  for op in cm.OPS:
    lax = [r for r in big if r.impl == "jax.lax" and r.op == op]
    if len({r.nbytes for r in lax}) >= 2:
      x = _solve(np.array([[1.0, cm.busbw_factor(op, r.n) * r.nbytes / 1e3] for r in lax]),
                 np.array([r.measured_us for r in lax]))
      xa[op], xb[op] = x[0], 1 / x[1]
  return dataclasses.replace(p, xla_alpha_us=xa, xla_busbw_gbps=xb)


def load_chains(results: dict[str, dict]) -> list[Row]:
  """The staged chains of `bench --steps` files (rows with "ranks"), their sizes as the model
  counts them (all_gather's: its output); impl "staged_packed" where the chain's exchange was
  the packed one."""
  rows = []
  for name, result in results.items():
    for r in result.get("device_latency", []):
      if "ranks" in r and r["ranks"] >= 2:
        n = r["ranks"]
        nbytes = r["bytes_per_rank"] * (n if r["op"] == "all_gather" else 1)
        impl = "staged_packed" if r.get("staged_packed") else "staged"
        rows.append(Row(name, r["op"], impl, None, nbytes, n, r["us_per_op"]))
  return rows


def load_lax_device_times(results: dict[str, dict]) -> list[Row]:
  """jax.lax's device time per op (chained inside one jit) from runs on GPUs of their own."""
  return [Row(name, r["op"], "jax.lax", None, r["bytes_per_device"], group_size(result),
              r["device_time_us"])
          for name, result in results.items() if "collectives" in result
          for r in result.get("device_latency", []) if r.get("impl") == "jax.lax"]


def fit_staged(chains: list[Row], p: cm.Params) -> cm.Params:
  """staged_alpha_us and staged_packed_alpha_us: the mean over two-rank chains of each exchange
  of what their local terms leave (on one GPU no flag crosses a link: the pushes and the sum
  are local copies). A fixed cost no chain measures is kept."""
  def local(r):
    return sum((e.link_bytes + e.sum_bytes) / p.sum_gbps / 1e3
               for e in cm.exchanges(r.op, "one_shot" if r.op == "psum" else None, r.nbytes, r.n))
  fitted = {}
  for impl, name in (("staged", "staged_alpha_us"), ("staged_packed", "staged_packed_alpha_us")):
    two = [r for r in chains if r.n == 2 and r.impl == impl]
    if two:
      fitted[name] = float(np.mean([r.measured_us - local(r) for r in two]))
  return dataclasses.replace(p, **fitted)


def staged_projection(p: cm.Params, lax: list[Row]) -> str:
  """Markdown: the staged path's projected device time per call on two GPUs against jax.lax's
  measured one, at every size jax.lax was measured up to 1 MiB."""
  lines = ["| jax.lax from | op | size | staged, projected us | jax.lax, measured us | "
           "projected / jax.lax |", "|---|---|---|---|---|---|"]
  for r in sorted(lax, key=lambda r: (cm.OPS.index(r.op), r.nbytes, r.source)):
    if r.n == 2 and r.nbytes <= MIB:
      ours = cm.staged_us(r.op, r.nbytes, r.n, p)
      lines.append(f"| {r.source} | {r.op} | {size(r.nbytes)} | {ours:.1f} | "
                   f"{r.measured_us:.1f} | {ours / r.measured_us:.2f} |")
  return "\n".join(lines)


def predict(rows: list[Row], p: cm.Params) -> list[Row]:
  for r in rows:
    if r.impl == "jax_hoccl":
      r.predicted_us = cm.hoccl_us(r.op, r.algorithm, r.nbytes, r.n, p)
    elif r.impl == "jax.lax":
      r.predicted_us = cm.xla_us(r.op, r.nbytes, r.n, p)
    else:  # the raw peer copy: one copy on one engine
      r.predicted_us = p.engine_alpha_us + r.nbytes / p.engine_gbps / 1e3
  return rows


def size(b: float) -> str:
  return f"{b / (1 << 30):.3g} GiB" if b >= 1 << 30 else f"{b / MIB:.3g} MiB" if b >= MIB \
      else f"{b / 1024:.3g} KiB"


def params_text(p: cm.Params) -> str:
  ops = "  ".join(f"{op}={p.alpha_us[op]:.1f}" for op in cm.OPS)
  xla = "  ".join(f"{op}={p.xla_alpha_us[op]:.1f}us/{p.xla_busbw_gbps[op]:.0f}GB/s"
                  for op in cm.OPS)
  return "\n".join([
      f"fitted: alpha_us per exchange: {ops}",
      f"fitted: link_gbps={p.link_gbps:.1f}  sum_gbps={p.sum_gbps:.0f}  "
      f"engine_gbps={p.engine_gbps:.1f}  engine_alpha_us={p.engine_alpha_us:.2f}",
      f"fitted: XLA alpha/busbw: {xla}",
      f"fitted: staged_alpha_us={p.staged_alpha_us:.2f}  staged_packed_alpha_us="
      f"{p.staged_packed_alpha_us:.2f} (chains of staged calls, one GPU; packed up to "
      f"{size(p.staged_packed_bytes)})",
      f"fixed:  hop_us={p.hop_us}  copy_issue_us={p.copy_issue_us}  engines={p.engines}",
      f"assumed (several nodes): gpus_per_node={p.gpus_per_node}  nic_gbps={p.nic_gbps}  "
      f"nic_latency_us={p.nic_latency_us}"])


def fit_table(rows: list[Row], min_bytes: int = MIB) -> str:
  """Markdown: every row, predicted next to measured, and whether it misses the target."""
  lines = ["| file | op | impl | algorithm | size | measured us | predicted us | error |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    miss = " **miss**" if r.nbytes >= min_bytes and abs(r.error) > TARGET else ""
    note = "" if r.nbytes >= min_bytes else " (not fitted)"
    lines.append(f"| {r.source} | {r.op} | {r.impl} | {r.algorithm or ''} | {size(r.nbytes)} | "
                 f"{r.measured_us:.1f} | {r.predicted_us:.1f} | {r.error * 100:+.1f}%{miss}{note} |")
  return "\n".join(lines)


def summary(rows: list[Row], min_bytes: int = MIB) -> str:
  out = []
  for impl in ("jax_hoccl", "jax.lax", "copy_engine_raw"):
    sel = [r for r in rows if r.impl == impl and r.nbytes >= min_bytes]
    if sel:
      worst = max(sel, key=lambda r: abs(r.error))
      misses = sum(abs(r.error) > TARGET for r in sel)
      out.append(f"{impl}: {len(sel)} rows >= {size(min_bytes)}, worst {worst.error * 100:+.1f}% "
                 f"({worst.op} {worst.algorithm or ''} {size(worst.nbytes)}), "
                 f"{misses} beyond {TARGET:.0%}")
  return "\n".join(out)


PROJECTION_OPS = ("psum", "all_gather", "psum_scatter", "all_to_all")
PROJECTION_SIZES = (MIB, 16 * MIB, 256 * MIB)


def projection(p: cm.Params, gpus=(8, 64, 512)) -> str:
  """Markdown: predicted time per op, jax_hoccl (psum: the algorithm the model picks inside a
  node) against XLA's collective over the same GPUs, gpus_per_node GPUs per node."""
  lines = ["| GPUs | op | size | jax_hoccl us | XLA us | XLA / jax_hoccl |",
           "|---|---|---|---|---|---|"]
  for g in gpus:
    nodes = max(1, g // p.gpus_per_node)
    for op in PROJECTION_OPS:
      for s in PROJECTION_SIZES:
        algo = cm.choose_psum(s, g, p) if op == "psum" and nodes == 1 else None
        ours = cm.time_us(op, algo, s, g, nodes=nodes, p=p)
        xla = cm.time_us(op, None, s, g, impl="xla", nodes=nodes, p=p)
        name = f"{op} ({algo})" if algo else op if nodes == 1 or op != "psum" else \
            f"{op} (hierarchical)"
        lines.append(f"| {g} | {name} | {size(s)} | {ours:.0f} | {xla:.0f} | {xla / ours:.2f} |")
  return "\n".join(lines)


def crossovers(p: cm.Params, ns=(2, 4, 8)) -> str:
  parts = []
  for n in ns:
    c = cm.psum_crossover_bytes(n, p)
    parts.append(f"n={n}: " + ("one_shot at every size" if c is None else f"two_step from {size(c)}"))
  return "psum auto (model): " + "; ".join(parts)


def report(results: dict[str, dict], min_bytes: int = MIB) -> str:
  rows = load(results)
  p = fit_staged(load_chains(results), fit(rows, min_bytes))
  predict(rows, p)
  parts = [params_text(p), fit_table(rows, min_bytes), summary(rows, min_bytes), crossovers(p)]
  lax = load_lax_device_times(results)
  if lax:
    parts.append("The staged path on two GPUs (projected: the fixed costs from one GPU, one "
                 f"flag hop of {p.hop_us} us, the links' bandwidth) against jax.lax:\n"
                 + staged_projection(p, lax))
  parts.append("Projection (" + projection_note(p) + "):\n" + projection(p))
  return "\n\n".join(parts)


def projection_note(p: cm.Params) -> str:
  return (f"{p.gpus_per_node} GPUs per node on NVLink, nodes joined by XLA's collectives over "
          f"one {p.nic_gbps:g} GB/s NIC per GPU, assumed")


def main(paths: list[str]) -> int:
  results = {}
  for path in paths:
    with open(path) as f:
      results[path.rsplit("/", 1)[-1]] = json.load(f)
  print(report(results))
  return 0
