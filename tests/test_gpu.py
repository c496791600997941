"""The CUDA copy-engine engine against jax.lax on real GPUs (skipped without >= 2 GPUs).

Run on a multi-GPU machine with `bash scripts/gpu_check.sh` (builds, runs this, benchmarks).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl
from conftest import gpus


GPUS = gpus()
pytestmark = pytest.mark.skipif(len(GPUS) < 2, reason="needs >= 2 GPUs")

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8]


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((len(GPUS),), ("x",), devices=GPUS)


def _rand(shape, dtype, seed=0):
  rng = np.random.default_rng(seed)
  if np.issubdtype(np.dtype(dtype), np.integer):
    return rng.integers(1, 50, size=shape).astype(dtype)
  return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _run(mesh, f, x, in_spec=P("x"), out_spec=P("x")):
  x = jax.device_put(x, NamedSharding(mesh, in_spec))
  return np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec))(x))


def _close(a, b, dtype):
  if np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2, atol=2e-2)
  else:
    np.testing.assert_array_equal(a, b)


OPS = {
    "all_gather": (lambda m: lambda v: m.all_gather(v, "x", tiled=True), P("x")),
    "all_gather_axis1": (lambda m: lambda v: m.all_gather(v, "x", axis=1), P("x")),
    "psum": (lambda m: lambda v: m.psum(v, "x"), P()),
    "psum_scatter": (lambda m: lambda v: m.psum_scatter(v, "x", tiled=True), P("x")),
    "all_to_all": (lambda m: lambda v: m.all_to_all(v, "x", 0, 1, tiled=True), P("x")),
    "ppermute": (lambda m: lambda v: m.ppermute(v, "x", [(i, (i + 1) % len(GPUS))
                                                          for i in range(len(GPUS))]), P("x")),
    "pmean": (lambda m: lambda v: m.pmean(v, "x"), P()),
    "pmax": (lambda m: lambda v: m.pmax(v, "x"), P()),
    "pmin": (lambda m: lambda v: m.pmin(v, "x"), P()),
}


def test_pytrees_move_in_buckets_on_gpu(mesh):
  """psum / all_gather / psum_scatter of a pytree (leaves of one dtype in one exchange)."""
  n = len(GPUS)
  x = _rand((n * 64, 6), jnp.float32, seed=21)

  def body(m):
    def f(v):
      t = {"a": v, "b": v[:, :2] * 3, "c": v.astype(jnp.bfloat16), "d": v[0, 0]}
      s = m.psum(t, "x")
      g = m.all_gather({"a": v, "b": v[:8] - 1}, "x", tiled=True, to="invarying")
      r = m.psum_scatter({"a": v, "b": v[:, :2] * 3}, "x", tiled=True)
      return s["a"] + s["b"].sum() + s["c"].astype(jnp.float32) + s["d"], g["a"], g["b"], r["a"], r["b"]
    return f

  xs = jax.device_put(x, NamedSharding(mesh, P("x")))
  specs = (P(), P(), P(), P("x"), P("x"))
  a, b = (jax.jit(jax.shard_map(body(m), mesh=mesh, in_specs=P("x"), out_specs=specs))(xs)
          for m in (jax_hoccl, jax.lax))
  for u, v in zip(a, b):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", sorted(OPS))
# Rows per device n*r: tiny, odd (not a multiple of any chunk), and ~4 MiB (chunked copies).
@pytest.mark.parametrize("r,cols", [(1, 3), (37, 5), (4099, 257)])
def test_op_matches_lax(mesh, op, dtype, r, cols):
  make, out_spec = OPS[op]
  n = len(GPUS)
  x = _rand((n * n * r, cols), dtype)
  ours = _run(mesh, make(jax_hoccl), x, out_spec=out_spec)
  ref = _run(mesh, make(jax.lax), x, out_spec=out_spec)
  _close(ours, ref, dtype)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_step"])
def test_psum_algorithms(mesh, algorithm):
  x = _rand((2 * 100003,), jnp.float32, seed=3)  # odd size: two_step pads
  with jax_hoccl.psum_algorithm(algorithm):
    ours = _run(mesh, lambda v: jax_hoccl.psum(v, "x"), x, out_spec=P())
  ref = _run(mesh, lambda v: jax.lax.psum(v, "x"), x, out_spec=P())
  np.testing.assert_allclose(ours, ref, rtol=1e-6)


def test_partial_ppermute_zero_fills(mesh):
  x = _rand((len(GPUS) * 8, 4), jnp.float32, seed=4)
  perm = [(0, 1)]
  ours = _run(mesh, lambda v: jax_hoccl.ppermute(v, "x", perm), x)
  ref = _run(mesh, lambda v: jax.lax.ppermute(v, "x", perm), x)
  np.testing.assert_array_equal(ours, ref)


def test_1000_back_to_back_calls(mesh):
  n = len(GPUS)
  perm = [(i, (i + 1) % n) for i in range(n)]

  def chain(mod):
    def body(v):
      def step(_, v):
        v = mod.ppermute(v, "x", perm)
        g = mod.all_gather(v, "x", tiled=True)
        return v + 0.001 * g[: v.shape[0]]
      return jax.lax.fori_loop(0, 500, step, v)
    return body

  x = _rand((n * 64, 16), jnp.float32, seed=5)
  ours = _run(mesh, chain(jax_hoccl), x)
  ref = _run(mesh, chain(jax.lax), x)
  np.testing.assert_allclose(ours, ref, rtol=1e-5)
  # And 1000 separate launches of one jitted op, then nothing left in the rendezvous.
  f = jax.jit(jax.shard_map(lambda v: jax_hoccl.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                            out_specs=P()))
  xs = jax.device_put(x, NamedSharding(mesh, P("x")))
  for _ in range(1000):
    y = f(xs)
  np.testing.assert_allclose(np.asarray(y), _run(mesh, lambda v: jax.lax.psum(v, "x"), x, out_spec=P()), rtol=1e-6)
  assert jax_hoccl._hoccl.live_slot_count() == 0


def test_mixed_with_xla_collectives_and_gemms(mesh):
  def f(mod):
    def body(x, w):
      h = mod.all_gather(x, "x", tiled=True) @ w          # column-parallel
      h = jax.lax.psum(h, "x") * 0.5                       # XLA's own collective
      h = jnp.tanh(h) @ w.T
      h = mod.psum_scatter(h, "x", tiled=True)
      return mod.psum(h @ w, "x")
    return body

  n = len(GPUS)
  x = _rand((n * 128, 256), jnp.float32, seed=6)
  w = _rand((256, 256), jnp.float32, seed=7) / 16
  outs = []
  for mod in (jax_hoccl, jax.lax):
    g = jax.jit(jax.shard_map(f(mod), mesh=mesh, in_specs=(P("x"), P()), out_specs=P()))
    outs.append(np.asarray(g(jax.device_put(x, NamedSharding(mesh, P("x"))),
                             jax.device_put(w, NamedSharding(mesh, P())))))
  np.testing.assert_allclose(outs[0], outs[1], rtol=2e-3, atol=2e-3)


def test_gradients_on_gpu(mesh):
  n = len(GPUS)
  x = _rand((n * 16, 8), jnp.float32, seed=8)

  def loss(mod):
    def body(v):
      g = mod.all_gather(v, "x", tiled=True)
      s = mod.psum_scatter(g * g, "x", tiled=True)
      return mod.psum(jnp.sum(jnp.sin(s)), "x")
    return lambda v: jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(v)

  xs = jax.device_put(x, NamedSharding(mesh, P("x")))
  g1 = jax.jit(jax.grad(loss(jax_hoccl)))(xs)
  g2 = jax.jit(jax.grad(loss(jax.lax)))(xs)
  np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-4, atol=1e-5)


def test_async_pairs_on_gpu(mesh):
  n = len(GPUS)
  x = _rand((n * 256, 64), jnp.float32, seed=9)
  w = _rand((64, 32), jnp.float32, seed=10)

  def ours(v):
    p = jax_hoccl.all_gather_start(v, "x", tiled=True)
    y = p.input @ w
    g, y = jax_hoccl.done(p, y)
    q = jax_hoccl.ppermute_start(v, "x", [(i, (i + 1) % n) for i in range(n)])
    a = jax_hoccl.all_to_all_start(v, "x")
    pp, = jax_hoccl.done(q)
    aa, = jax_hoccl.done(a)
    return g[: v.shape[0]] @ w + y, pp, aa

  def ref(v):
    g = jax.lax.all_gather(v, "x", tiled=True)
    return (g[: v.shape[0]] @ w + v @ w, jax.lax.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)]),
            jax.lax.all_to_all(v, "x", 0, 0, tiled=True))

  xs = jax.device_put(x, NamedSharding(mesh, P("x")))
  for _ in range(3):  # several launches: pairs are matched per call site
    a = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(xs)
  b = jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(xs)
  for u, v in zip(a, b):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32],
                         ids=lambda d: np.dtype(d).name)
def test_reducing_pairs_on_gpu(mesh, dtype):
  """psum_start / psum_scatter_start with a GEMM between start and done, against jax.lax."""
  n = len(GPUS)
  x = _rand((n * 512, 64), dtype, seed=13)
  w = _rand((64, 64), jnp.float32, seed=14)

  def ours(v):
    p = jax_hoccl.psum_start(v, "x")
    q = jax_hoccl.psum_scatter_start(v, "x", tiled=True)
    y = p.input.astype(jnp.float32) @ w
    s, y = jax_hoccl.done(p, y)
    t, y = jax_hoccl.done(q, y)
    return s, t, y

  def ref(v):
    return jax.lax.psum(v, "x"), jax.lax.psum_scatter(v, "x", tiled=True), v.astype(jnp.float32) @ w

  xs = jax.device_put(x, NamedSharding(mesh, P("x")))
  specs = (P(), P("x"), P("x"))
  for _ in range(3):  # several launches
    a = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=P("x"), out_specs=specs))(xs)
  b = jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=P("x"), out_specs=specs))(xs)
  for u, v in zip(a[:2], b[:2]):
    _close(np.asarray(u), np.asarray(v), dtype)
  np.testing.assert_allclose(np.asarray(a[2]), np.asarray(b[2]), rtol=1e-4, atol=1e-3)


FUSED = {
    "all_gather_matmul": (lambda x, w: jax_hoccl.all_gather_matmul(x, w, "x"),
                          lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w,
                          (P("x"), P(None, "x")), P(None, "x"), (64, 32), (32, 48)),
    "matmul_reduce_scatter": (lambda x, w: jax_hoccl.matmul_reduce_scatter(x, w, "x"),
                              lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True),
                              (P(None, "x"), P("x")), P("x"), (64, 32), (32, 48)),
    "matmul_psum": (lambda x, w: jax_hoccl.matmul_psum(x, w, "x", chunks=2),
                    lambda x, w: jax.lax.psum(x @ w, "x"),
                    (P(None, "x"), P("x")), P(), (64, 32), (32, 48)),
    "matmul_psum uneven pieces": (
        lambda x, w: jax_hoccl.matmul_psum(x, w, "x", chunks=(16, 8, 4, 4)),
        lambda x, w: jax.lax.psum(x @ w, "x"),
        (P(None, "x"), P("x")), P(), (64, 32), (32, 48)),
    "matmul_all_to_all": (lambda x, w: jax_hoccl.matmul_all_to_all(x, w, "x"),
                          lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w), "x", 0, 0, tiled=True),
                          (P("x"), P("x")), P("x"), None, None),
    "embedding_all_to_all": (lambda t, i: jax_hoccl.embedding_all_to_all(t, i, "x"),
                             lambda t, i: jax.lax.all_to_all(jnp.take(t, i, axis=0).sum(-2), "x",
                                                             0, 0, tiled=True),
                             (P("x"), P("x")), P("x"), None, None),
}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_on_gpu(mesh, name):
  n = len(GPUS)
  ours, ref, in_specs, out_spec, xs, ws = FUSED[name]
  if name == "matmul_all_to_all":
    x, w = _rand((n * n, 3, 16, 32), jnp.float32, 11), _rand((n * 3, 32, 24), jnp.float32, 12)
  elif name == "embedding_all_to_all":
    x = _rand((n * 100, 16), jnp.float32, 11)  # table shard [100, 16] per GPU
    w = np.random.default_rng(12).integers(0, 100, (n * n, 8, 5)).astype(np.int32)  # ids
  else:
    x, w = _rand(xs, jnp.float32, 11), _rand(ws, jnp.float32, 12)
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), in_specs)]
  run = lambda f: np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs,  # noqa: E731
                                                  out_specs=out_spec))(*args))
  np.testing.assert_allclose(run(ours), run(ref), rtol=1e-4, atol=1e-4)
  argnums = (0,) if name == "embedding_all_to_all" else (0, 1)  # ids have no gradient
  loss = lambda f: jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(jax.shard_map(  # noqa: E731
      f, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(a, b))), argnums=argnums))(*args)
  for g1, g2 in zip(loss(ours), loss(ref)):
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-4, atol=1e-4)


def _matches_lax(mesh, ours, ref, arrays, in_specs, out_spec):
  """(ours jitted, its device arguments), after checking its values against ref's within 2%
  of ref's largest magnitude (bf16/f16 GEMMs)."""
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, in_specs)]
  sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs,  # noqa: E731
                                       out_specs=out_spec))
  ours = sm(ours)
  a, b = (np.asarray(f(*args)).astype(np.float32) for f in (ours, sm(ref)))
  scale = np.abs(b).max()
  assert scale > 0 and np.abs(a - b).max() <= 2e-2 * scale, np.abs(a - b).max() / scale
  return ours, args


