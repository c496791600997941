"""Loads the C++ extension and registers its FFI handlers with XLA (once, at import)."""
from __future__ import annotations

import jax

try:
  from jax_hoccl import _hoccl
except ImportError as e:  # pragma: no cover - only when the package was not built
  raise ImportError(
      "jax_hoccl's C++ extension (_hoccl) is missing: install with `pip install .` "
      "from the repository (it builds cc/ with CMake).") from e

WITH_CUDA: bool = bool(_hoccl.with_cuda)
TARGETS: dict[str, tuple[str, ...]] = {}

for _name, _per_platform in _hoccl.registrations().items():
  for _platform, _capsule in _per_platform.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform=_platform, api_version=1)
  TARGETS[_name] = tuple(_per_platform)


def ffi_lower(target: str, op: str, ctx, *args, lowering_args=None, **attrs):
  """Lowers to the custom call `target`. has_side_effect keeps XLA from merging or dropping
  a collective on some devices only, and from moving it past other side-effecting ops."""
  platforms = ctx.module_context.platforms
  for p in platforms:
    if p not in ("cpu", "cuda"):
      raise NotImplementedError(f"jax_hoccl.{op}: platform {p!r} is not supported (cpu, cuda).")
    if p == "cuda" and "CUDA" not in TARGETS.get(target, ()):
      raise RuntimeError(
          f"jax_hoccl.{op}: this build of jax_hoccl has no CUDA engine (the CUDA toolkit was "
          "not found when it was built). Reinstall with nvcc on PATH.")
  return jax.ffi.ffi_lowering(target, has_side_effect=True, **(lowering_args or {}))(
      ctx, *args, **attrs)
