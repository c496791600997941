"""Starts a JAX program as N processes on this machine, one per GPU (how clusters run JAX),
and joins them into one jax.distributed job:

    python -m jax_hoccl.launch -n 2 examples/train_transformer.py [args...]

The program calls `jax_hoccl.launch.initialize()` before using jax (a no-op when it was not
started by this launcher). Process i gets GPU i; with fewer GPUs than processes they share
GPU 0 (each with 1/N of its memory), under an MPS daemon of the launcher's own so that their
kernels run at once instead of taking turns; without a GPU each gets 8/N virtual CPU devices
(at least 1). Output lines are prefixed with the process index.

The first process that fails ends the job: as soon as one exits non-zero, is killed by a
signal, or gives up on a jax_hoccl group (a timeout, a peer that exited, mismatched calls),
the others are stopped (after 2 s for their last output: a process that fails often hangs
in jax.distributed's shutdown, waiting for the peer it lost) and a summary names that
process, its exit code or signal and its last lines; the launcher exits with its code
(128 + the signal for a signal, 1 for a group error from a process that did not exit).
Whatever the job left in /dev/shm (names carrying the job's secret, which the launcher
makes) is removed when it ends, however it ends.

The launcher stopped by SIGTERM or SIGHUP (a scheduler cancelling the job), or by Ctrl-C,
passes the signal on to the processes, gives them 10 s to exit (time for a handler of theirs
to save a checkpoint), kills what is left, ends its MPS daemon and removes those files, then
exits with 128 + the signal. Killed outright (SIGKILL), it can do none of that: a process
that called initialize() dies with it, and a small shell process of the launcher's, in a
session of its own, removes those files and ends the MPS daemon.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

_ENV = "JAX_HOCCL_LAUNCH"  # "address,num_processes,process_id,local_gpu or -1,launcher pid"
# The job's secret (its /dev/shm names derive from it), and the file a process appends
# "pid<TAB>reason" to when it gives up on a group (cc/node_rendezvous.h, _src/job.py).
SECRET_ENV = "JAX_HOCCL_JOB_SECRET"
FAILURE_LOG_ENV = "JAX_HOCCL_FAILURE_LOG"
_GRACE_S = 2.0  # after the first failure: the processes' last output, then they are stopped
_TAIL_LINES = 20
_STOP_GRACE_S = 10.0  # the launcher stopped: its signal passed on, then the processes killed


class Stopped(KeyboardInterrupt):
  """A signal that ends a process stopped the launcher's job: the job was cleaned up on the
  way out (an interrupt, so that a test runner or a caller's loop stops too)."""

  def __init__(self, signum: int):
    super().__init__(f"stopped by {signal.Signals(signum).name}")
    self.signum = signum


def _signal_of(interrupt: KeyboardInterrupt) -> int:
  """The signal that stopped the launcher: Stopped's, else Ctrl-C's."""
  return interrupt.signum if isinstance(interrupt, Stopped) else signal.SIGINT


@contextlib.contextmanager
def _stopped_by_signals():
  """SIGTERM and SIGHUP raise Stopped inside the block, so the cleanup on the way out (the
  processes killed, the MPS daemon ended, the job's files removed) runs instead of the process
  ending at once, as it would by default. Only where the default is in force and on the main
  thread (the only one that may set handlers)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def stop(signum, _frame):
    raise Stopped(signum)

  previous = {}
  for sig in (signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(sig) is signal.SIG_DFL:
      previous[sig] = signal.signal(sig, stop)
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def initialize() -> bool:
  """jax.distributed.initialize() for a process this launcher started; False otherwise."""
  spec = os.environ.get(_ENV)
  if not spec:
    return False
  address, n, i, gpu, launcher = spec.split(",")
  _end_with(int(launcher))
  import jax
  kwargs = {"local_device_ids": [int(gpu)]} if int(gpu) >= 0 else {}
  if int(gpu) < 0:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # jax.lax across processes
  jax.distributed.initialize(address, num_processes=int(n), process_id=int(i), **kwargs)
  _report_uncaught_exceptions()
  return True


def _end_with(launcher: int) -> None:
  """This process is killed when the launcher dies, even of SIGKILL (which the launcher cannot
  pass on): Linux's parent-death signal, set here rather than at the launch because a
  subprocess's preexec_fn is unsafe in a launcher with threads."""
  if not sys.platform.startswith("linux"):
    return
  import ctypes
  pr_set_pdeathsig = 1
  try:
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
  except (OSError, AttributeError):
    return
  if os.getppid() != launcher:  # it died before the signal was set
    os._exit(1)


def report_failure(reason: str) -> None:
  """Tells the launcher that this process failed (it then ends the job at once instead of
  waiting for this process's exit, which jax.distributed's shutdown can hold up for minutes);
  nothing outside the launcher."""
  path = os.environ.get(FAILURE_LOG_ENV)
  if not path:
    return
  line = f"{os.getpid()}\t{' '.join(reason.splitlines())}\n".encode()
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # never created here: the launcher's
  except OSError:
    return
  try:
    os.write(fd, line)
  finally:
    os.close(fd)


def _report_uncaught_exceptions() -> None:
  previous = sys.excepthook

  def hook(kind, value, tb):
    previous(kind, value, tb)
    sys.stderr.flush()
    report_failure(f"uncaught {kind.__name__}: {value}")

  sys.excepthook = hook


def local_address() -> str:
  """A jax.distributed coordinator address on this machine (a free port of 127.0.0.1)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def _cleanup_if_killed(script: str, *args: str):
  """Starts `sh -c script` (args: $1...), which runs once the block is left (the block's own
  cleanup done: the script then finds nothing left to do) or this process dies, even of
  SIGKILL, which runs none of its cleanup: it waits on a pipe only this process holds open.
  Its own session: Ctrl-C at the terminal does not reach it. Best effort: without a shell
  the block runs without it."""
  read, write = os.pipe()
  try:
    subprocess.Popen(["sh", "-c", f"cat > /dev/null; {script}", "jax_hoccl-cleanup", *args],
                     stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
  except OSError:
    pass
  finally:
    os.close(read)
  try:
    yield
  finally:
    os.close(write)


@contextlib.contextmanager
def mps_daemon():
  """An MPS control daemon of its own (pipe and log folders in fresh temp folders): processes
  given the environment it yields share the GPU at once instead of taking turns. It quits on
  the way out (or, should this process be killed, once it is gone); end its clients first
  (start_group, end_group)."""
  env = {"CUDA_MPS_PIPE_DIRECTORY": tempfile.mkdtemp(prefix="mps-pipe-"),
         "CUDA_MPS_LOG_DIRECTORY": tempfile.mkdtemp(prefix="mps-log-")}
  full = {**os.environ, **env}
  try:
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=full, check=True, timeout=60)
  except (OSError, subprocess.SubprocessError):
    for d in env.values():
      shutil.rmtree(d, ignore_errors=True)
    raise
  pipe, log = env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]
  with _cleanup_if_killed('echo quit | CUDA_MPS_PIPE_DIRECTORY="$1" nvidia-cuda-mps-control; '
                          'rm -rf -- "$1" "$2"', pipe, log):
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


def _pass_on(signum: int, procs) -> None:
  """Sends the signal that stopped the launcher to a start_group group and gives its processes
  _STOP_GRACE_S to exit (their own handlers may save a checkpoint); end_group ends the rest."""
  if not procs:
    return
  try:
    os.killpg(procs[0].pid, signum)
  except ProcessLookupError:
    return
  deadline = time.monotonic() + _STOP_GRACE_S
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      return


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


class _Rank:
  """One process of a job: its output (kept whole, or echoed with a prefix) and last lines."""

  def __init__(self, index: int, proc: subprocess.Popen, echo: bool):
    self.index, self.proc, self.echo = index, proc, echo
    self.lines: list[str] = []
    self.tail: collections.deque = collections.deque(maxlen=_TAIL_LINES)
    self.pump = threading.Thread(target=self._read, daemon=True)
    self.pump.start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      self.tail.append(line)
      if self.echo:
        sys.stdout.write(f"[{self.index}] {line}")
        sys.stdout.flush()
      else:
        self.lines.append(line)


class JobResult:
  """How a job ended: each process's exit status and output (what it printed; empty when
  echoed), the first failure (None if none: its rank, what happened, its exit code for the
  launcher), and a summary of it."""

  def __init__(self, ranks, failure, timed_out, secret="", removed=()):
    self.secret, self.removed = secret, list(removed)  # its /dev/shm names the launcher removed
    self.codes = [r.proc.returncode for r in ranks]
    self.outputs = ["".join(r.lines) for r in ranks]
    self.failure, self.timed_out = failure, timed_out
    self.summary = ""
    if failure:
      rank, what, _ = failure
      last = "".join(f"  [{rank}] {line}" for line in ranks[rank].tail) if rank is not None else ""
      who = f"process {rank} (pid {ranks[rank].proc.pid})" if rank is not None else "a process"
      self.summary = (f"jax_hoccl.launch: {who} {what}; the other processes were stopped."
                      + (f" Its last lines:\n{last}" if last else ""))

  @property
  def code(self) -> int:
    return self.failure[2] if self.failure else 0


def _exit_text(code: int) -> tuple[str, int]:
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = "?"
    return f"was killed by signal {-code} ({name})", 128 - code
  return f"exited with code {code}", code


def run_job(commands, envs, timeout: float | None = None, echo: bool = False, **popen) -> JobResult:
  """Runs the commands as the processes 0..n-1 of one job (one process group, start_group)
  and watches them: the first that exits non-zero, is killed by a signal or reports a failure
  (report_failure, or cc/node_rendezvous.h's group errors) ends the job: the others are
  stopped _GRACE_S later (sooner if all have exited), the group killed whole. Whatever the
  job left in /dev/shm under its secret is removed (and listed in `removed`), however it
  ended. timeout (seconds): the job is stopped then, and timed_out set. SIGTERM, SIGHUP or
  SIGINT is passed on to the processes, which are stopped _STOP_GRACE_S later at most; then
  Stopped (KeyboardInterrupt for SIGINT) is raised."""
  secret = secrets.token_hex(16)
  folder = tempfile.mkdtemp(prefix="jax_hoccl-launch-")
  # _run_job's own cleanup of the files, should this process be killed
  with _stopped_by_signals(), _cleanup_if_killed(
      'rm -f -- "/dev/shm/jax_hoccl-$1"*; rm -rf -- "$2"', secret, folder):
    return _run_job(commands, envs, timeout, echo, secret, folder, **popen)


def _run_job(commands, envs, timeout, echo, secret, folder, **popen) -> JobResult:
  log = os.path.join(folder, "failures")
  open(log, "w").close()
  envs = [{**env, SECRET_ENV: secret, FAILURE_LOG_ENV: log} for env in envs]
  events: queue.Queue = queue.Queue()
  ranks: list[_Rank] = []
  failures = []  # (time, rank, what, code)
  timed_out, stop_at, removed = False, None, []
  try:
    procs = start_group(commands, envs, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, **popen)
    ranks = [_Rank(i, p, echo) for i, p in enumerate(procs)]
    pid_rank = {p.pid: i for i, p in enumerate(procs)}
    for r in ranks:
      threading.Thread(target=lambda r=r: events.put((r.index, r.proc.wait(), time.monotonic())),
                       daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    offset, exited = 0, set()
    while len(exited) < len(ranks):
      try:
        index, code, when = events.get(timeout=0.05)
        exited.add(index)
        if code != 0 and stop_at is None:
          what, launcher_code = _exit_text(code)
          failures.append((when, index, what, launcher_code))
      except queue.Empty:
        pass
      with open(log) as f:
        f.seek(offset)
        text = f.read()
      complete = text[:text.rfind("\n") + 1]
      offset += len(complete.encode())
      for line in complete.splitlines():
        pid, _, reason = line.partition("\t")
        index = pid_rank.get(int(pid)) if pid.isdigit() else None
        if stop_at is None:
          failures.append((time.monotonic(), index, f"gave up: {reason}", None))
      now = time.monotonic()
      if failures and stop_at is None:
        stop_at = now + _GRACE_S
      if stop_at is not None and now >= stop_at:
        break
      if deadline is not None and now >= deadline:
        timed_out = True
        break
  except KeyboardInterrupt as e:  # the processes get the signal first (to save a checkpoint)
    _pass_on(_signal_of(e), [r.proc for r in ranks])
    raise
  finally:
    end_group([r.proc for r in ranks])
    for r in ranks:
      r.pump.join(timeout=5)
    removed = remove_job_shared_memory(secret)
    shutil.rmtree(folder, ignore_errors=True)
  failure = None
  if failures:
    _, index, what, code = min(failures, key=lambda f: f[0])
    if code is None:  # a group error: the process's own code if it exited on its own, else 1
      own = ranks[index].proc.returncode if index is not None else None
      code = own if own and own > 0 and index in exited else 1
    failure = (index, what, code)
  return JobResult(ranks, failure, timed_out, secret, removed)


LEFT_BEHIND = "the job ended cleanly but left in /dev/shm (removed):"


def remove_job_shared_memory(secret: str) -> list[str]:
  """Removes the /dev/shm names of the job with this secret (cc/node_rendezvous.cc names
  them "jax_hoccl-<secret>-..."): what its processes could not unlink because they died
  first. Returns the names removed."""
  removed = []
  for path in glob.glob(f"/dev/shm/jax_hoccl-{secret}*"):
    try:
      os.unlink(path)
      removed.append(os.path.basename(path))
    except OSError:
      pass
  return removed


def run_worker_job(source: str, n: int, env: dict, timeout: float,
                   directory: str | None = None) -> JobResult:
  """Runs the Python program `source` as processes 0..n-1 of a jax.distributed job on this
  machine (argv: coordinator address, process id, n) under run_job (the first failure ends
  the job). The program is written to `directory`/worker.py (kept, to rerun by hand), else
  to a temp folder removed afterwards. Raises subprocess.TimeoutExpired after `timeout`
  seconds (the job stopped)."""
  address = local_address()
  with contextlib.ExitStack() as stack:
    tmp = directory or stack.enter_context(tempfile.TemporaryDirectory())
    script = os.path.join(tmp, "worker.py")
    with open(script, "w") as f:
      f.write(source)
    result = run_job([[sys.executable, "-P", script, address, str(i), str(n)]
                      for i in range(n)], [env] * n, timeout=timeout)
  if result.timed_out:
    raise subprocess.TimeoutExpired(script, timeout, output="\n".join(
        f"process {i}:\n{out[-3000:]}" for i, out in enumerate(result.outputs)))
  return result


def run_workers(source: str, n: int, env: dict, timeout: float,
                directory: str | None = None) -> list[tuple[int, str]]:
  """run_worker_job's processes' (exit status, output)."""
  result = run_worker_job(source, n, env, timeout, directory)
  return list(zip(result.codes, result.outputs))


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
  try:
    with _stopped_by_signals(), contextlib.ExitStack() as stack:
      shared = {}
      if 0 < gpus < a.nproc:
        try:
          shared = stack.enter_context(mps_daemon())
        except (OSError, subprocess.SubprocessError) as e:  # no MPS here: the GPU time-slices
          print(f"jax_hoccl.launch: no MPS daemon ({e}); the processes take turns on GPU 0",
                file=sys.stderr)
      return _run(a, gpus, shared)
  except KeyboardInterrupt as e:  # Ctrl-C, or Stopped: the job is cleaned up by now
    signum = _signal_of(e)
    print(f"jax_hoccl.launch: stopped by {signal.Signals(signum).name}; the processes were "
          "stopped.", file=sys.stderr)
    return 128 + signum


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
    env[_ENV] = f"{address},{a.nproc},{i},{gpu},{os.getpid()}"
    envs.append(env)
  result = run_job([[sys.executable, a.script, *a.args]] * a.nproc, envs, echo=True)
  if result.summary:
    print(result.summary, file=sys.stderr, end="" if result.summary.endswith("\n") else "\n")
  if result.removed and result.failure is None:  # its processes unlink their own: a leak
    print(f"jax_hoccl.launch: {LEFT_BEHIND} {', '.join(result.removed)}", file=sys.stderr)
  return result.code


if __name__ == "__main__":
  sys.exit(main())
