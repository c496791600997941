"""The fused matmul-collective ops vs their unfused jax.lax definitions: values (float32
tight, bfloat16 loose vs lax in float32), typing, gradients (through shard_map under jit,
check_vma True and False, replicated weights), no fallback to XLA's collectives, and input
errors, on a 2x4 mesh ('dp', 'tp') with tp=4 and a 4x2 mesh with tp=2. The data differs
across 'dp' too, so a group mix-up (a rank exchanging with the wrong dp row) changes the
result.

Per-device buffers stay <= 512 bytes (compile_sequential checks it; see test_collectives.py's
docstring). Each of the value and gradient tests shares one compiled program per mesh,
dtype and check_vma with the other cases (the runtime budget), cached by lru_cache.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("PJRT_NPROC", "16")

import functools  # noqa: E402
import re  # noqa: E402
import zlib  # noqa: E402

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


_BUFFER_LIMIT = 512  # XLA:CPU runs a program's thunks in order only if all buffers are <= this
_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64|c64|c128)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2, "f16": 2, "c64": 8, "c128": 16}


def compile_sequential(fn, *args):
  """jax.jit(fn) compiled for args, after checking that no per-device buffer of the program
  exceeds 512 bytes: above that XLA:CPU's ThunkExecutor runs independent thunks concurrently,
  in a different order on each rank, which jax_hoccl's per-rank sequence numbers (and any
  mix with XLA's own collectives) do not survive. A failure here means: shrink the shapes."""
  compiled = jax.jit(fn).lower(*args).compile()
  text = compiled.as_text()
  entry = text[text.index("ENTRY"):]
  for m in _SHAPE.finditer(entry):
    dt, dims = m.group(1), [int(v) for v in m.group(2).split(",") if v]
    nbytes = int(np.prod(dims)) * _BYTES.get(dt, int(re.sub(r"\D", "", dt) or 8) // 8)
    assert nbytes <= _BUFFER_LIMIT, f"test shapes too large: {m.group(0)} is {nbytes} bytes"
  return compiled


# ------------------------------------------------------------------------------------------
# Cases. Each builds global inputs (different on every dp row) and returns
#   args, in_specs, out_specs, ours(*local args) -> {name: out}, lax(*local args) -> same.
# ------------------------------------------------------------------------------------------

def case_agmm(mesh, dtype, rng, replicated_w=False, to="varying"):
  """to="invarying" with a replicated w: the result invariant over tp (out_specs without
  tp, under check_vma=True too); with a w sharded over tp the product varies anyway."""
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  x = put(mesh, rand(rng, (n * 2, d * 2, 4), dtype), P("tp", "dp", None))  # local [2, 2, 4]
  if replicated_w:
    w = put(mesh, rand(rng, (4, 3), dtype), P())
    # all_gather output is varying over tp, like lax's; invariant with to="invarying"
    out = P("tp", "dp", None) if to == "varying" else P(None, "dp", None)
  else:
    w = put(mesh, rand(rng, (4, n * 3), dtype), P(None, "tp"))  # local [4, 3]
    out = P(None, "dp", "tp")
  ours = lambda x, w: {"out": hc.all_gather_matmul(x, w, "tp", to=to)}
  lax = lambda x, w: {"out": jax.lax.all_gather(x, "tp", tiled=True, to=to) @ w}
  return (x, w), (x.sharding.spec, w.sharding.spec), out, ours, lax


def case_mmrs(mesh, dtype, rng):
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  x = put(mesh, rand(rng, (n * 2, d, n * 4), dtype), P(None, "dp", "tp"))  # local [2n, 1, 4]
  w = put(mesh, rand(rng, (n * 4, 3), dtype), P("tp", None))  # local [4, 3]
  ours = lambda x, w: {"out": hc.matmul_reduce_scatter(x, w, "tp")}
  lax = lambda x, w: {"out": jax.lax.psum_scatter(x @ w, "tp", tiled=True)}
  return (x, w), (x.sharding.spec, w.sharding.spec), P("tp", "dp", None), ours, lax


def case_mmps(mesh, dtype, rng, chunk_list=(None, 1, 2, 4, (2, 1, 1))):
  """M = 4n rows per device (4 per rank block), every `chunks` in one program (uneven pieces
  too); N = 2 keeps chunks=1's gathered [n, M, N] within the CPU buffer limit."""
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  x = put(mesh, rand(rng, (d * 4 * n, n * 4), dtype), P("dp", "tp"))  # local [4n, 4]
  w = put(mesh, rand(rng, (n * 4, 2), dtype), P("tp", None))  # local [4, 2]
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


def case_ema2a(mesh, dtype, rng, replicated_table=False):
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  V, D, B, L = 6, 3, 2, 3
  if replicated_table:  # the same table on every dp row; the ids still differ
    table = put(mesh, rand(rng, (n * V, D), dtype), P("tp", None))
  else:
    table = put(mesh, rand(rng, (n * V, d * D), dtype), P("tp", "dp"))  # local [V, D]
  ids = rng.integers(0, V, (n * n, d * B, L)).astype(np.int32)
  ids[:, :, 1] = ids[:, :, 0]  # repeated ids in a bag: the table grad must add them up
  ids = put(mesh, ids, P("tp", "dp", None))  # local [n, B, L]
  ours = lambda t, i: {"out": hc.embedding_all_to_all(t, i, "tp")}
  lax = lambda t, i: {"out": jax.lax.all_to_all(jnp.take(t, i, axis=0).sum(-2), "tp", 0, 0,
                                                tiled=True)}
  return ((table, ids), (table.sharding.spec, P("tp", "dp", None)), P("tp", "dp", None),
          ours, lax)


CASES = {
    "all_gather_matmul": case_agmm,
    "all_gather_matmul_replicated_w": lambda m, dt, r: case_agmm(m, dt, r, replicated_w=True),
    "all_gather_matmul_invarying": lambda m, dt, r: case_agmm(m, dt, r, replicated_w=True,
                                                               to="invarying"),
    "all_gather_matmul_invarying_sharded_w": lambda m, dt, r: case_agmm(m, dt, r,
                                                                         to="invarying"),
    "matmul_reduce_scatter": case_mmrs,
    "matmul_psum": case_mmps,
    "matmul_psum_gemv": case_mmps_gemv,
    "matmul_all_to_all": case_mma2a,
    "embedding_all_to_all": case_ema2a,
    "embedding_all_to_all_replicated_table":
        lambda m, dt, r: case_ema2a(m, dt, r, replicated_table=True),
}


def _seed(*key):
  return zlib.crc32(repr(key).encode())


@functools.lru_cache(maxsize=None)
def run_all_cases(mesh_id, dtype, check_vma):
  """Runs every case, ours and lax's, in ONE shard_map program (one compile per mesh, dtype
  and check_vma; the tests below share it): {case: (got, ref, types)}."""
  mesh, dt = MESHES[mesh_id], DTYPES[dtype]
  built = {c: make(mesh, dt, np.random.default_rng(_seed(c, mesh_id, dtype)))
           for c, make in CASES.items()}
  args = {c: b[0] for c, b in built.items()}
  in_specs = {c: b[1] for c, b in built.items()}
  out_specs = {c: b[2] for c, b in built.items()}
  types = {}

  def body(args):
    got, ref = {}, {}
    for c, (_, _, _, ours, lax) in built.items():
      got[c] = ours(*args[c])
      types[c] = ({k: jax.typeof(v) for k, v in got[c].items()},
                  {k: jax.typeof(v) for k, v in lax(*args[c]).items()})  # typing only
      ref[c] = lax(*f32(args[c]))
    return got, ref

  f = jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=(out_specs, out_specs),
                    check_vma=check_vma)
  got, ref = compile_sequential(f, args)(args)
  return {c: (got[c], ref[c], types[c]) for c in CASES}


