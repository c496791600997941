"""The README's quick start, runnable as is: a psum and an all_gather inside shard_map, checked
against jax.lax. Without a GPU it runs on 4 virtual CPU devices.

    python examples/quickstart.py
"""
import os

# Without a GPU, ask XLA for 4 CPU devices (must be set before jax starts).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_hoccl

mesh = jax.make_mesh((jax.device_count(),), ("tp",))


@jax.jit
@jax.shard_map(mesh=mesh, in_specs=P("tp"), out_specs=(P(), P()))
def step(x):                                     # x: this device's rows
  total = jax_hoccl.psum(x, "tp")                # was jax.lax.psum(x, "tp")
  rows = jax_hoccl.all_gather(x, "tp", tiled=True, to="invarying")
  return total, rows


@jax.jit
@jax.shard_map(mesh=mesh, in_specs=P("tp"), out_specs=(P(), P()))
def step_lax(x):
  return jax.lax.psum(x, "tp"), jax.lax.all_gather(x, "tp", tiled=True, to="invarying")


x = jax.random.normal(jax.random.key(0), (jax.device_count() * 2, 128))
x = jax.device_put(x, jax.NamedSharding(mesh, P("tp")))  # rows split over "tp"
total, rows = step(x)
want_total, want_rows = step_lax(x)
np.testing.assert_allclose(total, want_total, rtol=1e-6, atol=1e-6)
np.testing.assert_array_equal(rows, want_rows)
if jax.device_count() > 1:  # over one device nothing moves and jax.lax's op is used
  assert "hoccl_" in step.lower(x).as_text(), "jax_hoccl's collectives were not used"
print(f"jax_hoccl {jax_hoccl.__version__} on {jax.device_count()} {jax.devices()[0].platform} "
      f"device(s), jax {jax.__version__}, CUDA engine: {jax_hoccl.with_cuda}: psum and "
      "all_gather match jax.lax")
