"""The examples as `python -m jax_hoccl.launch -n 2` runs them (two CPU processes of 4 devices).

Their jax_hoccl run compiles no XLA collective in either process, set-up included (parameters,
optimizer state and batches placed on the mesh): on GPUs those would be NCCL's, which refuses
ranks that share a GPU (jax.device_put of host data to a mesh across processes compiles an
all-gather to check that every process passed the same value). And their check against the
same model on one device, the reference used where ranks share a GPU, MATCHes on both ranks."""
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import XLA_COLLECTIVES
from jax_hoccl.launch import LEFT_BEHIND

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAX_MISSING = [m for m in ("flax", "optax") if importlib.util.find_spec(m) is None]
EXAMPLES = [
    pytest.param("train_transformer.py", id="transformer"),
    pytest.param("train_flax.py", id="flax", marks=pytest.mark.skipif(
        bool(FLAX_MISSING), reason=f"{' and '.join(FLAX_MISSING)} not installed (example "
        "extras: pip install \".[examples]\")")),
]


def launch(example, *args, xla_flags=""):
  """(exit status, output, the names the job left in /dev/shm, which the launcher removed
  and named: none may survive a job that ended cleanly; other jobs may run beside it)."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_HOCCL_NODE")}
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  proc = subprocess.run([sys.executable, "-P", "-m", "jax_hoccl.launch", "-n", "2",
                         os.path.join(REPO, "examples", example), *args],
                        env=env, capture_output=True, text=True, timeout=600)
  out = proc.stdout + proc.stderr
  left = [line for line in out.splitlines() if LEFT_BEHIND in line]
  return proc.returncode, out, left


@pytest.mark.parametrize("example", EXAMPLES)
def test_jax_hoccl_run_compiles_no_xla_collective(tmp_path, example):
  dump = tmp_path / "hlo"
  _, out, left = launch(example, "--no-check", "--steps", "3",
                  xla_flags=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
  for rank in (0, 1):  # both ranks trained to the end (3 steps are too few to learn)
    assert f"[{rank}] [hoccl] loss" in out or f"[{rank}] hoccl: loss" in out, out[-3000:]
  texts = {p.name: p.read_text() for p in dump.glob("*after_optimizations.txt")}
  assert any("hoccl_" in t for t in texts.values()), sorted(texts)  # the train step is there
  found = {name: [c for c in XLA_COLLECTIVES if c in text] for name, text in texts.items()}
  assert not {k: v for k, v in found.items() if v}, "XLA collectives compiled"
  assert not left, left


@pytest.mark.parametrize("example", EXAMPLES)
def test_one_device_reference_matches(example):
  # (30 steps: too few for the transformer to learn, and so to exit 0; enough to compare)
  _, out, left = launch(example, "--reference", "one-device", "--steps", "30")
  assert "Traceback" not in out, out[-3000:]
  for rank in (0, 1):
    assert f"[{rank}] " in out and "one device" in out, out[-3000:]
    assert any(line.startswith(f"[{rank}] ") and line.endswith("MATCH")
               for line in out.splitlines()), out[-3000:]
  assert "FAIL" not in out and "MISMATCH" not in out, out[-3000:]
  assert not left, left