@pytest.mark.parametrize("check_vma", CHECK_VMA)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mesh_id", MESH_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_lax(case, mesh_id, dtype, check_vma):
  """ours == the unfused jax.lax definition (f32: tight; bf16: vs lax in f32), same type."""
  got, ref, (t_ours, t_lax) = run_all_cases(mesh_id, dtype, check_vma)[case]
  assert set(got) == set(ref) and got
  for k in ref:
    assert_close(got[k], ref[k], DTYPES[dtype], name=f"{case}/{k}")
    assert str(t_ours[k]) == str(t_lax[k]), (k, t_ours[k], t_lax[k])


# ------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------

def _is_diff(a):
  return jnp.issubdtype(a.dtype, jnp.floating)


@functools.lru_cache(maxsize=None)
def grads_all_cases(mesh_id, check_vma):
  """jax.grad of sum(sin(out)) w.r.t. every float operand (weights, x, the embedding table;
  not the ids), through shard_map under jit, for ours and for lax's, every case in one
  program: {case: (our grads, lax's grads)} (float32)."""
  mesh = MESHES[mesh_id]
  built = {c: make(mesh, jnp.float32, np.random.default_rng(_seed(c, mesh_id, "grad")))
           for c, make in CASES.items()}
  args = {c: b[0] for c, b in built.items()}
  in_specs = {c: b[1] for c, b in built.items()}
  out_specs = {c: b[2] for c, b in built.items()}
  diff = {c: tuple(a if _is_diff(a) else None for a in args[c]) for c in CASES}
  nondiff = {c: tuple(None if _is_diff(a) else a for a in args[c]) for c in CASES}

  def loss(which):
    def body(args):
      return {c: built[c][3 if which == "ours" else 4](*args[c]) for c in built}

    sm = jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs,
                       check_vma=check_vma)

    def L(diff, nondiff):
      merged = {c: tuple(d if d is not None else nd for d, nd in zip(diff[c], nondiff[c]))
                for c in diff}
      outs = sm(merged)
      return sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(outs))
    return jax.grad(L)

  # Two programs: ours never shares one with XLA's collectives (on XLA:CPU, a program whose
  # buffers exceed 512 bytes runs independent thunks concurrently, and two rendezvous
  # systems waiting on each other in different orders on different ranks can deadlock).
  g_ours = compile_sequential(loss("ours"), diff, nondiff)(diff, nondiff)
  g_lax = compile_sequential(loss("lax"), diff, nondiff)(diff, nondiff)
  return {c: (g_ours[c], g_lax[c]) for c in CASES}


