"""PNG figures from a results JSON (`python -m jax_hoccl.bench --plot DIR results.json`):
bus bandwidth against size per op (jax_hoccl, jax.lax, raw copy engine; log-scale sizes),
device time per op at small sizes, and the fused ops' time over the GEMM alone. matplotlib
is optional (`pip install jax_hoccl[bench]`) and imported only here."""
from __future__ import annotations

import os

from jax_hoccl.bench.report import fmt_bytes, fused_ratio

STYLE = {"jax_hoccl": ("C0", "o"), "jax.lax": ("C1", "s"), "copy_engine_raw": ("C2", "^")}


def _pyplot():
  try:
    import matplotlib
  except ImportError as e:
    raise SystemExit("plotting needs matplotlib: pip install 'jax_hoccl[bench]' "
                     "(or pip install matplotlib)") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot(result: dict, out_dir: str) -> list[str]:
  """Writes the figures the result has data for; returns their paths."""
  plt = _pyplot()
  os.makedirs(out_dir, exist_ok=True)
  title = f"{result['machine']}, jax {result['jax']}, {result['commit']}, {result['date']}"
  written = []

  def save(fig, name):
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

  rows = result.get("collectives", [])
  ops = list(dict.fromkeys(r["op"] for r in rows if r["impl"] == "jax_hoccl"))
  if ops:
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.6), squeeze=False)
    raw = [r for r in rows if r["impl"] == "copy_engine_raw"]
    for ax, op in zip(axes[0], ops):
      for impl, (color, marker) in STYLE.items():
        pts = sorted((r["bytes_per_device"], r["busbw_gbps"]) for r in
                     (raw if impl == "copy_engine_raw" else rows)
                     if r["impl"] == impl and (impl == "copy_engine_raw" or r["op"] == op))
        if pts:
          ax.plot(*zip(*pts), color=color, marker=marker, label=impl)
      ax.set_xscale("log", base=2)
      sizes = sorted({r["bytes_per_device"] for r in rows})
      ax.set_xticks(sizes, [fmt_bytes(b) for b in sizes], rotation=45, fontsize=7)
      ax.set_title(op)
      ax.set_ylabel("bus bandwidth (GB/s)")
      ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    written.append(save(fig, "busbw.png"))
  lat = result.get("device_latency", [])
  if lat:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = list(dict.fromkeys(f"{r['op']}\n{fmt_bytes(r['bytes_per_device'])}" for r in lat))
    for k, impl in enumerate(("jax_hoccl", "jax.lax")):
      vals = {f"{r['op']}\n{fmt_bytes(r['bytes_per_device'])}": r["device_time_us"]
              for r in lat if r["impl"] == impl}
      ax.bar([i + 0.4 * k for i in range(len(labels))], [vals.get(lb, 0) for lb in labels],
             width=0.4, color=STYLE[impl][0], label=impl)
    ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("device time per op (us)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    written.append(save(fig, "small_ops.png"))
  fused = result.get("fused", [])
  if fused:
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(fused) + 1.2))
    names = [f"{r['op']} / {r['impl']} {r['shape']}" for r in fused]
    ax.barh(range(len(fused)), [fused_ratio(r) for r in fused],
            color=["C0" if "jax_hoccl" in r["impl"] else "C1" for r in fused])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(fused)), names, fontsize=6)
    ax.set_xlabel("time / GEMM alone (1 = exchange fully hidden)")
    ax.set_title(title, fontsize=9)
    written.append(save(fig, "fused.png"))
  return written
