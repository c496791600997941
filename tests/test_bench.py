"""`python -m jax_hoccl.bench` end to end on CPU (tiny sizes), its results JSON against the
schema, and `--plot` on a committed GPU results file (skipped without matplotlib)."""
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from jax_hoccl.bench import report
from conftest import gpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(tmp_path, *args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, "-P", "-m", "jax_hoccl.bench", *args,
                         "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                        timeout=900)


def test_bench_runs_and_writes_a_valid_json(tmp_path):
  out = _bench(tmp_path, "--ops", "psum,all_gather", "--sizes", "0.0625", "--repeats", "1",
               "--quick")
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "CPU timings say nothing about GPUs" in out.stderr
  assert "2/4" in out.stderr  # the progress bar
  files = glob.glob(str(tmp_path / "*.json"))
  assert len(files) == 1, files
  result = json.load(open(files[0]))
  report.validate(result)
  assert {r["op"] for r in result["collectives"]} == {"psum", "all_gather"}
  assert {r["impl"] for r in result["collectives"]} == {"jax_hoccl", "jax.lax"}
  assert result["fused"], "the quick fused section ran"
  assert "hoccl/lax" in out.stdout and "psum" in out.stdout.split("hoccl/lax")[1]


def test_schema_names_the_broken_field():
  good = json.load(open(os.path.join(REPO, "benchmarks/results/2026-11-30-2xNVIDIA-H200.json")))
  report.validate(good)
  bad = dict(good, collectives=[dict(good["collectives"][0], time_us="fast")])
  with pytest.raises(ValueError, match=r"collectives\[0\]\.time_us"):
    report.validate(bad)
  with pytest.raises(ValueError, match="missing field 'commit'"):
    report.validate({k: v for k, v in good.items() if k != "commit"})


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_draws_a_committed_result(tmp_path):
  res = os.path.join(REPO, "benchmarks/results/2026-11-30-2xNVIDIA-H200.json")
  out = _bench(tmp_path, "--plot", str(tmp_path / "fig"), res)
  assert out.returncode == 0, out.stderr[-3000:]
  for name in ("busbw.png", "small_ops.png", "fused.png"):
    path = tmp_path / "fig" / name
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_per_call_rows_set_each_collective_beside_the_program_without_it(tmp_path, monkeypatch):
  """--processes: two processes of one CPU device each; every (op, size) row carries the same
  program's time without the collective, measured in the same job, on each path (the staged
  one by default, the rendezvous with JAX_HOCCL_STAGED_BYTES=0), as the engine counted it."""
  from jax_hoccl.bench import cpu_speed, processes
  monkeypatch.setattr(processes, "OPS", ("psum", "ppermute"))
  monkeypatch.setattr(processes, "BYTES_PER_RANK", (4096,))
  monkeypatch.setattr(processes, "JOBS", 1)
  monkeypatch.setattr(processes, "ROUNDS", 4)
  monkeypatch.setattr(processes, "CALLS", 50)
  monkeypatch.delenv("JAX_HOCCL_STAGED_BYTES", raising=False)
  path = processes.run(str(tmp_path), "test")
  assert os.path.dirname(path) == str(tmp_path) and path.endswith("-per-call.json"), path
  result = json.load(open(path))
  rows = result["per_call"]
  assert [(r["op"], r["bytes_per_rank"], r["ranks"], r["mps"], r["path"], r["setting"])
          for r in rows] == [
      ("psum", 4096, 2, False, "staged", "staged"),
      ("ppermute", 4096, 2, False, "staged", "staged"),
      ("psum", 4096, 2, False, "rendezvous", "rendezvous"),
      ("ppermute", 4096, 2, False, "rendezvous", "rendezvous")]
  assert all(r["us_per_call"] > 0 and r["baseline_us_per_call"] > 0 for r in rows), rows
  for r in rows:  # the paired rounds' differences: their median and quartiles
    added = r["added_per_round_us"]
    assert r["jobs"] == 1 and len(added) == processes.ROUNDS, r
    assert r["added_us_per_call"] == statistics.median(added), r
    assert min(added) <= r["spread_us"][0] <= r["added_us_per_call"] <= r["spread_us"][1], r
    job = r["job_added_per_round_us"]  # the job's: each round's slowest rank with and without
    assert len(job) == processes.ROUNDS and r["job_added_us_per_call"] == statistics.median(job)
    assert len(r["us_per_call_by_rank"]) == len(r["baseline_us_per_call_by_rank"]) == 2, r
    assert all(c > 0 for c in r["cpu_us_per_call_by_rank"] + r["baseline_cpu_us_per_call_by_rank"])
    switches = r["switches_per_call_by_rank"] + r["baseline_switches_per_call_by_rank"]
    assert len(switches) == 4 and all(len(s) == 2 and min(s) >= 0 for s in switches), r
    assert any(s[0] > 0 for s in switches), r  # waiting for a peer blocks some thread
    for total, dispatch in ((r["us_per_call_by_rank"], r["dispatch_us_per_call_by_rank"]), (
        r["baseline_us_per_call_by_rank"], r["baseline_dispatch_us_per_call_by_rank"])):
      assert all(0 < d <= t for d, t in zip(dispatch, total)) and len(dispatch) == 2, r
    assert r["baseline_us_per_call"] in r["baseline_us_per_call_by_rank"], r
    assert "us_per_round" not in r and "baseline_us_per_round" not in r, r
  assert isinstance(result["host_profile"], list)  # (phases are counted by the CUDA engine)
  cpus = sorted(os.sched_getaffinity(0))
  for when in ("before", "after"):  # whether the CPUs ran alike, around the jobs
    speed = result["cpu_speed"][when]
    assert speed["cpus"] == cpus and len(speed["loop_us"]) == cpu_speed.AROUND_JOBS
    assert all(len(row) == len(cpus) and min(row) > 0 for row in speed["loop_us"]), speed


def test_cpu_speed_times_the_loop_on_every_cpu_and_restores_the_affinity():
  """cpu_speed.probe pins itself to each CPU in turn: a time per CPU and pass, wall and CPU
  time alike for a loop that has its CPU to itself (within what a busy CI machine allows),
  the ratio per pass, and the process's own CPUs back afterwards."""
  from jax_hoccl.bench import cpu_speed
  cpus = sorted(os.sched_getaffinity(0))
  result = cpu_speed.probe(2)
  assert sorted(os.sched_getaffinity(0)) == cpus == result["cpus"]
  assert len(result["loop_us"]) == len(result["loop_cpu_us"]) == 2
  for wall, cpu in zip(result["loop_us"], result["loop_cpu_us"]):
    assert len(wall) == len(cpu) == len(cpus)
    assert all(0 < c <= w * 1.05 + 50 for w, c in zip(wall, cpu)), (wall, cpu)
  assert result["slowest_over_fastest"] == [round(max(r) / min(r), 3) for r in result["loop_us"]]
  assert len(result["steal_ticks"]) == len(cpus) and min(result["steal_ticks"]) >= 0


def test_a_job_in_one_ranks_slow_spell_runs_again():
  """A job whose ranks ran the baseline far apart (one rank in a slow spell) runs again, at
  most SPELL_RERUNS times, and the least skewed one is kept, saying so."""
  from jax_hoccl.bench import processes

  def job(*baselines):
    return [{"op": "psum", "baseline_us_per_call_by_rank": list(b)} for b in baselines], "gpu"

  jobs = iter([job((28, 72), (28, 70)), job((29, 33), (30, 31)), job((28, 29), (28, 28))])
  rows, plat = processes._least_skewed(lambda: next(jobs), processes.SPELL_RERUNS)
  assert plat == "gpu" and [r["baseline_us_per_call_by_rank"] for r in rows] == [[29, 33], [30, 31]]
  assert all(r["spell_reruns"] == 1 and r["rank_skew"] < processes.SKEWED for r in rows), rows
  spells = iter([job((28, 72))] * 3 + [job((28, 29))])  # every run skewed: the limit holds
  rows, _ = processes._least_skewed(lambda: next(spells), processes.SPELL_RERUNS)
  assert rows[0]["spell_reruns"] == processes.SPELL_RERUNS and rows[0]["rank_skew"] > 2, rows
  rows, _ = processes._least_skewed(lambda: job((28, 72)), 0)  # without a GPU: never again
  assert rows[0]["spell_reruns"] == 0, rows


def test_per_call_rows_of_donated_calls(tmp_path, monkeypatch):
  """--processes with each call's input donated (a job of the GPU's settings, run here on CPU):
  every round starts from a copy of the same array, so no call meets a donated one."""
  from jax_hoccl.bench import processes
  monkeypatch.setattr(processes, "OPS", ("psum", "all_gather"))
  monkeypatch.setattr(processes, "BYTES_PER_RANK", (4096,))
  monkeypatch.setattr(processes, "JOBS", 1)
  monkeypatch.setattr(processes, "ROUNDS", 3)
  monkeypatch.setattr(processes, "CALLS", 20)
  monkeypatch.setattr(processes, "settings",
                      lambda gpu, flags: {"donated": {"BENCH_DONATE": "1"}})
  monkeypatch.delenv("JAX_HOCCL_STAGED_BYTES", raising=False)
  rows = json.load(open(processes.run(str(tmp_path), "test")))["per_call"]
  assert [(r["op"], r["path"], r["donated"], r["setting"]) for r in rows] == [
      ("psum", "staged", True, "donated"), ("all_gather", "staged", True, "donated")], rows
  assert all(r["us_per_call"] > 0 and len(r["added_per_round_us"]) == 3 for r in rows), rows


def test_steps_rows_set_each_step_beside_the_step_without_collectives(tmp_path, monkeypatch):
  """--steps: two processes of one CPU device each; a step row per collective beside the same
  step without one, the chained collectives' device time and decode's GEMV + psum beside the
  GEMV alone."""
  from jax_hoccl.bench import cpu_speed, steps
  monkeypatch.setattr(steps, "ROUNDS", 4)
  monkeypatch.setattr(steps, "CALLS", 20)
  result = json.load(open(steps.run(str(tmp_path), "test")))
  rows = result["step"]
  assert sorted(r["op"] for r in rows) == ["all_gather", "ppermute", "psum"], rows
  assert all(len(result["cpu_speed"][when]["loop_us"]) == cpu_speed.AROUND_JOBS
             for when in ("before", "after")), result["cpu_speed"]
  for r in rows:
    assert r["layers"] == steps.LAYERS and r["ranks"] == 2 and r["floor_us"] is None
    assert r["staged_sum"] is False  # the sum inside the exchange kernel is CUDA's
    assert r["staged_packed"] is True  # (a setting: only GPU jobs turn the packed path off)
    assert r["us_per_step"] > 0 and r["baseline_us_per_step"] > 0
    assert abs(r["per_collective_us"] * r["layers"] - r["added_us_per_step"]) < 1e-6
    low, high = r["added_quartiles_us"]
    assert low <= r["added_us_per_step"] <= high, r
  assert sorted(r["op"] for r in result["device_latency"]) == ["all_gather", "psum"]
  decode = result["decode"]
  assert [r["rows"] for r in decode] == [1, 8, 64]
  for r in rows + decode:  # beside the slowest rank's: the job's, and every rank's baseline
    key = "job_added_us_per_step" if r in rows else "job_added_us_per_call"
    assert isinstance(r[key], float), r
    assert len(r.get("baseline_us_per_step_by_rank") or r["gemv_us_per_call_by_rank"]) == 2, r
    assert len(r.get("cpu_us_per_step_by_rank") or r["cpu_us_per_call_by_rank"]) == 2, r
    assert r["recorded_per_call"] == 0, r  # no CUDA graphs without a GPU
  for r in decode:
    assert r["layers"] == steps.LAYERS and r["us_per_call"] > 0 and r["gemv_us_per_call"] > 0
    low, high = r["added_quartiles_us"]
    assert low <= r["added_us_per_call"] <= high, r


def test_processes_on_a_gpu_time_both_sums_with_and_without_graphs(monkeypatch):
  """bench --processes on a GPU: every path (the staged one also without the packed exchange),
  and the staged sums inside the exchange kernel and by XLA (JAX_HOCCL_STAGED_SUM=0), each also
  with every program in CUDA graphs."""
  from jax_hoccl.bench import processes
  monkeypatch.delenv("JAX_HOCCL_STAGED_BYTES", raising=False)
  settings = [env for _, env in processes._settings(True, "--flags")]
  graphs = {"XLA_FLAGS": f"--flags {processes.CAPTURED_FLAG}"}
  for want in ({}, {"JAX_HOCCL_STAGED_SUM": "0"}, graphs, {**graphs, "JAX_HOCCL_STAGED_SUM": "0"},
               {"JAX_HOCCL_STAGED_KERNEL": "0"}, {"JAX_HOCCL_STAGED_BYTES": "0"},
               {"JAX_HOCCL_STAGED_PACKED_BYTES": "0"}, {**graphs, "BENCH_DONATE": "1"}):
    assert want in settings, settings
  assert processes._settings(False, "") == [("staged", {}),
                                            ("rendezvous", {"JAX_HOCCL_STAGED_BYTES": "0"})]


def test_processes_time_the_floor_on_a_gpu_only():
  """bench --processes: on a GPU each job also times one kernel copying the input in the
  collective's place (the staged rows' floor); without one there is no such kernel."""
  from jax_hoccl.bench import processes
  assert processes.ops(False) == processes.OPS
  assert processes.ops(True) == processes.OPS + (processes.FLOOR_OP,)


def test_rows_say_what_each_collective_adds_beyond_the_floor():
  """beyond_floor_us: a row's job figure less the floor row's of its own setting, group size
  and size; the floor rows, and sizes without one (zero copy), have none."""
  from jax_hoccl.bench import processes
  rng = np.random.default_rng(0)
  rows, want = [], {}
  for setting in ("staged", "graphs"):
    for n in (2, 4):
      for nbytes in (4096, 16 << 20):
        floor = float(rng.uniform(1, 9))
        if nbytes < 16 << 20:
          rows.append(dict(op=processes.FLOOR_OP, setting=setting, ranks=n,
                           bytes_per_rank=nbytes, job_added_us_per_call=floor))
        for op in processes.OPS:
          added = float(rng.uniform(1, 20))
          rows.append(dict(op=op, setting=setting, ranks=n, bytes_per_rank=nbytes,
                           job_added_us_per_call=added))
          if nbytes < 16 << 20:
            want[op, setting, n] = added - floor
  out = processes.beside_floor(rows)
  assert [{k: v for k, v in r.items() if k != "beyond_floor_us"} for r in out] == rows
  got = {(r["op"], r["setting"], r["ranks"]): r["beyond_floor_us"] for r in out
         if "beyond_floor_us" in r}
  assert got == pytest.approx(want) and len(got) == len(processes.OPS) * 4


@pytest.mark.skipif(not gpus(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("count", [3, 4096, (1 << 20) + 5])
def test_the_floor_copies_its_input_on_a_gpu(dtype, count):
  """The floor's kernel (hoccl_one_kernel_call) returns its input, whole words and tail."""
  import jax
  import jax.numpy as jnp
  from jax_hoccl._src import ffi_targets
  ffi_targets.register()  # (jax_hoccl's own ops register at their first lowering)
  x = (np.random.default_rng(0).standard_normal(count) * 50).astype(jnp.dtype(dtype))
  copy = jax.jit(lambda v: jax.ffi.ffi_call(
      "hoccl_one_kernel_call", jax.ShapeDtypeStruct(v.shape, v.dtype))(v))
  np.testing.assert_array_equal(np.asarray(copy(jnp.asarray(x))), x)


@pytest.fixture
def processes_on_a_gpu(monkeypatch):
  """bench/processes.py as on a machine with a GPU (every setting, no caller's crossover), its
  MPS daemons empty: the test stands in for the jobs."""
  import contextlib
  from jax_hoccl.bench import processes
  monkeypatch.delenv("JAX_HOCCL_STAGED_BYTES", raising=False)
  monkeypatch.setattr(processes.glob, "glob", lambda pattern: ["/dev/nvidia0"])
  monkeypatch.setattr(processes, "mps_daemon", lambda: contextlib.nullcontext({}))
  return processes


def test_processes_on_a_gpu_warm_each_mps_daemon_up_first(processes_on_a_gpu, monkeypatch,
                                                          tmp_path):
  """bench --processes on a GPU: under each MPS daemon a short job runs before the timed ones
  (the first job after a daemon starts runs slow), and its rows are dropped."""
  import contextlib
  processes = processes_on_a_gpu
  daemons = []

  @contextlib.contextmanager
  def daemon():
    daemons.append([])
    yield {}

  def run(n, env):
    daemons[-1].append(env)
    return [], "gpu"

  monkeypatch.setattr(processes, "mps_daemon", daemon)
  monkeypatch.setattr(processes, "_run", run)
  result = json.load(open(processes.run(str(tmp_path), "test")))
  assert len(daemons) == 2 and result["per_call"] == []  # 2 and 4 ranks; no row from it
  for jobs in daemons:
    first, timed = jobs[0], [env for env in jobs[1:] if "JAX_HOCCL_PROFILE" not in env]
    assert {k: first[k] for k in processes.WARM_UP} == processes.WARM_UP
    assert timed and all(env["OPS"] == json.dumps(processes.ops(True)) for env in timed)
  # the handlers' host time by phase: the collectives alone (the floor has no handler of ours)
  profiled = [env for env in daemons[0] if "JAX_HOCCL_PROFILE" in env]
  assert profiled and all(env["OPS"] == json.dumps(processes.OPS) for env in profiled)


def test_processes_run_the_settings_named(processes_on_a_gpu, monkeypatch, tmp_path):
  """bench --processes --settings: only the settings named run, in that order (rows carry
  their setting's name: test_per_call_rows_of_donated_calls); an unknown name fails before
  any job, naming the known ones."""
  from jax_hoccl.bench.__main__ import parse_args
  processes = processes_on_a_gpu
  assert parse_args(["--processes", "--settings", "graphs,staged"]).settings == "graphs,staged"
  with pytest.raises(SystemExit):
    parse_args(["--settings", "graphs"])
  envs = []

  def run(n, env):
    if env.get("OPS") == processes.WARM_UP["OPS"] or env.get("JAX_HOCCL_PROFILE"):
      return [], "gpu"
    envs.append(env)
    return [], "gpu"

  monkeypatch.setattr(processes, "_run", run)
  processes.run(str(tmp_path), "test", ["graphs", "staged"])
  flags = [processes.CAPTURED_FLAG in e["XLA_FLAGS"] for e in envs]
  assert flags == [True, False, True, False], flags  # 2 ranks, then 4
  assert not any("JAX_HOCCL_STAGED_SUM" in e or "BENCH_DONATE" in e for e in envs), envs
  envs.clear()
  with pytest.raises(ValueError, match="graphs_donated"):
    processes.run(str(tmp_path), "test", ["graph"])
  assert not envs


@pytest.mark.parametrize("alone", [False, True])
def test_processes_on_a_gpu_repeat_a_setting_that_runs_alone(processes_on_a_gpu, monkeypatch,
                                                             tmp_path, alone):
  """bench --processes on a GPU: every setting in one job each, or the caller's crossover
  alone in JOBS jobs, whose rows pool their rounds (one job's rows spread too much)."""
  processes = processes_on_a_gpu
  if alone:
    monkeypatch.setenv("JAX_HOCCL_STAGED_BYTES", str(1 << 20))
  timed = []

  def run(n, env):
    if env.get("OPS") == processes.WARM_UP["OPS"] or env.get("JAX_HOCCL_PROFILE"):
      return [], "gpu"
    timed.append(n)
    row = dict(op="psum", bytes_per_rank=4096, ranks=n, path="staged",
               added_per_round_us=[float(len(timed))], job_added_per_round_us=[0.0],
               us_per_call=1.0, baseline_us_per_call=1.0, us_per_call_by_rank=[1.0] * n,
               baseline_us_per_call_by_rank=[1.0] * n, cpu_us_per_call_by_rank=[1.0] * n,
               baseline_cpu_us_per_call_by_rank=[1.0] * n,
               switches_per_call_by_rank=[[0, 0]] * n,
               baseline_switches_per_call_by_rank=[[0, 0]] * n,
               dispatch_us_per_call_by_rank=[0.5] * n,
               baseline_dispatch_us_per_call_by_rank=[0.5] * n)
    return [row], "gpu"

  monkeypatch.setattr(processes, "_run", run)
  rows = json.load(open(processes.run(str(tmp_path), "test")))["per_call"]
  settings = len(processes._settings(True, ""))
  if alone:
    assert timed == [2] * processes.JOBS + [4] * processes.JOBS and processes.JOBS > 1
    assert [r["jobs"] for r in rows] == [processes.JOBS] * 2
    assert len(rows[0]["added_per_round_us"]) == processes.JOBS  # every job's rounds pooled
    assert rows[0]["added_us_by_job"] == [float(j + 1) for j in range(processes.JOBS)]
    assert len(rows[0]["cpu_us_per_call_by_rank_by_job"]) == processes.JOBS
    assert rows[0]["dispatch_us_per_call_by_rank_by_job"] == [[0.5, 0.5]] * processes.JOBS
  else:
    assert timed == [2] * settings + [4] * settings
    assert all(r["jobs"] == 1 for r in rows) and len(rows) == 2 * settings


def test_steps_on_a_gpu_time_both_sums_with_command_buffers_on_and_off(monkeypatch, tmp_path):
  """bench --steps on a GPU: the staged sums by XLA and inside the exchange kernel, each with
  command buffers on and off (on: with the packed exchange off too), and decode's GEMV inside
  the exchange (graphs on, sums in the kernel, packed), for 2 and 4 ranks, and the staged floor
  measured for each."""
  import contextlib
  from jax_hoccl.bench import steps
  monkeypatch.setattr(steps.glob, "glob", lambda pattern: ["/dev/nvidia0"])
  envs = []
  monkeypatch.setattr(steps, "mps_daemon", lambda: contextlib.nullcontext({}))
  monkeypatch.setattr(steps, "_job", lambda n, env: (envs.append((n, env)), ([], "gpu"))[1])
  floors = []  # the staged floor, once per number of ranks, at a chain's and a step's size
  monkeypatch.setattr(steps.staged_floor, "floors",
                      lambda n, sizes, env: (floors.append((n, sizes)), {})[1])
  steps.run(str(tmp_path), "test")
  assert floors == [(2, (65536, 131072)), (4, (65536, 131072))]
  for n in (2, 4):
    mine = [env for m, env in envs if m == n]
    assert len(mine) == 7, mine
    settings = {(e["JAX_HOCCL_STAGED_SUM"], "--xla_gpu_enable_command_buffer=" in e["XLA_FLAGS"],
                 e.get("JAX_HOCCL_STAGED_PACKED_BYTES") != "0", e["JAX_HOCCL_GEMV_PSUM"])
                for e in mine}
    assert settings == {(s, off, packed, "0") for s in ("0", "1") for off in (False, True)
                        for packed in (True, False) if packed or not off} | {
                            ("1", False, True, "1")}, settings


def test_steps_decode_runs_the_decode_rows_alone(monkeypatch, tmp_path):
  """bench --steps --decode: only decode's rows, in their own file. On a GPU two jobs of 2
  ranks (graphs on, sums in the kernel, packed), the GEMV inside the exchange and not, and no
  staged floor; without a GPU the one CPU job, which times decode alone."""
  import contextlib
  from jax_hoccl.bench import steps
  from jax_hoccl.bench.__main__ import parse_args
  assert parse_args(["--steps", "--decode"]).decode
  with pytest.raises(SystemExit):
    parse_args(["--decode"])
  monkeypatch.setattr(steps, "ROUNDS", 3)
  monkeypatch.setattr(steps, "CALLS", 10)
  path = steps.run(str(tmp_path), "test", decode_only=True)
  result = json.load(open(path))
  assert path.endswith("-cpu-decode.json") and not result["step"], path
  assert not result["device_latency"]
  assert [r["rows"] for r in result["decode"]] == [1, 8, 64]
  monkeypatch.setattr(steps.glob, "glob", lambda pattern: ["/dev/nvidia0"])
  monkeypatch.setattr(steps, "mps_daemon", lambda: contextlib.nullcontext({}))
  envs = []
  monkeypatch.setattr(steps, "_job", lambda n, env: (envs.append((n, env)), ([], "gpu"))[1])
  monkeypatch.setattr(steps.staged_floor, "floors", lambda *a: pytest.fail("a floor measured"))
  steps.run(str(tmp_path), "test", decode_only=True)
  assert [n for n, _ in envs] == [2, 2]
  assert {(e["JAX_HOCCL_GEMV_PSUM"], e["JAX_HOCCL_STAGED_SUM"], e["DECODE_ONLY"],
           "--xla_gpu_enable_command_buffer=" in e["XLA_FLAGS"],
           e.get("JAX_HOCCL_STAGED_PACKED_BYTES")) for _, e in envs} == {
               ("0", "1", "1", False, None), ("1", "1", "1", False, None)}


def test_steps_go_on_without_a_floor_that_cannot_be_measured(monkeypatch, tmp_path, capsys):
  """bench --steps on a GPU where the raw floor fails (no IPC, say): every job still runs, once
  per number of ranks the failure is printed, and the rows' floor_us is None."""
  import contextlib
  from jax_hoccl.bench import steps
  monkeypatch.setattr(steps.glob, "glob", lambda pattern: ["/dev/nvidia0"])
  monkeypatch.setattr(steps, "mps_daemon", lambda: contextlib.nullcontext({}))
  row = {"kind": "device_latency", "op": "psum", "bytes_per_rank": 65536, "us": 9.0}
  jobs = []
  monkeypatch.setattr(steps, "_job", lambda n, env: (jobs.append(n), ([row], "gpu"))[1])

  def fails(n, sizes, env):
    raise RuntimeError("cuIpcOpenMemHandle: CUDA driver error 201")

  monkeypatch.setattr(steps.staged_floor, "floors", fails)
  result = json.load(open(steps.run(str(tmp_path), "test")))
  assert jobs == [2] * 7 + [4] * 7
  assert capsys.readouterr().out.count("no staged floor") == 2
  assert result["device_latency"] and all(r["floor_us"] is None for r in result["device_latency"])


def test_the_job_counts_a_rank_slow_on_its_own_once():
  """ranks.with_job: rank 1 is 40 us slower per round with or without the collective, which
  adds 5 us to rank 1 and, through the wait, 45 us to rank 0. The slowest rank's row says 45;
  the job's rounds (slowest with minus slowest without) say 5."""
  from jax_hoccl.bench import ranks

  def row(ours, theirs):
    return {"us_per_round": ours, "baseline_us_per_round": theirs, "cpu_us": ours[0] / 2,
            "baseline_cpu_us": theirs[0] / 2, "switches": [ours[0] / 10, 1.0],
            "baseline_switches": [theirs[0] / 10, 0.0], "dispatch_us": ours[0] / 4,
            "baseline_dispatch_us": theirs[0] / 4,
            "added_us": statistics.median([a - b for a, b in zip(ours, theirs)])}

  fast = row([95.0, 96.0, 94.0], [50.0, 51.0, 49.0])
  slow = row([95.0, 96.0, 94.0], [90.0, 91.0, 89.0])
  plain = {"us": 9.5}  # a row without rounds (a chain's time) passes through
  out = ranks.with_job([[fast, plain], [slow, plain]], ["added_us", "us"])
  assert out[0]["added_us"] == 45.0  # rank 0's, the slowest by what the op adds to it
  assert out[0]["job_added_per_round_us"] == [5.0, 5.0, 5.0]
  assert out[0]["job_added_us"] == 5.0 and out[0]["job_added_quartiles_us"] == [5.0, 5.0]
  assert out[0]["baseline_us_by_rank"] == [50.0, 90.0]
  assert out[0]["us_by_rank"] == [95.0, 95.0]
  assert out[0]["baseline_cpu_us_by_rank"] == [25.0, 45.0]
  assert out[0]["baseline_switches_by_rank"] == [[5.0, 0.0], [9.0, 0.0]]
  assert out[0]["switches_by_rank"] == [[9.5, 1.0], [9.5, 1.0]]
  assert out[0]["baseline_dispatch_us_by_rank"] == [12.5, 22.5]
  assert out[0]["dispatch_us_by_rank"] == [23.75, 23.75]
  assert "us_per_round" not in out[0] and "cpu_us" not in out[0] and out[1] == plain
  assert "switches" not in out[0] and "dispatch_us" not in out[0]


def test_gpu_results_are_named_by_the_gpu_they_ran_on(monkeypatch):
  """A GPU run's results file and JSON name its GPU as nvidia-smi does (they said 1xH200
  whatever the GPU); a CPU run's say cpu."""
  from jax_hoccl.bench import machine
  monkeypatch.setattr(machine, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
  assert machine.file_tag(True) == "1xNVIDIA-H100-80GB-HBM3"
  assert machine.file_tag(False) == "cpu"
  monkeypatch.setattr(machine, "gpu_names", lambda: [])
  assert machine.file_tag(True) == "1xGPU"


def test_paired_rounds_run_the_dot_and_the_program_in_each_order(monkeypatch):
  """gemm.beside_dot's two jits return the dot's and the program's values whichever runs
  first, and paired_round takes the geometric mean of the two orders' ratios."""
  import jax
  import jax.numpy as jnp
  from jax_hoccl.bench import gemm

  key = jax.random.split(jax.random.key(0), 3)
  a, b = jax.random.normal(key[0], (32, 16)), jax.random.normal(key[1], (16, 24))
  c = jax.random.normal(key[2], (8, 8))
  pairs = gemm.beside_dot(lambda a, b: a @ b, lambda c: jnp.tanh(c) * 2, 2)
  for pair in pairs:
    dot, prog = pair(a, b, c)
    np.testing.assert_allclose(dot, a @ b, rtol=1e-6)
    np.testing.assert_allclose(prog, jnp.tanh(c) * 2, rtol=1e-6)
  # each order's calls: (program us, dot us); the second of two kernels runs 4% slower
  times = iter([[(104.0, 100.0)] * 5, [(100.0, 104.0)] * 5])
  monkeypatch.setattr(gemm, "beside_dot_us", lambda *_: next(times))
  ratio, dot_first, program_first, program_us, dot_us = gemm.paired_round(pairs, (), set())
  assert (dot_first, program_first) == (1.04, 100 / 104)
  assert ratio == pytest.approx(1.0)
  assert (program_us, dot_us) == (102.0, 102.0)
