"""The cost model (src/jax_hoccl/_src/cost_model.py) and its fit (src/jax_hoccl/bench/model.py):
the fit recovers known parameters, psum's auto choice switches at the model's crossover, the
committed 2x H200 results are predicted within the stated error, and
`python -m jax_hoccl.bench --model FILE` runs end to end without devices."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl as hc
from jax_hoccl._src import cost_model as cm
from jax_hoccl._src.ops import psum as psum_lib
from jax_hoccl.bench import model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = [os.path.join(REPO, "benchmarks/results", f) for f in
        ("2026-11-30-2xNVIDIA-H200.json", "2026-11-30-2xNVIDIA-H200-psum-one-shot-collectives.json")]
MIB = 1 << 20


def _load(paths):
  return {os.path.basename(p): json.load(open(p)) for p in paths}


def _synthetic(p, n=2, noise=0.0, seed=0):
  """A results dict whose times are the model's own predictions under p (times (1 + noise))."""
  rng = np.random.default_rng(seed)
  rows = []
  for s in (MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1 << 30):
    for op in cm.OPS:
      algos = cm.PSUM_ALGORITHMS if op == "psum" else (None,)
      for algo in algos:
        row = dict(op=op, impl="jax_hoccl", bytes_per_device=s,
                   time_us=cm.hoccl_us(op, algo, s, n, p) * (1 + noise * rng.standard_normal()))
        if algo:
          row["algorithm"] = algo
        rows.append(row)
      rows.append(dict(op=op, impl="jax.lax", bytes_per_device=s,
                       time_us=cm.xla_us(op, s, n, p) * (1 + noise * rng.standard_normal())))
    rows.append(dict(op="copy", impl="copy_engine_raw", bytes_per_device=s,
                     time_us=p.engine_alpha_us + s / p.engine_gbps / 1e3))
  return {"synthetic": dict(gpus=n, devices=["x"] * n, commit="synthetic", collectives=rows)}


TRUE = dataclasses.replace(
    cm.FITTED, alpha_us={"psum": 31.0, "all_gather": 22.0, "psum_scatter": 35.0,
                         "all_to_all": 18.0, "ppermute": 7.5},
    link_gbps=250.0, sum_gbps=3000.0, engine_gbps=410.0, engine_alpha_us=3.0,
    xla_alpha_us={op: 10.0 + i for i, op in enumerate(cm.OPS)},
    xla_busbw_gbps={op: 150.0 + 20 * i for i, op in enumerate(cm.OPS)})


def test_fit_recovers_known_parameters():
  rows = model.load(_synthetic(TRUE))
  got = model.fit(rows)  # starts from FITTED's values, which differ from TRUE's
  for op in cm.OPS:
    assert got.alpha_us[op] == pytest.approx(TRUE.alpha_us[op], rel=1e-6), op
    assert got.xla_alpha_us[op] == pytest.approx(TRUE.xla_alpha_us[op], rel=1e-6), op
    assert got.xla_busbw_gbps[op] == pytest.approx(TRUE.xla_busbw_gbps[op], rel=1e-6), op
  for name in ("link_gbps", "sum_gbps", "engine_gbps", "engine_alpha_us"):
    assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
  # With 2% noise the bandwidths still come back within a few percent.
  noisy = model.fit(model.load(_synthetic(TRUE, noise=0.02, seed=1)))
  assert noisy.link_gbps == pytest.approx(TRUE.link_gbps, rel=0.05)
  for op in cm.OPS:
    assert noisy.xla_busbw_gbps[op] == pytest.approx(TRUE.xla_busbw_gbps[op], rel=0.05), op


def test_committed_fit_is_what_the_model_holds():
  """FITTED is the fit of the committed 2x H200 results (not hand-tuned numbers)."""
  got = model.fit(model.load(_load(H200)))
  for op in cm.OPS:
    assert got.alpha_us[op] == pytest.approx(cm.FITTED.alpha_us[op], abs=0.1), op
    assert got.xla_alpha_us[op] == pytest.approx(cm.FITTED.xla_alpha_us[op], abs=0.1), op
    assert got.xla_busbw_gbps[op] == pytest.approx(cm.FITTED.xla_busbw_gbps[op], rel=0.005), op
  for name in ("link_gbps", "sum_gbps", "engine_gbps", "engine_alpha_us"):
    assert getattr(got, name) == pytest.approx(getattr(cm.FITTED, name), rel=0.005), name