@pytest.mark.parametrize("check_vma", CHECK_VMA)
@pytest.mark.parametrize("mesh_id", MESH_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_grad_matches_lax(case, mesh_id, check_vma):
  """d/d(operands) sum(sin(ours)) == the same for lax's definition (embedding: the table)."""
  ours, lax = grads_all_cases(mesh_id, check_vma)[case]
  assert len(ours) == len(lax)
  n_checked = 0
  for i, (a, b) in enumerate(zip(ours, lax)):
    assert (a is None) == (b is None), i
    if a is None:
      continue
    assert_close(a, b, jnp.float32, name=f"{case}/grad{i}")
    n_checked += 1
  assert n_checked == (1 if case.startswith("embedding_all_to_all") else len(ours))


FSDP_MESH = jax.make_mesh((2, 4), ("dp", "tp"), devices=CPUS[:8],
                          axis_types=(jax.sharding.AxisType.Explicit,) * 2)
_REDUCED_W = {  # (ours, lax's) of a, w, ids (locals); w is reduced over dp
    "all_gather_matmul": (lambda a, w, i: hc.all_gather_matmul(a, w, "tp"),
                          lambda a, w, i: jax.lax.all_gather(a, "tp", tiled=True) @ w),
    "matmul_reduce_scatter": (
        lambda a, w, i: hc.matmul_reduce_scatter(a, w, "tp"),
        lambda a, w, i: jax.lax.psum_scatter(a @ w, "tp", tiled=True)),
    "matmul_psum": (
        lambda a, w, i: jax.lax.pcast(hc.matmul_psum(a, w, "tp"), "tp", to="varying"),
        lambda a, w, i: jax.lax.pcast(jax.lax.psum(a @ w, "tp"), "tp", to="varying")),
    "matmul_all_to_all": (
        lambda a, w, i: hc.matmul_all_to_all(a.reshape(4, 1, 8), w, "tp"),
        lambda a, w, i: jax.lax.all_to_all(a.reshape(4, 1, 8) @ w, "tp", 0, 0, tiled=True)),
    "embedding_all_to_all": (
        lambda a, w, i: hc.embedding_all_to_all(w, i, "tp"),
        lambda a, w, i: jax.lax.all_to_all(jnp.take(w, i, axis=0).sum(-2), "tp", 0, 0,
                                           tiled=True)),
}


@pytest.mark.parametrize("op", list(_REDUCED_W))
def test_fused_grad_of_a_weight_reduced_over_dp(op):
  """FSDP: w reduced over dp (pcast to="reduced"). The backward pass must leave w's
  cotangent unreduced over dp, where the pcast's transpose sums it; a cotangent summed or
  left varying there is a type error of the custom_vjp."""
  mesh = FSDP_MESH
  rng = np.random.default_rng(zlib.crc32(op.encode()))
  a = put(mesh, rand(rng, (32, 8)), P(("dp", "tp")))  # local [4, 8]
  w = put(mesh, rand(rng, (8, 8)), P(None, "tp"))  # local [8, 2]
  ids = put(mesh, jnp.asarray(rng.integers(0, 8, (32, 1, 2)), jnp.int32), P(("dp", "tp")))

  def grad_of(fn):
    def body(a, w, i):
      def loss(w):
        h = fn(a, jax.lax.pcast(w, "dp", to="reduced"), i)
        return jax.lax.psum(jnp.sum(jnp.tanh(h)), ("dp", "tp"))
      return jax.grad(loss)(w)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(("dp", "tp")), P(None, "tp"),
                                                    P(("dp", "tp"))), out_specs=P(None, "tp"))

  ours, lax = _REDUCED_W[op]
  with jax.set_mesh(mesh):
    g_ours = compile_sequential(grad_of(ours), a, w, ids)(a, w, ids)
    g_lax = compile_sequential(grad_of(lax), a, w, ids)(a, w, ids)
  assert_close(g_ours, g_lax, jnp.float32, name=op)
  assert float(np.abs(to_np(g_lax)).max()) > 0


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------

def _trace(fn, *shapes, axis="tp", mesh_id="tp4"):
  """Traces fn(*args, axis) inside a shard_map over replicated inputs of these shapes
  (int32 where the shape is given as ('i', shape))."""
  mesh = MESHES[mesh_id]
  sds = []
  for s in shapes:
    dt = jnp.float32
    if s and s[0] == "i":
      dt, s = jnp.int32, s[1]
    sds.append(jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, P())))
  f = jax.shard_map(lambda *a: fn(*a, axis), mesh=mesh, in_specs=P(), out_specs=P(),
                    check_vma=False)
  return jax.eval_shape(f, *sds)


BAD_SHAPES = [  # (op, shapes, what the message must name)
    ("all_gather_matmul", [(2, 5), (4, 3)], "all_gather_matmul"),
    ("all_gather_matmul", [(8,), (8, 3)], "all_gather_matmul"),  # 1-D x
    ("all_gather_matmul", [(2, 4), (4, 3, 1)], "all_gather_matmul"),  # 3-D w
    ("matmul_reduce_scatter", [(8, 5), (4, 3)], "matmul_reduce_scatter"),
    ("matmul_reduce_scatter", [(6, 4), (4, 3)], "matmul_reduce_scatter"),  # 6 rows, tp=4
    ("matmul_psum", [(8, 5), (4, 3)], "matmul_psum"),
    ("matmul_psum", [(5,), (4, 3)], "matmul_psum"),  # 1-D x with the wrong K
    ("matmul_all_to_all", [(3, 2, 4), (4, 3)], "matmul_all_to_all"),  # leading 3 != tp=4
    ("matmul_all_to_all", [(4, 2, 5), (4, 3)], "matmul_all_to_all"),  # K mismatch
    ("embedding_all_to_all", [(6, 3), ("i", (3, 2, 2))], "embedding_all_to_all"),  # 3 != 4
    ("embedding_all_to_all", [(6, 3, 1), ("i", (4, 2, 2))], "embedding_all_to_all"),
]


@pytest.mark.parametrize("op,shapes,name", BAD_SHAPES,
                         ids=[f"{o}-{i}" for i, (o, _, _) in enumerate(BAD_SHAPES)])
