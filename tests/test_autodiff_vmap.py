"""Autodiff (grad, vjp, jvp) and vmap of every collective equal jax.lax's, with check_vma True
and False, on 1-D and 2-D meshes.

psum's transpose differs by mode (docs/design.md): with check_vma=True the cotangent of its
invariant output is pcast back to varying; with check_vma=False it is psum'ed. Comparing
against jax.lax in both modes catches either being wrong (e.g. gradients 8x too small).

Per-device buffers stay <= 512 bytes: a grad/jvp/vjp program holds several independent
collectives, which XLA:CPU would otherwise run concurrently (see test_programs.py).
"""
import contextlib

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_hoccl as hc
from conftest import MESH1, MESH2, axis_size, lax_ppermute_any_axis_order, put, rand, to_np


def lax_all_to_all(x, axis_name, split_axis, concat_axis, tiled=False):
  """jax.lax.all_to_all as reference. Its tiled=False transpose is broken in jax 0.11.2
  ("Expected cotangent type float32[1,2,8] but got float32[2,1,8]"), so untiled goes through
  the tiled op with the split axis moved to the front (same values, working transpose)."""
  if tiled:
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)
  s, c = split_axis % x.ndim, concat_axis % x.ndim
  y = jax.lax.all_to_all(jnp.moveaxis(x, s, 0), axis_name, 0, 0, tiled=True)
  return jnp.moveaxis(y, 0, c)


def lax_all_gather(x, axis_name, *, axis=0, tiled=False, to="varying"):
  """jax.lax.all_gather as reference. With to='invarying' and check_vma=False jax 0.11.2's
  gradient is wrong (it takes the local cotangent block without summing; finite differences
  agree with the varying form), so the reference is always the varying all_gather: the same
  values, and the true gradient in both modes."""
  del to
  return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


class _LaxRef:
  """jax.lax with the all_to_all and all_gather references above."""
  def __getattr__(self, name):
    return {"all_to_all": lax_all_to_all, "all_gather": lax_all_gather}.get(
        name, getattr(jax.lax, name))


LAX = _LaxRef()


