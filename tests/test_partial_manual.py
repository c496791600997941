"""Partial-manual shard_map (axis_names a subset of the mesh's axes, the others left to XLA's
partitioner) and vmap of a shard_map whose batch axis is sharded over an Explicit mesh axis:
every op, async pair and fused op equals jax.lax's, with the same types.

On a 2x4 mesh each axis is manual in turn, the other auto (Auto and Explicit axis types). The
body first constrains its input to be sharded over the auto axis, so the partitioner really
splits the value there before jax_hoccl's op sees it (jax_internals.register_lowering). Random
data differs on every device: a group that mixed devices of different auto coordinates
(axes.group_table) would sum or move the wrong blocks.
"""
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_hoccl as hc
from conftest import CPUS, XLA_COLLECTIVES, rand, to_np

MESHES = {
    kind: jax.make_mesh((2, 4), ("x", "y"), devices=CPUS[:8], axis_types=(t, t))
    for kind, t in (("auto", AxisType.Auto), ("explicit", AxisType.Explicit))}
MANUAL = [pytest.param("x", id="manual-x"), pytest.param("y", id="manual-y")]
KINDS = list(MESHES)
CHECK_VMA = [pytest.param(True, id="vma"), pytest.param(False, id="novma")]
R, C, N = 8, 8, 4  # the body's x: [R, C] (rows split over the manual axis); w: [C, N]


def other(manual):
  return "y" if manual == "x" else "x"


def constrain(v, kind, auto, dim):
  """v sharded over the auto axis along `dim`: a sharding constraint inside the body."""
  spec = P(*([None] * dim), auto)
  if kind == "explicit":
    return jax.sharding.reshard(v, spec)
  return jax.lax.with_sharding_constraint(v, spec)


def shift(n):
  return [(i, (i + 1) % n) for i in range(n)]


def in_f32(reduce):
  """A jax.lax all-reduce of bf16/f16 done in f32 and rounded once (as jax_hoccl's sums are).
  jax.lax's own bf16 psum/pmax/pmin in a partial-manual shard_map abort XLA:CPU at compile
  time in jax 0.11.2 (AllReducePromotion: "Invalid binary instruction opcode copy")."""
  def f(v, ax):
    if np.dtype(v.dtype).itemsize >= 4 or not jnp.issubdtype(v.dtype, jnp.floating):
      return reduce(v, ax)
    return reduce(v.astype(jnp.float32), ax).astype(v.dtype)
  return f


def lax_psum_scatter(v, ax, n):
  """jax.lax.psum_scatter(v, ax, tiled=True) as my block of jax.lax.psum: jax 0.11.2's own
  reduce-scatter lowering fails in a partial-manual shard_map over Explicit axes ("Length of
  sharding.spec (2) must be equal to aval's ndim (0)")."""
  rows = v.shape[0] // n
  return jax.lax.dynamic_slice_in_dim(in_f32(jax.lax.psum)(v, ax),
                                      jax.lax.axis_index(ax) * rows, rows)


def collectives(lib, v, ax, n):
  """Every collective whose API jax_hoccl shares with jax.lax."""
  reduce = (lambda op: op) if lib is hc else in_f32
  o = {
      "psum": reduce(lib.psum)(v, ax), "pmean": lib.pmean(v, ax) if lib is hc else
      reduce(lambda v, ax: jax.lax.psum(v, ax) / n)(v, ax),
      "pmax": reduce(lib.pmax)(v, ax), "pmin": reduce(lib.pmin)(v, ax),
      "all_gather": lib.all_gather(v, ax), "all_gather_tiled_1": lib.all_gather(v, ax, axis=1,
                                                                                tiled=True),
      "psum_scatter": (hc.psum_scatter(v, ax, tiled=True) if lib is hc else
                       lax_psum_scatter(v, ax, n)),
      "all_to_all": lib.all_to_all(v, ax, 0, 1, tiled=True),
      "ppermute": lib.ppermute(v, ax, shift(n)),
  }
  return o


def pairs_ours(v, ax, n):
  """The async pairs (and compute between start and done, on pending.input)."""
  o = {}
  p = hc.all_gather_start(v, ax, tiled=True)
  o["all_gather_start"], o["between"] = hc.done(p, jnp.sin(p.input))
  o["psum_start"] = hc.done(hc.psum_start(v, ax))[0]
  o["psum_scatter_start"] = hc.done(hc.psum_scatter_start(v, ax, tiled=True))[0]
  o["all_to_all_start"] = hc.done(hc.all_to_all_start(v, ax))[0]
  o["ppermute_start"] = hc.done(hc.ppermute_start(v, ax, shift(n)))[0]
  return o


