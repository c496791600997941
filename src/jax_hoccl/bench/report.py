"""What a benchmark run produced: its results JSON checked against the schema below, and the
table printed at the end of a run (ratios first: what a reader compares)."""
from __future__ import annotations

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# key -> type of the run's fields; section -> the fields every row of it has.
RUN_FIELDS = {"machine": str, "gpus": int, "devices": list, "jax": str, "date": str,
              "commit": str, "python": str}
SECTIONS = {
    "collectives": {"op": str, "impl": str, "bytes_per_device": int, "time_us": float,
                    "busbw_gbps": float},
    "interference": {"op": str, "impl": str, "gemm_ratio": float},
    "device_latency": {"op": str, "impl": str, "bytes_per_device": int, "device_time_us": float},
    "fused": {"op": str, "impl": str, "shape": str, "time_ms": float, "gemm_only_ms": float},
    "gemm": {"impl": str, "m": int, "k": int, "n": int, "time_us": float},
    "flag_latency": {"what": str, "time_us": float},
}
# (Fused rows since 2026-11-30 also carry "ratio", the median over interleaved rounds;
# fused_ratio falls back to the ratio of the medians for older files.)


def fused_ratio(row) -> float:
  return row.get("ratio", row["time_ms"] / row["gemm_only_ms"])


def validate(result: dict) -> None:
  """Raises ValueError naming the first field that breaks the schema."""
  def check(where, value, kind):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
        isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
      raise ValueError(f"{where}: expected {kind.__name__}, got {value!r}")
  for key, kind in RUN_FIELDS.items():
    if key not in result:
      raise ValueError(f"missing field {key!r}")
    check(key, result[key], kind)
  for section, fields in SECTIONS.items():
    rows = result.get(section, [])
    check(section, rows, list)
    for i, row in enumerate(rows):
      for key, kind in fields.items():
        if key not in row:
          raise ValueError(f"{section}[{i}]: missing field {key!r}")
        check(f"{section}[{i}].{key}", row[key], kind)


def fmt_bytes(b: int) -> str:
  return f"{b // GIB} GiB" if b >= GIB else f"{b // MIB} MiB" if b >= MIB else f"{b // KIB} KiB"


def table(result) -> str:
  """Per op and size: bandwidth ratio to jax.lax and to the raw copy engine, then times."""
  lines = ["op            size   hoccl/lax  hoccl/raw   hoccl_us    lax_us  hoccl_GB/s"]
  rows = result.get("collectives", [])
  raw = {r["bytes_per_device"]: r for r in rows if r["impl"] == "copy_engine_raw"}
  by = {(r["op"], r["impl"], r["bytes_per_device"]): r for r in rows}
  for op in dict.fromkeys(r["op"] for r in rows if r["impl"] == "jax_hoccl"):
    for nbytes in sorted({r["bytes_per_device"] for r in rows}):
      h, l = by.get((op, "jax_hoccl", nbytes)), by.get((op, "jax.lax", nbytes))
      if not h or not l:
        continue
      rr = raw.get(nbytes)
      vs_raw = f"{h['busbw_gbps'] / rr['busbw_gbps']:.2f}" if rr else "-"
      lines.append(f"{op:13s} {fmt_bytes(nbytes):>7s} {h['busbw_gbps'] / l['busbw_gbps']:9.2f} "
                   f"{vs_raw:>10s} {h['time_us']:10.1f} {l['time_us']:9.1f} "
                   f"{h['busbw_gbps']:11.1f}")
  if result.get("interference"):
    lines.append("GEMM speed beside the op (1 = untouched): " + "  ".join(
        f"{r['op']}/{'hoccl' if r['impl'] == 'jax_hoccl' else 'lax'}={r['gemm_ratio']:.3f}"
        for r in result["interference"]))
  lat = {(r["op"], r["impl"], r["bytes_per_device"]): r["device_time_us"]
         for r in result.get("device_latency", [])}
  if lat:
    lines.append("device time per op, host hidden (us, hoccl/lax): " + "  ".join(
        f"{op}@{fmt_bytes(b)}={lat[(op, 'jax_hoccl', b)]:.1f}/{lat.get((op, 'jax.lax', b), 0):.1f}"
        for (op, impl, b) in lat if impl == "jax_hoccl"))
  for r in result.get("gemm", []):
    if r["impl"] != "xla":
      lines.append(f"gemm {r['m']}x{r['k']}x{r['n']} {r['impl']}: {r['time_us']:.1f} us, "
                   f"x{r.get('speed_vs_xla', 0):.3f} of XLA's dot speed "
                   f"(paired x{r.get('paired_speed_vs_xla', 0):.3f})")
  for r in result.get("flag_latency", []):
    lines.append(f"flag latency: {r['what']}: {r['time_us']:.1f} us")
  for r in result.get("fused", []):
    lines.append(f"fused {r['op']:22s} {r['impl']:28s} x{fused_ratio(r):.2f} of GEMM alone  "
                 f"{r['time_ms']:8.3f} ms ({r['shape']})")
  return "\n".join(lines)
