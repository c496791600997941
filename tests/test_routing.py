"""jax_hoccl.route_collectives(): jax.lax's collectives inside shard_map, written by the user or
inserted by JAX (transposes), lower to jax_hoccl's; values equal the unrouted program's on
random data; off again, XLA's collectives are back. Where jax_hoccl has nothing to do (a
one-device axis) the collective stays XLA's and nothing recurses."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl as hc
from conftest import CPUS, XLA_COLLECTIVES

MESH = jax.make_mesh((2, 4), ("x", "y"), devices=CPUS[:8])
SHIFT = [(i, (i + 1) % 4) for i in range(4)]

CASES = {  # name: body over axis "y" (every result's leading dim laid out over both axes)
    "psum": lambda v: jax.lax.psum(v, "y"),
    "pmean": lambda v: jax.lax.pmean(v, "y"),
    "pmax": lambda v: jax.lax.pmax(v, "y"),
    "pmin": lambda v: jax.lax.pmin(v, ("y",)),
    "all_gather tiled axis 1": lambda v: jax.lax.all_gather(v, "y", axis=1, tiled=True),
    "all_gather stacked": lambda v: jax.lax.all_gather(v, "y"),
    "all_gather invarying": lambda v: jax.lax.all_gather(v, "y", tiled=True, to="invarying"),
    "psum_scatter tiled": lambda v: jax.lax.psum_scatter(v, "y", tiled=True),
    "psum_scatter dim 1": lambda v: jax.lax.psum_scatter(v, "y", scatter_dimension=1, tiled=True),
    "all_to_all tiled": lambda v: jax.lax.all_to_all(v, "y", 0, 1, tiled=True),
    "all_to_all untiled": lambda v: jax.lax.all_to_all(v.reshape(4, 2, 8), "y", 0, 2),
    "ppermute": lambda v: jax.lax.ppermute(v, "y", SHIFT),
    "grad of all_gather": lambda v: jax.grad(
        lambda v: jnp.sum(jnp.sin(jax.lax.all_gather(v, "y", tiled=True))))(v),
}


def _program(body, check_vma):
  return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P(("x", "y")),
                               out_specs=P(("x", "y")), check_vma=check_vma))


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=["f32", "i32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_routed_collective_equals_xla(name, dtype, check_vma):
  body = CASES[name]
  if dtype == np.int32 and name in ("pmean", "grad of all_gather"):
    pytest.skip("floats only")
  if name == "all_gather invarying" and not check_vma:
    pytest.skip("a type: check_vma=True only")
  rng = np.random.default_rng(11)
  x = jax.device_put((rng.standard_normal((8 * 8, 8)) * 8).astype(dtype),
                     NamedSharding(MESH, P(("x", "y"))))
  want = _program(body, check_vma)(x)
  assert any(c in _program(body, check_vma).lower(x).as_text()
             for c in XLA_COLLECTIVES)
  was = hc.route_collectives()
  try:
    routed = _program(body, check_vma)
    text = routed.lower(x).as_text()
    assert "hoccl_" in text, name
    for c in XLA_COLLECTIVES:
      assert c not in text, (name, c)
    got = routed(x)
  finally:
    hc.route_collectives(was)
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             rtol=1e-5, atol=1e-5)
  assert any(c in _program(body, check_vma).lower(x).as_text()
             for c in XLA_COLLECTIVES)  # off again: XLA's


def test_one_device_axis_stays_xla_and_does_not_recurse():
  mesh = jax.make_mesh((8, 1), ("x", "one"), devices=CPUS[:8])
  f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "one") + jax.lax.all_gather(
      v, "one", tiled=True), mesh=mesh, in_specs=P("x"), out_specs=P(("x", "one"))))
  x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("x")))
  was = hc.route_collectives()
  try:
    got = f(x)
    assert "hoccl_" not in f.lower(x).as_text()
  finally:
    hc.route_collectives(was)
  np.testing.assert_allclose(got, 2 * np.asarray(x))


def test_switch_reports_its_previous_state():
  was = hc.route_collectives()
  try:
    assert hc.route_collectives() is True        # already on
    assert hc.route_collectives(False) is True   # was on, now off
    assert hc.route_collectives(False) is False  # already off
  finally:
    hc.route_collectives(was)


def test_switch_applies_to_what_was_not_lowered_before():
  """route_collectives() applies to programs lowered after it, but for a function lowered
  (or run) before it with the same argument types: JAX's cache hands back the old lowering,
  even under a new jax.jit, as docs/supported.md says. Traced only, a function is routed."""
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(MESH, P(("x", "y"))))
  def make(k):
    return jax.shard_map(lambda v: jax.lax.psum(v, "y") + k, mesh=MESH, in_specs=P(("x", "y")),
                         out_specs=P(("x", "y")))
  was = hc.route_collectives(False)
  try:
    run_before, traced_before = make(1.0), make(2.0)
    jax.jit(run_before)(x)
    jax.jit(traced_before).trace(x)
    hc.route_collectives()
    assert "hoccl_" not in jax.jit(run_before).lower(x).as_text()   # the cached lowering
    assert "hoccl_" in jax.jit(run_before).lower(x[:, :4]).as_text()  # other types: new
    assert "hoccl_" in jax.jit(traced_before).lower(x).as_text()
    assert "hoccl_" in jax.jit(make(3.0)).lower(x).as_text()
  finally:
    hc.route_collectives(was)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_routed_collectives_in_rank_dependent_branches(check_vma, monkeypatch):
  """Each rank takes the branch its axis index picks, and the branches call jax.lax's
  collectives (two in one branch, in the order XLA might swap; a switch of three; a gradient,
  whose transpose JAX inserts): routed, the ranks meet across branches (branches.py pairs
  them, as it pairs jax_hoccl's own) and the values equal the unrouted program's."""
  monkeypatch.setenv("JAX_HOCCL_TIMEOUT_S", "30")  # a regression times out instead of hanging
  rng = np.random.default_rng(61)
  x = jax.device_put(rng.standard_normal((16, 8)).astype(np.float32),
                     NamedSharding(MESH, P(("x", "y"))))

  def body(v):
    r = jax.lax.axis_index("y")
    a, b = jax.lax.cond(r % 2 == 0,
                        lambda v: (jax.lax.psum(v, "y") * 2, jax.lax.ppermute(v, "y", SHIFT)),
                        lambda v: (jax.lax.psum(v + 0, "y") - 1,
                                   jax.lax.ppermute(v, "y", SHIFT) + 1), v)
    c = jax.lax.switch(r % 3, [lambda v: jax.lax.pmax(v, "y"),
                               lambda v: jax.lax.pmax(v, "y") * 3,
                               lambda v: jax.lax.pmax(v, "y") + 1], a + b)
    g = jax.lax.cond(r < 2, jax.grad(lambda v: jnp.sum(jax.lax.all_gather(v, "y", tiled=True)
                                                         ** 2)),
                     jax.grad(lambda v: jnp.sum(jnp.sin(jax.lax.all_gather(v, "y", tiled=True)))),
                     c)
    return a, b, c, g

  want = _program(body, check_vma)(x)
  was = hc.route_collectives()
  try:
    routed = _program(body, check_vma)
    text = routed.lower(x).as_text()
    for c in XLA_COLLECTIVES:
      assert c not in text, c
    got = routed(x)
  finally:
    hc.route_collectives(was)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_routed_psum_scatter_of_bool_fails_as_jax_lax():
  """jax.lax refuses a psum_scatter of bool (its sum does not take bool); routed, the same
  error, not a program that fails to verify (jax_hoccl would sum it as int32)."""
  x = jax.device_put(np.ones((64, 8), bool), NamedSharding(MESH, P(("x", "y"))))
  f = jax.shard_map(lambda v: jax.lax.psum_scatter(v, "y", tiled=True), mesh=MESH,
                    in_specs=P(("x", "y")), out_specs=P(("x", "y")))
  with pytest.raises(TypeError) as want:
    jax.jit(f)(x)
  was = hc.route_collectives()
  try:
    with pytest.raises(TypeError) as got:
      jax.jit(f).lower(x)
  finally:
    hc.route_collectives(was)
  assert str(got.value) == str(want.value)
