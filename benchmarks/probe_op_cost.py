"""What one collective costs, split into host and device: for a chain of K dependent ops in
one jit, the wall time per op, the device time per op with the host hidden (each op behind a
GEMM, minus the GEMMs alone), and the host time jax_hoccl's handlers spent per op by phase
(JAX_HOCCL_PROFILE=1 is set here). If wall/op is close to the host time, the chain is
host-bound; if close to the device time, device-bound.

    python3 benchmarks/probe_op_cost.py [sizes in KiB, default 64,1024,16384]
Env knobs of the engine (JAX_HOCCL_MULTISTREAM_MIN_BYTES, JAX_HOCCL_SPIN_US, ...) apply;
PROBE_VARIANTS=psum,all_gather runs only the variants whose names contain one of those;
PROBE_TIMELINE=1 also prints each variant's device timeline behind the GEMMs (where the GPU
waits), PROBE_K sets the chain length (default 32).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_HOCCL_PROFILE", "1")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_hoccl  # noqa: E402
from jax_hoccl import _hoccl  # noqa: E402
from jax_hoccl.bench.collectives import behind_gemms, time_call  # noqa: E402

K = int(os.environ.get("PROBE_K", 32))


def variants(n):
  perm = [(i, (i + 1) % n) for i in range(n)]

  def hoccl_async(x):
    return jax_hoccl.done(jax_hoccl.ppermute_start(x, "x", perm))[0]

  def hoccl_ag(x):  # all_gather then keep my block: same size in and out
    return jax_hoccl.all_gather(x, "x", tiled=True)[: x.shape[0]] * 0.5

  def lax_ag(x):
    return jax.lax.all_gather(x, "x", tiled=True)[: x.shape[0]] * 0.5

  return {
      "ppermute hoccl": lambda x: jax_hoccl.ppermute(x, "x", perm),
      "ppermute lax": lambda x: jax.lax.ppermute(x, "x", perm),
      "ppermute_start/done hoccl": hoccl_async,
      "all_gather hoccl": hoccl_ag,
      "all_gather lax": lax_ag,
      "psum hoccl": lambda x: jax_hoccl.psum(x, "x") * 0.5,
      "psum lax": lambda x: jax.lax.psum(x, "x") * 0.5,
  }


def median_wall(f, args, repeats=7):
  return time_call(lambda a: f(*a), args, repeats)


def main():
  kib = sys.argv[1] if len(sys.argv) > 1 else "64,1024,16384"
  sizes = [int(s) * 1024 for s in kib.split(",")]
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  n = mesh.shape["x"]
  rng = np.random.default_rng(0)
  gemm_n = int(os.environ.get("PROBE_GEMM_N", 2048))  # the GEMM each op hides behind
  a = jax.device_put(
      rng.standard_normal((n * gemm_n, gemm_n), dtype=np.float32).astype(jnp.bfloat16),
      NamedSharding(mesh, P("x")))
  smap = lambda body, specs: jax.jit(jax.shard_map(  # noqa: E731
      body, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False))

  def chain(op):
    def body(x):
      for _ in range(K):
        x = op(x)
      return x
    return body

  base = smap(behind_gemms(lambda x: x, K), (P("x"), P("x")))
  env = {k: v for k, v in os.environ.items() if k.startswith("JAX_HOCCL_") and k != "JAX_HOCCL_PROFILE"}
  print(f"probe_op_cost: {n} x {jax.devices()[0].device_kind}, K={K}, env {env or 'default'}")
  print(f"{'variant':28s} {'size':>8s} {'wall/op':>8s} {'device/op':>9s}  host us/op by phase")
  for nbytes in sizes:
    x = jax.device_put(rng.standard_normal(n * nbytes // 4, dtype=np.float32), NamedSharding(mesh, P("x")))
    t_base = median_wall(base, (x, a))
    only = os.environ.get("PROBE_VARIANTS", "").split(",")  # substrings of names to run
    for name, op in variants(n).items():
      if not any(v in name for v in only):
        continue
      f = smap(chain(op), P("x"))
      g = smap(behind_gemms(op, K), (P("x"), P("x")))
      wall = median_wall(f, (x,)) / K
      dev = (median_wall(g, (x, a)) - t_base) / K
      _hoccl.host_profile(reset=True)
      calls = 5
      for _ in range(calls):
        jax.block_until_ready(f(x))
      prof = _hoccl.host_profile(reset=True)
      per_op = "  ".join(f"{ph}={ns / 1e3 / (calls * K * n):.1f}" for ph, c, ns in prof)
      size = f"{nbytes // 1024} KiB"
      print(f"{name:28s} {size:>8s} {wall * 1e6:8.1f} {dev * 1e6:9.1f}  {per_op}", flush=True)
      if os.environ.get("PROBE_TIMELINE"):
        from probe_fused import timeline
        timeline(g, (x, a), calls=2)


if __name__ == "__main__":
  main()
