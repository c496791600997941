"""Starts a JAX program as N processes on this machine, one per GPU (how clusters run JAX),
and joins them into one jax.distributed job:

    python -m jax_hoccl.launch -n 2 examples/train_transformer.py [args...]

The program calls `jax_hoccl.launch.initialize()` before using jax (a no-op when it was not
started by this launcher). Process i gets GPU i; with fewer GPUs than processes they share
GPU 0 (each with 1/N of its memory), under an MPS daemon of the launcher's own so that their
kernels run at once instead of taking turns; without a GPU each gets 8/N virtual CPU devices
(at least 1). Output lines are prefixed with the process index; the exit status is the first
non-zero one.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

_ENV = "JAX_HOCCL_LAUNCH"  # "address,num_processes,process_id,local_gpu or -1"


def initialize() -> bool:
  """jax.distributed.initialize() for a process this launcher started; False otherwise."""
  spec = os.environ.get(_ENV)
  if not spec:
    return False
  address, n, i, gpu = spec.split(",")
  import jax
  kwargs = {"local_device_ids": [int(gpu)]} if int(gpu) >= 0 else {}
  if int(gpu) < 0:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # jax.lax across processes
  jax.distributed.initialize(address, num_processes=int(n), process_id=int(i), **kwargs)
  return True


def local_address() -> str:
  """A jax.distributed coordinator address on this machine (a free port of 127.0.0.1)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def mps_daemon():
  """An MPS control daemon of its own (pipe and log folders in fresh temp folders): processes
  given the environment it yields share the GPU at once instead of taking turns. It quits on
  the way out; end its clients first (start_group, end_group)."""
  env = {"CUDA_MPS_PIPE_DIRECTORY": tempfile.mkdtemp(prefix="mps-pipe-"),
         "CUDA_MPS_LOG_DIRECTORY": tempfile.mkdtemp(prefix="mps-log-")}
  full = {**os.environ, **env}
  try:
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=full, check=True, timeout=60)
  except (OSError, subprocess.SubprocessError):
    for d in env.values():
      shutil.rmtree(d, ignore_errors=True)
    raise
  try:
    yield env
  finally:
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=full,
                   timeout=60, capture_output=True)
    for d in env.values():
      shutil.rmtree(d, ignore_errors=True)


def start_group(commands, envs, **popen):
  """Starts the commands as one process group (a list of Popen), so that end_group can end
  them all: ranks killed one by one and left behind once left MPS refusing new clients."""
  procs = []
  for cmd, env in zip(commands, envs):
    procs.append(subprocess.Popen(cmd, env=env, process_group=procs[0].pid if procs else 0,
                                  **popen))
  return procs


def end_group(procs) -> None:
  """Kills what is left of a start_group group and reaps it."""
  if not procs:
    return
  try:
    os.killpg(procs[0].pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  for p in procs:
    p.wait()


def run_workers(source: str, n: int, env: dict, timeout: float,
                directory: str | None = None) -> list[tuple[int, str]]:
  """Runs the Python program `source` as processes 0..n-1 of a jax.distributed job on this
  machine (argv: coordinator address, process id, n), one process group ended whole; each
  process's (exit status, output). The program is written to `directory`/worker.py (kept, to
  rerun by hand), else to a temp folder removed afterwards."""
  address = local_address()
  with contextlib.ExitStack() as stack:
    tmp = directory or stack.enter_context(tempfile.TemporaryDirectory())
    script = os.path.join(tmp, "worker.py")
    with open(script, "w") as f:
      f.write(source)
    procs = start_group([[sys.executable, "-P", script, address, str(i), str(n)]
                         for i in range(n)], [env] * n, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)
    try:
      outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
      end_group(procs)
  return [(p.returncode, out) for p, out in zip(procs, outs)]


def _pump(stream, prefix: str) -> None:
  for line in stream:
    sys.stdout.write(prefix + line)
    sys.stdout.flush()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_hoccl.launch", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
  ap.add_argument("script", help="the Python program to run")
  ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
  a = ap.parse_args(argv)
  if a.nproc < 1:
    ap.error("--nproc must be >= 1")
  gpus = len(glob.glob("/dev/nvidia[0-9]*"))
  with contextlib.ExitStack() as stack:
    shared = {}
    if 0 < gpus < a.nproc:
      try:
        shared = stack.enter_context(mps_daemon())
      except (OSError, subprocess.SubprocessError) as e:  # no MPS here: the GPU time-slices
        print(f"jax_hoccl.launch: no MPS daemon ({e}); the processes take turns on GPU 0",
              file=sys.stderr)
    return _run(a, gpus, shared)


def _run(a, gpus: int, shared: dict) -> int:
  address = local_address()
  envs = []
  for i in range(a.nproc):
    env = {**os.environ, **shared}
    if gpus >= a.nproc:
      gpu = i
    elif gpus:
      gpu = 0
      env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / a.nproc:.2f}"
    else:
      gpu = -1
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={max(1, 8 // a.nproc)}").strip()
      env.setdefault("PJRT_NPROC", "16")
    env[_ENV] = f"{address},{a.nproc},{i},{gpu}"
    envs.append(env)
  procs = start_group([[sys.executable, a.script, *a.args]] * a.nproc, envs,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pumps = [threading.Thread(target=_pump, args=(p.stdout, f"[{i}] "), daemon=True)
           for i, p in enumerate(procs)]
  for t in pumps:
    t.start()
  try:
    # One process failing leaves its peers waiting for it: end them too.
    codes = [None] * len(procs)
    while None in codes:
      for k, p in enumerate(procs):
        if codes[k] is None:
          try:
            codes[k] = p.wait(timeout=0.2)
          except subprocess.TimeoutExpired:
            pass
        if codes[k]:
          for q in procs:
            if q.poll() is None:
              q.terminate()
  finally:
    end_group(procs)
  for t in pumps:
    t.join(timeout=5)
  return next((c for c in codes if c), 0)


if __name__ == "__main__":
  sys.exit(main())
