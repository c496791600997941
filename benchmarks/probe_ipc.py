"""Can another process map XLA's device buffers with CUDA IPC? The question one process per GPU
(cross-process copy engines, the `PeerTransport` seam in cc/cuda/cuda_executor.h) starts from.

    python3 benchmarks/probe_ipc.py          # on a machine with >= 2 GPUs

This process (JAX) puts a known array on GPU 0 and prints the allocation that holds it
(cuMemGetAddressRange: with XLA's preallocated pool it should be the whole pool) and whether
cudaIpcGetMemHandle exports it (it refuses memory from cuMemCreate/VMM). A child process without
JAX opens the handle on GPU 1 (peer access) and reads the array back through the mapping.
Try XLA_PYTHON_CLIENT_PREALLOCATE=false too (the pool then grows in several allocations).
"""
from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys


def load(names):
  """The first of `names` found in the process, on the library path or in site-packages."""
  for name in names:
    try:
      return ctypes.CDLL(name)
    except OSError:
      pass
  for d in sys.path:
    for name in names:
      for path in glob.glob(os.path.join(d, "nvidia", "**", name), recursive=True):
        return ctypes.CDLL(path)
  raise OSError(f"none of {names} found")


CUDART = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class IpcHandle(ctypes.Structure):  # cudaIpcMemHandle_t: 64 opaque bytes, passed by value
  _fields_ = [("reserved", ctypes.c_char * 64)]


def child(handle_hex: str, offset: int, count: int) -> None:
  rt = load(CUDART)
  assert rt.cudaSetDevice(1) == 0
  h = IpcHandle()
  ctypes.memmove(ctypes.addressof(h), bytes.fromhex(handle_hex), 64)
  ptr = ctypes.c_void_p()
  err = rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, 1)  # cudaIpcMemLazyEnablePeerAccess
  print(f"child on GPU 1: cudaIpcOpenMemHandle -> {err}", flush=True)
  if err:
    return
  out = (ctypes.c_float * count)()
  err = rt.cudaMemcpy(out, ctypes.c_void_p(ptr.value + offset), 4 * count, 2)  # D2H
  print(f"child read through the mapping (cudaMemcpy -> {err}): {list(out)}", flush=True)
  rt.cudaIpcCloseMemHandle(ptr)


def main() -> None:
  import numpy as np
  import jax
  import jax.numpy as jnp
  x = jax.device_put(jnp.arange(1 << 20, dtype=jnp.float32) + 0.5, jax.devices()[0])
  x.block_until_ready()
  ptr = x.unsafe_buffer_pointer()
  rt = load(CUDART)
  cu = load(("libcuda.so.1", "libcuda.so"))
  assert rt.cudaSetDevice(0) == 0  # the primary context, which XLA uses, current here too
  base, size = ctypes.c_uint64(), ctypes.c_size_t()
  err = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
  print(f"jax buffer 0x{ptr:x}: cuMemGetAddressRange -> {err}, allocation base 0x{base.value:x}, "
        f"{size.value / 2**30:.2f} GiB (XLA_PYTHON_CLIENT_PREALLOCATE="
        f"{os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', 'default')})", flush=True)
  # A VMM allocation (cuMemCreate) has a handle; its requested handle types say whether it
  # can be exported to another process (1 = POSIX file descriptor).
  vmm = ctypes.c_uint64()
  err = cu.cuMemRetainAllocationHandle(ctypes.byref(vmm), ctypes.c_void_p(ptr))
  print(f"cuMemRetainAllocationHandle -> {err} (0: a VMM allocation)", flush=True)
  if err == 0:
    prop = (ctypes.c_int * 16)()  # CUmemAllocationProp: type, requestedHandleTypes, location...
    err = cu.cuMemGetAllocationPropertiesFromHandle(prop, vmm)
    print(f"  properties -> {err}: type {prop[0]}, requestedHandleTypes {prop[1]}, "
          f"location type {prop[2]} id {prop[3]}", flush=True)
    cu.cuMemRelease(vmm)
  h = IpcHandle()
  err = rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base.value or ptr))
  print(f"cudaIpcGetMemHandle(allocation base) -> {err}", flush=True)
  if err:
    return
  offset = ptr - (base.value or ptr)
  raw = ctypes.string_at(ctypes.addressof(h), 64)  # (h.reserved would stop at a zero byte)
  subprocess.run([sys.executable, __file__, "--child", raw.hex(), str(offset), "8"], check=False)
  print(f"expected: {np.asarray(x[:8]).tolist()}", flush=True)


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
  else:
    main()