def _perm(n, partial=False):
  rng = np.random.default_rng(100 + n)
  p = rng.permutation(n)
  pairs = [(i, int(p[i])) for i in range(n)]
  return pairs[: max(1, n // 2)] if partial else pairs


# name -> (op(module, axis_name) -> fn(x), local shape given the group size n)
OPS = {
    "psum": (lambda m, a, n: lambda x: m.psum(x, a), lambda n: (2, 4)),
    "psum_two_step": (lambda m, a, n: lambda x: m.psum(x, a), lambda n: (3, 3)),
    "all_gather": (lambda m, a, n: lambda x: m.all_gather(x, a, axis=1), lambda n: (2, 4)),
    "all_gather_tiled": (lambda m, a, n: lambda x: m.all_gather(x, a, axis=0, tiled=True),
                         lambda n: (2, 4)),
    "all_gather_invarying": (
        lambda m, a, n: lambda x: m.all_gather(x, a, axis=1, tiled=True, to="invarying"),
        lambda n: (2, 4)),
    "psum_scatter_tiled": (
        lambda m, a, n: lambda x: m.psum_scatter(x, a, scatter_dimension=0, tiled=True),
        lambda n: (2 * n, 2)),
    "psum_scatter": (lambda m, a, n: lambda x: m.psum_scatter(x, a, scatter_dimension=1),
                     lambda n: (2, n)),
    "all_to_all_tiled": (lambda m, a, n: lambda x: m.all_to_all(x, a, 0, 1, tiled=True),
                         lambda n: (2 * n, 2)),
    "all_to_all": (lambda m, a, n: lambda x: m.all_to_all(x, a, 1, 0), lambda n: (2, n)),
    "ppermute": (lambda m, a, n: lambda x: m.ppermute(x, a, _perm(n)), lambda n: (2, 4)),
    "ppermute_partial": (lambda m, a, n: lambda x: m.ppermute(x, a, _perm(n, partial=True)),
                         lambda n: (2, 4)),
}

AXES = [
    pytest.param(MESH1, "x", id="1d-x"),
    pytest.param(MESH2, "y", id="2d-y"),
    pytest.param(MESH2, ("y", "x"), id="2d-yx"),
]


def _algorithm(op):
  return hc.psum_algorithm("two_step" if op == "psum_two_step" else "one_shot")


def _spec(mesh):
  return P(tuple(mesh.axis_names)) if len(mesh.axis_names) > 1 else P(mesh.axis_names[0])


def _close(a, b, name):
  np.testing.assert_allclose(to_np(a), to_np(b), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("mesh,name", AXES)
@pytest.mark.parametrize("op", list(OPS))
def test_grad_vjp_jvp(op, mesh, name, check_vma):
  make, local = OPS[op]
  n = axis_size(mesh, name)
  spec = _spec(mesh)
  rng = np.random.default_rng(20)
  shape = local(n)
  x = put(mesh, rand(rng, (shape[0] * mesh.size, *shape[1:]), np.float32), spec)

  def program(m):
    f = jax.shard_map(make(m, name, n), mesh=mesh, in_specs=spec, out_specs=spec,
                      check_vma=check_vma)

    def run(x, w, t, ct):
      grad = jax.grad(lambda x: jnp.sum(jnp.sin(f(x)) * w))(x)
      primal, tangent = jax.jvp(f, (x,), (t,))
      _, pullback = jax.vjp(f, x)
      return grad, primal, tangent, pullback(ct)[0]
    return run

  out_shape = jax.eval_shape(jax.shard_map(make(LAX, name, n), mesh=mesh, in_specs=spec,
                                           out_specs=spec, check_vma=check_vma), x)
  w = put(mesh, rand(rng, out_shape.shape, np.float32), spec)
  ct = put(mesh, rand(rng, out_shape.shape, np.float32), spec)
  t = put(mesh, rand(rng, x.shape, np.float32), spec)
  ctx = lax_ppermute_any_axis_order() if name == ("y", "x") else contextlib.nullcontext()
  with _algorithm(op), ctx:
    ours_fn = jax.jit(program(hc))
    ours = ours_fn(x, w, t, ct)
    ref = jax.jit(program(LAX))(x, w, t, ct)
    text = ours_fn.lower(x, w, t, ct).as_text()
  # forward, transpose (except psum's pcast under check_vma), jvp primal and tangent
  assert text.count("custom_call @hoccl_") >= 3
  if not (check_vma and op in ("psum", "psum_two_step", "all_gather_invarying")):
    # (With check_vma, shard_map itself adds an all-reduce when transposing an out_specs
    # that names an axis the result is invariant over: jax's, not ours.)
    for xla_op in ("stablehlo.all_", "collective_permute", "reduce_scatter"):
      assert xla_op not in text, xla_op
  for what, a, b in zip(("grad", "jvp primal", "jvp tangent", "vjp"), ours, ref):
    _close(a, b, f"{op} {what}")
  # Not trivially zero: the cotangents really moved.
  assert np.abs(to_np(ours[3])).sum() > 0


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_psum_grad_with_replicated_out_specs(check_vma):
  """The realistic psum: out_specs=P(), loss on the replicated result."""
  rng = np.random.default_rng(21)
  x = put(MESH2, rand(rng, (16, 3), np.float32), P(("x", "y")))
  w = jnp.asarray(rand(rng, (2, 3), np.float32))

  def loss(m):
    f = jax.shard_map(lambda a: m.psum(a * a, ("x", "y")), mesh=MESH2,
                      in_specs=P(("x", "y")), out_specs=P(), check_vma=check_vma)
    return jax.jit(jax.grad(lambda x: jnp.sum(f(x) * w)))

  got, ref = loss(hc)(x), loss(jax.lax)(x)
  _close(got, ref, "grad")
  # d/dx sum(w * sum_devices x^2) = 2 x w (check_vma=True); lax's check_vma=False convention
  # is whatever lax does, compared above.
  if check_vma:
    _close(got, 2 * to_np(x) * np.tile(to_np(w), (8, 1)), "analytic")


def test_second_order_grad():
  """grad of grad through psum and ppermute (transposes of transposes)."""
  rng = np.random.default_rng(22)
  x = put(MESH1, rand(rng, (8, 2), np.float32), P("x"))
  perm = _perm(8)

  def make(m):
    f = jax.shard_map(lambda a: m.ppermute(m.psum(a ** 3, "x") * a, "x", perm), mesh=MESH1,
                      in_specs=P("x"), out_specs=P("x"))
    g = jax.grad(lambda x: jnp.sum(f(x)))
    return jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(g(x)))))

  _close(make(hc)(x), make(jax.lax)(x), "grad of grad")


# ----------------------------------------------------------------------------------- vmap
VMAP_OPS = {
    "psum": lambda m: lambda b: m.psum(b, "y"),
    "all_gather": lambda m: lambda b: m.all_gather(b, "y", axis=1),
    "all_gather_tiled": lambda m: lambda b: m.all_gather(b, "y", axis=0, tiled=True),
    "psum_scatter": lambda m: lambda b: m.psum_scatter(b, "y", scatter_dimension=0, tiled=True),
    "psum_scatter_d1": lambda m: lambda b: m.psum_scatter(b, "y", scatter_dimension=1),
    "all_to_all": lambda m: lambda b: m.all_to_all(b, "y", 0, 1, tiled=True),
    "all_to_all_untiled": lambda m: lambda b: m.all_to_all(b, "y", 1, 0),
    "ppermute": lambda m: lambda b: m.ppermute(b, "y", _perm(4)),
}