def test_committed_h200_rows_within_target():
  """Every jax_hoccl and raw-copy row >= 1 MiB within 15%; XLA's rows, which an alpha-beta
  form fits worse (NCCL changes protocol with size), within the 25% benchmarks/README.md
  states, with the misses it names."""
  rows = model.predict(model.load(_load(H200)), cm.FITTED)
  big = [r for r in rows if r.nbytes >= MIB]
  assert len(big) == 99
  for r in big:
    bound = 0.25 if r.impl == "jax.lax" else model.TARGET
    assert abs(r.error) <= bound, (r.source, r.op, r.impl, r.nbytes, r.error)
  misses = {(r.op, r.nbytes) for r in big if abs(r.error) > model.TARGET}
  assert misses == {("ppermute", 16 * MIB), ("psum", 1 << 30), ("ppermute", 1 << 30)}


def test_psum_times_follow_the_structure():
  """one_shot pulls (n-1)x the bytes, two_step 2(n-1)/n x: at n = 2 the same link bytes, so
  two_step only wins once its smaller sum outweighs its second exchange; the wider the group,
  the earlier two_step wins."""
  c2, c4, c8 = (cm.psum_crossover_bytes(n) for n in (2, 4, 8))
  assert c8 < c4 < c2
  assert 1 * MIB < c8 < 16 * MIB
  for n, c in ((2, c2), (8, c8)):
    assert cm.choose_psum(int(c * 0.9), n) == "one_shot"
    assert cm.choose_psum(int(c * 1.1), n) == "two_step"
  assert cm.choose_psum(64 * 1024, 8) == "one_shot"


@pytest.mark.parametrize("n", [2, 8])
def test_psum_auto_switches_at_the_model_crossover(n, monkeypatch):
  """The traced program uses two_step exactly from the model's crossover on, for an f32 and a
  bf16 array (the choice goes by bytes), and the override still wins."""
  monkeypatch.delenv("JAX_HOCCL_PSUM_ALGORITHM", raising=False)
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  spec = P("x")
  f = jax.jit(jax.shard_map(lambda a: hc.psum(a, "x"), mesh=mesh, in_specs=spec, out_specs=spec))
  cross = cm.psum_crossover_bytes(n)
  for dtype in (jnp.float32, jnp.bfloat16):
    item = jnp.dtype(dtype).itemsize
    for factor, want in ((0.95, False), (1.05, True)):
      elems = int(cross * factor) // item
      x = jax.ShapeDtypeStruct((n * elems,), dtype, sharding=NamedSharding(mesh, spec))
      text = f.lower(x).as_text()
      assert ("hoccl_all_to_all" in text) == want, (dtype, factor)
      assert psum_lib.choose_algorithm(elems * item, n) == ("two_step" if want else "one_shot")
  small = jax.ShapeDtypeStruct((n * 16,), jnp.float32, sharding=NamedSharding(mesh, spec))
  with hc.psum_algorithm("two_step"):
    assert "hoccl_all_to_all" in f.lower(small).as_text()


