"""Loads the C++ extension and registers its FFI handlers with XLA (once, at import)."""
from __future__ import annotations

import os
import threading

import jax
import numpy as np

from jax_hoccl._src import environment

try:
  from jax_hoccl import _hoccl
except ImportError as e:  # pragma: no cover - only when the package was not built
  raise ImportError(
      "jax_hoccl's C++ extension (_hoccl) is missing: install with `pip install .` "
      "from the repository (it builds cc/ with CMake).") from e

WITH_CUDA: bool = bool(_hoccl.with_cuda)
TARGETS: dict[str, tuple[str, ...]] = {
    name: tuple(per_platform) for name, per_platform in _hoccl.registrations().items()}
_registered = False
_lock = threading.Lock()


def _tell_local_devices() -> None:
  """XLA:GPU hands a handler its local CUDA ordinal; the groups hold global device ids."""
  try:
    gpus = jax.local_devices(backend="gpu")
  except RuntimeError:  # no GPU backend
    return
  ids = [-1] * (max((d.local_hardware_id for d in gpus), default=-1) + 1)
  for d in gpus:
    ids[d.local_hardware_id] = d.id
  _hoccl.set_local_devices(ids)


def register() -> None:
  """Registers the handlers with XLA, once, at the first lowering. The CPU handlers keep
  per-instruction state (handlers_cpu.cc) whose type XLA must know before them, and
  registrations queued before the backends start are applied handlers first: so this waits
  until the backends are up (a lowering needs them anyway), then registers the type, then
  the handlers."""
  global _registered
  with _lock:
    if _registered:
      return
    environment.check()  # a malformed JAX_HOCCL_* value fails here, not silently later
    jax.devices()
    _tell_local_devices()
    jax.ffi.register_ffi_type("hoccl_cpu_call", _hoccl.cpu_call_type(), platform="cpu")
    for name, per_platform in _hoccl.registrations().items():
      for platform, handler in per_platform.items():
        jax.ffi.register_ffi_target(name, handler, platform=platform, api_version=1)
    _registered = True


def gpu_pci_bus_id(local_ordinal: int) -> str:
  """The PCI bus id of a local CUDA ordinal ("" without the CUDA engine)."""
  return _hoccl.gpu_pci_bus_id(int(local_ordinal)) if WITH_CUDA else ""


def set_job(secret: str, process_index: int, device_process: list, pids: list) -> None:
  _hoccl.set_job(secret, int(process_index), [int(p) for p in device_process],
                 [int(p) for p in pids])


def name_site(site: int, name: str) -> None:
  _hoccl.name_site(int(site), name)


def ffi_lower(target: str, op: str, ctx, *args, lowering_args=None, side_effect=True, **attrs):
  """Lowers to the custom call `target`. has_side_effect keeps XLA from merging or dropping
  a collective on some devices only, and from moving it past other side-effecting ops
  (side_effect=False: a call that only passes data through, which XLA may drop if unused)."""
  register()
  platforms = ctx.module_context.platforms
  for p in platforms:
    if p not in ("cpu", "cuda"):
      raise NotImplementedError(f"jax_hoccl.{op}: platform {p!r} is not supported (cpu, cuda).")
    if p == "cuda" and "CUDA" not in TARGETS.get(target, ()):
      raise RuntimeError(
          f"jax_hoccl.{op}: this build of jax_hoccl has no CUDA engine (the CUDA toolkit was "
          "not found when it was built). Reinstall with nvcc on PATH.")
  return jax.ffi.ffi_lowering(target, has_side_effect=side_effect, **(lowering_args or {}))(
      ctx, *args, **attrs)


DEFAULT_STAGED_BYTES = 1 << 20