def _entry_kinds(text, start_target):
  """The compiled program's start / gemm / done custom calls and XLA dots, in schedule order."""
  entry = text[text.index("\nENTRY "):].splitlines()
  kinds = []
  for l in entry:
    if " = " not in l:
      continue
    if start_target in l:
      kinds.append("start")
    elif "hoccl_done" in l:
      kinds.append("done")
    elif "hoccl_rows_matmul" in l or "gemm" in l or "cublas" in l or " dot(" in l:
      kinds.append("gemm")
  return kinds


def test_async_pair_compute_between_start_and_done_on_gpu(mesh):
  """The public async pair: XLA's own GEMM on pending.input is scheduled between start and
  done in the compiled GPU program (start's output 2 aliases x: a data dependency, where an
  optimization barrier let XLA hoist the GEMM above the start), and the values are right."""
  n = len(GPUS)
  x, w = _rand((n * 512, 256), jnp.bfloat16, 51), _rand((256, 512), jnp.bfloat16, 52)

  def ours(v, w):
    v = v * 2  # an activation: a fresh array, as in a model (a jit argument would be copied)
    p = jax_hoccl.all_gather_start(v, "x", tiled=True)
    y = p.input @ w
    g, y = jax_hoccl.done(p, y)
    return g, y

  f = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
  args = (jax.device_put(x, NamedSharding(mesh, P("x"))), jax.device_put(w, NamedSharding(mesh, P())))
  kinds = _entry_kinds(f.lower(*args).compile().as_text(), "hoccl_all_gather_start")
  assert kinds.index("start") < kinds.index("gemm") < kinds.index("done"), kinds
  g, y = (np.asarray(a).astype(np.float32) for a in f(*args))
  x2 = x.astype(np.float32) * 2
  np.testing.assert_array_equal(g.reshape(n, n * 512, 256)[0], x2)
  ref = (x2.reshape(n, 512, 256) @ w.astype(np.float32)).reshape(n * 512, 512)
  assert np.abs(y - ref).max() <= 2e-2 * np.abs(ref).max()


