"""Reduced and unreduced manual-axis types (check_vma=True, Explicit meshes), as jax.lax 0.11.2
takes and makes them: psum / pmean / pmax / pmin / psum_scatter of an unreduced input,
all_gather(..., to="reduced"), their gradients, pytrees mixing types, and the errors jax.lax
also raises. Each result and its type are compared with jax.lax's on random data, and each
program must lower to jax_hoccl's custom calls and none of XLA's collectives.
"""
import numpy as np
import pytest
import jax
import jax.extend.core
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, UnreducedKind

import jax_hoccl as hc
from jax_hoccl._src import jax_internals as ji
from conftest import CPUS, NDEV, assert_lowers_to_ours, assert_same, assert_sum_matches, rand

MESH = jax.make_mesh((2, 4), ("x", "y"), devices=CPUS[:NDEV],
                     axis_types=(AxisType.Explicit, AxisType.Explicit))
ALL = P(("x", "y"))
AXES = [pytest.param("y", id="y"), pytest.param("x", id="x"),
        pytest.param(("x", "y"), id="xy")]


def others(axes):
  axes = axes if isinstance(axes, tuple) else (axes,)
  rest = tuple(a for a in MESH.axis_names if a not in axes)
  return P(rest if len(rest) > 1 else rest[0]) if rest else P()


def put(x, spec=ALL):
  return jax.device_put(x, NamedSharding(MESH, spec))


def run_both(body, out_specs, *args, in_specs=ALL, route_ours=False):
  """body(lib, *args) inside shard_map with lib = jax.lax and jax_hoccl: (ours, lax's, our
  output type, lax's output type). Ours must lower to jax_hoccl only (with route_ours, JAX's
  own psums in it are routed to jax_hoccl, jax.lax's run staying XLA's)."""
  results, types = {}, {}
  for name, lib in (("lax", jax.lax), ("ours", hc)):
    def fn(*a, lib=lib, name=name):
      out = body(lib, *a)
      types[name] = jax.tree.map(lambda v: str(jax.typeof(v)), out)
      return out
    f = jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=in_specs, out_specs=out_specs))
    was = hc.route_collectives(route_ours and name == "ours")
    try:
      with jax.set_mesh(MESH):
        if name == "ours":
          assert_lowers_to_ours(f, *args)
        results[name] = f(*args)
    finally:
      hc.route_collectives(was)
  return results["ours"], results["lax"], types["ours"], types["lax"]


