"""Shared setup for the CPU test suite: 8 virtual host devices, meshes, data and checks.

The environment must be set before jax is imported anywhere, so it is done at the top of
this file (pytest imports conftest.py before any test module).
"""
import contextlib
import json
import os
import subprocess
import sys
import time

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# docs/design.md: with 8 virtual devices on few cores XLA needs PJRT_NPROC >= 2x the device count.
os.environ.setdefault("PJRT_NPROC", "16")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_hoccl  # noqa: E402,F401  (its FFI targets register at the first lowering)

NDEV = 8
CPUS = jax.devices("cpu")
assert len(CPUS) >= NDEV, (
    f"the suite needs {NDEV} CPU devices; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r} was set "
    "after jax initialised its backend")

# Explicitly CPU devices: this conftest is shared with GPU test files on machines where the
# default backend is CUDA.
MESH1 = jax.make_mesh((8,), ("x",), devices=CPUS[:NDEV])
MESH2 = jax.make_mesh((2, 4), ("x", "y"), devices=CPUS[:NDEV])

# (id, mesh, axis_name) for every group shape the collectives are tested on.
AXIS_CASES = [
    pytest.param(MESH1, "x", id="1d-x"),
    pytest.param(MESH2, "x", id="2d-x"),
    pytest.param(MESH2, "y", id="2d-y"),
    pytest.param(MESH2, ("x", "y"), id="2d-xy"),
    pytest.param(MESH2, ("y", "x"), id="2d-yx"),
]

DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "int32": jnp.int32,
    "int8": jnp.int8,
    "uint8": jnp.uint8,
    "bool": jnp.bool_,
    "complex64": jnp.complex64,
}
LOW_PRECISION = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

# XLA's own collectives, in StableHLO (lowered text) and HLO (compiled text) spelling.
XLA_COLLECTIVES = (
    "stablehlo.all_gather", "stablehlo.all_reduce", "stablehlo.all_to_all",
    "stablehlo.collective_permute", "stablehlo.reduce_scatter", "stablehlo.collective_broadcast",
    "all-gather", "all-reduce", "all_reduce", "all-to-all", "collective-permute",
    "reduce-scatter",
)


def axis_size(mesh, axis_name) -> int:
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  return int(np.prod([mesh.shape[a] for a in names]))


def all_axes_spec(mesh) -> P:
  """Dim 0 sharded over every mesh axis: each device holds its own block."""
  names = tuple(mesh.axis_names)
  return P(names if len(names) > 1 else names[0])


def rand(rng, shape, dtype):
  """Random (never all-zero) data of `dtype`, small enough that integer sums of 8 fit."""
  dt = np.dtype(dtype)
  if dt == np.bool_:
    return rng.random(shape) < 0.5
  if dt.kind in "iu":
    lo = 0 if dt.kind == "u" else -10
    a = rng.integers(lo, 11, size=shape)
    a[(a == 0)] = 3
    return a.astype(dt)
  if dt.kind == "c":
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
  return rng.standard_normal(shape).astype(np.float32).astype(dt)


def put(mesh, x, spec=None):
  return jax.device_put(x, NamedSharding(mesh, all_axes_spec(mesh) if spec is None else spec))


def global_inputs(mesh, local_shape, dtypes, seed=0):
  """{dtype name: global array} with `local_shape` per device, sharded over all axes."""
  rng = np.random.default_rng(seed)
  shape = (local_shape[0] * mesh.size, *local_shape[1:])
  return {name: put(mesh, rand(rng, shape, dt)) for name, dt in dtypes.items()}


def lowered_text(fn, *args) -> str:
  return jax.jit(fn).lower(*args).as_text()


def assert_lowers_to_ours(fn, *args, expect=(), compiled=False):
  """`fn` lowers to our custom calls and to none of XLA's own collectives."""
  lowered = jax.jit(fn).lower(*args)
  text = lowered.as_text()
  assert "hoccl_" in text, text[:2000]
  for target in expect:
    assert f"@{target}" in text, f"{target} not in lowered text"
  bad = [c for c in XLA_COLLECTIVES if c in text]
  assert not bad, f"XLA collectives {bad} in the lowered text"
  if compiled:
    hlo = lowered.compile().as_text()
    bad = [c for c in XLA_COLLECTIVES if c in hlo]
    assert not bad, f"XLA collectives {bad} in the compiled HLO"
    assert "hoccl_" in hlo
  return text


