"""axis_index_groups: collectives over subgroups of a mesh axis, against jax.lax on random
data. Even groups run on jax_hoccl's movers over the subgroups (the group table passed to
C++ holds them); groups of unequal sizes, which jax.lax allows for its reductions only, sum
or reduce my group's blocks of the whole axis. Where jax.lax refuses groups, so does jax_hoccl.
"""
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_hoccl as hc
from conftest import (MESH1, MESH2, all_axes_spec, assert_lowers_to_ours, assert_same,
                      assert_sum_matches, global_inputs, to_np)

# (mesh, axis_name, groups): contiguous, strided, listed out of order, over two axes, over
# the second axis of a 2-D mesh.
EVEN = [
    pytest.param(MESH1, "x", [[0, 1, 2, 3], [4, 5, 6, 7]], id="halves"),
    pytest.param(MESH1, "x", [[0, 2], [1, 3], [4, 6], [5, 7]], id="strided"),
    pytest.param(MESH1, "x", [[3, 1, 0, 2], [7, 5, 4, 6]], id="out-of-order"),
    pytest.param(MESH2, ("x", "y"), [[0, 1, 4, 5], [2, 3, 6, 7]], id="2d-xy"),
    pytest.param(MESH2, "y", [[0, 2], [1, 3]], id="2d-y"),
]
UNEVEN = [
    pytest.param(MESH1, "x", [[0, 1, 2], [3, 4, 5, 6, 7]], id="3+5"),
    pytest.param(MESH1, "x", [[6], [0, 7, 2], [1, 3, 4, 5]], id="1+3+4"),
]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int32": jnp.int32}


def _low(leaf):
  return leaf.dtype in (jnp.bfloat16, jnp.float16)


# name -> (ours, lax, summing, check_vma): lax's gets the same arguments. Sums of bf16 are
# compared with lax's sum of the same values in f32 (jax_hoccl accumulates in f32).
def _ops(groups):
  kw = dict(axis_index_groups=groups)
  return {
      "psum": (lambda x, a: hc.psum(x, a, **kw), lambda x, a: jax.lax.psum(x, a, **kw), True,
               False),
      "pmax": (lambda x, a: hc.pmax(x, a, **kw), lambda x, a: jax.lax.pmax(x, a, **kw), False,
               True),
      "pmin": (lambda x, a: hc.pmin(x, a, **kw), lambda x, a: jax.lax.pmin(x, a, **kw), False,
               False),
      "all_gather": (lambda x, a: hc.all_gather(x, a, axis=1, **kw),
                     lambda x, a: jax.lax.all_gather(x, a, axis=1, **kw), False, True),
      "all_gather_tiled": (lambda x, a: hc.all_gather(x, a, tiled=True, **kw),
                           lambda x, a: jax.lax.all_gather(x, a, tiled=True, **kw), False, True),
      "psum_scatter": (lambda x, a: hc.psum_scatter(x, a, tiled=True, **kw),
                       lambda x, a: jax.lax.psum_scatter(x, a, tiled=True, **kw), True, True),
      "all_to_all": (lambda x, a: hc.all_to_all(x, a, 0, 1, tiled=True, **kw),
                     lambda x, a: jax.lax.all_to_all(x, a, 0, 1, tiled=True, **kw), False, True),
  }


def _run(mesh, body, inputs, check_vma, out_specs=None):
  spec = all_axes_spec(mesh)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec,
                            out_specs=spec if out_specs is None else out_specs,
                            check_vma=check_vma))
  return f(inputs)


def _compare(mesh, name, ours, lax, summing, check_vma, inputs):
  def body(tree):
    o = jax.tree.map(lambda l: ours(l, name), tree)
    r = jax.tree.map(lambda l: lax(l.astype(jnp.float32) if summing and _low(l) else l, name),
                     tree)
    return o, r

  spec = all_axes_spec(mesh)
  got, ref = _run(mesh, body, inputs, check_vma, out_specs=(spec, spec))
  for k in inputs:
    if summing:
      assert_sum_matches(got[k], ref[k], name=k)
    else:
      assert_same(got[k], ref[k], exact=True, name=k)
  return got


@pytest.mark.parametrize("op", list(_ops(None)))
@pytest.mark.parametrize("mesh,name,groups", EVEN)
def test_even_groups_like_lax(mesh, name, groups, op):
  ours, lax, summing, check_vma = _ops(groups)[op]
  g = len(groups[0])
  inputs = global_inputs(mesh, (2 * g, 3), DTYPES, seed=len(op) + g)
  got = _compare(mesh, name, ours, lax, summing, check_vma, inputs)
  # Results differ between groups (the test would pass with no groups at all otherwise).
  blocks = to_np(got["float32"]).reshape(mesh.size, -1)
  assert not all(np.array_equal(blocks[0], b) for b in blocks[1:])
  spec = all_axes_spec(mesh)
  text = assert_lowers_to_ours(
      jax.shard_map(lambda t: jax.tree.map(lambda l: ours(l, name), t), mesh=mesh,
                    in_specs=spec, out_specs=spec, check_vma=check_vma), inputs)
  assert f"group_size = {g} : i64" in text  # the subgroups, not the whole axis


@pytest.mark.parametrize("mesh,name,groups", EVEN[:2])
def test_even_groups_psum_two_step_and_pmean(mesh, name, groups):
  inputs = global_inputs(mesh, (8, 3), {"float32": jnp.float32, "int32": jnp.int32}, seed=3)
  kw = dict(axis_index_groups=groups)
  with hc.psum_algorithm("two_step"):
    _compare(mesh, name, lambda x, a: hc.psum(x, a, **kw),
             lambda x, a: jax.lax.psum(x, a, **kw), True, False, inputs)
  got = _compare(mesh, name, lambda x, a: hc.pmean(x, a, **kw),
                 lambda x, a: jax.lax.pmean(x, a, **kw), False, False, inputs)
  assert got["int32"].dtype == jnp.float32  # integers become floats, like jax.lax


