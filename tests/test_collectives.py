"""The five collectives vs jax.lax's on random data: values, dtypes, pytrees, 1-D and 2-D
meshes, every axis combination, shard_map typing (check_vma True and False), out_specs, and
that each one lowers to our custom calls and none of XLA's own collectives.

Every case runs ours and jax.lax's in one shard_map (one compile) over a pytree holding one
leaf per dtype; the typing of each leaf is compared inside the body at trace time.

Sizes: the multi-leaf cases keep every per-device buffer <= 512 bytes. XLA:CPU runs such
programs sequentially; above that its ThunkExecutor runs independent custom calls
concurrently and in any order, which breaks jax_hoccl's per-rank sequence numbering (see
test_programs.py::test_independent_collectives_in_one_program). Larger sizes are tested with
one collective per program (test_large_single_leaf).
"""
import contextlib
import functools
import zlib

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl as hc
from conftest import (AXIS_CASES, DTYPES, LOW_PRECISION, MESH1, MESH2, all_axes_spec,
                      assert_lowers_to_ours, assert_same, assert_sum_matches, axis_size,
                      global_inputs, lax_ppermute_any_axis_order, put, rand, to_np)

ALL_DTYPES = DTYPES  # bool is summed as int32 (promoted like jax.lax.psum)


def some_dtypes(*key):
  """float32 plus one other dtype, rotating with the test's parameters, so that every dtype
  meets every op on some axis configurations while each compile stays small (compiling is
  what the suite's time goes to). test_all_dtypes covers every dtype on every op."""
  others = [k for k in DTYPES if k != "float32"]
  other = others[zlib.crc32(repr(key).encode()) % len(others)]
  return {"float32": DTYPES["float32"], other: DTYPES[other]}


def _is_low(leaf):
  return np.dtype(leaf.dtype) in LOW_PRECISION


def _as_summable(leaf):
  return leaf.astype(jnp.int32) if leaf.dtype == jnp.bool_ else leaf


def run_compare(mesh, ours, lax_typed, lax_ref, inputs, *, summing=False, check_vma=True,
                out_specs=None, expect=()):
  """Runs ours and lax's in one shard_map; compares types (trace time) and values."""
  spec = all_axes_spec(mesh)
  out_specs = spec if out_specs is None else out_specs
  types = {}

  def body(tree):
    o = ours(tree)
    r = lax_ref(tree)
    types["ours"] = jax.tree.map(jax.typeof, o)
    types["lax"] = jax.tree.map(jax.typeof, lax_typed(tree))
    return o, r

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(out_specs, out_specs),
                            check_vma=check_vma))
  got, ref = f(inputs)
  assert jax.tree.structure(types["ours"]) == jax.tree.structure(types["lax"])
  for k in inputs:
    assert types["ours"][k] == types["lax"][k], (k, types["ours"][k], types["lax"][k])
    # The printed type shows the varying manual axes ({V:x}), whichever field holds them.
    assert str(types["ours"][k]) == str(types["lax"][k]), k
    if summing:
      assert_sum_matches(got[k], ref[k], name=k)
    else:
      assert_same(got[k], ref[k], exact=True, name=k)
  only_ours = jax.shard_map(ours, mesh=mesh, in_specs=spec, out_specs=out_specs,
                            check_vma=check_vma)
  assert_lowers_to_ours(only_ours, inputs, expect=expect)
  return got


def summing_refs(lax_op, promote_bool):
  """(lax on the original dtypes: typing; lax with bf16/f16 in f32: values)."""
  def typed(tree):
    return jax.tree.map(lambda l: lax_op(_as_summable(l) if promote_bool else l), tree)

  def ref(tree):
    return jax.tree.map(
        lambda l: lax_op(l.astype(jnp.float32) if _is_low(l) else
                         (_as_summable(l) if promote_bool else l)), tree)
  return typed, ref