def pairs_lax(v, ax, n):
  return {
      "all_gather_start": jax.lax.all_gather(v, ax, tiled=True), "between": jnp.sin(v),
      "psum_start": jax.lax.psum(v, ax),
      "psum_scatter_start": lax_psum_scatter(v, ax, n),
      "all_to_all_start": jax.lax.all_to_all(v, ax, 0, 0, tiled=True),
      "ppermute_start": jax.lax.ppermute(v, ax, shift(n)),
  }


def fused_ours(v, w, ax):
  return {"all_gather_matmul": hc.all_gather_matmul(v, w, ax),
          "matmul_psum": hc.matmul_psum(v, w, ax),
          "matmul_reduce_scatter": hc.matmul_reduce_scatter(v, w, ax)}


def fused_lax(v, w, ax, n):
  return {"all_gather_matmul": jax.lax.all_gather(v, ax, tiled=True) @ w,
          "matmul_psum": jax.lax.psum(v @ w, ax),
          "matmul_reduce_scatter": lax_psum_scatter(v @ w, ax, n)}


BODIES = {  # group -> (ours, lax): fn(v, w, manual axis, its size) -> {name: array}
    "collectives": (lambda v, w, ax, n: collectives(hc, v, ax, n),
                    lambda v, w, ax, n: collectives(jax.lax, v, ax, n)),
    "async_pairs": (lambda v, w, ax, n: pairs_ours(v, ax, n),
                    lambda v, w, ax, n: pairs_lax(v, ax, n)),
    "fused": (lambda v, w, ax, n: fused_ours(v, w, ax),
              lambda v, w, ax, n: fused_lax(v, w, ax, n)),
}


def run_partial(kind, manual, body, x, w, check_vma=True):
  """body(v, w, manual, n) inside shard_map over `manual` only; its outputs, and their types
  inside the body (str of jax.typeof)."""
  mesh = MESHES[kind]
  auto, n = other(manual), mesh.shape[manual]
  types = {}

  def f(v, w):
    v = constrain(v, kind, auto, dim=1)
    out = body(v, w, manual, n)
    types.update({k: str(jax.typeof(a)) for k, a in out.items()})
    return out

  sm = jax.shard_map(f, mesh=mesh, in_specs=(P(manual), P()), out_specs=P(manual),
                     axis_names={manual}, check_vma=check_vma)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(manual)))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    fn = jax.jit(sm)
    out = fn(xs, ws)
    text = fn.lower(xs, ws).as_text()
  return out, types, text


def assert_close(a, b, name):
  a, b = to_np(a), to_np(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
  if a.dtype.kind in "iub":
    np.testing.assert_array_equal(a, b, err_msg=name)
  else:
    tol = 2e-2 if a.dtype.itemsize < 4 else 1e-5
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol,
                               err_msg=name)


def inputs(dtype, n_manual, seed=0):
  rng = np.random.default_rng(seed)
  return rand(rng, (n_manual * R, C), dtype), rand(rng, (C, N), dtype)


@pytest.mark.parametrize("group,dtype", [
    ("collectives", jnp.float32), ("collectives", jnp.bfloat16), ("collectives", jnp.int32),
    ("async_pairs", jnp.float32), ("async_pairs", jnp.int32), ("fused", jnp.float32)])
@pytest.mark.parametrize("manual", MANUAL)
@pytest.mark.parametrize("kind", KINDS)
def test_partial_manual_matches_lax(kind, manual, group, dtype):
  """Each op in a shard_map manual over one axis equals jax.lax's, values and types."""
  x, w = inputs(dtype, MESHES[kind].shape[manual])
  ours, lax = BODIES[group]
  got, got_types, text = run_partial(kind, manual, ours, x, w)
  ref, ref_types, _ = run_partial(kind, manual, lax, x, w)
  assert "hoccl_" in text
  bad = [c for c in XLA_COLLECTIVES if c in text]
  assert not bad, f"XLA collectives {bad} in jax_hoccl's lowered program"
  assert set(got) == set(ref)
  for k in ref:
    assert_close(got[k], ref[k], k)
    want = ref_types[k]
    if group != "collectives":  # explicit_axes.py: unsharded over the Explicit auto axes
      want = want.replace(f"@{other(manual)}", "")
    assert got_types[k] == want, (k, got_types[k], want)
    if kind == "explicit" and group == "collectives":  # Auto axes: the partitioner's choice
      assert got[k].sharding.spec == ref[k].sharding.spec, (k, got[k].sharding,
                                                            ref[k].sharding)
  # Something moved: the manual axis' ranks hold different data, so the permuted rows differ.
  moved = "ppermute" if group == "collectives" else "ppermute_start"
  if moved in got:
    assert not np.array_equal(to_np(got[moved]), x)


