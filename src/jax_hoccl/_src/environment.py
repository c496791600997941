"""Every JAX_HOCCL_* environment variable, checked once when jax_hoccl first lowers a program
(ffi_targets.register): a malformed value is an error naming the variable, instead of a
silent fallback to the default in whichever file reads it. docs/supported.md says what each
one does."""
from __future__ import annotations

import os
import warnings

# name -> what a valid value is: ("int", minimum), ("float>0",), ("choice", {...}), ("any",)
VARIABLES = {
    "JAX_HOCCL_TIMEOUT_S": ("float>0",),
    "JAX_HOCCL_PSUM_ALGORITHM": ("choice", {"auto", "one_shot", "two_step"}),
    "JAX_HOCCL_CHUNKS": ("int", 1),
    "JAX_HOCCL_CHANNELS": ("int", 1),
    "JAX_HOCCL_MULTISTREAM_MIN_BYTES": ("int", 1),
    "JAX_HOCCL_SPIN_US": ("int", 0),
    "JAX_HOCCL_ASYNC_STREAMS": ("int", 1),
    "JAX_HOCCL_BUCKET_BYTES": ("int", 0),
    "JAX_HOCCL_STAGED_BYTES": ("int", 0),
    "JAX_HOCCL_CUBLASLT": ("choice", {"0", "1"}),
    "JAX_HOCCL_CUBLASLT_CANDIDATES": ("int", 1),
    "JAX_HOCCL_CUBLASLT_VERBOSE": ("choice", {"0", "1"}),
    "JAX_HOCCL_DEBUG": ("choice", {"0", "1"}),
    "JAX_HOCCL_PROFILE": ("choice", {"0", "1"}),
    "JAX_HOCCL_NODE": ("any",),
    "JAX_HOCCL_LAUNCH": ("any",),  # set by python -m jax_hoccl.launch
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
  try:
    value = float(raw) if kind == "float>0" else int(raw)
  except ValueError:
    value = None
  if kind == "float>0":
    return None if value is not None and value > 0 else "a positive number"
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
