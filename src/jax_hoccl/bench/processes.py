"""Time per call of jax_hoccl's collectives across processes, each beside the same program
without the collective (`a * 0.5`, measured in the same process): what a collective adds to a
jit call, host work included. jit calls dispatched back to back (each call's output is the
next one's input) and waited for at the end, in paired rounds of the op's program and the
baseline (paired.py): what an op adds is the median of the rounds' differences.

On one GPU, 2 and 4 processes share it under an MPS daemon of their own (their kernels run at
once, as on GPUs of their own; same-GPU copies run on SMs, HBM is shared and there is no
NVLink: the host work per call and the protocol's hops transfer to several GPUs, the bytes'
cost does not). Without a GPU, 2 processes of one CPU device each.

Every size runs on both paths, in alternating jobs: the default crossover (calls up to 1 MiB
per peer staged) and JAX_HOCCL_STAGED_BYTES=0 (the per-call rendezvous: zero copy on GPU); on a
GPU also the staged calls as copy calls and stream memory operations instead of the exchange
kernel (JAX_HOCCL_STAGED_KERNEL=0), the staged psum and psum_scatter summed by XLA after the
exchange instead of inside the exchange kernel (JAX_HOCCL_STAGED_SUM=0), and both sums with XLA
recording every program into a CUDA graph (CAPTURED_FLAG: staged calls are replayed, their
handler runs once), the sums inside the kernel also with each call's input donated (as a
training loop's state: its output can take the input's buffer, so the addresses need not change
and XLA need not update its graph before a launch): `settings` names them, and --settings runs
those named alone. A JAX_HOCCL_STAGED_BYTES set by the caller runs alone (setting
"environment"). 16 MiB per rank is above the crossover: both paths' rows are zero copy there.
On a GPU every job also times, at the staged sizes, one kernel copying the input in the
collective's place (op FLOOR_OP, path "floor": cc/cuda/one_kernel_call.cu, bound like the
staged handlers): what any custom call of one kernel adds to the program, so that a staged row
less its floor row is what jax_hoccl adds beyond it. Without a GPU, and on one where a setting
runs alone, the jobs repeat (JOBS times: the machine may be shared, and on a GPU one job's rows
of a setting may read far from the next job's: docs/design.md, section 4) and a row pools their
rounds, keeping each job's own medians ("added_us_by_job", "job_added_us_by_job"), its ranks'
CPU time per call ("cpu_us_per_call_by_rank_by_job", "baseline_cpu_us_per_call_by_rank_by_job")
and their dispatch time per call ("dispatch_us_per_call_by_rank_by_job"). On a GPU a short job
runs first under each MPS daemon, its rows dropped (WARM_UP), and a job whose ranks ran the
program without the collective more than SKEWED times apart (one rank in a slow spell of host
work outside jax_hoccl, which its peers wait for) runs again, up to SPELL_RERUNS times; the
least skewed job is kept, and its rows say how many ran ("spell_reruns") and how far apart its
ranks were ("rank_skew").

    python -m jax_hoccl.bench --processes [--settings staged,graphs] [--out DIR]

Rows: {"op", "bytes_per_rank", "ranks", "mps", "setting", "path", "us_per_call",
"baseline_us_per_call", "added_us_per_call", "spread_us" (the quartiles of the rounds'
differences), "added_per_round_us", "jobs", "donated"}, from the rank the op adds most to;
beside them what the op adds to the job, each round's slowest rank with it minus its slowest
rank without ("job_added_us_per_call", "job_spread_us", "job_added_per_round_us":
ranks.with_job; a rank slower on its own counts once, not as a cost to the peers that wait for
it), and every rank's medians ("us_per_call_by_rank", "baseline_us_per_call_by_rank", and its
process's CPU time per call: "cpu_us_per_call_by_rank", "baseline_cpu_us_per_call_by_rank"; its
context switches per call, [voluntary, involuntary]: "switches_per_call_by_rank",
"baseline_switches_per_call_by_rank"; its time per call until a round's last call returned,
before the round waits for the device: "dispatch_us_per_call_by_rank",
"baseline_dispatch_us_per_call_by_rank"); "path" is the path the op's calls took ("staged",
"rendezvous" or "zero_copy", as the engine counted them on CPU; "floor" for the floor); on a
GPU's staged rows, "exchange": "packed" (the packed exchange, blocks up to
JAX_HOCCL_STAGED_PACKED_BYTES), "kernel" or "copy_calls" (and for psum and psum_scatter "sum":
"kernel" or "xla", who adds the blocks), and on a GPU "captured": whether XLA recorded the
calls into CUDA graphs, and "recorded_per_call": how many times per call the handler ran under
capture (XLA traces a call for each set of buffer addresses it has not kept a trace of; on
replay, and on updating a graph from kept traces, the handler does not run), and
"beyond_floor_us": "job_added_us_per_call" less the floor row's of the same setting, group size
and size (beside_floor). And "host_profile": the same calls' host time inside jax_hoccl's
handlers by phase (JAX_HOCCL_PROFILE=1, rank 0, 64 KiB, 2 ranks), on each path; "cpu_speed":
whether the machine's CPUs ran alike before the jobs and after (cpu_speed.probe: on a VM a CPU
may run slow for a while, and a rank on it slows its job).
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import platform
import textwrap

from jax_hoccl.bench import cpu_speed, machine, paired, ranks
from jax_hoccl.launch import mps_daemon, run_workers

OPS = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")
BYTES_PER_RANK = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
# Jobs per setting without a GPU, and on one where a setting runs alone: of three, a job in a
# slow spell is the odd one, and the median over their pooled rounds reads the other two.
JOBS = 3
# On a GPU, also one kernel copying the input in the collective's place, at the staged sizes
# (cc/cuda/one_kernel_call.cu): what any one-kernel custom call adds, the staged rows' floor.
FLOOR_OP = "one_kernel_call"
ROUNDS, CALLS = paired.ROUNDS, paired.CALLS  # paired rounds per row, calls per round
# XLA's flag for the job whose calls XLA records into CUDA graphs: a graph of any size (its
# default minimum leaves a program this small uncaptured).
CAPTURED_FLAG = "--xla_gpu_graph_min_graph_size=1"
# A job whose ranks' baselines are this far apart (the median over its rows of the slowest
# rank's over the fastest's) ran in one rank's slow spell: on a GPU it runs again, at most
# SPELL_RERUNS times.
SKEWED, SPELL_RERUNS = 1.5, 2
# A short job run first under each MPS daemon, its rows dropped: the first job after a daemon
# starts measured 2-4x the later ones
# (benchmarks/results/raw/2026-12-03-1xH200-per-call-attribution.txt).
WARM_UP = {"OPS": json.dumps(["psum"]), "BYTES": json.dumps([4 << 10]), "ROUNDS": "2",
           "CALLS": "50"}

WORKER = textwrap.dedent("""
    import json, os, sys
    addr, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import jax
    kw = {"local_device_ids": [0]} if os.environ.get("BENCH_GPU") else {}
    jax.distributed.initialize(addr, num_processes=n, process_id=me, **kw)
    import numpy as np, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    from jax_hoccl import _hoccl
    from jax_hoccl.bench import paired
    from jax_hoccl.bench.processes import FLOOR_OP
    from jax_hoccl._src.ffi_targets import DEFAULT_STAGED_BYTES, register, staged_sums_in_kernel
    register()  # the floor's target too, whatever program lowers first
    mesh = jax.make_mesh((n,), ("x",))
    rounds, calls = int(os.environ["ROUNDS"]), int(os.environ["CALLS"])
    shift = [(i, (i + 1) % n) for i in range(n)]
    bodies = {
        "psum": lambda v: jax_hoccl.psum(v, "x") * 0.5,
        "all_gather": lambda v: jax_hoccl.all_gather(v, "x", tiled=True)[:v.shape[0]] * 0.5,
        "psum_scatter": lambda v: jnp.tile(
            jax_hoccl.psum_scatter(v, "x", scatter_dimension=1, tiled=True), (1, n)) * 0.5,
        "all_to_all": lambda v: jax_hoccl.all_to_all(v, "x", 1, 1, tiled=True) * 0.5,
        "ppermute": lambda v: jax_hoccl.ppermute(v, "x", shift) * 0.5,
        "none": lambda v: v * 0.5,
        "one_kernel_call": lambda v: jax.ffi.ffi_call(  # a GPU's floor: one kernel copying v
            "hoccl_one_kernel_call", jax.ShapeDtypeStruct(v.shape, v.dtype))(v) * 0.5,
    }

    programs = {}
    donate = bool(os.environ.get("BENCH_DONATE"))  # each call's input, as a loop's state

    def program(name):  # one jit per body: the baseline compiles once per size
        if name not in programs:
            f = jax.jit(jax.shard_map(bodies[name], mesh=mesh, in_specs=P("x"),
                                      out_specs=P("x")), donate_argnums=(0,) if donate else ())
            if donate:  # the paired rounds start from the same array: it takes a copy
                f = lambda v, f=f: f(jnp.copy(v) if v is first[0] else v)
            programs[name] = f
        return programs[name]

    first = [None]

    def data(nbytes):
        return jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("x")), np.ones((1, nbytes // 4), np.float32))

    recorded = getattr(_hoccl, "staged_captured_calls", lambda: 0)  # into CUDA graphs
    packed_calls = getattr(_hoccl, "staged_packed_calls", lambda: 0)  # the packed exchange
    captured_rows, packed_rows = {}, {}

    def taking(op, nbytes, measure, ncalls):  # measure(the op's program) of ncalls calls,
        before, captured = _hoccl.cpu_calls_by_path(), recorded()  # the path its calls took
        packed = packed_calls()
        result = measure(program(op))
        after = _hoccl.cpu_calls_by_path()
        captured_rows[op, nbytes] = (recorded() - captured) / ncalls
        packed_rows[op, nbytes] = packed_calls() > packed
        took = sorted(k for k in after if after[k] > before[k])
        staged = (os.environ.get("JAX_HOCCL_STAGED_BYTES") != "0"
                  and nbytes <= DEFAULT_STAGED_BYTES)
        default = "floor" if op == FLOOR_OP else "staged" if staged else "zero_copy"
        return result, "+".join(took) or default  # the GPU engine counts no paths

    def profiled(f, nbytes):  # host time by phase over 1 + calls calls
        f(data(nbytes)).block_until_ready()  # compiled, run once
        _hoccl.host_profile(True)
        y = f(data(nbytes))
        for _ in range(calls):
            y = f(y)
        y.block_until_ready()
        return _hoccl.host_profile(True)

    def gpu_fields(path, op, nbytes):  # the staged calls' engine, capture into graphs
        if not os.environ.get("BENCH_GPU") or op == FLOOR_OP:
            return {}
        recorded_per_call = captured_rows[op, nbytes]
        out = {"captured": recorded_per_call > 0, "recorded_per_call": round(recorded_per_call, 3)}
        if path == "staged":
            kernel = os.environ.get("JAX_HOCCL_STAGED_KERNEL") != "0"
            out["exchange"] = ("packed" if packed_rows[op, nbytes] else "kernel" if kernel
                               else "copy_calls")
            if op in ("psum", "psum_scatter"):  # who adds: the exchange kernel, or XLA after it
                out["sum"] = "kernel" if staged_sums_in_kernel() else "xla"
        return out

    rows = []
    for nbytes in json.loads(os.environ["BYTES"]):
        for op in json.loads(os.environ["OPS"]):
            if op == FLOOR_OP and nbytes > DEFAULT_STAGED_BYTES:  # the staged sizes' floor
                continue
            key = dict(op=op, bytes_per_rank=nbytes, ranks=n)
            if os.environ.get("JAX_HOCCL_PROFILE"):  # where a call's host time goes, by phase
                phases, path = taking(op, nbytes, lambda f: profiled(f, nbytes), 2 + calls)
                rows += [dict(key, path=path, **gpu_fields(path, op, nbytes), phase=phase,
                              us_per_call=ns / 1e3 / (1 + calls),
                              calls_per_call=count / (1 + calls))
                         for phase, count, ns in phases]
                continue
            first[0] = data(nbytes)
            t, path = taking(op, nbytes, lambda f: paired.paired(
                f, program("none"), (first[0],), rounds, calls), paired.calls_made(rounds, calls))
            rows.append(dict(key, path=path, donated=donate, **gpu_fields(path, op, nbytes),
                             us_per_call=t["us"], baseline_us_per_call=t["baseline_us"],
                             added_us_per_call=t["added_us"],
                             added_per_round_us=t["added_per_round_us"],
                             us_per_round=t["us_per_round"],
                             baseline_us_per_round=t["baseline_us_per_round"],
                             cpu_us=t["cpu_us"], baseline_cpu_us=t["baseline_cpu_us"],
                             switches=t["switches"], baseline_switches=t["baseline_switches"],
                             dispatch_us=t["dispatch_us"],
                             baseline_dispatch_us=t["baseline_dispatch_us"]))
    print("RESULT" + json.dumps({"rows": rows, "platform": jax.devices()[0].platform}), flush=True)
    os._exit(0)
""")


def ops(gpu: bool) -> tuple[str, ...]:
  """The programs each job times beside the one without the collective: the collectives, and
  on a GPU the floor."""
  return OPS + (FLOOR_OP,) if gpu else OPS


def _run(n: int, env: dict):
  """The rows of one job of n processes (each the row of the rank the op adds most to), and
  the platform."""
  found = ranks.results(run_workers(WORKER, n, {**env, "PYTHONFAULTHANDLER": "1"}, 600))
  if env.get("JAX_HOCCL_PROFILE"):
    return found[0]["rows"], found[0]["platform"]  # rank 0's phases
  rows = ranks.with_job([r["rows"] for r in found], ["added_us_per_call"])
  for r in rows:  # the job's figures in this schema's names
    r.update(job_added_us_per_call=r.pop("job_added_us"),
             job_spread_us=r.pop("job_added_quartiles_us"),
             us_per_call_by_rank=r.pop("us_by_rank"),
             baseline_us_per_call_by_rank=r.pop("baseline_us_by_rank"),
             cpu_us_per_call_by_rank=r.pop("cpu_us_by_rank"),
             baseline_cpu_us_per_call_by_rank=r.pop("baseline_cpu_us_by_rank"),
             switches_per_call_by_rank=r.pop("switches_by_rank"),
             baseline_switches_per_call_by_rank=r.pop("baseline_switches_by_rank"),
             dispatch_us_per_call_by_rank=r.pop("dispatch_us_by_rank"),
             baseline_dispatch_us_per_call_by_rank=r.pop("baseline_dispatch_us_by_rank"))
  return rows, found[0]["platform"]


def rank_skew(rows: list[dict]) -> float:
  """How far apart a job's ranks ran the program without the collective: the median over its
  rows of the slowest rank's time per call over the fastest's."""
  import statistics
  return statistics.median([max(b) / min(b) for b in
                            (r["baseline_us_per_call_by_rank"] for r in rows)] or [1.0])


def _least_skewed(run, reruns: int):
  """run() -> (rows, platform), run again while its job was SKEWED, at most `reruns` times;
  the least skewed job's, its rows with "spell_reruns" and "rank_skew"."""
  best, ran = run(), 0
  while ran < reruns and rank_skew(best[0]) > SKEWED:
    again, ran = run(), ran + 1
    if rank_skew(again[0]) < rank_skew(best[0]):
      best = again
  skew = rank_skew(best[0])
  return [dict(r, spell_reruns=ran, rank_skew=skew) for r in best[0]], best[1]


def settings(gpu: bool, xla_flags: str) -> dict[str, dict]:
  """Every setting a job may run in, by name: its environment over the jobs'. The staged path
  at the default crossover ("staged") and the per-call rendezvous (JAX_HOCCL_STAGED_BYTES=0:
  "zero_copy" on a GPU, "rendezvous" without); on a GPU also the staged path without the
  packed exchange ("unpacked": the exchange kernel with its flags at every size), its
  copy-call exchange ("copy_calls"), the staged sums by XLA after the exchange ("xla_sum"),
  every program in CUDA graphs with either sum ("graphs", "graphs_xla_sum"; `xla_flags`: the
  jobs' XLA flags), and in graphs with each call's input donated ("graphs_donated")."""
  if not gpu:
    return {"staged": {}, "rendezvous": {"JAX_HOCCL_STAGED_BYTES": "0"}}
  graphs = {"XLA_FLAGS": f"{xla_flags} {CAPTURED_FLAG}"}
  return {"staged": {}, "unpacked": {"JAX_HOCCL_STAGED_PACKED_BYTES": "0"},
          "copy_calls": {"JAX_HOCCL_STAGED_KERNEL": "0"},
          "zero_copy": {"JAX_HOCCL_STAGED_BYTES": "0"}, "xla_sum": {"JAX_HOCCL_STAGED_SUM": "0"},
          "graphs": graphs, "graphs_xla_sum": {**graphs, "JAX_HOCCL_STAGED_SUM": "0"},
          "graphs_donated": {**graphs, "BENCH_DONATE": "1"}}


def _settings(gpu: bool, xla_flags: str, names=None) -> list[tuple[str, dict]]:
  """The settings the jobs run in, (name, environment): those named (all by default), or the
  caller's crossover alone ("environment": JAX_HOCCL_STAGED_BYTES set by the caller)."""
  if os.environ.get("JAX_HOCCL_STAGED_BYTES"):
    return [("environment", {})]
  known = settings(gpu, xla_flags)
  unknown = [n for n in names or () if n not in known]
  if unknown:
    raise ValueError(f"unknown settings {unknown}; here: {', '.join(known)}")
  return [(n, known[n]) for n in (names or known)]


def _over_jobs(jobs: list[list[dict]]) -> list[dict]:
  """One row per op, size and path over jobs of the same setting: the medians over jobs of
  the times (each rank's too), the median and quartiles of every job's rounds' paired
  differences (the slowest rank's, and the job's), and each job's medians and CPU times."""
  import statistics
  out = []
  for per_job in zip(*jobs):
    added = [a for r in per_job for a in r["added_per_round_us"]]
    job = [a for r in per_job for a in r["job_added_per_round_us"]]
    by_rank = {k: [statistics.median(v) for v in zip(*(r[k] for r in per_job))]
               for k in ("us_per_call_by_rank", "baseline_us_per_call_by_rank",
                         "cpu_us_per_call_by_rank", "baseline_cpu_us_per_call_by_rank",
                         "dispatch_us_per_call_by_rank",
                         "baseline_dispatch_us_per_call_by_rank")}
    by_rank.update({k: [[statistics.median(v) for v in zip(*rank)]
                        for rank in zip(*(r[k] for r in per_job))]
                    for k in ("switches_per_call_by_rank", "baseline_switches_per_call_by_rank")})
    # each job's own figures: a job in a slow spell shows apart
    by_job = {"added_us_by_job": [statistics.median(r["added_per_round_us"]) for r in per_job],
              "job_added_us_by_job": [statistics.median(r["job_added_per_round_us"])
                                      for r in per_job],
              **{f"{k}_by_job": [r[k] for r in per_job]
                 for k in ("cpu_us_per_call_by_rank", "baseline_cpu_us_per_call_by_rank",
                           "dispatch_us_per_call_by_rank")}}
    out.append(dict(
        per_job[0], jobs=len(per_job), **by_job,
        us_per_call=statistics.median(r["us_per_call"] for r in per_job),
        baseline_us_per_call=statistics.median(r["baseline_us_per_call"] for r in per_job),
        added_us_per_call=statistics.median(added), spread_us=paired.quartiles(added),
        added_per_round_us=added, job_added_us_per_call=statistics.median(job),
        job_spread_us=paired.quartiles(job), job_added_per_round_us=job, **by_rank))
  return out


def run(out_dir: str, commit: str, names=None) -> str:
  """Runs the jobs, in the settings `names` (all by default); writes and returns the results
  JSON's path."""
  base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_HOCCL_NODE")}
  # XLA:CPU hangs with many launches in flight and few threads (docs/design.md, section 3).
  base.setdefault("PJRT_NPROC", "16")
  base.setdefault("JAX_HOCCL_TIMEOUT_S", "60")
  gpu = bool(glob.glob("/dev/nvidia[0-9]*"))
  base.update(OPS=json.dumps(ops(gpu)), BYTES=json.dumps(BYTES_PER_RANK), ROUNDS=str(ROUNDS),
              CALLS=str(CALLS))
  _settings(gpu, "", names)  # an unknown name fails before any job
  load = [os.getloadavg()[0]]  # a shared machine's load, at the start and the end
  # and whether its CPUs ran alike (a slow CPU makes its rank the job's slow one)
  speed = {"before": cpu_speed.probe(cpu_speed.AROUND_JOBS)}
  rows, profile = [], []
  name = os.path.join(out_dir, f"{datetime.date.today()}-{machine.file_tag(gpu)}-per-call.json")
  for n in ((2, 4) if gpu else (2,)):
    with contextlib.ExitStack() as stack:
      if gpu:
        env = {**base, **stack.enter_context(mps_daemon()), "BENCH_GPU": "1",
               "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.6 / n:.2f}",
               "XLA_FLAGS": "--xla_gpu_shard_autotuning=false"}
      else:
        env = {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
      if gpu:
        _run(n, {**env, **WARM_UP})
      chosen = _settings(gpu, env["XLA_FLAGS"], names)
      jobs = JOBS if not gpu or len(chosen) == 1 else 1  # (a GPU's device time is short)
      per_setting = [[] for _ in chosen]
      for _ in range(jobs):  # the settings alternate, so a busy spell hits both alike
        for i, (_, setting) in enumerate(chosen):
          job_rows, plat = _least_skewed(lambda: _run(n, {**env, **setting}),
                                         SPELL_RERUNS if gpu else 0)
          per_setting[i].append(job_rows)
      for (setting, _), found in zip(chosen, per_setting):
        rows += [dict(r, setting=setting, mps=gpu) for r in _over_jobs(found)]
      if n == 2:  # the same calls with the handlers' host time counted by phase (64 KiB)
        for setting in (env for _, env in chosen if "XLA_FLAGS" not in env):  # handlers that run
          # the collectives alone: the floor has no handler of jax_hoccl's to profile
          found, _ = _run(n, {**env, **setting, "JAX_HOCCL_PROFILE": "1",
                              "OPS": json.dumps(OPS), "BYTES": json.dumps([64 << 10])})
          profile += found
    # written after each group size too, so a run stopped during the next keeps these rows
    speed["after"] = cpu_speed.probe(cpu_speed.AROUND_JOBS)
    result = _result(rows, profile, plat, gpu, load + [os.getloadavg()[0]], speed, commit)
    os.makedirs(out_dir, exist_ok=True)
    with open(name, "w") as f:
      json.dump(result, f, indent=1)
  _print(result)
  return name


def _result(rows, profile, plat, gpu, load, speed, commit) -> dict:
  """The results JSON: the rows so far, with machine, its load and CPU speeds, versions and
  commit."""
  import jax
  import jaxlib
  return {"what": "time per jit call, back to back, against the same program without the "
                  f"collective: {ROUNDS} paired rounds of {CALLS} calls per job; "
                  "added: the median of the rounds' differences, spread: their quartiles "
                  "(jax_hoccl/bench/processes.py, paired.py)",
          "platform": plat,
          "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
          "devices": machine.gpu_names() if gpu else [],
          "load_average_1min": [round(x, 2) for x in load],
          "cpu_speed": speed,
          "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "python": platform.python_version(), "commit": commit, "date": str(datetime.date.today()),
          "per_call": beside_floor(rows),
          "host_profile": [dict(r, mps=gpu) for r in profile]}


def beside_floor(rows: list[dict]) -> list[dict]:
  """The rows, each collective's with what it adds to the job beyond the floor row of its
  setting, group size and size ("beyond_floor_us"), where one was timed."""
  floor = {(r["setting"], r["ranks"], r["bytes_per_rank"]): r["job_added_us_per_call"]
           for r in rows if r["op"] == FLOOR_OP}
  out = []
  for r in rows:
    f = floor.get((r["setting"], r["ranks"], r["bytes_per_rank"]))
    beyond = r["op"] != FLOOR_OP and f is not None
    out.append(dict(r, beyond_floor_us=r["job_added_us_per_call"] - f) if beyond else r)
  return out


def _print(result: dict) -> None:
  """The rows as a table, then the handlers' host time by phase."""
  rows = result["per_call"]
  print(f"{'op':<15} {'per rank':>9} ranks {'path':<31} {'us/call':>9} {'added q1-q3':>15} "
        f"{'without':>9} {'added':>8} {'job':>7} {'-floor':>7} {'rec':>4}  without, by rank")
  def label(r):  # the path, the staged exchange and who summed: "staged/kernel/sum"
    return (r["path"] + (f"/{r['exchange']}" if "exchange" in r else "")
            + ("/sum" if r.get("sum") == "kernel" else ""))

  for r in rows:
    spread = f"{r['spread_us'][0]:.0f}-{r['spread_us'][1]:.0f}"
    path = (label(r) + ("/graph" if r.get("captured") else "")
            + ("/donated" if r.get("donated") else ""))
    beyond = f"{r['beyond_floor_us']:7.1f}" if "beyond_floor_us" in r else f"{'':>7}"
    print(f"{r['op']:<15} {r['bytes_per_rank']:9d} {r['ranks']:5d} {path:<31} "
          f"{r['us_per_call']:9.1f} {spread:>15} {r['baseline_us_per_call']:9.1f} "
          f"{r['added_us_per_call']:8.1f} {r['job_added_us_per_call']:7.1f} {beyond} "
          f"{r.get('recorded_per_call', 0):4.2f}  "
          + " ".join(f"{b:.0f}" for b in r["baseline_us_per_call_by_rank"]))
  if result["host_profile"]:  # (none where every setting's calls are captured)
    print("host time inside the handlers per call, 64 KiB, 2 ranks (JAX_HOCCL_PROFILE=1):")
  for r in result["host_profile"]:
    print(f"  {r['op']:<13} {label(r):<17} {r['phase']:<28} {r['us_per_call']:8.1f} us")
  print("the slowest CPU's time over the fastest's for one loop, per pass: " + ", ".join(
      f"{when} " + " ".join(f"{x:.2f}" for x in p["slowest_over_fastest"])
      for when, p in result["cpu_speed"].items()))