def unreduced(a, axes):
  return jax.lax.pcast(a, axes, to="unreduced")


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_psum_pmean_of_unreduced(axes, dtype, op):
  x = put(rand(np.random.default_rng(1), (16, 24), dtype))
  body = lambda lib, a: getattr(lib, op)(unreduced(a, axes), axes)  # noqa: E731
  ours, ref, t_ours, t_ref = run_both(body, others(axes), x)
  assert t_ours == t_ref
  if dtype == "bfloat16":  # ours accumulates bf16 in f32 and rounds once
    _, ref, _, _ = run_both(body, others(axes), x.astype(jnp.float32))
    if op == "psum":
      assert_sum_matches(ours, ref)
    else:
      np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref), rtol=1e-2)
  elif op == "psum":
    assert_sum_matches(ours, ref)
  else:
    assert_same(ours, ref, exact=False)


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("tiled,dim", [(True, 0), (True, 1), (False, 0)])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_psum_scatter_of_unreduced(axes, tiled, dim, dtype):
  n = int(np.prod([MESH.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
  local = (n, 6) if not tiled else ((2 * n, 6) if dim == 0 else (4, 2 * n))
  x = put(rand(np.random.default_rng(2), (local[0] * NDEV, local[1]), dtype))

  def body(lib, a):
    return lib.psum_scatter(unreduced(a, axes), axes, scatter_dimension=dim, tiled=tiled)

  ours, ref, t_ours, t_ref = run_both(body, ALL, x)
  assert t_ours == t_ref
  assert_sum_matches(ours, ref)


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("tiled,axis", [(True, 0), (True, 1), (False, 0), (False, 2)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_gather_to_reduced(axes, tiled, axis, dtype):
  x = put(rand(np.random.default_rng(3), (4 * NDEV, 6), dtype))
  seen = {}

  def body(lib, a):
    g = lib.all_gather(a, axes, axis=axis, tiled=tiled, to="reduced")
    seen[lib.__name__] = str(jax.typeof(g))
    return jax.lax.pcast(g, axes, to="varying")  # reduced -> varying, to return it

  ours, ref, _, _ = run_both(body, ALL, x)
  assert seen["jax_hoccl"] == seen["jax.lax"] and "R:" in seen["jax_hoccl"], seen
  assert_same(ours, ref)


@pytest.mark.parametrize("op,kind", [("pmax", UnreducedKind.max), ("pmin", UnreducedKind.min)])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_pmax_pmin_of_unreduced(op, kind, dtype):
  """An input unreduced waiting for a max (min): lax.reduce_max with an unreduced out_sharding
  on an Explicit mesh, passed to shard_map as such."""
  spec = P(None, unreduced={"y"}, unreduced_kind=kind)
  reduce = jax.lax.reduce_max if op == "pmax" else jax.lax.reduce_min
  x = rand(np.random.default_rng(4), (4, 3, 16), dtype)
  with jax.set_mesh(MESH):
    partial = jax.jit(lambda a: reduce(a, (0,), out_sharding=NamedSharding(MESH, spec)))(
        put(x, P("y")))
  ours, ref, t_ours, t_ref = run_both(lambda lib, a: getattr(lib, op)(a, "y"), P(), partial,
                                      in_specs=spec)
  assert t_ours == t_ref
  assert_same(ours, ref)
  assert_same(ours, (x.max if op == "pmax" else x.min)(axis=0))


def test_pytree_of_unreduced_and_varying_leaves():
  """Leaves of other types go to other buckets: a dict of unreduced and varying leaves."""
  rng = np.random.default_rng(5)
  x, y = put(rand(rng, (16, 8), np.float32)), put(rand(rng, (16, 4), np.float32))

  def body(lib, a, b):
    return lib.psum({"u": unreduced(a, "y"), "v": b, "u2": unreduced(2 * a, "y")}, "y")

  ours, ref, t_ours, t_ref = run_both(body, others("y"), x, y, in_specs=(ALL, ALL))
  assert t_ours == t_ref
  for k in ref:
    assert_sum_matches(ours[k], ref[k], name=k)


def _grad_cases():
  def psum_loss(lib, a):
    return lib.psum(jnp.sum(jnp.sin(lib.psum(unreduced(a, "y"), "y")) ** 2), "x")

  def psum_scatter_loss(lib, a):
    s = lib.psum_scatter(unreduced(jnp.tile(a, (4, 1)), "y"), "y", tiled=True)
    return lib.psum(jnp.sum(s ** 3), ("x", "y"))

  def gathered_weight_loss(lib, a, w):  # FSDP: weights gathered reduced, grads scattered
    wf = lib.all_gather(w, "y", axis=1, tiled=True, to="reduced")
    h = a @ jax.lax.pcast(wf, "y", to="varying")
    return lib.psum(jnp.sum(jnp.tanh(h)), ("x", "y"))

  return [pytest.param(psum_loss, False, id="psum"),
          pytest.param(psum_scatter_loss, False, id="psum_scatter"),
          pytest.param(gathered_weight_loss, True, id="all_gather_reduced")]


@pytest.mark.parametrize("loss,with_weight", _grad_cases())
def test_gradients_equal_lax(loss, with_weight):
  rng = np.random.default_rng(6)
  a = put(rand(rng, (16, 12), np.float32))
  if with_weight:
    # w is replicated over "x": its gradient's sum over "x" is JAX's own (the transpose of
    # an implicit pvary), which route_collectives puts on jax_hoccl.
    w = put(rand(rng, (12, 8), np.float32), P(None, "y"))
    body = lambda lib, a, w: jax.grad(lambda w: loss(lib, a, w))(w)  # noqa: E731
    ours, ref, t_ours, t_ref = run_both(body, P(None, "y"), a, w,
                                        in_specs=(ALL, P(None, "y")), route_ours=True)
  else:
    body = lambda lib, a: jax.grad(lambda a: loss(lib, a))(a)  # noqa: E731
    ours, ref, t_ours, t_ref = run_both(body, ALL, a)
  assert t_ours == t_ref
  assert_same(ours, ref, exact=False)
  assert float(np.abs(np.asarray(ref)).max()) > 0


def _trace(body, check_vma=True):
  x = put(rand(np.random.default_rng(7), (16, 8), np.float32))
  f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=ALL, out_specs=ALL, check_vma=check_vma))
  with jax.set_mesh(MESH):
    return f.trace(x)


@pytest.mark.parametrize("body,match", [
    (lambda a: hc.all_gather(unreduced(a, "y"), "y"), r"jax_hoccl\.all_gather.*unreduced"),
    (lambda a: hc.ppermute(unreduced(a, "y"), "y", [(0, 1)]), r"jax_hoccl\.ppermute.*unreduced"),
    (lambda a: hc.all_to_all(unreduced(a, "y"), "y", 0, 0, tiled=True),
     r"jax_hoccl\.all_to_all.*unreduced"),
    (lambda a: hc.psum(hc.all_gather(a, "y", tiled=True, to="reduced"), "y"),
     r"jax_hoccl\.psum.*reduced over"),
    (lambda a: hc.psum(unreduced(a, "y"), ("x", "y")), r"jax_hoccl\.psum.*different axes"),
    (lambda a: hc.pmax(unreduced(a, "y"), "y"), r"jax_hoccl\.pmax.*unreduced_kind=max"),
    (lambda a: hc.psum_start(unreduced(a, "y"), "y"), r"jax_hoccl\.psum_start.*unreduced"),
], ids=["all_gather", "ppermute", "all_to_all", "psum_of_reduced", "mixed_axes",
        "pmax_of_sum_kind", "psum_start"])
def test_what_lax_refuses_is_an_error(body, match):
  with pytest.raises(ValueError, match=match):
    _trace(body)


def test_reduced_needs_types():
  with pytest.raises(ValueError, match="to='reduced' needs shard_map\\(check_vma=True\\)"):
    _trace(lambda a: hc.all_gather(a, "y", to="reduced"), check_vma=False)
  with pytest.raises(NotImplementedError, match="all_gather_start: to='reduced'"):
    _trace(lambda a: hc.all_gather_start(a, "y", to="reduced"))


# FSDP: a weight reduced over a data axis, gathered over another axis. Its cotangent is
# unreduced over the data axis all the way back; the pcast's transpose (jax.lax's
# unreduced_psum) sums it, so these programs hold one XLA collective, in both runs.
FSDP_MESH = jax.make_mesh((4, 2), ("data", "seq"), devices=CPUS[:NDEV],
                          axis_types=(AxisType.Explicit, AxisType.Explicit))


def _fsdp_gather_grad(lib, form):
  mesh = FSDP_MESH

  @jax.shard_map(mesh=mesh, in_specs=P("seq", None), out_specs=P("seq", None, reduced={"data"}))
  def to_reduced(a):
    return jax.lax.pcast(a, axis_name="data", to="reduced")

  def gathered(a):
    return lib.all_gather(a, axis_name="seq", tiled=True, to="reduced")

  if form == "custom_vjp":  # the user's own rule: the gather's cotangent reduce-scattered
    gathered = jax.custom_vjp(gathered)
    gathered.defvjp(lambda a: (gathered(a), None),
                    lambda _, ct: (lib.psum_scatter(ct, "seq", scatter_dimension=0,
                                                    tiled=True),))

  gather = jax.shard_map(gathered, mesh=mesh, in_specs=P("seq", None, reduced={"data"}),
                         out_specs=P(None, None, reduced={"seq", "data"}))
  f = lambda x, w: jnp.einsum("btd,df->btf", x, gather(to_reduced(w)))  # noqa: E731
  return jax.jit(jax.grad(lambda x, w: jnp.sin(f(x, w)).sum(), argnums=(0, 1)))


def _eqn_names(jaxpr, out):
  for e in jaxpr.eqns:
    out.append((e.primitive.name, e.params))
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      _eqn_names(sub, out)
  return out


@pytest.mark.parametrize("form", ["plain", "custom_vjp"])
def test_fsdp_gather_gradient_equals_lax(form):
  rng = np.random.default_rng(8)
  mesh = FSDP_MESH
  x = jax.device_put(rand(rng, (8, 4, 2), np.float32), NamedSharding(mesh, P("data", "seq", None)))
  w = jax.device_put(rand(rng, (2, 6), np.float32), NamedSharding(mesh, P("seq", None)))
  with jax.set_mesh(mesh):
    want = _fsdp_gather_grad(jax.lax, form)(x, w)
    f = _fsdp_gather_grad(hc, form)
    got = f(x, w)
    eqns = _eqn_names(f.trace(x, w).jaxpr.jaxpr, [])
  for g, r, name in zip(got, want, ("dx", "dw")):
    assert g.sharding.spec == r.sharding.spec, (name, g.sharding.spec, r.sharding.spec)
    assert_same(g, r, exact=False, name=name)
    assert float(np.abs(np.asarray(r)).max()) > 0
  # The gradient of w: our reduce-scatter of the unreduced cotangent, then the unreduced psum.
  names = [n for n, _ in eqns]
  assert any(n == "hoccl_reduce_scatter" and p["unreduced"] for n, p in eqns), names
  assert "unreduced_psum" in names, names
  assert "hoccl_all_gather" in names, names


def _reduced_weight_ops():
  perm = [(i, (i + 1) % 4) for i in range(4)]
  varying = lambda v: jax.lax.pcast(v, "y", to="varying")  # noqa: E731
  return {
      "all_gather": lambda lib, v: lib.all_gather(v, "y", axis=1, tiled=True),
      "all_gather_untiled": lambda lib, v: jnp.moveaxis(lib.all_gather(v, "y"), 0, 1).reshape(
          v.shape[0], -1),
      "all_gather_reduced": lambda lib, v: varying(
          lib.all_gather(v, "y", axis=1, tiled=True, to="reduced")),
      "psum": lambda lib, v: jnp.tile(varying(lib.psum(v, "y")), (1, 4)),
      "psum_scatter": lambda lib, v: jnp.tile(lib.psum_scatter(v, "y", tiled=True), (4, 4)),
      "all_to_all": lambda lib, v: jnp.tile(
          lib.all_to_all(v, "y", 0, 1, tiled=True).reshape(v.shape[0], -1), (1, 4)),
      "ppermute": lambda lib, v: jnp.tile(lib.ppermute(v, "y", perm), (1, 4)),
  }


@pytest.mark.parametrize("op", list(_reduced_weight_ops()))
def test_gradient_of_a_weight_reduced_over_another_axis(op):
  """The op over "y" of a weight reduced over "x": its transpose gets a cotangent unreduced
  over "x", which it must leave unreduced (jax.lax's pcast transpose sums it)."""
  fn = _reduced_weight_ops()[op]
  rng = np.random.default_rng(9)
  a = put(rand(rng, (16, 8), np.float32))
  w = put(rand(rng, (8, 8), np.float32), P(None, "y"))

  def run(lib):
    def body(a, w):
      def loss(w):
        h = a @ fn(lib, jax.lax.pcast(w, "x", to="reduced"))
        return jax.lax.psum(jnp.sum(jnp.tanh(h)), ("x", "y"))
      return jax.grad(loss)(w)
    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(ALL, P(None, "y")),
                              out_specs=P(None, "y")))
    with jax.set_mesh(MESH):
      return f(a, w)

  ours, ref = run(hc), run(jax.lax)
  assert_same(ours, ref, exact=False)
  assert float(np.abs(np.asarray(ref)).max()) > 0


@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather", "all_to_all", "ppermute"])
def test_input_unreduced_over_another_axis(op):
  """The op over "y" of a value unreduced over "x" keeps it unreduced over "x"; summed over
  "x" afterwards it equals jax.lax's."""
  fn = {"psum": lambda lib, u: lib.psum(u, "y"),
        "psum_scatter": lambda lib, u: lib.psum_scatter(u, "y", tiled=True),
        "all_gather": lambda lib, u: lib.all_gather(u, "y", tiled=True),
        "all_to_all": lambda lib, u: lib.all_to_all(u, "y", 0, 0, tiled=True),
        "ppermute": lambda lib, u: lib.ppermute(u, "y", [(i, (i + 1) % 4) for i in range(4)]),
        }[op]
  x = put(rand(np.random.default_rng(10), (32, 8), np.float32))

  def body(lib, a):
    r = fn(lib, unreduced(a, "x"))
    assert "x" in ji.unreduced_axes(jax.typeof(r))
    r = jax.lax.psum(r, "x")
    return r if "y" in ji.varying_axes(jax.typeof(r)) else jax.lax.pcast(r, "y", to="varying")

  results = {}
  for name, lib in (("lax", jax.lax), ("ours", hc)):
    f = jax.jit(jax.shard_map(lambda a, lib=lib: body(lib, a), mesh=MESH, in_specs=ALL,
                              out_specs=P("y")))
    with jax.set_mesh(MESH):
      results[name] = f(x)
  assert_same(results["ours"], results["lax"], exact=False)
