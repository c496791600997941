"""Every JAX_HOCCL_* environment variable, checked once when jax_hoccl first lowers a program
(ffi_targets.register): a malformed value is an error naming the variable, instead of a
silent fallback to the default in whichever file reads it. docs/supported.md says what each
one does."""
from __future__ import annotations

import os
import warnings

# name -> what a valid value is: ("int", minimum[, maximum]), ("float>0",), ("choice", {...}),
# ("hex", length), ("any",)
VARIABLES = {
    "JAX_HOCCL_TIMEOUT_S": ("float>0",),
    "JAX_HOCCL_PSUM_ALGORITHM": ("choice", {"auto", "one_shot", "two_step"}),
    "JAX_HOCCL_CHUNKS": ("int", 1, 64),  # the CUDA engine caps it there (cuda_executor.cc)
    "JAX_HOCCL_CHANNELS": ("int", 1, 4),  # XLA's stream + kMaxSideStreams (cuda_executor.h)
    "JAX_HOCCL_MULTISTREAM_MIN_BYTES": ("int", 1),
    "JAX_HOCCL_SPIN_US": ("int", 0),
    "JAX_HOCCL_ASYNC_STREAMS": ("int", 1, 4),  # ops/async_collectives.py: MAX_ASYNC_STREAMS
    "JAX_HOCCL_BUCKET_BYTES": ("int", 0),
    "JAX_HOCCL_STAGED_BYTES": ("int", 0),
    "JAX_HOCCL_STAGED_KERNEL": ("choice", {"0", "1"}),
    "JAX_HOCCL_STAGED_SUM": ("choice", {"0", "1"}),
    "JAX_HOCCL_STAGED_PACKED_BYTES": ("int", 0),
    "JAX_HOCCL_GEMV_PSUM": ("choice", {"0", "1"}),
    "JAX_HOCCL_CUBLASLT": ("choice", {"0", "1"}),
    "JAX_HOCCL_CUBLASLT_CANDIDATES": ("int", 1, 64),
    "JAX_HOCCL_CUBLASLT_VERBOSE": ("choice", {"0", "1"}),
    "JAX_HOCCL_DEBUG": ("choice", {"0", "1"}),
    "JAX_HOCCL_PROFILE": ("choice", {"0", "1"}),
    "JAX_HOCCL_NODE": ("any",),
    "JAX_HOCCL_LAUNCH": ("any",),  # set by python -m jax_hoccl.launch (launch.py)
    "JAX_HOCCL_JOB_SECRET": ("hex", 32),  # set by the launcher (launch.run_job)
    "JAX_HOCCL_FAILURE_LOG": ("any",),  # set by the launcher (launch.run_job)
    # Read by the repository's scripts, not by the package.
    "JAX_HOCCL_PYTHON": ("any",),
    "JAX_HOCCL_BOOTSTRAP_PYTHON": ("any",),
    "JAX_HOCCL_COMMIT": ("any",),
}


def _problem(rule, raw: str) -> str | None:
  kind = rule[0]
  if kind == "any":
    return None
  if kind == "choice":
    return None if raw in rule[1] else f"one of {sorted(rule[1])}"
  if kind == "hex":
    ok = len(raw) == rule[1] and all(c in "0123456789abcdef" for c in raw)
    return None if ok else f"{rule[1]} lowercase hex digits"
  try:
    value = float(raw) if kind == "float>0" else int(raw)
  except ValueError:
    value = None
  if kind == "float>0":
    return None if value is not None and value > 0 else "a positive number"
  if len(rule) > 2:
    ok = value is not None and rule[1] <= value <= rule[2]
    return None if ok else f"an integer from {rule[1]} to {rule[2]}"
  return None if value is not None and value >= rule[1] else f"an integer >= {rule[1]}"


def check() -> None:
  """Raises ValueError for a set JAX_HOCCL_* variable with a malformed value; warns about one
  that jax_hoccl does not know (a typo would otherwise do nothing)."""
  for name, raw in sorted(os.environ.items()):
    if not name.startswith("JAX_HOCCL_") or raw == "":
      continue
    rule = VARIABLES.get(name)
    if rule is None:
      warnings.warn(f"{name} is not a jax_hoccl environment variable and does nothing "
                    f"(known: {', '.join(sorted(VARIABLES))}).", stacklevel=2)
      continue
    want = _problem(rule, raw)
    if want:
      raise ValueError(f"{name} must be {want}, got {raw!r}.")
