"""examples/train_flax.py, a Flax NNX + optax data x tensor-parallel model, run as a user runs
it: its jax_hoccl step (route_collectives on, jax_hoccl's tensor-parallel collectives) must compile
to no XLA collective, learn, and give the loss curve of the same run on jax.lax. Skips when
flax or optax is not installed (they are example extras: pip install ".[examples]")."""
import importlib.util
import os
import subprocess
import sys

import pytest

MISSING = [m for m in ("flax", "optax") if importlib.util.find_spec(m) is None]
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "train_flax.py")


@pytest.mark.skipif(bool(MISSING), reason=f"{' and '.join(MISSING)} not installed (example "
                    "extras: pip install \".[examples]\")")
@pytest.mark.parametrize("dp,tp", [(4, 2), (2, 4)])
def test_flax_example_matches_lax(dp, tp):
  proc = subprocess.run([sys.executable, "-P", EXAMPLE, "--dp", str(dp), "--tp", str(tp),
                         "--steps", "25"], capture_output=True, text=True, timeout=600)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-4000:]
  assert "hoccl: loss" in out and "XLA collectives in the compiled step: none" in out, out
  assert "MATCH" in out and "FAIL" not in out, out