@pytest.mark.parametrize("in_axis", [0, 1, 2])
@pytest.mark.parametrize("op", list(VMAP_OPS))
def test_vmap_inside_shard_map(op, in_axis):
  """jax.vmap over an extra batch dimension (at several positions) of each collective,
  inside shard_map over the 2-D mesh's 'y' axis, equals lax's; so does grad of the vmap."""
  rng = np.random.default_rng(30)
  local = [4, 4]  # per example: dims of size 4 = |y| for the untiled ops
  local.insert(in_axis, 2)  # the batch dimension
  x = put(MESH2, rand(rng, (local[0] * 8, *local[1:]), np.float32), P(("x", "y")))

  def make(m):
    def body(a):
      return jax.vmap(VMAP_OPS[op](m), in_axes=in_axis, out_axes=0)(a)
    f = jax.shard_map(body, mesh=MESH2, in_specs=P(("x", "y")), out_specs=P(("x", "y")))
    return f

  def unrolled(m):
    """The definition of vmap, with lax's unbatched op (lax's own batching rule fails for
    e.g. psum_scatter(scatter_dimension=1) batched at the last axis)."""
    def body(a):
      return jnp.stack([VMAP_OPS[op](m)(jnp.take(a, i, axis=in_axis))
                        for i in range(a.shape[in_axis])])
    return jax.shard_map(body, mesh=MESH2, in_specs=P(("x", "y")), out_specs=P(("x", "y")))

  out = jax.eval_shape(unrolled(LAX), x)
  w = put(MESH2, rand(rng, out.shape, np.float32), P(("x", "y")))

  def program(f):
    return jax.jit(lambda x, w: (f(x), jax.grad(lambda x: jnp.sum(f(x) * w))(x)))

  got, ref = program(make(hc))(x, w), program(unrolled(LAX))(x, w)
  assert got[0].shape == ref[0].shape
  _close(got[0], ref[0], "vmap")
  _close(got[1], ref[1], "grad of vmap")


@pytest.mark.parametrize("op", ["psum", "all_gather_tiled", "all_to_all", "ppermute"])
def test_vmap_of_shard_map(op):
  """jax.vmap outside the shard_map (the batch dim is unsharded)."""
  rng = np.random.default_rng(31)
  x = put(MESH2, rand(rng, (3, 32, 4), np.float32), P(None, ("x", "y")))

  def make(m):
    f = jax.shard_map(VMAP_OPS[op](m), mesh=MESH2, in_specs=P(("x", "y")),
                      out_specs=P(("x", "y")))
    return jax.jit(jax.vmap(f, in_axes=0, out_axes=1))

  _close(make(hc)(x), make(LAX)(x), "vmap of shard_map")


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("op", ["psum", "all_gather_invarying", "psum_scatter_tiled",
                                "ppermute_partial"])
def test_grad_matches_finite_differences(op, check_vma):
  """Independent of jax.lax: <grad, v> equals the central difference of the loss along v
  (psum's transpose differs by mode; a wrong choice is off by the group size)."""
  make, local = OPS[op]
  rng = np.random.default_rng(23)
  spec = P("x")
  shape = local(8)
  x = put(MESH1, rand(rng, (shape[0] * 8, *shape[1:]), np.float32), spec)
  f = jax.shard_map(make(hc, "x", 8), mesh=MESH1, in_specs=spec, out_specs=spec,
                    check_vma=check_vma)
  w = jnp.asarray(rand(rng, jax.eval_shape(f, x).shape, np.float32))
  loss = jax.jit(lambda x: jnp.sum(jnp.sin(f(x)) * w))
  v = rand(rng, x.shape, np.float32)
  g = to_np(jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)) * w)))(x))
  eps = 1e-2
  numeric = (float(loss(x + eps * v)) - float(loss(x - eps * v))) / (2 * eps)
  np.testing.assert_allclose(float(np.sum(g * v)), numeric, rtol=2e-2, atol=2e-2)


def test_invarying_all_gather_grad_with_replicated_out_specs_is_the_true_one():
  """all_gather(to="invarying") under check_vma=False, out_specs=P(): the loss counts the
  gathered value once, so <grad, v> equals the loss's central difference along v (jax 0.11.2's
  jax.lax.all_gather gives 1/n of it: docs/supported.md)."""
  rng = np.random.default_rng(29)
  x = put(MESH1, rand(rng, (16, 3), np.float32), P("x"))
  w = jnp.asarray(rand(rng, (16, 3), np.float32))
  f = jax.shard_map(lambda a: hc.all_gather(a, "x", tiled=True, to="invarying"), mesh=MESH1,
                    in_specs=P("x"), out_specs=P(), check_vma=False)
  loss = jax.jit(lambda x: jnp.sum(jnp.sin(f(x)) * w))
  g = to_np(jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)) * w)))(x))
  v = rand(rng, x.shape, np.float32)
  eps = 1e-2
  numeric = (float(loss(x + eps * v)) - float(loss(x - eps * v))) / (2 * eps)
  np.testing.assert_allclose(float(np.sum(g * v)), numeric, rtol=2e-2, atol=2e-2)