def staged_limit() -> int:
  """The staged crossover: blocks of at most this many bytes take the staged path
  (JAX_HOCCL_STAGED_BYTES; cc/cuda/staged/staged_layout.h: StagedSlotBytes)."""
  raw = os.environ.get("JAX_HOCCL_STAGED_BYTES", "")
  return -(-(int(raw) if raw else DEFAULT_STAGED_BYTES) // 256) * 256  # slots: 256-byte units


DEFAULT_PACKED_BYTES = 128 << 10
PACKED_MAX_BYTES = 1 << 23


def packed_limit() -> int:
  """The packed crossover: blocks of at most this many bytes take the packed exchange
  (JAX_HOCCL_STAGED_PACKED_BYTES; cc/cuda/staged/staged_layout.h: PackedSlotBytes)."""
  raw = os.environ.get("JAX_HOCCL_STAGED_PACKED_BYTES", "")
  packed = -(-(int(raw) if raw else DEFAULT_PACKED_BYTES) // 16) * 16
  return min(packed, staged_limit(), PACKED_MAX_BYTES)


def mover_target(target: str, ctx, attrs: dict, parts: int = 1) -> str:
  """The custom call of a mover (hoccl_all_gather, hoccl_all_to_all, hoccl_ppermute) on CUDA:
  its command-buffer compatible twin `<target>_staged` when the block (what one rank sends one
  peer: the input's bytes / `parts`) takes the staged path, so XLA may capture it into its CUDA
  graphs; else `target`. The same test as the C++ engine's (cc/cuda/staged/staged_exchange.h:
  StagedEligible), which decides the path at run time."""
  if tuple(ctx.module_context.platforms) != ("cuda",):
    return target
  limit = staged_limit()
  aval = ctx.avals_in[0]
  try:
    block = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize // parts
  except TypeError:  # symbolic shapes: sizes known only at run time
    return target
  group_size = int(attrs["group"]["group_size"])
  return f"{target}_staged" if group_size >= 2 and 0 < block <= limit else target


# What the exchange kernel adds (cc/ffi/handler_common.h: SumOf), and the groups it serves
# (cc/cuda/staged/exchange_kernel.h: kKernelMaxRanks).
SUMMED_DTYPES = (np.dtype(np.float32), np.dtype(jax.numpy.bfloat16), np.dtype(np.float16))
KERNEL_MAX_RANKS = 16


def staged_sums_in_kernel() -> bool:
  """Whether a staged psum or psum_scatter is summed inside the exchange kernel where it
  serves: unless JAX_HOCCL_STAGED_SUM=0, or the kernel is off (JAX_HOCCL_STAGED_KERNEL=0)."""
  return (os.environ.get("JAX_HOCCL_STAGED_SUM", "1") != "0"
          and os.environ.get("JAX_HOCCL_STAGED_KERNEL", "1") != "0")


def lower_staged_sum(target: str, mover: str, op: str, ctx, x, group_attrs, blocks: bool = False):
  """The custom call `target` (hoccl_psum_staged, hoccl_psum_scatter_staged), whose sum runs
  inside the staged exchange, where it can: on CUDA, a block that `mover` (hoccl_all_gather;
  hoccl_all_to_all, `blocks`: x holds one block per rank) stages, of a type the exchange
  kernel adds, in a group it serves (JAX_HOCCL_STAGED_KERNEL not 0), unless
  JAX_HOCCL_STAGED_SUM=0. Else None: the mover and a sum of XLA's, which XLA may fuse with the
  sum's consumers (docs/design.md, "The staged path" says when each is faster). `group_attrs()`
  gives the group's attributes (axes.ffi_group_attrs)."""
  if tuple(ctx.module_context.platforms) != ("cuda",):
    return None
  if not staged_sums_in_kernel():
    return None
  if np.dtype(ctx.avals_in[0].dtype) not in SUMMED_DTYPES:
    return None
  attrs = group_attrs()
  n = int(attrs["group"]["group_size"])
  if n > KERNEL_MAX_RANKS or not mover_target(mover, ctx, attrs, n if blocks else 1).endswith(
      "_staged"):
    return None
  return ffi_lower(target, op, ctx, x, **attrs)