@pytest.mark.parametrize("op", ["matmul_psum", "matmul_all_to_all", "matmul_all_to_all experts"])
def test_fused_under_vmap_on_gpu(mesh, op):
  """vmap of the fused ops whose async copies fill a buffer the GEMMs also write (matmul_psum's
  in-place gathers, matmul_all_to_all's received blocks), bf16, against jax.lax: the batch
  runs as more rows of one pipeline, whose GEMMs stay cuBLASLt calls."""
  n, B = len(GPUS), 3
  if op == "matmul_psum":
    x, w = _rand((B, 512, 64 * n), jnp.bfloat16, 51), _rand((64 * n, 256), jnp.bfloat16, 52)
    in_specs, out_spec = (P(None, None, "x"), P("x")), P()
    ours = lambda x, w: jax_hoccl.matmul_psum(x, w, "x", chunks=2)  # noqa: E731
    ref = lambda x, w: jax.lax.psum(x @ w, "x")  # noqa: E731
  else:
    e = 3 if "experts" in op else None
    x = _rand((B, n * n, *((e,) if e else ()), 64, 32), jnp.bfloat16, 53)
    w = _rand((n * e, 32, 48) if e else (32, 48), jnp.bfloat16, 54)
    in_specs, out_spec = (P(None, "x"), P("x") if e else P()), P(None, "x")
    ours = lambda x, w: jax_hoccl.matmul_all_to_all(x, w, "x")  # noqa: E731
    ref = lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w), "x", 0, 0, tiled=True)  # noqa: E731
  vm = lambda f: jax.vmap(f, in_axes=(0, None))  # noqa: E731
  compiled, args = _matches_lax(mesh, vm(ours), vm(ref), (x, w), in_specs, out_spec)
  text = compiled.lower(*args).compile().as_text()
  assert "hoccl_rows_matmul" in text and " dot(" not in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("experts", [None, 3])
