"""The GPUs a benchmark ran on, as its results name them: in the JSON ("devices") and in the
file name ("1xNVIDIA-H100-80GB-HBM3"), read from nvidia-smi so that a process that only
starts ranks needs no CUDA context of its own."""
from __future__ import annotations

import subprocess


def gpu_names() -> list[str]:
  """Each GPU's name (as jax's device_kind has it), [] without nvidia-smi or GPUs."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.TimeoutExpired):
    return []
  return [line.strip() for line in out.splitlines() if line.strip()]


def file_tag(gpu: bool) -> str:
  """What a results file name says of the machine: "1xNVIDIA-H200" (one GPU used, of that
  kind), or "cpu"."""
  names = gpu_names() if gpu else []
  return f"1x{names[0].replace(' ', '-')}" if names else ("1xGPU" if gpu else "cpu")