@pytest.mark.parametrize("op", ["psum", "pmax", "pmin"])
@pytest.mark.parametrize("mesh,name,groups", UNEVEN)
def test_uneven_groups_like_lax(mesh, name, groups, op):
  ours, lax, summing, check_vma = _ops(groups)[op]
  inputs = global_inputs(mesh, (2, 3), DTYPES, seed=11)
  _compare(mesh, name, ours, lax, summing, check_vma, inputs)
  lowered = assert_lowers_to_ours(
      jax.shard_map(lambda t: ours(t, name), mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=check_vma), inputs["float32"])
  assert "hoccl_all_gather" in lowered


@pytest.mark.parametrize("mesh,name,groups", UNEVEN)
def test_uneven_groups_pmean_divides_by_its_own_group(mesh, name, groups):
  """jax.lax 0.11.2 divides every group's sum by the first group's size; jax_hoccl by each
  group's own size (docs/supported.md)."""
  inputs = global_inputs(mesh, (2, 3), {"float32": jnp.float32}, seed=12)
  kw = dict(axis_index_groups=groups)
  sizes = {i: len(g) for g in groups for i in g}

  def body(x):
    ours = hc.pmean(x, name, **kw)
    ref = jax.lax.psum(x, name, **kw) / jnp.asarray(
        [sizes[i] for i in range(8)], jnp.float32)[jax.lax.axis_index(name)]
    return ours, ref

  got, ref = _run(mesh, body, inputs["float32"], False, out_specs=(P("x"), P("x")))
  np.testing.assert_allclose(to_np(got), to_np(ref), rtol=1e-6, atol=1e-6)


def test_gradients_through_groups_like_lax():
  groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
  x = global_inputs(MESH1, (4, 3), {"f": jnp.float32}, seed=13)["f"]
  for check_vma, fn in ((False, "psum"), (True, "all_gather"), (True, "psum_scatter"),
                        (True, "all_to_all")):
    ours, lax, _, _ = _ops(groups)["all_gather_tiled" if fn == "all_gather" else fn]

    def loss(impl):
      def per_device(v):
        y = impl(v, "x")
        return jax.lax.psum(jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape)), "x")
      return jax.shard_map(per_device, mesh=MESH1, in_specs=P("x"), out_specs=P(),
                           check_vma=check_vma)

    g_ours = jax.jit(jax.grad(loss(ours)))(x)
    g_lax = jax.jit(jax.grad(loss(lax)))(x)
    np.testing.assert_allclose(to_np(g_ours), to_np(g_lax), rtol=1e-5, atol=1e-5, err_msg=fn)


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter", "all_to_all"])
def test_uneven_groups_refused_where_lax_cannot_lower_them(op):
  groups = [[0, 1, 2], [3, 4, 5, 6, 7]]
  x = global_inputs(MESH1, (30, 3), {"f": jnp.float32}, seed=14)["f"]
  ours, lax, _, check_vma = _ops(groups)[op]
  with pytest.raises(ValueError):  # jax.lax: a verifier error or a size error
    _run(MESH1, lambda v: lax(v, "x"), x, check_vma)
  with pytest.raises(ValueError, match=rf"jax_hoccl.{op}: axis_index_groups must all have "
                     "the same size"):
    _run(MESH1, lambda v: ours(v, "x"), x, check_vma)


@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_sums_over_groups_need_check_vma_false_like_lax(op):
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  x = global_inputs(MESH1, (2, 3), {"f": jnp.float32}, seed=15)["f"]
  with pytest.raises(NotImplementedError):
    _run(MESH1, lambda v: getattr(jax.lax, op)(v, "x", axis_index_groups=groups), x, True)
  with pytest.raises(NotImplementedError, match=rf"jax_hoccl.{op}: axis_index_groups need "
                     r"shard_map\(\.\.\., check_vma=False\)"):
    _run(MESH1, lambda v: getattr(hc, op)(v, "x", axis_index_groups=groups), x, True)


def test_groups_must_cover_the_axis_once():
  x = global_inputs(MESH1, (4, 3), {"f": jnp.float32}, seed=16)["f"]
  for bad in ([[0, 1, 2, 3]], [[0, 1, 2, 3], [3, 4, 5, 6, 7]], [[0, 1, 2, 3], [4, 5, 6, 8]]):
    for op in ("psum", "pmax", "all_gather"):
      with pytest.raises(ValueError, match=rf"jax_hoccl.{op}: axis_index_groups must cover "
                         "all indices exactly once"):
        _run(MESH1, lambda v: getattr(hc, op)(v, "x", axis_index_groups=bad), x, False)


def test_grouped_results_are_typed_varying():
  """A result over groups differs between groups, so it stays varying over the axis:
  out_specs=P() is refused (jax.lax's pmax types it invariant and returns device 0's)."""
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  x = global_inputs(MESH1, (2, 3), {"f": jnp.float32}, seed=17)["f"]
  for fn in (lambda v: hc.pmax(v, "x", axis_index_groups=groups),
             lambda v: hc.all_gather(v, "x", axis_index_groups=groups, to="invarying")):
    types = []
    _run(MESH1, lambda v: (types.append(jax.typeof(fn(v))), fn(v))[1], x, True)
    assert "V:x" in str(types[0]), types[0]
    with pytest.raises(ValueError):
      _run(MESH1, fn, x, True, out_specs=P())