def test_bad_shapes_raise_value_error(op, shapes, name):
  with pytest.raises(ValueError, match=name):
    _trace(getattr(hc, op), *shapes)


def test_matmul_psum_chunks_must_divide_rows():
  with pytest.raises(ValueError, match="matmul_psum.*chunks=3"):
    _trace(lambda x, w, a: hc.matmul_psum(x, w, a, chunks=3), (8, 4), (4, 3))


def test_embedding_ids_must_be_integers():
  with pytest.raises(TypeError, match="embedding_all_to_all"):
    _trace(hc.embedding_all_to_all, (6, 3), (4, 2, 2))


MIXED = {  # op -> (x's spec and local shape, w's spec and shape, the jax.lax definition)
    "all_gather_matmul": ((P("tp"), (4, 8)), (P(), (8, 8)),
                          lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w),
    "matmul_psum": ((P(None, "tp"), (4, 8)), (P("tp"), (8, 8)),
                    lambda x, w: jax.lax.psum(x @ w, "tp")),
    "matmul_reduce_scatter": ((P(None, "tp"), (4, 8)), (P("tp"), (8, 8)),
                              lambda x, w: jax.lax.psum_scatter(x @ w, "tp", tiled=True)),
    "matmul_all_to_all": ((P("tp"), (2, 2, 8)), (P(), (8, 8)),
                          lambda x, w: jax.lax.all_to_all(x @ w, "tp", 0, 0, tiled=True)),
}


@pytest.mark.parametrize("types", [(jnp.bfloat16, jnp.float32), (jnp.float16, jnp.bfloat16),
                                   (jnp.float32, jnp.bfloat16), (jnp.int8, jnp.int32)],
                         ids=["bf16@f32", "f16@bf16", "f32@bf16", "i8@i32"])
@pytest.mark.parametrize("op", list(MIXED))
def test_operands_of_two_types_multiply_as_jnp_matmul_does(op, types):
  """x and w of different types: the product in jnp.matmul's type (bf16 @ f32 is f32), equal
  to the jax.lax definition; the gradients in the operands' own types."""
  (x_spec, x_local), (w_spec, w_local), lax_op = MIXED[op]
  mesh = MESHES["tp2"]
  rng = np.random.default_rng(zlib.crc32(op.encode()))
  glob = lambda spec, shape: tuple(d * (2 if spec and i < len(spec) and spec[i] else 1)  # noqa: E731
                                   for i, d in enumerate(shape))
  x = put(mesh, rand(rng, glob(x_spec, x_local), types[0]), x_spec)
  w = put(mesh, rand(rng, glob(w_spec, w_local), types[1]), w_spec)
  sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec),  # noqa: E731
                                       out_specs=P("tp") if op != "matmul_psum" else P()))
  got, ref = sm(lambda a, b: getattr(hc, op)(a, b, "tp"))(x, w), sm(lax_op)(x, w)
  assert got.dtype == ref.dtype == jnp.result_type(types[0], types[1]), (got.dtype, ref.dtype)
  assert_close(got, ref, ref.dtype, op)
  if jnp.issubdtype(ref.dtype, jnp.floating):
    loss = lambda f: jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)),  # noqa: E731
                                      argnums=(0, 1)))
    grads = loss(sm(lambda a, b: getattr(hc, op)(a, b, "tp")))(x, w)
    ref_grads = loss(sm(lax_op))(x, w)
    for g, r, v in zip(grads, ref_grads, (x, w)):
      assert g.dtype == r.dtype == v.dtype, (g.dtype, r.dtype, v.dtype)
      g, r = to_np(g).astype(np.float64), to_np(r).astype(np.float64)
      tol = (2e-5 if v.dtype == jnp.float32 else 1e-2) * max(1.0, np.abs(r).max())
      assert np.abs(g - r).max() <= tol and np.abs(r).max() > 0, (op, v.dtype)


@pytest.mark.parametrize("op", list(MIXED))
def test_no_output_columns_like_lax(op):
  """w with N = 0 columns: an empty product of jax.lax's shape."""
  (x_spec, x_local), (w_spec, _), lax_op = MIXED[op]
  mesh = MESHES["tp2"]
  glob = lambda spec, shape: tuple(d * (2 if spec and i < len(spec) and spec[i] else 1)  # noqa: E731
                                   for i, d in enumerate(shape))
  x = put(mesh, rand(np.random.default_rng(3), glob(x_spec, x_local)), x_spec)
  w = put(mesh, jnp.zeros(glob(w_spec, (8, 0)), jnp.float32), w_spec)
  sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec),  # noqa: E731
                               out_specs=P("tp") if op != "matmul_psum" else P())
  ours = sm(lambda a, b: getattr(hc, op)(a, b, "tp"))
  assert jax.jit(ours)(x, w).shape == jax.jit(sm(lax_op))(x, w).shape


GOOD_SHAPES = {
    "all_gather_matmul": [(2, 4), (4, 3)],
    "matmul_reduce_scatter": [(8, 4), (4, 3)],
    "matmul_psum": [(8, 4), (4, 3)],
    "matmul_all_to_all": [(4, 2, 4), (4, 3)],
    "embedding_all_to_all": [(6, 3), ("i", (4, 2, 2))],
}


@pytest.mark.parametrize("op", list(GOOD_SHAPES))
def test_axis_not_in_mesh(op):
  """An unknown axis name raises a ValueError naming it; the same call with 'tp' traces."""
  _trace(getattr(hc, op), *GOOD_SHAPES[op])  # control: valid as written
  with pytest.raises(ValueError, match="'model'"):
    _trace(getattr(hc, op), *GOOD_SHAPES[op], axis="model")