def test_psum_auto_gives_jax_lax_results_on_both_sides():
  """Around n = 8's crossover (a few MiB), both algorithms the model picks sum correctly."""
  n = 8
  mesh = jax.make_mesh((n,), ("x",))
  cross = cm.psum_crossover_bytes(n)
  rng = np.random.default_rng(0)
  f = jax.jit(jax.shard_map(lambda a: (hc.psum(a, "x"), jax.lax.psum(a, "x")), mesh=mesh,
                            in_specs=P("x"), out_specs=(P(), P())))
  for factor in (0.9, 1.1):
    elems = int(cross * factor) // 4
    x = jax.device_put(rng.standard_normal(n * elems, dtype=np.float32),
                       NamedSharding(mesh, P("x")))
    got, ref = f(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_projection_composes_as_across_processes():
  """Several nodes: psum = reduce-scatter inside + XLA's psum across on 1/8 + all-gather
  inside; all_to_all is XLA's over the whole group."""
  p = cm.FITTED
  s = 256 * MIB
  want = (cm.hoccl_us("psum_scatter", None, s, 8, p) + cm.xla_us("psum", s / 8, 8, p, nodes=8)
          + cm.hoccl_us("all_gather", None, s, 8, p))
  assert cm.time_us("psum", None, s, 64, nodes=8) == pytest.approx(want)
  assert cm.time_us("all_to_all", None, s, 64, nodes=8) == \
      cm.time_us("all_to_all", None, s, 64, impl="xla", nodes=8)
  # XLA's all_to_all across nodes is bound by the NIC: slower per byte than inside a node.
  assert cm.xla_us("all_to_all", s, 64, p, nodes=8) > 4 * cm.xla_us("all_to_all", s, 8, p)
  with pytest.raises(ValueError, match="unknown op"):
    cm.time_us("pmax", None, s, 8)


def test_model_cli_on_a_committed_file():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-P", "-m", "jax_hoccl.bench", "--model", *H200],
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout
  assert f"link_gbps={cm.FITTED.link_gbps:.1f}" in text
  assert "jax_hoccl: 45 rows >= 1 MiB" in text and "0 beyond 15%" in text
  assert "| 2026-11-30-2xNVIDIA-H200.json | psum | jax_hoccl | two_step | 1 GiB | 3635.1 |" in text
  for gpus in (8, 64, 512):
    assert f"\n| {gpus} | psum" in text, gpus
  assert "CPU timings" not in out.stderr  # nothing was measured: no device was needed


STEPS = os.path.join(os.path.dirname(H200[0]), "2026-12-04-1xH200-steps-packed-5671fa3.json")


def test_staged_fit_is_what_the_model_holds_and_projects_two_gpus():
  """staged_alpha_us and staged_packed_alpha_us are the fits of the committed chains of
  staged calls (one H200, 2 ranks), each over the chains of its exchange; the projection puts
  the staged path's device time per call beside every jax.lax row of the 2x H200 runs up to
  1 MiB, and its terms are the staged path's: the fixed cost, one flag hop, the link bytes
  (psum pulls the peer's whole array, all_gather its half; packed blocks twice that)."""
  chains = model.load_chains(_load([STEPS]))
  assert {(r.op, r.n, r.impl) for r in chains} >= {
      (op, 2, impl) for op in ("psum", "all_gather") for impl in ("staged", "staged_packed")}
  p = model.fit_staged(chains, cm.FITTED)
  assert p.staged_alpha_us == pytest.approx(cm.FITTED.staged_alpha_us, abs=0.05)
  assert p.staged_packed_alpha_us == pytest.approx(cm.FITTED.staged_packed_alpha_us, abs=0.05)
  assert p.staged_packed_alpha_us < p.staged_alpha_us  # the packed chains ran faster
  assert model.fit_staged([], cm.FITTED) == cm.FITTED  # nothing to fit: kept
  unpacked_only = model.fit_staged([r for r in chains if r.impl == "staged"], cm.FITTED)
  assert unpacked_only.staged_packed_alpha_us == cm.FITTED.staged_packed_alpha_us
  small = 64 << 10  # packed: all_gather's 32 KiB block, psum's 64 KiB; never ppermute
  packed = p.staged_packed_alpha_us + p.hop_us
  assert cm.staged_us("all_gather", small, 2, p) == pytest.approx(
      packed + 2 * (small / 2) / p.link_gbps / 1e3 + small / p.sum_gbps / 1e3)
  assert cm.staged_us("psum", small, 2, p) == pytest.approx(
      packed + 2 * small / p.link_gbps / 1e3 + 3 * small / p.sum_gbps / 1e3)
  assert cm.staged_us("ppermute", small, 2, p) == pytest.approx(
      p.staged_alpha_us + p.hop_us + small / p.link_gbps / 1e3)
  s = 1 * MIB
  fixed = p.staged_alpha_us + p.hop_us
  assert cm.staged_us("ppermute", s, 2, p) == pytest.approx(fixed + s / p.link_gbps / 1e3)
  assert cm.staged_us("all_gather", s, 2, p) == pytest.approx(
      fixed + (s / 2) / p.link_gbps / 1e3 + s / p.sum_gbps / 1e3)
  assert cm.staged_us("psum", s, 2, p) == pytest.approx(
      fixed + s / p.link_gbps / 1e3 + 3 * s / p.sum_gbps / 1e3)
  lax = model.load_lax_device_times(_load(H200))
  table = model.staged_projection(p, lax)
  body = table.splitlines()[2:]
  assert len(body) == len([r for r in lax if r.nbytes <= MIB]) == 20
  for line in body:
    cells = [c.strip() for c in line.strip("|").split("|")]
    ours, theirs, ratio = float(cells[3]), float(cells[4]), float(cells[5])
    assert ratio == pytest.approx(ours / theirs, abs=0.01), line  # (cells rounded)