@pytest.mark.parametrize("check_vma", CHECK_VMA)
@pytest.mark.parametrize("manual", MANUAL)
@pytest.mark.parametrize("kind", KINDS)
def test_partial_manual_grad_matches_lax(kind, manual, check_vma):
  """grad through psum and all_gather inside a partial-manual shard_map equals jax.lax's."""
  x, w = inputs(jnp.float32, MESHES[kind].shape[manual], seed=1)
  weights = {k: rand(np.random.default_rng(2), s, jnp.float32) for k, s in
             (("psum", x.shape), ("all_gather", (x.shape[0] * MESHES[kind].shape[manual],
                                                 C)))}

  def gather(lib, v, ax, n):
    if lib is hc:
      return hc.all_gather(v, ax, tiled=True)
    # jax.lax.all_gather's transpose, jax.lax.psum_scatter, fails to lower here in jax 0.11.2
    # (lax_psum_scatter): the reference is the gather as a psum of my block in my place.
    placed = jnp.zeros((n * v.shape[0], *v.shape[1:]), v.dtype)
    placed = jax.lax.dynamic_update_slice_in_dim(placed, v, jax.lax.axis_index(ax) * v.shape[0], 0)
    return jax.lax.psum(placed, ax)

  def body_of(lib):
    def body(v, w, ax, n):
      return {"psum": lib.psum(v * v, ax), "all_gather": gather(lib, jnp.sin(v) @ w @ w.T,
                                                                ax, n)}
    return body

  def loss(lib):
    def f(x, w):
      out, _, _ = run_partial_traced(kind, manual, body_of(lib), x, w, check_vma)
      return sum(jnp.sum(out[k] * weights[k]) for k in out)
    return f

  mesh = MESHES[kind]
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(manual)))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    got = jax.jit(jax.grad(loss(hc), argnums=(0, 1)))(xs, ws)
    ref = jax.jit(jax.grad(loss(jax.lax), argnums=(0, 1)))(xs, ws)
  for name, a, b in zip(("dx", "dw"), got, ref):
    assert_close(a, b, name)
  assert np.abs(to_np(got[0])).max() > 0


def run_partial_traced(kind, manual, body, x, w, check_vma):
  """run_partial's shard_map applied to traced arguments (inside jit/grad)."""
  mesh = MESHES[kind]
  auto, n = other(manual), mesh.shape[manual]

  def f(v, w):
    return body(constrain(v, kind, auto, dim=1), w, manual, n)

  sm = jax.shard_map(f, mesh=mesh, in_specs=(P(manual), P()), out_specs=P(manual),
                     axis_names={manual}, check_vma=check_vma)
  return sm(x, w), None, None


W = np.linspace(-1, 1, C * N, dtype=np.float32).reshape(C, N)  # a weight shared by the batch
VMAP_OPS = {  # name -> fn(lib, v, axis, n); the lax reference of an async pair is its op
    "psum": lambda lib, v, ax, n: lib.psum(v, ax),
    "pmax": lambda lib, v, ax, n: lib.pmax(v, ax),
    "all_gather": lambda lib, v, ax, n: lib.all_gather(v, ax, tiled=True),
    "psum_scatter": lambda lib, v, ax, n: (hc.psum_scatter(v, ax, tiled=True) if lib is hc
                                           else lax_psum_scatter(v, ax, n)),
    "all_to_all": lambda lib, v, ax, n: lib.all_to_all(v, ax, 0, 1, tiled=True),
    "ppermute": lambda lib, v, ax, n: lib.ppermute(v, ax, shift(n)),
    "psum_start": lambda lib, v, ax, n: (hc.done(hc.psum_start(v, ax))[0] if lib is hc
                                         else jax.lax.psum(v, ax)),
    "matmul_psum": lambda lib, v, ax, n: (hc.matmul_psum(v, W, ax) if lib is hc
                                          else jax.lax.psum(v @ W, ax)),
    "matmul_psum_w_per_example": lambda lib, v, ax, n: (
        hc.matmul_psum(v, v.T, ax) if lib is hc else jax.lax.psum(v @ v.T, ax)),
}


@pytest.mark.parametrize("check_vma", CHECK_VMA)
@pytest.mark.parametrize("op", list(VMAP_OPS))
def test_vmap_over_explicit_batch_axis_matches_lax(op, check_vma):
  """vmap of a shard_map over "y" whose batch axis is sharded over the Explicit axis "x"
  (jax makes that shard_map manual over "y" alone): values and result shardings equal
  jax.lax's."""
  mesh = MESHES["explicit"]
  n = mesh.shape["y"]
  x = rand(np.random.default_rng(3), (mesh.shape["x"], n * R, C), jnp.float32)

  def run(lib):
    sm = jax.shard_map(lambda v: VMAP_OPS[op](lib, v, "y", n), mesh=mesh, in_specs=P("y"),
                       out_specs=P("y"), check_vma=check_vma)
    with jax.set_mesh(mesh):
      return jax.jit(jax.vmap(sm))(jax.device_put(x, NamedSharding(mesh, P("x", "y"))))

  got, ref = run(hc), run(jax.lax)
  assert_close(got, ref, op)
  assert got.sharding.spec == ref.sharding.spec, (got.sharding, ref.sharding)