@pytest.mark.parametrize("op", list(GOOD_SHAPES))
def test_outside_shard_map(op):
  args = [jnp.zeros(s[1], jnp.int32) if s[0] == "i" else jnp.ones(s, jnp.float32)
          for s in GOOD_SHAPES[op]]
  with pytest.raises(ValueError, match="outside jax.shard_map"):
    getattr(hc, op)(*args, "tp")


# ------------------------------------------------------------------------------------------
# No fallback to XLA's collectives
# ------------------------------------------------------------------------------------------

XLA_COLLECTIVES = ("stablehlo.all_gather", "stablehlo.all_reduce", "stablehlo.all_to_all",
                   "stablehlo.collective_permute", "stablehlo.reduce_scatter",
                   "stablehlo.collective_broadcast")


@pytest.mark.parametrize("check_vma", CHECK_VMA)
@pytest.mark.parametrize("case", list(CASES))
def test_lowers_to_hoccl_only(case, check_vma):
  """Each fused op lowers to jax_hoccl custom calls and none of XLA's own collectives; with
  check_vma=True its backward too (the mesh has a 'dp' axis that weights are replicated
  over: their cotangents must be summed with jax_hoccl.psum, not jax.lax.psum). With
  check_vma=False jax's shard_map transpose itself psums (jax.lax) over the axes an input's
  in_spec leaves out, so only the forward is checked there. Lowering only, no compile."""
  mesh = MESHES["tp4"]
  args, in_specs, out, ours, _ = CASES[case](mesh, jnp.float32, np.random.default_rng(0))
  sm = jax.shard_map(ours, mesh=mesh, in_specs=in_specs, out_specs=out, check_vma=check_vma)
  argnums = tuple(i for i, a in enumerate(args) if _is_diff(a))

  def loss(*a):
    return sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(sm(*a)))

  fns = {"forward": sm}
  if check_vma:
    fns["backward"] = jax.grad(loss, argnums=argnums)
  for what, fn in fns.items():
    text = jax.jit(fn).lower(*args).as_text()
    assert "hoccl_" in text
    bad = [c for c in XLA_COLLECTIVES if c in text]
    assert not bad, f"{case} {what}: XLA collectives {bad} in the lowered text"


# ------------------------------------------------------------------------------------------
# The ring's structure: GEMMs do the sums, copy engines assemble the output
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cublaslt", [False, True])
@pytest.mark.parametrize("chunks", [2, (2, 1, 1)])
def test_ring_structure(chunks, cublaslt, monkeypatch):
  """matmul_psum's program, lowered for CPU and (cross-platform, no GPU needed) for CUDA:
  (n-1) ppermute starts and n GEMMs per piece, every add taking a dot's result, the output
  assembled by gathers into it (in place for cuBLASLt GEMMs, the last one on XLA's stream;
  no concatenate). By default every CUDA GEMM is a
  hoccl_rows_matmul (x's rows read in place, the received partial added in the epilogue) and
  no dynamic_slice, dot or add is left; with JAX_HOCCL_CUBLASLT=0 they are XLA's. Values
  equal jax.lax."""
  monkeypatch.setenv("JAX_HOCCL_CUBLASLT", "1" if cublaslt else "0")
  mesh = MESHES["tp4"]
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  rng = np.random.default_rng(0)
  # K and N multiples of 8: rows of 16 bytes, what rows_matmul's cuBLASLt path takes
  x = put(mesh, rand(rng, (d * 4 * n, n * 8), jnp.bfloat16), P("dp", "tp"))
  w = put(mesh, rand(rng, (n * 8, 8), jnp.bfloat16), P("tp", None))
  sm = jax.jit(jax.shard_map(lambda x, w: hc.matmul_psum(x, w, "tp", chunks=chunks), mesh=mesh,
                             in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P("dp", None)))
  pieces = chunks if isinstance(chunks, int) else len(chunks)
  cpu = sm.lower(x, w).as_text()
  # Lowering for CUDA needs a build with the CUDA engine (pip with nvcc; Bazel's is CPU-only).
  cuda = sm.trace(x, w).lower(lowering_platforms=("cuda",)).as_text() if hc.with_cuda else cpu
  if cublaslt and not hc.with_cuda:
    pytest.skip("this build has no CUDA engine to lower rows_matmul for")
  add = r"= stablehlo.add (%[\w#]+), (%[\w#]+) : tensor<\d+x8xbf16>"
  for text in (cpu, cuda):
    assert text.count("@hoccl_ppermute_start(") == pieces * (n - 1)
    gathers = [l for l in text.splitlines() if "@hoccl_into_start(" in l]
    assert len(gathers) == pieces
    assert "stablehlo.concatenate" not in text
    # cuBLASLt GEMMs write their pieces into the output, gathered in place (in_place = the
    # piece's bytes); XLA's dots gather separate pieces into it; the last gather runs on
    # XLA's stream (stream -1) either way
    in_place = [int(re.search(r"in_place = (\d+)", l).group(1)) for l in gathers]
    assert all(in_place) if cublaslt else not any(in_place), in_place
    assert ["stream = -1 " in l for l in gathers] == [False] * (pieces - 1) + [True]
  for text in (cpu,) if cublaslt else (cpu, cuda):
    dots = set(re.findall(r"(%[\w#]+) = stablehlo.dot_general", text))
    adds = re.findall(add, text)
    assert len(dots) == pieces * n and "hoccl_rows_matmul" not in text
    assert len(adds) == pieces * (n - 1) and all(a in dots or b in dots for a, b in adds), adds
  if cublaslt:
    assert cuda.count("@hoccl_rows_matmul(") == pieces * n
    assert not re.search(add, cuda)
    assert "dynamic_slice" not in cuda and "stablehlo.dot_general" not in cuda
  ref = jax.jit(jax.shard_map(lambda x, w: jax.lax.psum(x @ w, "tp"), mesh=mesh,
                              in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P("dp", None)))
  assert_close(sm(x, w), ref(x, w), jnp.bfloat16, name="matmul_psum")


