"""The fused matmul-collective ops vs their unfused jax.lax definitions: values (float32
tight, bfloat16 loose vs lax in float32), typing, gradients (through shard_map under jit,
check_vma True and False, replicated weights), and input errors, on a 2x4 mesh ('dp', 'tp')
with tp=4 and a 4x2 mesh with tp=2. The data differs across 'dp' too, so a group mix-up
(a rank exchanging with the wrong dp row) changes the result.

Per-device buffers stay <= 512 bytes (see test_collectives.py's docstring).
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("PJRT_NPROC", "16")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_hoccl as hc  # noqa: E402

CPUS = jax.devices("cpu")
MESHES = {
    "tp4": jax.make_mesh((2, 4), ("dp", "tp"), devices=CPUS[:8]),
    "tp2": jax.make_mesh((4, 2), ("dp", "tp"), devices=CPUS[:8]),
}
MESH_IDS = list(MESHES)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
CHECK_VMA = [pytest.param(True, id="vma"), pytest.param(False, id="novma")]


def rand(rng, shape, dtype=jnp.float32):
  a = rng.standard_normal(shape).astype(np.float32)
  a[a == 0] = 0.5
  return jnp.asarray(a).astype(dtype)


def put(mesh, a, spec):
  return jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))


def to_np(a):
  return np.asarray(jax.device_get(a))


def f32(tree):
  return jax.tree.map(lambda a: a.astype(jnp.float32)
                      if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def assert_close(got, ref, dtype, name=""):
  a, b = to_np(got), to_np(ref)
  assert a.shape == b.shape, (name, a.shape, b.shape)
  assert a.dtype == np.dtype(dtype), (name, a.dtype, dtype)
  a, b = a.astype(np.float64), b.astype(np.float64)
  scale = max(1.0, float(np.abs(b).max()))
  if np.dtype(dtype) == np.dtype(jnp.bfloat16):
    tol = 3e-2 * scale  # bf16 inputs/outputs and bf16-rounded partials vs lax in f32
  else:
    tol = 2e-5 * scale
  err = float(np.abs(a - b).max())
  assert err <= tol, f"{name}: max |ours - lax| = {err} > {tol}"
  assert np.abs(b).max() > 0, name  # the comparison is not vacuous


# ------------------------------------------------------------------------------------------
# Cases. Each builds global inputs (different on every dp row) and returns
#   args, in_specs, out_specs, ours(*local args) -> {name: out}, lax(*local args) -> same.
# ------------------------------------------------------------------------------------------

def case_agmm(mesh, dtype, rng, replicated_w=False):
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  x = put(mesh, rand(rng, (n * 2, d * 2, 8), dtype), P("tp", "dp", None))  # local [2, 2, 8]
  if replicated_w:
    w = put(mesh, rand(rng, (8, 3), dtype), P())
    out = P("tp", "dp", None)  # all_gather output is varying over tp, like lax's
  else:
    w = put(mesh, rand(rng, (8, n * 3), dtype), P(None, "tp"))  # local [8, 3]
    out = P(None, "dp", "tp")
  ours = lambda x, w: {"out": hc.all_gather_matmul(x, w, "tp")}
  lax = lambda x, w: {"out": jax.lax.all_gather(x, "tp", tiled=True) @ w}
  return (x, w), (x.sharding.spec, w.sharding.spec), out, ours, lax


def case_mmrs(mesh, dtype, rng):
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  x = put(mesh, rand(rng, (n * 2, d, n * 4), dtype), P(None, "dp", "tp"))  # local [2n, 1, 4]
  w = put(mesh, rand(rng, (n * 4, 3), dtype), P("tp", None))  # local [4, 3]
  ours = lambda x, w: {"out": hc.matmul_reduce_scatter(x, w, "tp")}
  lax = lambda x, w: {"out": jax.lax.psum_scatter(x @ w, "tp", tiled=True)}
  return (x, w), (x.sharding.spec, w.sharding.spec), P("tp", "dp", None), ours, lax


def case_mmps(mesh, dtype, rng, chunk_list=(None, 1, 2, 4)):
  """M = 8 rows per device, every `chunks` in one program."""
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  x = put(mesh, rand(rng, (d * 8, n * 4), dtype), P("dp", "tp"))  # local [8, 4]
  w = put(mesh, rand(rng, (n * 4, 3), dtype), P("tp", None))  # local [4, 3]
  ours = lambda x, w: {f"chunks={c}": hc.matmul_psum(x, w, "tp", chunks=c) for c in chunk_list}
  lax = lambda x, w: {f"chunks={c}": jax.lax.psum(x @ w, "tp") for c in chunk_list}
  return (x, w), (P("dp", "tp"), P("tp", None)), P("dp", None), ours, lax


def case_mmps_gemv(mesh, dtype, rng):
  """GEMV shapes: M = 1, and a 1-D x (w then differs across dp instead)."""
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  x1 = put(mesh, rand(rng, (d * 1, n * 4), dtype), P("dp", "tp"))  # local [1, 4]
  xv = put(mesh, rand(rng, (n * 4,), dtype), P("tp"))  # local [4]
  w = put(mesh, rand(rng, (n * 4, d * 3), dtype), P("tp", "dp"))  # local [4, 3]

  def ours(x1, xv, w):
    o = {f"M=1 chunks={c}": hc.matmul_psum(x1, w, "tp", chunks=c) for c in (None, 1)}
    o.update({f"1-D chunks={c}": hc.matmul_psum(xv, w, "tp", chunks=c) for c in (None, 1)})
    return o

  def lax(x1, xv, w):
    o = {f"M=1 chunks={c}": jax.lax.psum(x1 @ w, "tp") for c in (None, 1)}
    o.update({f"1-D chunks={c}": jax.lax.psum(xv @ w, "tp") for c in (None, 1)})
    return o

  outs = {f"M=1 chunks={c}": P("dp", None) for c in (None, 1)}
  outs.update({f"1-D chunks={c}": P("dp") for c in (None, 1)})
  return (x1, xv, w), (P("dp", "tp"), P("tp"), P("tp", "dp")), outs, ours, lax


def case_mma2a(mesh, dtype, rng):
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  E, C, K, N = 2, 2, 4, 3
  x = put(mesh, rand(rng, (n * n, E, d * C, K), dtype), P("tp", None, "dp", None))  # [n,E,C,K]
  w = put(mesh, rand(rng, (n * E, K, N), dtype), P("tp"))  # local [E, K, N]
  ours = lambda x, w: {"out": hc.matmul_all_to_all(x, w, "tp")}
  lax = lambda x, w: {"out": jax.lax.all_to_all(jnp.matmul(x, w), "tp", 0, 0, tiled=True)}
  return (x, w), (x.sharding.spec, w.sharding.spec), P("tp", None, "dp", None), ours, lax


def case_ema2a(mesh, dtype, rng):
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  V, D, B, L = 6, 3, 2, 3
  table = put(mesh, rand(rng, (n * V, d * D), dtype), P("tp", "dp"))  # local [V, D]
  ids = rng.integers(0, V, (n * n, d * B, L)).astype(np.int32)
  ids[:, :, 1] = ids[:, :, 0]  # repeated ids in a bag: the table grad must add them up
  ids = put(mesh, ids, P("tp", "dp", None))  # local [n, B, L]
  ours = lambda t, i: {"out": hc.embedding_all_to_all(t, i, "tp")}
  lax = lambda t, i: {"out": jax.lax.all_to_all(jnp.take(t, i, axis=0).sum(-2), "tp", 0, 0,
                                                tiled=True)}
  return (table, ids), (P("tp", "dp"), P("tp", "dp", None)), P("tp", "dp", None), ours, lax


CASES = {
    "all_gather_matmul": case_agmm,
    "all_gather_matmul_replicated_w": lambda m, dt, r: case_agmm(m, dt, r, replicated_w=True),
    "matmul_reduce_scatter": case_mmrs,
    "matmul_psum": case_mmps,
    "matmul_psum_gemv": case_mmps_gemv,
    "matmul_all_to_all": case_mma2a,
    "embedding_all_to_all": case_ema2a,
}


@pytest.mark.parametrize("check_vma", CHECK_VMA)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mesh_id", MESH_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_lax(case, mesh_id, dtype, check_vma):
  """ours == the unfused jax.lax definition (f32: tight; bf16: vs lax in f32), same type."""
  mesh, dt = MESHES[mesh_id], DTYPES[dtype]
  rng = np.random.default_rng(abs(hash((case, mesh_id))) % 2**32)
  args, in_specs, out, ours, lax = CASES[case](mesh, dt, rng)
  types = {}

  def body(*a):
    o = ours(*a)
    types["ours"] = {k: jax.typeof(v) for k, v in o.items()}
    types["lax"] = {k: jax.typeof(v) for k, v in lax(*a).items()}  # typing only (DCE'd)
    return o, lax(*f32(a))

  # `out` is one spec for every output (a pytree prefix) or a dict of specs
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(out, out),
                            check_vma=check_vma))
  got, ref = f(*args)
  assert set(got) == set(ref) and got
  for k in ref:
    assert_close(got[k], ref[k], dt, name=f"{case}/{k}")
    assert str(types["ours"][k]) == str(types["lax"][k]), (k, types["ours"][k],
                                                           types["lax"][k])