def to_np(x):
  return np.asarray(jax.device_get(x))


def assert_same(ours, ref, *, exact=True, name=""):
  """Exact (bitwise for movers) or close comparison of two arrays of the same dtype."""
  a, b = to_np(ours), to_np(ref)
  assert a.shape == b.shape, (name, a.shape, b.shape)
  assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
  if exact:
    np.testing.assert_array_equal(a, b, err_msg=name)
  else:
    np.testing.assert_allclose(a.astype(np.complex128 if a.dtype.kind == "c" else np.float64),
                               b.astype(np.complex128 if b.dtype.kind == "c" else np.float64),
                               rtol=2e-5, atol=2e-5, err_msg=name)


def assert_sum_matches(ours, ref, name=""):
  """A sum computed by us vs jax.lax's. jax_hoccl sums the received blocks as a left fold in
  rank order, the order XLA:CPU's own all-reduce uses, so integers, f32 and c64 are bitwise
  equal. bf16/f16 (and float8) accumulate in f32 and round once: `ref` is then lax's sum of
  the same values in f32, which must be within one rounding and equal once rounded."""
  a = to_np(ours)
  b = to_np(ref)
  assert a.shape == b.shape, (name, a.shape, b.shape)
  if a.dtype != b.dtype:
    assert b.dtype == np.float32 and jnp.issubdtype(a.dtype, jnp.floating), (name, b.dtype)
    eps = float(jnp.finfo(a.dtype).eps)
    np.testing.assert_allclose(a.astype(np.float32), b, rtol=eps, atol=eps, err_msg=name)
    np.testing.assert_array_equal(a, b.astype(a.dtype), err_msg=name)
  else:
    np.testing.assert_array_equal(a, b, err_msg=name)


@contextlib.contextmanager
def lax_ppermute_any_axis_order():
  """jax.lax.ppermute, and jax_hoccl.ppermute like it, refuses axis names out of mesh order
  (('y', 'x') on an ('x', 'y') mesh) unless this check is off; with it off both use the given
  order. (The other collectives take any order, in jax.lax and in jax_hoccl.)"""
  prev = jax.config.jax_raise_on_ppermute_sort_diff
  jax.config.update("jax_raise_on_ppermute_sort_diff", False)
  try:
    yield
  finally:
    jax.config.update("jax_raise_on_ppermute_sort_diff", prev)


def gpus():
  """The GPU devices, or [] where jax has no GPU backend (the GPU test files skip then)."""
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def run_processes(tmp_path, worker: str, timeout: float, n: int = 2, env=None,
                  drop=("XLA_FLAGS", "JAX_HOCCL_NODE")):
  """Runs `worker` as processes 0..n-1 of a jax.distributed job on localhost (argv: address,
  process id, n) with this environment less `drop`, plus `env`; their outputs."""
  from jax_hoccl.launch import run_worker_job
  global _last_job
  base = {k: v for k, v in os.environ.items() if k not in drop}
  _last_job = run_worker_job(worker, n, {**base, **(env or {})}, timeout,
                             directory=str(tmp_path))
  return _last_job.outputs


_last_job = None


def shared_memory_left():
  """The last run_processes job's names in /dev/shm: still there (none may survive a job),
  or, when it ended cleanly, left for the runner to remove (its processes unlink their own).
  Only that job's (its secret): other jobs on the machine may be running."""
  job = _last_job
  left = [f for f in os.listdir("/dev/shm") if f.startswith(f"jax_hoccl-{job.secret}")]
  return left + (job.removed if job.failure is None else [])


def run_script(script, timeout=240, env_extra=None):
  """Runs `script` in a fresh Python (its own XLA flags, timeouts) and returns (the JSON it
  printed after "RESULT", wall seconds); fails with its output if it printed none."""
  env = dict(os.environ)
  env.update(env_extra or {})
  t = time.monotonic()
  proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                        timeout=timeout, env=env)
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  assert line, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
  return json.loads(line[-1][len("RESULT"):]), time.monotonic() - t