@pytest.mark.parametrize("mesh_id", ["tp2", "tp4"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_matmul_reduce_scatter_ring(mesh_id, dtype, monkeypatch):
  """bf16 matmul_reduce_scatter runs as the ring of rows_matmuls (f32: one send per block
  and a sum): equal to jax.lax (values and gradients); lowered for CUDA (bf16) it is n GEMMs
  per piece, all hoccl_rows_matmul, and no dynamic_slice, add or concatenate."""
  monkeypatch.setenv("JAX_HOCCL_CUBLASLT", "1")
  mesh = MESHES[mesh_id]
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  dt = DTYPES[dtype]
  rng = np.random.default_rng(5)
  x = put(mesh, rand(rng, (n * 4, d, n * 8), dt), P(None, "dp", "tp"))  # local [4n, 1, 8]
  w = put(mesh, rand(rng, (n * 8, 8), dt), P("tp", None))
  specs = (x.sharding.spec, w.sharding.spec)
  sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=specs,  # noqa: E731
                               out_specs=P("tp", "dp", None))
  ours = sm(lambda x, w: hc.matmul_reduce_scatter(x, w, "tp"))
  ref = sm(lambda x, w: jax.lax.psum_scatter(x @ w, "tp", tiled=True))
  assert_close(jax.jit(ours)(x, w), jax.jit(ref)(x, w), dt, name="mmrs ring")
  loss = lambda f: jax.jit(jax.grad(  # noqa: E731
      lambda a, b: jnp.sum(jnp.sin(f(a, b).astype(jnp.float32))), argnums=(0, 1)))(x, w)
  for g1, g2 in zip(loss(ours), loss(ref)):
    assert_close(g1, g2, dt, name="mmrs ring grad")
  if dtype == "bf16" and hc.with_cuda:  # lowering for CUDA needs the CUDA engine's build
    cuda = jax.jit(ours).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("@hoccl_rows_matmul(") == 2 * n  # 2 pieces per block, n steps
    assert cuda.count("@hoccl_ppermute_start(") == 2 * (n - 1)
    for op in ("dynamic_slice", "stablehlo.concatenate", "stablehlo.dot_general"):
      assert op not in cuda, op
    # Order by data dependencies only (XLA drops optimization barriers before it schedules
    # on GPU): every GEMM but the first takes the latest start's token as an operand, and the
    # done that brings a later piece's partial takes the GEMM before it (in the last step:
    # the buffer the next GEMM writes into). Without that XLA scheduled GEMMs above their
    # starts and dones above their GEMMs on GPU.
    defs = dict(re.findall(r"^\s*(%\w+)(?::\d+)? = (.*)$", cuda, re.M))
    base = lambda v: v.split("#")[0]  # noqa: E731
    gemms = [m.group(1).split(", ") for m in
             re.finditer(r"stablehlo.custom_call @hoccl_rows_matmul\(([^)]*)\)", cuda)]
    for ops in gemms[1:]:
      assert any("_start(" in defs.get(base(o), "") for o in ops[2:]), ops
    chained = 0
    for ops in gemms:
      if len(ops) != 5:  # x, w, c, into, token: the last step's chained GEMMs
        continue
      _, _, c, into, _ = ops
      done = re.match(r"stablehlo.custom_call @hoccl_done\(([^)]*)\)", defs[c])
      assert done, defs[c][:80]
      assert base(into) in [base(o) for o in done.group(1).split(", ")[2:]], (done, into)
      assert "@hoccl_rows_matmul(" in defs[base(into)]
      chained += 1
    assert chained == 1  # 2 pieces: the second waits on the first


@pytest.mark.parametrize("chunks", [1, 2, 4, (1, 3)])
def test_matmul_reduce_scatter_chunks(chunks, monkeypatch):
  """chunks cuts the ring's pieces (bf16): equal to jax.lax for each; lowered for CUDA there
  are n GEMMs per piece. A cut that does not fit the block fails at trace time."""
  monkeypatch.setenv("JAX_HOCCL_CUBLASLT", "1")
  mesh = MESHES["tp2"]
  rng = np.random.default_rng(6)
  x = put(mesh, rand(rng, (8, 4, 16), jnp.bfloat16), P(None, "dp", "tp"))  # local [8, 1, 8]
  w = put(mesh, rand(rng, (16, 8), jnp.bfloat16), P("tp", None))
  specs = (x.sharding.spec, w.sharding.spec)
  sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs,  # noqa: E731
                                       out_specs=P("tp", "dp", None)))
  ours = sm(lambda x, w: hc.matmul_reduce_scatter(x, w, "tp", chunks=chunks))
  ref = sm(lambda x, w: jax.lax.psum_scatter(x @ w, "tp", tiled=True))
  assert_close(ours(x, w), ref(x, w), jnp.bfloat16, name=f"mmrs chunks={chunks}")
  if hc.with_cuda:
    cuda = ours.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    pieces = chunks if isinstance(chunks, int) else len(chunks)
    assert cuda.count("@hoccl_rows_matmul(") == 2 * pieces
  with pytest.raises(ValueError, match="chunks=3 does not divide the 4 rows"):
    sm(lambda x, w: hc.matmul_reduce_scatter(x, w, "tp", chunks=3))(x, w)
  with pytest.raises(ValueError, match=r"summing to the 4 rows"):
    sm(lambda x, w: hc.matmul_reduce_scatter(x, w, "tp", chunks=(1, 2)))(x, w)




