"""Runs one jax_hoccl collective a few times, for a profiler to count the kernels it launches.

    ncu --clock-control none --csv --metrics gpu__time_duration.sum \
        python -P benchmarks/kernel_check.py all_gather

Inputs come from the host (device_put launches no kernel), so every kernel the profiler sees
belongs to the op: none are expected for all_gather, all_to_all and ppermute (copy engines and
stream memory operations only); psum and psum_scatter show XLA's fusion that sums the blocks.
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
import numpy as np
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl

op = sys.argv[1]
n = len(jax.devices())
mesh = jax.make_mesh((n,), ("x",))
perm = [(i, (i + 1) % n) for i in range(n)]
fns = {
    "all_gather": lambda v: jax_hoccl.all_gather(v, "x"),  # untiled: output is the op's buffer
    "all_to_all": lambda v: jax_hoccl.all_to_all(v.reshape(n, -1), "x", 0, 0, tiled=True),
    "ppermute": lambda v: jax_hoccl.ppermute(v, "x", perm),
    "psum": lambda v: jax_hoccl.psum(v, "x"),
    "psum_scatter": lambda v: jax_hoccl.psum_scatter(v, "x", tiled=True),
}
out_spec = P() if op == "psum" else P("x")
f = jax.jit(jax.shard_map(fns[op], mesh=mesh, in_specs=P("x"), out_specs=out_spec))
x = jax.device_put(np.random.default_rng(0).standard_normal(n * (4 << 20) // 4, dtype=np.float32),
                   NamedSharding(mesh, P("x")))
for _ in range(3):
  y = f(x)
jax.block_until_ready(y)
print(f"kernel_check {op}: ran 3 calls of 4 MiB per device on {n} devices")