# ------------------------------------------------------------------------------ all_gather
@pytest.mark.parametrize("tiled", [False, True], ids=["stacked", "tiled"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("mesh,name", AXIS_CASES)
def test_all_gather(mesh, name, axis, tiled):
  inputs = global_inputs(mesh, (2, 2, 2), some_dtypes(name, axis, tiled), seed=1)

  def ours(t):
    return hc.all_gather(t, name, axis=axis, tiled=tiled)

  def lax(t):
    return jax.lax.all_gather(t, name, axis=axis, tiled=tiled)

  got = run_compare(mesh, ours, lax, lax, inputs, expect=["hoccl_all_gather"])
  n = axis_size(mesh, name)
  shape = got["float32"].shape
  if tiled:
    assert shape[axis] == n * 2 * (mesh.size if axis == 0 else 1)
  else:
    assert shape[axis % 4] == (n * mesh.size if axis == 0 else n)


# ---------------------------------------------------------------------------- psum_scatter
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("mesh,name", AXIS_CASES)
def test_psum_scatter(mesh, name, dim, tiled):
  n = axis_size(mesh, name)
  local = [2, 2, 2]
  local[dim] = 2 * n if tiled else n
  inputs = global_inputs(mesh, tuple(local), some_dtypes(name, dim, tiled), seed=2)

  def lax_op(l):
    return jax.lax.psum_scatter(l, name, scatter_dimension=dim, tiled=tiled)

  typed, ref = summing_refs(lax_op, promote_bool=True)  # lax.psum_scatter rejects bool

  def ours(t):
    return hc.psum_scatter(t, name, scatter_dimension=dim, tiled=tiled)

  got = run_compare(mesh, ours, typed, ref, inputs, summing=True, expect=["hoccl_all_to_all"])
  if "bool" in got:
    assert got["bool"].dtype == jnp.int32


# ------------------------------------------------------------------------------ all_to_all
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("split,concat", [(0, 0), (0, 2), (2, 1), (1, -1)])
@pytest.mark.parametrize("mesh,name", AXIS_CASES)
def test_all_to_all(mesh, name, split, concat, tiled):
  n = axis_size(mesh, name)
  local = [2, 2, 2]
  local[split] = 2 * n if tiled else n
  inputs = global_inputs(mesh, tuple(local), some_dtypes(name, split, concat, tiled), seed=3)

  def ours(t):
    return hc.all_to_all(t, name, split, concat, tiled=tiled)

  def lax(t):
    return jax.lax.all_to_all(t, name, split, concat, tiled=tiled)

  run_compare(mesh, ours, lax, lax, inputs, expect=["hoccl_all_to_all"])


# ------------------------------------------------------------------------------- ppermute
def make_perm(kind, n, seed=0):
  rng = np.random.default_rng(seed + n)
  if kind == "shift":
    return [(i, (i + 1) % n) for i in range(n)]
  if kind == "random":
    return [(i, int(d)) for i, d in enumerate(rng.permutation(n))]
  k = max(1, n // 2)  # partial: only k ranks send; the others receive zeros
  src, dst = rng.permutation(n)[:k], rng.permutation(n)[:k]
  return [(int(s), int(d)) for s, d in zip(src, dst)]


@pytest.mark.parametrize("kind", ["shift", "random", "partial"])
@pytest.mark.parametrize("mesh,name", AXIS_CASES)
def test_ppermute(mesh, name, kind):
  n = axis_size(mesh, name)
  perm = make_perm(kind, n)
  inputs = global_inputs(mesh, (2, 4), some_dtypes(name, kind), seed=4)

  def ours(t):
    return hc.ppermute(t, name, perm)

  def lax(t):
    return jax.lax.ppermute(t, name, perm)

  # jax.lax.ppermute refuses axis names out of mesh order unless told otherwise.
  allow = lax_ppermute_any_axis_order() if name == ("y", "x") else contextlib.nullcontext()
  with allow:
    got = run_compare(mesh, ours, lax, lax, inputs, expect=["hoccl_ppermute"])
  if kind == "partial":  # some device's block is all zeros, and not all are
    blocks = to_np(got["float32"]).reshape(mesh.size, -1)
    zero = np.all(blocks == 0, axis=1)
    assert zero.any() and not zero.all()


# ----------------------------------------------------------------------------------- psum
@pytest.mark.parametrize("local", [(2, 4), (5,)], ids=["divisible", "ragged"])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_step"])
@pytest.mark.parametrize("mesh,name", AXIS_CASES)
def test_psum(mesh, name, algorithm, local):
  inputs = global_inputs(mesh, local, some_dtypes(name, algorithm, local), seed=5)
  typed, ref = summing_refs(lambda l: jax.lax.psum(l, name), promote_bool=False)

  def ours(t):
    return hc.psum(t, name)

  expect = {"one_shot": ["hoccl_all_gather"],
            "two_step": ["hoccl_all_gather", "hoccl_all_to_all"]}[algorithm]
  with hc.psum_algorithm(algorithm):
    got = run_compare(mesh, ours, typed, ref, inputs, summing=True, expect=expect)
    text = assert_lowers_to_ours(
        jax.shard_map(ours, mesh=mesh, in_specs=all_axes_spec(mesh),
                      out_specs=all_axes_spec(mesh)), inputs)
  assert ("hoccl_all_to_all" in text) == (algorithm != "one_shot")
  if "bool" in got:
    assert got["bool"].dtype == jnp.int32


def test_psum_auto_algorithm_by_size():
  """'auto' picks one_shot for small inputs and two_step from the cost model's crossover on
  (trace only), and one_shot for a group of two at that size (same bytes moved, one exchange
  instead of two: its crossover is far larger)."""
  from jax_hoccl._src import cost_model
  spec = P("x")
  f = jax.shard_map(lambda a: hc.psum(a, "x"), mesh=MESH1, in_specs=spec, out_specs=spec)
  small = jax.ShapeDtypeStruct((8 * 16,), jnp.float32)
  big_elems = int(cost_model.psum_crossover_bytes(8)) // 4 + 8
  big = jax.ShapeDtypeStruct((8 * big_elems,), jnp.float32)
  from jax.sharding import NamedSharding
  small = jax.ShapeDtypeStruct(small.shape, small.dtype, sharding=NamedSharding(MESH1, spec))
  big = jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=NamedSharding(MESH1, spec))
  assert "hoccl_all_to_all" not in jax.jit(f).lower(small).as_text()
  assert "hoccl_all_to_all" in jax.jit(f).lower(big).as_text()
  pair = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  f2 = jax.shard_map(lambda a: hc.psum(a, "x"), mesh=pair, in_specs=spec, out_specs=spec)
  big2 = jax.ShapeDtypeStruct((2 * big_elems,), jnp.float32, sharding=NamedSharding(pair, spec))
  assert "hoccl_all_to_all" not in jax.jit(f2).lower(big2).as_text()
  with pytest.raises(ValueError, match="psum_algorithm"):
    with hc.psum_algorithm("ring"):
      pass


def test_psum_float8():
  """float8 is summable (like jax.lax.psum): accumulated in f32 and rounded once."""
  rng = np.random.default_rng(6)
  for dt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    x = put(MESH1, rng.standard_normal((16, 4)).astype(np.float32).astype(dt))
    for algorithm in ("one_shot", "two_step"):
      with hc.psum_algorithm(algorithm):
        f = jax.jit(jax.shard_map(
            lambda a: (hc.psum(a, "x"), jax.lax.psum(a.astype(jnp.float32), "x")),
            mesh=MESH1, in_specs=P("x"), out_specs=P()))
        got, ref = f(x)
      assert got.dtype == dt
      assert_sum_matches(got, ref, name=f"{dt} {algorithm}")


def test_ppermute_fills_as_jax_lax_in_a_type_without_zero():
  """A rank nobody sends to gets convert(0) of the type, as in jax.lax: in float8_e8m0fnu,
  which has no zero, that is NaN (0xff), not the zero bytes the exchange leaves (2**-127)."""
  rng = np.random.default_rng(62)
  x = put(MESH1, np.exp2(rng.integers(-8, 8, (16, 4))).astype(jnp.float8_e8m0fnu))
  perm = [(0, 3), (5, 1), (2, 2)]
  got, want = (jax.jit(jax.shard_map(lambda a, m=m: m.ppermute(a, "x", perm), mesh=MESH1,
                                     in_specs=P("x"), out_specs=P("x")))(x) for m in (hc, jax.lax))
  np.testing.assert_array_equal(to_np(got).view(np.uint8), to_np(want).view(np.uint8))
  assert (to_np(got).view(np.uint8) == 0xff).any()


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("op", ["psum", "pmax", "pmin", "pmean"])
def test_all_reduce_of_a_weak_type_types_as_jax_lax(op, check_vma):
  """A weakly typed input (a Python float times axis_index): the result is weak as jax.lax's
  is (under check_vma=True) or not (False), so adding bfloat16 to it gives jax.lax's type."""
  x = put(MESH1, np.ones((8, 2), jnp.bfloat16))

  def make(m):
    return jax.jit(jax.shard_map(
        lambda a: getattr(m, op)(jax.lax.axis_index("x") * 1.5, "x") + a, mesh=MESH1,
        in_specs=P("x"), out_specs=P("x"), check_vma=check_vma))
  got, want = make(hc)(x), make(jax.lax)(x)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(to_np(got).astype(np.float32), to_np(want).astype(np.float32))


# ------------------------------------------------------------------------ every dtype
DTYPE_CASES = {
    "all_gather": (lambda t, a: hc.all_gather(t, a, axis=1, tiled=True),
                   lambda t, a: jax.lax.all_gather(t, a, axis=1, tiled=True), False, (2, 2)),
    "psum_scatter": (lambda t, a: hc.psum_scatter(t, a, scatter_dimension=0, tiled=True),
                     lambda t, a: jax.lax.psum_scatter(t, a, scatter_dimension=0, tiled=True),
                     True, (8, 2)),
    "all_to_all": (lambda t, a: hc.all_to_all(t, a, 1, 0, tiled=True),
                   lambda t, a: jax.lax.all_to_all(t, a, 1, 0, tiled=True), False, (2, 8)),
    "ppermute": (lambda t, a: hc.ppermute(t, a, make_perm("random", 8)),
                 lambda t, a: jax.lax.ppermute(t, a, make_perm("random", 8)), False, (2, 4)),
    "psum_one_shot": (lambda t, a: hc.psum(t, a), lambda t, a: jax.lax.psum(t, a), True, (5,)),
    "psum_two_step": (lambda t, a: hc.psum(t, a), lambda t, a: jax.lax.psum(t, a), True, (5,)),
}


@pytest.mark.parametrize("op", list(DTYPE_CASES))
def test_all_dtypes(op):
  """Every dtype through every op, over the 2-D group ('y', 'x'), values and types."""
  ours_op, lax_op, summing, local = DTYPE_CASES[op]
  name = ("y", "x")
  inputs = global_inputs(MESH2, local, ALL_DTYPES, seed=14)

  def ours(t):
    return ours_op(t, name)

  def lax(t):
    return lax_op(t, name)

  if summing:
    typed, ref = summing_refs(lambda l: lax_op(l, name), promote_bool=(op == "psum_scatter"))
  else:
    typed = ref = lax
  algo = op.split("_", 1)[1] if op.startswith("psum_") and op != "psum_scatter" else "auto"
  with hc.psum_algorithm(algo), lax_ppermute_any_axis_order():
    got = run_compare(MESH2, ours, typed, ref, inputs, summing=summing)
  for k, dt in ALL_DTYPES.items():
    want = jnp.int32 if (k == "bool" and summing) else dt
    assert got[k].dtype == want, (k, got[k].dtype)


# ------------------------------------------------------------------ check_vma=False typing
OPS = {
    "psum": (lambda t, a: hc.psum(t, a), lambda t, a: jax.lax.psum(t, a), True),
    "all_gather": (lambda t, a: hc.all_gather(t, a, axis=1, tiled=True),
                   lambda t, a: jax.lax.all_gather(t, a, axis=1, tiled=True), False),
    "psum_scatter": (lambda t, a: hc.psum_scatter(t, a, scatter_dimension=0, tiled=True),
                     lambda t, a: jax.lax.psum_scatter(t, a, scatter_dimension=0, tiled=True),
                     True),
    "all_to_all": (lambda t, a: hc.all_to_all(t, a, 0, 1, tiled=True),
                   lambda t, a: jax.lax.all_to_all(t, a, 0, 1, tiled=True), False),
    "ppermute": (lambda t, a: hc.ppermute(t, a, make_perm("random", axis_size(MESH2, a))),
                 lambda t, a: jax.lax.ppermute(t, a, make_perm("random", axis_size(MESH2, a))),
                 False),
}


@pytest.mark.parametrize("name", [("y",), ("y", "x")], ids=["y", "yx"])
@pytest.mark.parametrize("op", list(OPS))
def test_check_vma_false(op, name):
  """With check_vma=False ours still computes what lax's does and types its results alike."""
  name = name if len(name) > 1 else name[0]
  ours_op, lax_op, summing = OPS[op]
  dtypes = {k: DTYPES[k] for k in ("float32", "bfloat16", "int8")}
  inputs = global_inputs(MESH2, (8, 2), dtypes, seed=7)

  def ours(t):
    return ours_op(t, name)

  def lax(t):
    return lax_op(t, name)

  if summing:
    typed, ref = summing_refs(lambda l: lax_op(l, name), promote_bool=False)
  else:
    typed = ref = lax
  with lax_ppermute_any_axis_order():
    run_compare(MESH2, ours, typed, ref, inputs, summing=summing, check_vma=False)


# --------------------------------------------------------------------------- out_specs
def test_psum_out_specs_replicated():
  """psum's result is invariant: out_specs=P() is accepted (check_vma=True), like lax's."""
  xn = rand(np.random.default_rng(8), (16, 3), np.float32)
  x = put(MESH2, xn)
  blocks = xn.reshape(2, 4, 2, 3)  # [x, y, local rows, cols]
  for name, spec, want in (("x", P("y"), blocks.sum(0).reshape(8, 3)),
                           (("x", "y"), P(), blocks.sum((0, 1)))):
    f = jax.jit(jax.shard_map(lambda a: (hc.psum(a, name), jax.lax.psum(a, name)), mesh=MESH2,
                              in_specs=P(("x", "y")), out_specs=(spec, spec)))
    got, ref = f(x)
    assert_same(got, ref, exact=True)
    np.testing.assert_allclose(to_np(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["psum", "all_gather", "psum_scatter", "all_to_all", "ppermute"])
def test_no_axes_is_the_input_as_in_lax(op):
  """axis_name=() names no axis (a group of one): jax.lax's collectives return the input as it
  is, and so do jax_hoccl's (route_collectives hands them such calls)."""
  call = {"psum": lambda m, a: m.psum(a, ()),
          "all_gather": lambda m, a: m.all_gather(a, (), tiled=True),
          "psum_scatter": lambda m, a: m.psum_scatter(a, (), tiled=True),
          "all_to_all": lambda m, a: m.all_to_all(a, (), 0, 0, tiled=True),
          "ppermute": lambda m, a: m.ppermute(a, (), [(0, 0)])}[op]  # one rank, to itself
  x = put(MESH1, rand(np.random.default_rng(10), (16, 3), np.float32))
  f = jax.jit(jax.shard_map(lambda a: (call(hc, a), call(jax.lax, a)), mesh=MESH1,
                            in_specs=P("x"), out_specs=(P("x"), P("x"))))
  got, ref = f(x)
  assert_same(got, ref)
  assert_same(got, x)


def test_all_gather_invarying_out_specs():
  """all_gather(to='invarying') (lax's spelling) is invariant: out_specs=P() accepted."""
  x = put(MESH1, rand(np.random.default_rng(9), (16, 3), np.float32))
  f = jax.jit(jax.shard_map(
      lambda a: (hc.all_gather(a, "x", tiled=True, to="invarying"),
                 jax.lax.all_gather(a, "x", tiled=True, to="invarying")),
      mesh=MESH1, in_specs=P("x"), out_specs=(P(), P())))
  got, ref = f(x)
  assert_same(got, ref)
  assert_same(got, x)


@pytest.mark.parametrize("op", ["ppermute", "all_gather", "psum_scatter", "all_to_all"])
def test_varying_result_rejects_replicated_out_specs(op):
  """A varying result with out_specs=P() is an error for ours exactly when it is for lax's
  (docs/design.md: a plain ffi_call was silently accepted and returned device 0's shard)."""
  ours_op, lax_op, _ = OPS[op] if op != "ppermute" else (
      lambda t, a: hc.ppermute(t, a, make_perm("shift", 8)),
      lambda t, a: jax.lax.ppermute(t, a, make_perm("shift", 8)), False)
  x = put(MESH1, rand(np.random.default_rng(10), (64, 8), np.float32))
  errors = []
  for fn in (ours_op, lax_op):
    f = jax.shard_map(lambda a: fn(a, "x"), mesh=MESH1, in_specs=P("x"), out_specs=P())
    with pytest.raises(Exception) as e:
      jax.jit(f).trace(x)
    errors.append(type(e.value))
  assert errors[0] == errors[1]


# ---------------------------------------------------------------- invariant inputs, scalars
@pytest.mark.parametrize("check_vma", [True, False])
def test_invariant_and_scalar_inputs(check_vma):
  """Replicated (invariant) inputs and scalars behave like lax's: psum of a replicated value
  sums the copies, all_gather stacks them, ppermute moves them."""
  rng = np.random.default_rng(11)
  x = put(MESH2, rand(rng, (8, 3), np.float32))
  rep = put(MESH2, rand(rng, (5,), np.float32), P())
  perm = make_perm("random", 4)

  def make(m):
    def body(a, r):
      s = a[0, 0]  # a scalar per device
      return (m.psum(r, "y"), m.psum(s, ("x", "y")), m.all_gather(s, "y"),
              m.ppermute(s, "y", perm)[None], m.all_gather(r, "x", tiled=True, to="invarying"))
    return body

  outs = P(("x", "y"))
  specs = (P(), P(), outs, outs, P())
  got, ref = [jax.jit(jax.shard_map(make(m), mesh=MESH2, in_specs=(P(("x", "y")), P()),
                                    out_specs=specs, check_vma=check_vma))(x, rep)
              for m in (hc, jax.lax)]
  for g, r in zip(got, ref):
    assert_same(g, r, exact=True)
  np.testing.assert_allclose(to_np(got[0]), 4 * to_np(rep), rtol=1e-6)
  np.testing.assert_allclose(to_np(got[1]), to_np(x)[:, 0].sum(), rtol=1e-5)
  np.testing.assert_array_equal(to_np(got[4]), np.tile(to_np(rep), 2))


# ---------------------------------------------------------------------------------- pytrees
def test_nested_pytrees():
  """Nested tuples/lists/dicts with mixed shapes and dtypes, for every op."""
  rng = np.random.default_rng(12)
  tree = {"a": (put(MESH1, rand(rng, (64, 2), np.float32)),
                put(MESH1, rand(rng, (64, 1, 2), np.int32))),
          "b": [put(MESH1, rand(rng, (128,), jnp.bfloat16))]}
  perm = make_perm("random", 8)

  def make(m):
    def body(t):
      return (m.psum(t, "x"), m.all_gather(t, "x", tiled=True),
              m.psum_scatter(jax.tree.map(lambda l: l.astype(jnp.float32), t), "x", tiled=True),
              m.all_to_all(t, "x", 0, 0, tiled=True), m.ppermute(t, "x", perm))
    return body

  spec = P("x")
  got = jax.jit(jax.shard_map(make(hc), mesh=MESH1, in_specs=spec, out_specs=spec))(tree)
  ref = jax.jit(jax.shard_map(make(jax.lax), mesh=MESH1, in_specs=spec, out_specs=spec))(tree)
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
  assert len(leaves) == 15
  for i, (g, r) in enumerate(leaves):
    summed = i < 3 or 6 <= i < 9  # psum and psum_scatter leaves
    if g.dtype == jnp.bfloat16 and summed:  # one rounding (ours) vs lax's per-hop rounding
      np.testing.assert_allclose(to_np(g).astype(np.float32), to_np(r).astype(np.float32),
                                 rtol=2e-2, atol=5e-2)
    else:
      assert_same(g, r, name=str(i))


def test_compiled_hlo_has_no_xla_collectives():
  """After XLA's passes the compiled module still has only our custom calls."""
  x = put(MESH2, rand(np.random.default_rng(13), (64, 8), np.float32))

  def body(a):
    a = hc.psum(a, "x")
    a = hc.all_gather(a, "y", tiled=True)
    a = hc.psum_scatter(a, "y", tiled=True)
    a = hc.all_to_all(a, ("x", "y"), 1, 0, tiled=True)
    return hc.ppermute(a, "y", make_perm("shift", 4))

  with hc.psum_algorithm("two_step"):
    f = jax.shard_map(body, mesh=MESH2, in_specs=P(("x", "y")), out_specs=P(("x", "y")))
    text = assert_lowers_to_ours(f, x, compiled=True,
                                 expect=["hoccl_all_gather", "hoccl_all_to_all",
                                         "hoccl_ppermute"])
  assert "has_side_effect = true" in text


# ------------------------------------------------------------------------ larger sizes
LARGE = {
    "all_gather": (lambda m, x: m.all_gather(x, ("y", "x"), axis=1, tiled=True), (64, 250)),
    "psum_scatter": (lambda m, x: m.psum_scatter(x, "y", scatter_dimension=1, tiled=True),
                     (64, 256)),
    "all_to_all": (lambda m, x: m.all_to_all(x, ("x", "y"), 1, 0, tiled=True), (64, 256)),
    "ppermute": (lambda m, x: m.ppermute(x, "y", make_perm("random", 4)), (64, 250)),
    "psum_one_shot": (lambda m, x: m.psum(x, "y"), (64, 250)),
    "psum_two_step": (lambda m, x: m.psum(x, ("x", "y")), (63, 251)),  # ragged: pads
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", list(LARGE))
def test_large_single_leaf(op, dtype):
  """Tens of KiB per device, one collective per program, vs jax.lax in its own program."""
  fn, local = LARGE[op]
  x = put(MESH2, rand(np.random.default_rng(15), (local[0] * 8, local[1]), DTYPES[dtype]))
  spec = all_axes_spec(MESH2)
  algo = "two_step" if op == "psum_two_step" else "one_shot"
  summing = op.startswith("psum")
  low = dtype != "float32" and summing

  def ref_fn(a):
    return fn(jax.lax, a.astype(jnp.float32) if low else a)

  with hc.psum_algorithm(algo), lax_ppermute_any_axis_order():
    ours = jax.jit(jax.shard_map(lambda a: fn(hc, a), mesh=MESH2, in_specs=spec,
                                 out_specs=spec))
    got = ours(x)
    ref = jax.jit(jax.shard_map(ref_fn, mesh=MESH2, in_specs=spec, out_specs=spec))(x)
    assert_lowers_to_ours(ours, x)
  if summing:
    assert_sum_matches(got, ref, name=op)
  else:
    assert_same(got, ref, name=op)


def test_sums_take_their_own_block_from_the_input():
  """psum (one_shot) and psum_scatter leave their own slot of the mover's output unwritten
  (skip_own = 1: no local copy) and sum it from the input; the plain movers write it. The
  values are checked by test_psum / test_psum_scatter."""
  import re
  pair = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  spec = P("x")
  x = jax.ShapeDtypeStruct((2 * 8,), jnp.float32,
                           sharding=jax.sharding.NamedSharding(pair, spec))

  def skip_own_of(body, target):
    text = jax.jit(jax.shard_map(body, mesh=pair, in_specs=spec, out_specs=spec,
                                 check_vma=False)).lower(x).as_text()
    calls = [l for l in text.splitlines() if f'@{target}(' in l or f'"{target}"' in l]
    assert calls, text
    return {int(m) for l in calls for m in re.findall(r"skip_own = (\d+)", l)}

  assert skip_own_of(lambda a: hc.psum(a, "x"), "hoccl_all_gather") == {1}
  assert skip_own_of(lambda a: hc.psum_scatter(a, "x", tiled=True), "hoccl_all_to_all") == {1}
  assert skip_own_of(lambda a: hc.all_gather(a, "x", tiled=True), "hoccl_all_gather") == {0}
  assert skip_own_of(lambda a: hc.all_to_all(a, "x", 0, 0, tiled=True),
                     "hoccl_all_to_all") == {0}


@pytest.mark.parametrize("bucket", [None, "0", "24"], ids=["default", "per-leaf", "24B"])
def test_psum_of_a_pytree_sums_buckets(bucket, monkeypatch):
  """psum of a pytree sums leaves of one dtype and type in one exchange per bucket (env
  JAX_HOCCL_BUCKET_BYTES: 0 = one per leaf; 24 bytes splits the f32 leaves in two):
  values and types equal jax.lax.psum's, including a leaf invariant over another mesh axis
  (never bucketed with leaves varying over it), bools (summed as int32) and scalars."""
  import re
  if bucket is not None:
    monkeypatch.setenv("JAX_HOCCL_BUCKET_BYTES", bucket)
  rng = np.random.default_rng(3)
  u = jnp.asarray(rng.standard_normal((8 * 3, 2)).astype(np.float32))  # varying over x and y
  v = jnp.asarray(rng.standard_normal((4 * 2,)).astype(np.float32))    # varying over y only
  i = jnp.asarray(rng.integers(-9, 9, (8 * 2,)).astype(np.int32))

  def tree(u, v, i):
    return {"a": u, "b": u[0] * 3, "c": v, "d": u[:, 0] - 1, "e": i, "f": i > 0,
            "g": u.astype(jnp.bfloat16)}

  def body(fn):
    def f(u, v, i):
      out = fn(tree(u, v, i), "y")
      return out, jax.tree.map(jax.typeof, out)
    return f

  types = {}

  def run(fn, name):
    def f(u, v, i):
      out, t = body(fn)(u, v, i)
      types[name] = t
      return jax.tree.map(lambda a: a[None], out)  # one per device
    spec = P(("x", "y"))
    g = jax.jit(jax.shard_map(f, mesh=MESH2, in_specs=(spec, P("y"), spec), out_specs=spec))
    args = [jax.device_put(a, jax.sharding.NamedSharding(MESH2, s_))
            for a, s_ in zip((u, v, i), (spec, P("y"), spec))]
    return g(*args), g.lower(*args).as_text()

  ours, text = run(hc.psum, "ours")
  ref, _ = run(jax.lax.psum, "lax")
  for k in ref:
    np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(ref[k]), err_msg=k)
    assert str(types["ours"][k]) == str(types["lax"][k]), (k, types["ours"][k], types["lax"][k])
  calls = len(re.findall(r"hoccl_all_gather", text))
  # f32 varying over x,y: a, b, d (24 + 4 + 12 bytes); f32 varying over y: c; int32: e, f;
  # bf16: g. Default: 4 exchanges; per leaf: 7; 24-byte buckets: a alone, b + d, c, e + f, g.
  assert calls == {None: 4, "0": 7, "24": 5}[bucket], (calls, text)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_psum_of_a_pytree_differentiates_like_lax(check_vma):
  """grad through a bucketed psum (concatenate, one exchange, slices) equals jax.lax's."""
  rng = np.random.default_rng(4)
  u = jax.device_put(jnp.asarray(rng.standard_normal((8 * 3, 2)).astype(np.float32)),
                     jax.sharding.NamedSharding(MESH2, P(("x", "y"))))

  def loss(m):
    def f(u):
      t = m.psum({"a": u * u, "b": jnp.sin(u[0]), "c": u.sum()}, "y")
      return (t["a"] * t["b"]).sum() + t["c"] * 2
    g = jax.shard_map(jax.grad(f), mesh=MESH2, in_specs=P(("x", "y")),
                      out_specs=P(("x", "y")), check_vma=check_vma)
    return jax.jit(g)(u)

  np.testing.assert_allclose(np.asarray(loss(hc)), np.asarray(loss(jax.lax)), rtol=1e-5,
                             atol=1e-5)


GATHER_SCATTER_PYTREE = {
    "all_gather": (lambda m: lambda t: m.all_gather(t, "y"), "hoccl_all_gather"),
    "all_gather_tiled": (lambda m: lambda t: m.all_gather(t, "y", tiled=True), "hoccl_all_gather"),
    "all_gather_last": (lambda m: lambda t: m.all_gather(t, "y", axis=-1), "hoccl_all_gather"),
    "psum_scatter_tiled": (lambda m: lambda t: m.psum_scatter(t, "y", tiled=True),
                           "hoccl_all_to_all"),
    "psum_scatter": (lambda m: lambda t: m.psum_scatter(t, "y"), "hoccl_all_to_all"),
    "all_to_all_tiled": (lambda m: lambda t: m.all_to_all(t, "y", 0, 0, tiled=True),
                         "hoccl_all_to_all"),
    "all_to_all": (lambda m: lambda t: m.all_to_all(t, "y", 0, 0), "hoccl_all_to_all"),
    "ppermute": (lambda m: lambda t: m.ppermute(t, "y", [(0, 2), (2, 1), (1, 0), (3, 3)]),
                 "hoccl_ppermute"),
}


@pytest.mark.parametrize("bucket", [None, "0"], ids=["default", "per-leaf"])
@pytest.mark.parametrize("op", sorted(GATHER_SCATTER_PYTREE))
def test_gather_and_scatter_of_a_pytree_move_buckets(op, bucket, monkeypatch):
  """all_gather, psum_scatter, all_to_all and ppermute of a pytree move leaves of one dtype
  and type in one exchange per bucket, like psum (values and types equal jax.lax's)."""
  import re
  if bucket is not None:
    monkeypatch.setenv("JAX_HOCCL_BUCKET_BYTES", bucket)
  fn, target = GATHER_SCATTER_PYTREE[op]
  rng = np.random.default_rng(5)
  spec = P(("x", "y"))
  u = jax.device_put(rng.standard_normal((8 * 4, 2)).astype(np.float32),
                     jax.sharding.NamedSharding(MESH2, spec))           # varying over x and y
  v = jax.device_put(rng.standard_normal((4 * 4,)).astype(np.float32),
                     jax.sharding.NamedSharding(MESH2, P("y")))         # varying over y only
  i = jax.device_put(rng.integers(-9, 9, (8 * 4,)).astype(np.int32),
                     jax.sharding.NamedSharding(MESH2, spec))
  types = {}

  def run(m, name):
    def f(u, v, i):
      out = fn(m)({"a": u, "b": u[:, 0] * 3, "c": v, "d": i, "g": u.astype(jnp.bfloat16)})
      types[name] = jax.tree.map(jax.typeof, out)
      return jax.tree.map(lambda a: a[None], out)
    g = jax.jit(jax.shard_map(f, mesh=MESH2, in_specs=(spec, P("y"), spec), out_specs=spec))
    return g(u, v, i), g.lower(u, v, i).as_text()

  ours, text = run(hc, "ours")
  ref, _ = run(jax.lax, "lax")
  for k in ref:
    np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(ref[k]), err_msg=k)
    assert str(types["ours"][k]) == str(types["lax"][k]), (k, types["ours"][k], types["lax"][k])
  # f32 varying over x and y: a + b; f32 varying over y: c; int32: d; bf16: g.
  assert len(re.findall(target, text)) == {None: 4, "0": 5}[bucket], text


# ------------------------------------------------------------------- pmean / pmax / pmin
@pytest.mark.parametrize("op", ["pmean", "pmax", "pmin"])
@pytest.mark.parametrize("mesh,name", AXIS_CASES)
def test_pmean_pmax_pmin(mesh, name, op):
  """Equal to jax.lax's (values and types) on every dtype they take, on pytrees, and lowered
  to our copy engines only."""
  dtypes = {k: v for k, v in DTYPES.items()  # (complex numbers have no order)
            if k != "bool" and not jnp.issubdtype(v, jnp.complexfloating)}
  inputs = global_inputs(mesh, (2, 3), some_dtypes(name, op) if op == "pmean" else dtypes,
                         seed=11)
  ours = lambda t: getattr(hc, op)(t, name)  # noqa: E731
  lax = lambda t: getattr(jax.lax, op)(t, name)  # noqa: E731
  if op == "pmean":
    typed, ref = summing_refs(lax, promote_bool=False)
    got = run_compare(mesh, ours, typed, ref, inputs, summing=True, expect=["hoccl_all_gather"])
  else:
    got = run_compare(mesh, ours, lax, lax, inputs, expect=["hoccl_all_gather"])
  # Non-trivial data: the result is not every rank's own input.
  assert not np.array_equal(to_np(got["float32"]), to_np(inputs["float32"]))


def test_pmax_pmin_pmean_grad_vmap_and_errors():
  """pmean differentiates like jax.lax's; pmax, like jax.lax's, does not; vmap works;
  complex numbers have no order."""
  x = put(MESH1, rand(np.random.default_rng(12), (8 * 2, 3), jnp.float32))

  def smap(f, out_specs=P()):
    return jax.jit(jax.shard_map(f, mesh=MESH1, in_specs=P("x"), out_specs=out_specs))

  def grad_of(m):
    return smap(jax.grad(lambda v: jnp.sum(jnp.sin(m.pmean(v * v, "x")))), P("x"))(x)

  np.testing.assert_allclose(to_np(grad_of(hc)), to_np(grad_of(jax.lax)), rtol=1e-6, atol=1e-6)
  with pytest.raises(NotImplementedError):
    smap(jax.grad(lambda v: jnp.sum(hc.pmax(v, "x"))), P("x"))(x)
  for op in ("pmax", "pmin"):
    a = smap(jax.vmap(lambda v: getattr(hc, op)(v, "x"), in_axes=1, out_axes=1))(x)
    b = smap(jax.vmap(lambda v: getattr(jax.lax, op)(v, "x"), in_axes=1, out_axes=1))(x)
    np.testing.assert_array_equal(to_np(a), to_np(b))
  with pytest.raises(TypeError, match="complex"):
    smap(lambda v: hc.pmax(v.astype(jnp.complex64), "x")).lower(x)


def test_psum_of_constants_folds_like_lax():
  """psum(1, axis), the idiom for an axis size, is a Python int (usable in shapes) as with
  jax.lax, and constants fold at trace time: nothing is exchanged."""
  seen = {}

  def body(v):
    n, nn = hc.psum(1, "y"), hc.psum(1, ("x", "y"))
    seen.update(n=n, nn=nn, mean=hc.pmean(3.0, "y"), lax=jax.lax.psum(1, "y"),
                tree=hc.psum({"a": 2, "b": np.float32(0.5)}, "x"))
    return v.reshape(n, -1)[0]

  x = put(MESH2, np.arange(8 * 4, dtype=np.float32))
  f = jax.jit(jax.shard_map(body, mesh=MESH2, in_specs=P(("x", "y")), out_specs=P(("x", "y"))))
  text = f.lower(x).as_text()
  assert "hoccl_" not in text, text  # no exchange
  assert type(seen["n"]) is int and seen["n"] == seen["lax"] == 4 and seen["nn"] == 8
  assert seen["mean"] == 3.0 and seen["tree"]["a"] == 4 and float(seen["tree"]["b"]) == 1.0
  np.testing.assert_array_equal(to_np(f(x)), np.arange(32, dtype=np.float32)[::4])


def test_one_device_axis_costs_nothing():
  """Over a one-device axis nothing moves: every collective is jax.lax's (which XLA folds
  away), no jax_hoccl custom call, the same values and types."""
  mesh = jax.make_mesh((8, 1), ("x", "one"), devices=jax.devices("cpu")[:8])
  x = jax.device_put(np.arange(8 * 6, dtype=np.float32).reshape(8, 6), NamedSharding(mesh, P(("x", "one"))))
  cases = {
      "psum": lambda m, v: m.psum(v, "one"),
      "pmax": lambda m, v: m.pmax(v, "one"),
      "all_gather": lambda m, v: m.all_gather(v, "one", tiled=True),
      "psum_scatter": lambda m, v: m.psum_scatter(v, "one", tiled=True),
      "all_to_all": lambda m, v: m.all_to_all(v, "one", 0, 0, tiled=True),
      "ppermute": lambda m, v: m.ppermute(v, "one", [(0, 0)]),
  }
  for name, body in cases.items():
    spec = P(("x", "one"))
    run = lambda m: jax.jit(jax.shard_map(lambda v: body(m, v), mesh=mesh, in_specs=spec,  # noqa: E731
                                          out_specs=spec))
    ours, lax = run(hc), run(jax.lax)
    assert "hoccl_" not in ours.lower(x).as_text(), name
    np.testing.assert_array_equal(ours(x), lax(x), err_msg=name)


def test_vmap_axis_names_like_lax():
  """Collectives over a vmap(axis_name=...) axis, alone or mixed with mesh axes, inside
  shard_map and outside it: the same values as jax.lax (the vmap part never leaves the
  device); the mesh part of a sum still runs on jax_hoccl."""
  mesh = MESH1
  # Each device holds [1, 3, 3]: vmap over its 3 rows (axis "b"), each row of 3 elements.
  x = jax.device_put(np.random.default_rng(0).standard_normal((8, 3, 3)).astype(np.float32),
                     NamedSharding(mesh, P("x")))
  cases = {
      "psum b": lambda m, v: m.psum(v, "b"),
      "psum (b, x)": lambda m, v: m.psum(v, ("b", "x")),
      "pmean (x, b)": lambda m, v: m.pmean(v, ("x", "b")),
      "pmax (b, x)": lambda m, v: m.pmax(v, ("b", "x")),
      "all_gather b": lambda m, v: m.all_gather(v, "b"),
      "psum_scatter b": lambda m, v: m.psum_scatter(v, "b"),
      "all_to_all b": lambda m, v: m.all_to_all(v, "b", 0, 0),
      "ppermute b": lambda m, v: m.ppermute(v, "b", [(0, 1), (1, 2), (2, 0)]),
      "psum ()": lambda m, v: m.psum(v, ()),
  }
  for name, body in cases.items():
    def run(m):
      inner = jax.vmap(lambda v: body(m, v), axis_name="b")  # over the 3 rows of each shard
      return jax.jit(jax.shard_map(lambda v: inner(v[0])[None], mesh=mesh, in_specs=P("x"),
                                   out_specs=P("x"), check_vma=False))
    ours, lax = run(hc), run(jax.lax)
    np.testing.assert_allclose(ours(x), lax(x), rtol=1e-5, atol=1e-5, err_msg=name)
    if "x" in name:
      assert "hoccl_" in ours.lower(x).as_text(), name
  with pytest.raises(TypeError, match="list or a tuple"):  # as jax.lax: no one-shot iterators
    jax.jit(jax.shard_map(lambda v: hc.ppermute(v, "x", iter([(0, 1)])), mesh=mesh,
                          in_specs=P("x"), out_specs=P("x")))(x)
  # Outside shard_map: only vmap axes.
  v = jnp.arange(12.0).reshape(4, 3)
  np.testing.assert_allclose(jax.vmap(lambda r: hc.psum(r, "b"), axis_name="b")(v),
                             jax.vmap(lambda r: jax.lax.psum(r, "b"), axis_name="b")(v))


def test_vmap_axis_names_under_check_vma_are_a_clear_error():
  """The same collectives under shard_map(check_vma=True): jax.lax fails (a ValueError over
  mixed axes, a bare AssertionError over the vmap axis alone); jax_hoccl raises a ValueError
  that names the vmap axis and says what to do, instead of a bare AssertionError."""
  x = jax.device_put(np.random.default_rng(0).standard_normal((8, 3, 3)).astype(np.float32),
                     NamedSharding(MESH1, P("x")))
  cases = {
      "psum": lambda m, v: m.psum(v, ("b", "x")),
      "psum b": lambda m, v: m.psum(v, "b"),
      "pmean": lambda m, v: m.pmean(v, ("x", "b")),
      "pmax": lambda m, v: m.pmax(v, ("b", "x")),
      "pmin": lambda m, v: m.pmin(v, ("b", "x")),
      "all_gather": lambda m, v: m.all_gather(v, "b"),
      "psum_scatter": lambda m, v: m.psum_scatter(v, "b"),
      "all_to_all": lambda m, v: m.all_to_all(v, "b", 0, 0),
      "ppermute": lambda m, v: m.ppermute(v, "b", [(0, 1), (1, 2), (2, 0)]),
  }
  for name, body in cases.items():
    def run(m, body=body):
      inner = jax.vmap(lambda v: body(m, v), axis_name="b")
      return jax.jit(jax.shard_map(lambda v: inner(v[0])[None], mesh=MESH1, in_specs=P("x"),
                                   out_specs=P("x"), check_vma=True))(x)
    with pytest.raises((ValueError, AssertionError)):  # jax.lax fails here too
      run(jax.lax)
    with pytest.raises(ValueError, match="names the jax.vmap axis 'b'.*check_vma=False") as e:
      run(hc)
    assert f"jax_hoccl.{name.split()[0]}" in str(e.value), (name, str(e.value))


# ------------------------------------------------------------------------- special values
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_pmax_pmin_propagate_nan_and_psum_keeps_negative_zero(dtype):
  """Decided in docs/supported.md: pmax/pmin propagate NaN like jnp.max (jax.lax on XLA:CPU returns the
  other value), psum of all -0.0 is -0.0 (jax.lax on XLA:CPU gives +0.0); elsewhere equal to
  jax.lax. The reference is numpy on the gathered blocks (np.sum would start from +0.0)."""
  dt = DTYPES[dtype]
  rng = np.random.default_rng(80)
  host = rand(rng, (8 * 2, 4), dt)
  host[3, 1] = host[9, 2] = host[14, 0] = np.nan
  x = put(MESH1, host, P("x"))
  zeros = put(MESH1, np.full((8 * 2, 4), -0.0, dtype=dt), P("x"))

  def body(a, z):
    return (hc.pmax(a, "x"), hc.pmin(a, "x"), jax.lax.pmax(a, "x"), hc.psum(z, "x"),
            jax.lax.psum(z, "x"))

  f = jax.jit(jax.shard_map(body, mesh=MESH1, in_specs=(P("x"), P("x")), out_specs=P()))
  with hc.psum_algorithm("two_step"):
    two = jax.jit(jax.shard_map(lambda z: hc.psum(z, "x"), mesh=MESH1, in_specs=P("x"),
                                out_specs=P()))(zeros)
  mx, mn, lax_mx, zsum, lax_zsum = map(to_np, f(x, zeros))
  blocks = host.reshape(8, 2, 4).astype(np.float32)
  np.testing.assert_array_equal(mx.astype(np.float32), blocks.max(0))  # NaN where any NaN
  np.testing.assert_array_equal(mn.astype(np.float32), blocks.min(0))
  nan = np.isnan(blocks).any(0)
  assert nan.sum() == 3 and np.isnan(mx[nan]).all() and np.isnan(mn[nan]).all()
  np.testing.assert_array_equal(mx[~nan], lax_mx[~nan])  # elsewhere: jax.lax's
  for got in (zsum, to_np(two)):
    assert (got == 0).all() and np.signbit(got).all()  # -0.0: a left fold of the ranks' -0.0
  assert np.signbit(functools.reduce(np.add, np.full(8, -0.0, dtype=np.float32)))
  # What docs/supported.md says jax.lax does on XLA:CPU (if jax changes it, update it).
  assert (lax_zsum == 0).all() and not np.signbit(lax_zsum).any()
  assert not np.isnan(lax_mx[nan]).any()