# ------------------------------------------------------------------------------------------
# vmap
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_psum",
                                "matmul_all_to_all", "embedding_all_to_all"])
def test_fused_under_vmap(op):
  """Each fused op vmapped over a leading batch of its first operand (ids for the embedding)
  equals jax.lax's unfused form vmapped the same way."""
  mesh = MESHES["tp4"]
  n, B = mesh.shape["tp"], 2
  rng = np.random.default_rng(9)
  f32 = jnp.float32
  if op == "all_gather_matmul":
    a, b = rand(rng, (B, n * 2, 8), f32), rand(rng, (8, n * 3), f32)
    specs, out = (P(None, "tp", None), P(None, "tp")), P(None, None, "tp")
    ours = lambda x, w: hc.all_gather_matmul(x, w, "tp")  # noqa: E731
    lax = lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w  # noqa: E731
  elif op == "matmul_reduce_scatter":
    a, b = rand(rng, (B, n * 2, n * 8), f32), rand(rng, (n * 8, 3), f32)
    specs, out = (P(None, None, "tp"), P("tp", None)), P(None, "tp", None)
    ours = lambda x, w: hc.matmul_reduce_scatter(x, w, "tp")  # noqa: E731
    lax = lambda x, w: jax.lax.psum_scatter(x @ w, "tp", tiled=True)  # noqa: E731
  elif op == "matmul_psum":
    a, b = rand(rng, (B, n * 2, n * 8), f32), rand(rng, (n * 8, 8), f32)
    specs, out = (P(None, None, "tp"), P("tp", None)), P()
    ours = lambda x, w: hc.matmul_psum(x, w, "tp", chunks=2)  # noqa: E731
    lax = lambda x, w: jax.lax.psum(x @ w, "tp")  # noqa: E731
  elif op == "matmul_all_to_all":
    a, b = rand(rng, (B, n * n, 2, 2, 4), f32), rand(rng, (n * 2, 4, 3), f32)
    specs, out = (P(None, "tp"), P("tp")), P(None, "tp")
    ours = lambda x, w: hc.matmul_all_to_all(x, w, "tp")  # noqa: E731
    lax = lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w), "tp", 0, 0, tiled=True)  # noqa: E731
  else:
    b = rng.integers(0, 10, (B, n * n, 2, 3)).astype(np.int32)
    a = rand(rng, (n * 10, 4), f32)
    specs, out = (P("tp"), P(None, "tp")), P(None, "tp")
    ours = lambda t, i: hc.embedding_all_to_all(t, i, "tp")  # noqa: E731
    lax = lambda t, i: jax.lax.all_to_all(  # noqa: E731
        jnp.take(t, i, axis=0).sum(-2), "tp", 0, 0, tiled=True)
  axes = (None, 0) if op == "embedding_all_to_all" else (0, None)
  args = [put(mesh, v, s) for v, s in zip((a, b), specs)]
  run = lambda f: jax.jit(jax.shard_map(jax.vmap(f, in_axes=axes), mesh=mesh,  # noqa: E731
                                        in_specs=specs, out_specs=out))(*args)
  assert_close(run(ours), run(lax), f32, name=op)


@pytest.mark.parametrize("w_batched", [False, True])
def test_matmul_psum_vmap_keeps_the_pipeline(w_batched):
  """vmap(matmul_psum) in bf16 runs the batch as more rows of one pipeline (a weight per
  example: one pipeline per example): lowered for CUDA its GEMMs stay rows_matmul calls
  writing into the in-place gathers' buffer, with no XLA dot or dynamic_update_slice on it;
  values equal jax.lax's."""
  mesh = MESHES["tp4"]
  n, B = mesh.shape["tp"], 3
  rng = np.random.default_rng(12)
  bf16 = jnp.bfloat16
  x = put(mesh, rand(rng, (B, n * 4, n * 8), bf16), P(None, None, "tp"))
  w = put(mesh, rand(rng, (B, n * 8, 8) if w_batched else (n * 8, 8), bf16),
          P(None, "tp", None) if w_batched else P("tp", None))
  specs = (x.sharding.spec, w.sharding.spec)
  axes = (0, 0 if w_batched else None)
  sm = lambda f: jax.jit(jax.shard_map(jax.vmap(f, in_axes=axes), mesh=mesh,  # noqa: E731
                                       in_specs=specs, out_specs=P()))
  ours = sm(lambda x, w: hc.matmul_psum(x, w, "tp", chunks=2))
  lax = sm(lambda x, w: jax.lax.psum(x @ w, "tp"))
  if hc.with_cuda:
    cuda = ours.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = B if w_batched else 1
    assert cuda.count("@hoccl_rows_matmul(") == calls * 2 * n
    for op in ("dot_general", "dynamic_update_slice"):
      assert f"stablehlo.{op}" not in cuda, op
  assert_close(ours(x, w), lax(x, w), bf16, name="vmap(matmul_psum)")


