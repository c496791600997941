"""examples/train_transformer.py run as the README runs it (one process, 8 CPU devices): the
jax_hoccl run learns and MATCHes jax.lax's, in float32 (both at matmul precision "highest") and
with --fused --bf16, whose tolerance is measured from bf16 rounding over the reference run (the
README's command, at its default 300 steps: that is where the rounding compounds)."""
import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "train_transformer.py")


def run(*args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-P", EXAMPLE, *args], env=env, capture_output=True,
                        text=True, timeout=600)
  return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("args,how", [
    (("--fused", "--steps", "150"), "float32, matmul precision 'highest' in both runs, rtol 1e-4"),
    (("--fused", "--bf16"), "bfloat16 rounding moves the lax run from its float32 run by"),
], ids=["fused-f32", "fused-bf16"])
def test_example_matches_lax(args, how):
  rc, out = run(*args)
  assert rc == 0, out[-3000:]
  lines = out.splitlines()
  assert "8 cpu devices, mesh dp=4 x tp=2" in out, out[-3000:]
  assert sum(line.endswith(": learned") for line in lines) == 2, out[-3000:]
  assert any(line.startswith("compared with lax") and how in line for line in lines), out[-3000:]
  assert "MATCH" in lines and "MISMATCH" not in out, out[-3000:]