def test_matmul_all_to_all_blocks_on_gpu(mesh, dtype, experts):
  """matmul_all_to_all with per-expert weights ([n, E, C, K] @ [E, K, N], a strided batch of
  cuBLASLt GEMMs) and shared ones ([n, C, K] @ [K, N]) against jax.lax in bf16, f16 and f32.
  bf16/f16: every GEMM is a rows_matmul (x's blocks read in place, my block written into my
  slot: no dot, no dynamic-slice fusion), and the own GEMM runs between start and done."""
  n = len(GPUS)
  e = experts or 1
  xs = (n * n, e, 64, 32) if experts else (n * n, 64, 32)
  ws = (n * e, 32, 48) if experts else (32, 48)
  x, w = _rand(xs, dtype, 61), _rand(ws, dtype, 62)
  ours, args = _matches_lax(
      mesh, lambda x, w: jax_hoccl.matmul_all_to_all(x, w, "x"),
      lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w), "x", 0, 0, tiled=True),
      (x, w), (P("x"), P("x") if experts else P()), P("x"))
  if dtype == jnp.float32:
    return
  text = ours.lower(*args).compile().as_text()
  kinds = _entry_kinds(text, "hoccl_into_start")
  assert kinds.count("gemm") == n and "dynamic_slice" not in text and " dot(" not in text, kinds
  assert kinds.index("start") < len(kinds) - 1 - kinds[::-1].index("gemm") < kinds.index("done")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_all_gather_matmul_gemm_between_start_and_done_on_gpu(mesh, dtype):
  """The GEMM on this rank's rows is scheduled after the all_gather's start (so the copies
  overlap it) in the compiled GPU program, and the values equal jax.lax's. (XLA's own dot
  behind an optimization barrier was hoisted above the start; bf16/f16 use a rows_matmul
  custom call that takes the start's token, f32 XLA's dot on the start's output 2.)"""
  n = len(GPUS)
  x, w = _rand((n * 256, 512), dtype, 41), _rand((512, n * 256), dtype, 42)
  ours, args = _matches_lax(
      mesh, lambda x, w: jax_hoccl.all_gather_matmul(x, w, "x"),
      lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w,
      (x, w), (P("x"), P(None, "x")), P(None, "x"))
  kinds = _entry_kinds(ours.lower(*args).compile().as_text(), "hoccl_all_gather_start")
  assert kinds.index("start") < kinds.index("gemm") < kinds.index("done"), kinds