@pytest.mark.parametrize("experts", [None, 2])
def test_matmul_all_to_all_vmap_keeps_the_pipeline(experts):
  """vmap(matmul_all_to_all) in bf16 runs the batch as more rows of one pipeline (behind the
  blocks' axis, or among each expert's tokens): lowered for CUDA, n rows_matmul calls and no
  XLA dot or dynamic_update_slice on the buffer the received blocks land in; values equal
  jax.lax's."""
  mesh = MESHES["tp4"]
  n, B = mesh.shape["tp"], 3
  rng = np.random.default_rng(13)
  e = experts or 1
  xs = (B, n * n, e, 4, 16) if experts else (B, n * n, 4, 16)
  x = put(mesh, rand(rng, xs, jnp.bfloat16), P(None, "tp"))
  w = put(mesh, rand(rng, (n * e, 16, 8) if experts else (16, 8), jnp.bfloat16),
          P("tp") if experts else P())
  specs = (x.sharding.spec, w.sharding.spec)
  sm = lambda f: jax.jit(jax.shard_map(jax.vmap(f, in_axes=(0, None)), mesh=mesh,  # noqa: E731
                                       in_specs=specs, out_specs=P(None, "tp")))
  ours = sm(lambda x, w: hc.matmul_all_to_all(x, w, "tp"))
  lax = sm(lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w), "tp", 0, 0, tiled=True))
  if hc.with_cuda:
    cuda = ours.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("@hoccl_rows_matmul(") == n
    for op in ("dot_general", "dynamic_update_slice"):
      assert f"stablehlo.{op}" not in cuda, op
  assert_close(ours(x, w), lax(x, w), jnp.bfloat16, name="vmap(matmul_all_to_all)")


def test_all_gather_matmul_structure():
  """all_gather_matmul's program (bf16), lowered for CPU and, cross-platform, for CUDA: one
  peers-only all_gather start and its done; on CUDA n rows_matmul GEMMs, each writing its rows
  into its rank's slot of one output (no dot, no concatenate or roll of the output after).
  Values equal jax.lax's."""
  mesh = MESHES["tp4"]
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  rng = np.random.default_rng(6)
  x = put(mesh, rand(rng, (d * n * 4, 3, 16), jnp.bfloat16), P(("dp", "tp")))
  w = put(mesh, rand(rng, (16, n * 8), jnp.bfloat16), P(None, "tp"))
  sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(("dp", "tp")), P(None, "tp")),  # noqa: E731
                                       out_specs=P("dp", None, "tp")))
  ours = sm(lambda x, w: hc.all_gather_matmul(x, w, "tp"))
  ref = sm(lambda x, w: jax.lax.all_gather(x, "tp", tiled=True) @ w)
  texts = [ours.lower(x, w).as_text()]
  if hc.with_cuda:
    texts.append(ours.trace(x, w).lower(lowering_platforms=("cuda",)).as_text())
  for text in texts:
    assert text.count("@hoccl_all_gather_start(") == 1 and text.count("@hoccl_done(") == 1
  if hc.with_cuda:
    cuda = texts[1]
    assert cuda.count("@hoccl_rows_matmul(") == n
    for op in ("dot_general", "concatenate", "dynamic_slice"):
      assert f"stablehlo.{op}" not in cuda, op
  np.testing.assert_allclose(np.asarray(ours(x, w), np.float32), np.asarray(ref(x, w), np.float32),
                             rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("experts", [None, 2])
def test_matmul_all_to_all_structure(experts):
  """matmul_all_to_all's program (bf16), lowered for CPU and, cross-platform, for CUDA: n - 1
  ppermute starts into the sender's slot of one output buffer, n - 2 waits and one done. On
  CUDA its n GEMMs are rows_matmul calls (x's blocks read in place, per-expert weights as one
  strided batch, the own block written into its slot): no dot, dynamic_slice, gather or
  concatenate left. Values equal jax.lax's."""
  mesh = MESHES["tp4"]
  n, d = mesh.shape["tp"], mesh.shape["dp"]
  rng = np.random.default_rng(5)
  e = experts or 1
  xs = (d * n * n, e, 4, 16) if experts else (d * n * n, 4, 16)
  x = put(mesh, rand(rng, xs, jnp.bfloat16), P(("dp", "tp")))
  w = put(mesh, rand(rng, (e, 16, 8) if experts else (16, 8), jnp.bfloat16), P())
  sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(("dp", "tp")), P()),  # noqa: E731
                                       out_specs=P(("dp", "tp"))))
  ours = sm(lambda x, w: hc.matmul_all_to_all(x, w, "tp"))
  ref = sm(lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w), "tp", 0, 0, tiled=True))
  cpu = ours.lower(x, w).as_text()
  texts = [cpu]
  if hc.with_cuda:
    texts.append(ours.trace(x, w).lower(lowering_platforms=("cuda",)).as_text())
  for text in texts:
    assert text.count("@hoccl_into_start(") == n - 1
    assert text.count("@hoccl_done(") == n - 1 and "@hoccl_ppermute_start(" not in text
  if hc.with_cuda:
    cuda = texts[1]
    assert cuda.count("@hoccl_rows_matmul(") == n
    for op in ("dot_general", "dynamic_slice", "gather", "concatenate"):
      assert f"stablehlo.{op}" not in cuda, op
  np.testing.assert_allclose(np.asarray(ours(x, w), np.float32), np.asarray(ref(x, w), np.float32),
                             rtol=2e-2, atol=2e-2)
