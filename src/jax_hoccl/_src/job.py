"""The jax.distributed job as jax_hoccl's engines need it (cc/job.h): which processes share a
node, their pids, and a secret shared by the job's processes only, from which the names of
the shared memory and sockets of groups spanning processes derive (nothing outside the job
can guess them). Found once per process, at the first lowering of a group that spans
processes, through jax.distributed's key-value store; every process lowers the same programs,
so all of them get here."""
from __future__ import annotations

import os
import secrets
import socket
import time

import numpy as np
import jax

from jax_hoccl._src import environment, ffi_targets
from jax_hoccl._src import jax_internals as ji

_PREFIX = "jax_hoccl/job/"
_nodes: list[str] | None = None  # node of each process
_gpus_shared: bool | None = None  # two of the job's devices are one physical GPU
_never_came: str | None = None  # why the job's processes did not all come (raised again)


def node_name() -> str:
  """This process's node: JAX_HOCCL_NODE if set (tests run several "nodes" on one host),
  else the host name and kernel boot id (containers of one host that share /dev/shm)."""
  name = os.environ.get("JAX_HOCCL_NODE", "")
  if name:
    return name
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
  except OSError:
    boot = ""
  return f"{socket.gethostname()}/{boot}"


def timeout_s() -> float:
  """JAX_HOCCL_TIMEOUT_S: seconds to wait for a peer (default 300), checked by environment.py
  (this may run before the first registration, which checks it too)."""
  environment.check()
  return float(os.environ.get("JAX_HOCCL_TIMEOUT_S") or 300.0)


def nodes(op: str = "collective") -> list[str]:
  """The node of every process, after telling the C++ engines about the job (once). `op`:
  the call that needs it, named in the error when a process never comes."""
  global _nodes, _gpus_shared
  if _nodes is not None:
    return _nodes
  if _never_came is not None:  # (a second try would wait again, or set the secret twice)
    raise RuntimeError(_never_came)
  n, me = jax.process_count(), jax.process_index()
  client = ji.distributed_client()
  if n == 1 or client is None:
    _nodes = [node_name()] * n
    _gpus_shared = False  # one process: each of its devices is its own GPU
    return _nodes
  timeout = timeout_s()
  deadline = time.monotonic() + timeout
  if me == 0:
    # python -m jax_hoccl.launch makes the secret, so that it can remove what a job that died
    # left in /dev/shm (launch.run_job)
    client.key_value_set(_PREFIX + "secret",
                         os.environ.get("JAX_HOCCL_JOB_SECRET") or secrets.token_hex(16))
  client.key_value_set(_PREFIX + f"process/{me}", f"{os.getpid()} {_local_gpus()} {node_name()}")

  def get(key):
    # One deadline for all the keys: a missing process costs the timeout once.
    wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
      return client.blocking_key_value_get(_PREFIX + key, wait_ms)
    except Exception as e:  # jax.distributed's DEADLINE_EXCEEDED (its error type is private)
      if "DEADLINE_EXCEEDED" not in str(e):
        raise
      global _never_came
      reason = _never_came = _never_joined(client, op, me, n, timeout)
      from jax_hoccl import launch  # the launcher, if any, ends the job at once
      launch.report_failure(reason)
      raise RuntimeError(reason) from None

  secret = get("secret")
  procs = [get(f"process/{i}").split(" ", 2) for i in range(n)]
  found = [node for _, _, node in procs]
  pids = [int(pid) if found[i] == found[me] else 0 for i, (pid, _, _) in enumerate(procs)]
  gpus = [(node, bus) for _, buses, node in procs for bus in buses.split(",") if bus != "-"]
  _gpus_shared = len(set(gpus)) < len(gpus)
  devices = jax.devices()
  owner = np.full(max(d.id for d in devices) + 1, -1, np.int64)
  for d in devices:
    owner[d.id] = d.process_index
  ffi_targets.set_job(secret, me, owner.tolist(), pids)
  _nodes = found
  return _nodes


def _local_gpus() -> str:
  """This process's GPUs by PCI bus id (the physical GPU, whatever CUDA_VISIBLE_DEVICES
  numbers it), comma-separated; "-" for none."""
  try:
    gpus = jax.local_devices(backend="gpu")
  except RuntimeError:
    return "-"
  buses = [ffi_targets.gpu_pci_bus_id(d.local_hardware_id) for d in gpus]
  return ",".join(b for b in buses if b) or "-"


def gpus_shared(op: str = "collective") -> bool:
  """Whether two of the job's devices are one physical GPU (several ranks on one GPU, as under
  MPS): their copies to each other are then kernels that need SMs, not copy engines. `op`: the
  call that asks, named if a process never comes."""
  nodes(op)
  return bool(_gpus_shared)


def node_of_device(device, op: str = "collective") -> str:
  return nodes(op)[device.process_index]


def _never_joined(client, op, me, n, timeout) -> str:
  """The error when a process never published itself: which processes those are."""
  joined = {key.rsplit("/", 1)[-1] for key, _ in client.key_value_dir_get(_PREFIX + "process/")}
  missing = [i for i in range(n) if str(i) not in joined]
  who = (f"process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
         if missing else "a process")
  their = "their" if len(missing) > 1 else "its"
  return (f"jax_hoccl {op}: process {me} of {n} timed out after {timeout:g} s "
          f"(JAX_HOCCL_TIMEOUT_S) waiting for {who} to reach {their} first jax_hoccl call "
          "across processes; every process must call the same collectives in the same order. "
          "A process still compiling another program on GPU can be held there by XLA's "
          "sharded autotuning, which waits for every process: --xla_gpu_shard_autotuning=false "
          "ends that wait.")