@pytest.mark.parametrize("cublaslt", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunks", [2, (256, 128, 64, 64)])
def test_matmul_psum_ring_on_gpu(mesh, chunks, dtype, cublaslt, monkeypatch):
  """matmul_psum's ring with equal and uneven pieces in bf16 and f16, its GEMMs XLA's or
  rows_matmul's cuBLASLt calls (the default), against jax.lax."""
  monkeypatch.setenv("JAX_HOCCL_CUBLASLT", "1" if cublaslt else "0")
  n = len(GPUS)
  x, w = _rand((1024, 256 * n), dtype, 21), _rand((256 * n, 4096), dtype, 22)
  ours = lambda x, w: jax_hoccl.matmul_psum(x, w, "x", chunks=chunks)  # noqa: E731
  ref = lambda x, w: jax.lax.psum(x @ w, "x")  # noqa: E731
  specs = (P(None, "x"), P("x"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  run = lambda f: np.asarray(jax.jit(jax.shard_map(  # noqa: E731
      f, mesh=mesh, in_specs=specs, out_specs=P()))(*args)).astype(np.float32)
  for _ in range(2):  # a second launch reuses the cached cuBLASLt plans
    a = run(ours)
  b = run(ref)
  scale = np.abs(b).max()
  assert scale > 0 and np.abs(a - b).max() <= 2e-2 * scale, np.abs(a - b).max() / scale


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunks", [None, 2, 4])
def test_matmul_reduce_scatter_ring_cublaslt_on_gpu(mesh, dtype, chunks, monkeypatch):
  """matmul_reduce_scatter as the ring of cuBLASLt rows_matmuls (the default for bf16/f16)."""
  monkeypatch.setenv("JAX_HOCCL_CUBLASLT", "1")
  n = len(GPUS)
  x, w = _rand((1024, 256 * n), dtype, 23), _rand((256 * n, 4096), dtype, 24)
  specs = (P(None, "x"), P("x"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  run = lambda f: np.asarray(jax.jit(jax.shard_map(  # noqa: E731
      f, mesh=mesh, in_specs=specs, out_specs=P("x")))(*args)).astype(np.float32)
  a = run(lambda x, w: jax_hoccl.matmul_reduce_scatter(x, w, "x", chunks=chunks))
  b = run(lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True))
  scale = np.abs(b).max()
  assert scale > 0 and np.abs(a - b).max() <= 2e-2 * scale, np.abs(a - b).max() / scale


def _sync_inside_async(mesh, seed):
  """An all_gather_start in flight while a ppermute of the same group runs on XLA's stream,
  then the done; (ours, jax.lax) results. The two use different flag lanes: sharing one, the
  ppermute's "done" flags could release the start's input before the peers had read it."""
  n = len(GPUS)
  perm = [(i, (i + 1) % n) for i in range(n)]
  x = _rand((n * (8 << 20),), jnp.float32, seed)  # 32 MiB per GPU: in flight for a while
  y = _rand((n * 4096,), jnp.float32, seed + 1)

  def ours(x, y):
    p = jax_hoccl.all_gather_start(x, "x", tiled=True)
    z = jax_hoccl.ppermute(p.after_start(y * 2.0), "x", perm)  # after the start, before done
    g, z = jax_hoccl.done(p, z)
    return g[::4096], z

  def ref(x, y):
    return jax.lax.all_gather(x, "x", tiled=True)[::4096], jax.lax.ppermute(y * 2.0, "x", perm)

  args = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (x, y)]
  run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x")),  # noqa: E731
                                        out_specs=(P("x"), P("x"))))(*args)
  return run(ours), run(ref)


def test_sync_collective_inside_async_pair_on_gpu(mesh):
  for seed in range(5):
    (g, z), (g_ref, z_ref) = _sync_inside_async(mesh, 30 + seed)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))
    np.testing.assert_array_equal(np.asarray(z), np.asarray(z_ref))


@pytest.mark.parametrize("streams", ["2", "3"])
def test_matmul_psum_over_several_async_streams_on_gpu(mesh, streams, monkeypatch):
  """JAX_HOCCL_ASYNC_STREAMS: the starts of matmul_psum's ring spread over several async
  streams (each with its own flag lane), results equal jax.lax's."""
  monkeypatch.setenv("JAX_HOCCL_ASYNC_STREAMS", streams)
  n = len(GPUS)
  x, w = _rand((1024, 256 * n), jnp.bfloat16, 27), _rand((256 * n, 4096), jnp.bfloat16, 28)
  specs = (P(None, "x"), P("x"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  run = lambda f: np.asarray(jax.jit(jax.shard_map(  # noqa: E731
      f, mesh=mesh, in_specs=specs, out_specs=P()))(*args)).astype(np.float32)
  b = run(lambda x, w: jax.lax.psum(x @ w, "x"))
  for chunks in (2, 4, (128, 128, 64, 64, 32, 32, 32, 32)):
    a = run(lambda x, w: jax_hoccl.matmul_psum(x, w, "x", chunks=chunks))
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), (chunks, np.abs(a - b).max())
