"""Clear errors: at trace time for misuse (axes, sizes, dtypes, permutations, context), and at
run time for a peer that never arrives (a timeout naming the op, the rank and the missing
peers; later calls on that broken communicator fail fast). The runtime cases run in a
subprocess so that a broken communicator cannot affect the rest of the suite.
"""
import os
import textwrap

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_hoccl as hc
from conftest import MESH1, MESH2, lax_ppermute_any_axis_order, put, rand, run_script

X1 = put(MESH1, rand(np.random.default_rng(40), (64, 8), np.float32), P("x"))
X2 = put(MESH2, rand(np.random.default_rng(41), (64, 8), np.float32), P(("x", "y")))

ALL_OPS = {
    "psum": lambda x, a, **kw: hc.psum(x, a, **kw),
    "all_gather": lambda x, a, **kw: hc.all_gather(x, a, **kw),
    "psum_scatter": lambda x, a, **kw: hc.psum_scatter(x, a, tiled=True, **kw),
    "all_to_all": lambda x, a, **kw: hc.all_to_all(x, a, 0, 0, tiled=True, **kw),
    "ppermute": lambda x, a, **kw: hc.ppermute(x, a, [(0, 1)], **kw),
}


def trace(body, mesh=MESH1, x=X1, check_vma=True):
  spec = P(tuple(mesh.axis_names)) if len(mesh.axis_names) > 1 else P("x")
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=check_vma)).trace(x)


def out_aval(body, mesh=MESH1, x=X1):
  spec = P(tuple(mesh.axis_names)) if len(mesh.axis_names) > 1 else P("x")
  return jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec), x)


# ----------------------------------------------------------------------------- axis names
@pytest.mark.parametrize("op", list(ALL_OPS))
def test_unknown_axis_names_the_axis(op):
  """jax.lax raises a bare AssertionError here; ours names the axis and the mesh."""
  for bad, mesh, x in (("z", MESH1, X1), (("x", "q"), MESH2, X2)):
    with pytest.raises(ValueError) as e:
      trace(lambda a: ALL_OPS[op](a, bad), mesh, x)
    msg = str(e.value)
    assert f"jax_hoccl.{op}" in msg
    assert ("'z'" in msg) if bad == "z" else ("'q'" in msg and "'x'" not in msg.split("[")[1])
    assert "manual axes" in msg


@pytest.mark.parametrize("op", list(ALL_OPS))
def test_repeated_axis_name(op):
  """(No axis at all is jax.lax's x itself: test_collectives.py, test_no_axes_is_the_input.)"""
  with pytest.raises(ValueError, match="repeats an axis"):
    trace(lambda a: ALL_OPS[op](a, ("x", "y", "x")), MESH2, X2)


@pytest.mark.parametrize("op", list(ALL_OPS))
def test_outside_shard_map(op):
  """Under plain jit and eagerly: an error that says to use shard_map."""
  x = jnp.ones((8, 4))
  with pytest.raises(ValueError, match=r"outside jax\.shard_map"):
    jax.jit(lambda a: ALL_OPS[op](a, "x")).trace(x)
  with pytest.raises(ValueError, match=r"outside jax\.shard_map"):
    ALL_OPS[op](x, "x")


def test_ppermute_axes_out_of_mesh_order_like_lax():
  """jax.lax.ppermute raises for ('y', 'x') on an ('x', 'y') mesh unless
  jax_raise_on_ppermute_sort_diff is off; so does jax_hoccl's, and with the check off both
  permute in the order given (test_collectives.py::test_ppermute, id 2d-yx)."""
  perm = [(i, (i + 1) % 8) for i in range(8)]
  with pytest.raises(RuntimeError, match="same order as the axis_names declared on the mesh"):
    jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, ("y", "x"), perm), mesh=MESH2,
                          in_specs=P(("x", "y")), out_specs=P(("x", "y")))).lower(X2)
  with pytest.raises(RuntimeError, match=r"jax_hoccl.ppermute: axis_name \('y', 'x'\) is not in "
                     r"the order of the mesh's axes \('x', 'y'\).*raise_on_ppermute_sort_diff"):
    trace(lambda a: hc.ppermute(a, ("y", "x"), perm), MESH2, X2)
  with pytest.raises(RuntimeError, match=r"jax_hoccl.ppermute_start: axis_name \('y', 'x'\) "
                     r"is not in the order"):
    trace(lambda a: hc.done(hc.ppermute_start(a, ("y", "x"), perm)), MESH2, X2)
  trace(lambda a: hc.ppermute(a, ("x", "y"), perm), MESH2, X2)
  trace(lambda a: hc.done(hc.ppermute_start(a, ("x", "y"), perm)), MESH2, X2)
  with lax_ppermute_any_axis_order():
    trace(lambda a: hc.ppermute(a, ("y", "x"), perm), MESH2, X2)
    trace(lambda a: hc.done(hc.ppermute_start(a, ("y", "x"), perm)), MESH2, X2)
  for op in ("psum", "all_gather", "psum_scatter", "all_to_all"):  # these take any order
    trace(lambda a: ALL_OPS[op](a, ("y", "x")), MESH2, X2)


# ---------------------------------------------------------------------------------- sizes
def test_psum_scatter_sizes():
  # tiled: the scatter dimension must divide by the group size (3 rows, 8 ranks)
  with pytest.raises(ValueError, match=r"psum_scatter.*size 3.*divide.*8"):
    trace(lambda a: hc.psum_scatter(a[:3], "x", tiled=True))
  with pytest.raises(ValueError, match=r"psum_scatter.*size 7.*divide.*8"):
    trace(lambda a: hc.psum_scatter(a[:, :7], "x", scatter_dimension=1, tiled=True))
  # untiled: the scatter dimension must equal the group size
  with pytest.raises(ValueError, match=r"tiled=False.*must have size 8.*got 16"):
    trace(lambda a: hc.psum_scatter(jnp.concatenate([a, a]), "x"))
  with pytest.raises(ValueError, match=r"must have size 4.*got 8"):
    trace(lambda a: hc.psum_scatter(a, "y", scatter_dimension=1), MESH2, X2)
  with pytest.raises(ValueError, match="rank >= 1"):
    trace(lambda a: hc.psum_scatter(a[0, 0], "x"))
  with pytest.raises(ValueError, match="scatter_dimension=2 is out of range"):
    trace(lambda a: hc.psum_scatter(a, "x", scatter_dimension=2, tiled=True))


def test_all_to_all_sizes():
  with pytest.raises(ValueError, match=r"all_to_all.*split_axis 1 has size 6.*divide.*8"):
    trace(lambda a: hc.all_to_all(a[:, :6], "x", 1, 0, tiled=True))
  with pytest.raises(ValueError, match=r"tiled=False split_axis 0 must have size 8.*got 4"):
    trace(lambda a: hc.all_to_all(a[:4], "x", 0, 1))
  with pytest.raises(ValueError, match=r"must have size 2.*got 8"):
    trace(lambda a: hc.all_to_all(a, "x", 1, 0), MESH2, X2)
  with pytest.raises(ValueError, match="rank >= 1"):
    trace(lambda a: hc.all_to_all(a[0, 0], "x", 0, 0))
  with pytest.raises(ValueError, match="concat_axis=5 is out of range"):
    trace(lambda a: hc.all_to_all(a, "x", 0, 5, tiled=True))
  with pytest.raises(ValueError, match="split_axis=-3 is out of range"):
    trace(lambda a: hc.all_to_all(a, "x", -3, 0, tiled=True))


def test_all_gather_arguments():
  with pytest.raises(ValueError, match="axis=3 is out of range"):
    trace(lambda a: hc.all_gather(a, "x", axis=3))
  with pytest.raises(ValueError, match="axis=2 is out of range"):
    trace(lambda a: hc.all_gather(a, "x", axis=2, tiled=True))
  with pytest.raises(ValueError, match=r"all_gather.*(rank >= 1|rank 0)"):
    trace(lambda a: hc.all_gather(a[0, 0], "x", tiled=True))
  with pytest.raises(ValueError, match="to must be"):
    trace(lambda a: hc.all_gather(a, "x", to="sideways"))
  # axis=2 is valid for the stacked (untiled) form of a rank-2 input: new trailing axis
  assert out_aval(lambda a: hc.all_gather(a, "x", axis=2)).shape == (64, 8, 8)


# --------------------------------------------------------------------------------- dtypes
SUB_BYTE = [getattr(jnp, n) for n in ("int4", "uint4", "int2", "uint2") if hasattr(jnp, n)]


@pytest.mark.parametrize("op", list(ALL_OPS))
def test_sub_byte_dtypes_rejected(op):
  assert SUB_BYTE, "jax has no int4"
  for dt in SUB_BYTE:
    with pytest.raises(TypeError) as e:
      trace(lambda a: ALL_OPS[op](a.astype(dt), "x"))
    assert f"jax_hoccl.{op}" in str(e.value) and str(np.dtype(dt)) in str(e.value)


def test_float8_moved_and_summed():
  """float8 types are whole bytes: every op accepts them (movers exactly, sums like lax)."""
  dt = jnp.float8_e4m3fn
  x = put(MESH1, rand(np.random.default_rng(42), (64, 8), np.float32).astype(dt), P("x"))
  f = jax.jit(jax.shard_map(
      lambda a: (hc.all_gather(a, "x", tiled=True), hc.ppermute(a, "x", [(0, 1), (1, 0)]),
                 hc.all_to_all(a, "x", 0, 0, tiled=True)),
      mesh=MESH1, in_specs=P("x"), out_specs=P("x")))
  g = jax.jit(jax.shard_map(
      lambda a: (jax.lax.all_gather(a, "x", tiled=True),
                 jax.lax.ppermute(a, "x", [(0, 1), (1, 0)]),
                 jax.lax.all_to_all(a, "x", 0, 0, tiled=True)),
      mesh=MESH1, in_specs=P("x"), out_specs=P("x")))
  for got, ref in zip(f(x), g(x)):
    assert got.dtype == dt
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  assert out_aval(lambda a: hc.psum(a, "x"), x=x).dtype == dt
  assert out_aval(lambda a: hc.psum_scatter(a, "x", tiled=True), x=x).dtype == dt


# --------------------------------------------------------------------------- permutations
@pytest.mark.parametrize("perm,match", [
    ([(0, 1), (1, 1)], "twice"),          # duplicate destination
    ([(0, 1), (0, 2)], "twice"),          # duplicate source
    ([(0, 1), (-8, 2)], "twice"),         # duplicate source once normalised
    ([(0, 8)], "index 8 is out of range"),
    ([(-9, 0)], "index -9 is out of range"),
])
def test_bad_permutation(perm, match):
  with pytest.raises(ValueError, match=match):
    trace(lambda a: hc.ppermute(a, "x", perm))


def test_negative_permutation_indices_like_lax():
  """jax.lax.ppermute treats perm entries as indices into the axis: -1 is the last rank."""
  perm = [(0, -1), (-1, 0), (3, 4)]
  f = jax.jit(jax.shard_map(lambda a: (hc.ppermute(a, "x", perm), jax.lax.ppermute(a, "x", perm)),
                            mesh=MESH1, in_specs=P("x"), out_specs=P("x")))
  got, ref = f(X1)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  assert np.asarray(got)[56:].any()  # rank 7 received rank 0's block


def test_psum_algorithm_name(monkeypatch):
  with pytest.raises(ValueError, match="one_shot"):
    with hc.psum_algorithm("tree"):
      pass
  monkeypatch.setenv("JAX_HOCCL_PSUM_ALGORITHM", "bogus")
  with pytest.raises(ValueError, match="algorithm must be one of"):
    trace(lambda a: hc.psum(a, "x"))
  monkeypatch.setenv("JAX_HOCCL_PSUM_ALGORITHM", "two_step")
  text = jax.jit(jax.shard_map(lambda a: hc.psum(a, "x"), mesh=MESH1, in_specs=P("x"),
                               out_specs=P())).lower(X1).as_text()
  assert "hoccl_all_to_all" in text  # the env var picks the algorithm


# ---------------------------------------------------------------- runtime: missing peers
_MISSING_PEER_SCRIPT = textwrap.dedent("""
    import json, os, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["PJRT_NPROC"] = "16"
    os.environ["JAX_HOCCL_TIMEOUT_S"] = "2"
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl as hc

    def attempt(f, *args):
      t = time.monotonic()
      try:
        jax.block_until_ready(f(*args))
        return {"error": None, "seconds": time.monotonic() - t}
      except Exception as e:
        return {"error": str(e), "seconds": time.monotonic() - t}

    out = {}
    # 1. A group naming device 99, which does not exist: device 0 waits for it in vain.
    #    (Called through the registered FFI target, as the lowering does.)
    mesh1 = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    x1 = jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(mesh1, P("x")))
    from jax_hoccl._src.ffi_targets import register
    register()  # the lowering registers the handlers; this calls one directly
    def ghost(a):
      call = jax.ffi.ffi_call("hoccl_all_gather", jax.ShapeDtypeStruct((2, 4), a.dtype),
                              has_side_effect=True)
      from jax_hoccl._src.jax_internals import hashable_array  # ffi_call hashes attributes
      group = dict(groups=hashable_array(np.array([0, 99], np.int64)), group_size=np.int64(2),
                   site=np.int64(987654321))
      return call(a, group=group, skip_own=np.int64(0))[0]
    f = jax.jit(jax.shard_map(ghost, mesh=mesh1, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    out["ghost"] = attempt(f, x1)
    out["ghost_again"] = attempt(f, x1)

    # 2. A real program where only device 0 calls the collective (lax.cond on axis_index).
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh, P("x")))
    def lonely(a):
      return jax.lax.cond(jax.lax.axis_index("x") == 0,
                          lambda a: hc.ppermute(a, "x", [(0, 1), (1, 0)]), lambda a: a, a)
    g = jax.jit(jax.shard_map(lonely, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    out["lonely"] = attempt(g, x)
    out["lonely_again"] = attempt(g, x)

    # 3. The user's op is named, not the mover it runs on, with a call number a user can read.
    mesh4 = jax.make_mesh((2,), ("z",), devices=[jax.devices()[0], jax.devices()[4]])  # a group no other case uses
    x4 = jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(mesh4, P("z")))
    def lonely_psum(a):
      return jax.lax.cond(jax.lax.axis_index("z") == 0, lambda a: hc.psum(a, "z"),
                          lambda a: a, a)
    k = jax.jit(jax.shard_map(lonely_psum, mesh=mesh4, in_specs=P("z"), out_specs=P("z"),
                              check_vma=False))
    out["lonely_psum"] = attempt(k, x4)

    # 5. A fused op names itself, not the exchanges it runs on (a group no other case uses).
    mesh5 = jax.make_mesh((2,), ("v",), devices=[jax.devices()[1], jax.devices()[5]])
    x5 = jax.device_put(np.ones((2, 4, 8), np.float32), NamedSharding(mesh5, P("v")))
    w5 = np.ones((8, 4), np.float32)
    def lonely_fused(a):
      return jax.lax.cond(jax.lax.axis_index("v") == 0,
                          lambda a: hc.matmul_reduce_scatter(a[0], w5, "v"),
                          lambda a: a[0, :2, :4], a)
    m = jax.jit(jax.shard_map(lonely_fused, mesh=mesh5, in_specs=P("v"), out_specs=P("v"),
                              check_vma=False))
    out["lonely_fused"] = attempt(m, x5)

    # 4. Other communicators still work: the groups of the 'y' axis of a 2x4 mesh.
    mesh2 = jax.make_mesh((2, 4), ("x", "y"))
    x2 = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh2, P(("x", "y"))))
    h = jax.jit(jax.shard_map(lambda a: hc.psum(a, "y"), mesh=mesh2, in_specs=P(("x", "y")),
                              out_specs=P(("x", "y"))))
    r = attempt(h, x2)
    r["value"] = np.asarray(h(x2)).tolist() if r["error"] is None else None
    out["healthy"] = r
    print("RESULT" + json.dumps(out))
""")


def test_missing_peer_times_out_with_a_clear_error():
  res, wall = run_script(_MISSING_PEER_SCRIPT, timeout=120)
  assert wall < 60, wall

  ghost = res["ghost"]
  assert ghost["error"], "a collective with a missing peer must fail"
  msg = ghost["error"]
  assert "all_gather" in msg and "rank 0" in msg and "device 99" in msg, msg
  assert "JAX_HOCCL_TIMEOUT_S" in msg and "timed out" in msg, msg
  assert 1.5 < ghost["seconds"] < 30, ghost["seconds"]
  # the communicator is broken now: the next call fails at once, with the original reason
  again = res["ghost_again"]
  assert again["error"] and "device 99" in again["error"], again
  assert again["seconds"] < 1.5, again["seconds"]

  lonely = res["lonely"]
  assert lonely["error"], "a collective only device 0 calls must fail"
  msg = lonely["error"]
  assert "ppermute" in msg and "rank 0 (device 0)" in msg, msg
  assert "missing peer" in msg and "rank 1 (device 1)" in msg, msg
  assert 1.5 < lonely["seconds"] < 30, lonely["seconds"]
  assert res["lonely_again"]["error"] and res["lonely_again"]["seconds"] < 1.5

  msg = res["lonely_fused"]["error"]
  assert msg and "jax_hoccl matmul_reduce_scatter (ppermute): rank 0 (device 1)" in msg, msg
  msg = res["lonely_psum"]["error"]
  assert msg and "jax_hoccl psum (all_gather)" in msg and "call #1 of call site" in msg, msg

  healthy = res["healthy"]
  assert healthy["error"] is None, healthy["error"]
  want = np.arange(16, dtype=np.float32).reshape(2, 4, 2).sum(1)  # [x, local] over y
  np.testing.assert_array_equal(np.asarray(healthy["value"]).reshape(2, 4, 2),
                                np.repeat(want[:, None, :], 4, axis=1))


def test_malformed_environment_variables_fail_naming_them():
  from jax_hoccl._src import environment
  for name, raw, want in [("JAX_HOCCL_TIMEOUT_S", "abc", "a positive number"),
                          ("JAX_HOCCL_TIMEOUT_S", "-3", "a positive number"),
                          ("JAX_HOCCL_BUCKET_BYTES", "1.5", "an integer >= 0"),
                          ("JAX_HOCCL_CHUNKS", "0", "an integer from 1 to 64"),
                          ("JAX_HOCCL_CHUNKS", "100", "an integer from 1 to 64"),
                          ("JAX_HOCCL_CHANNELS", "99", "an integer from 1 to 4"),
                          ("JAX_HOCCL_CHANNELS", "5", "an integer from 1 to 4"),
                          ("JAX_HOCCL_ASYNC_STREAMS", "9", "an integer from 1 to 4"),
                          ("JAX_HOCCL_ASYNC_STREAMS", "0", "an integer from 1 to 4"),
                          ("JAX_HOCCL_CUBLASLT_CANDIDATES", "65", "an integer from 1 to 64"),
                          ("JAX_HOCCL_PSUM_ALGORITHM", "fast", "one of")]:
    old = os.environ.get(name)
    os.environ[name] = raw
    try:
      with pytest.raises(ValueError, match=f"{name} must be {want}"):
        environment.check()
    finally:
      if old is None:
        del os.environ[name]
      else:
        os.environ[name] = old
  os.environ["JAX_HOCCL_TIMEUOT_S"] = "5"  # a typo: does nothing, so say so
  try:
    with pytest.warns(UserWarning, match="JAX_HOCCL_TIMEUOT_S is not a jax_hoccl"):
      environment.check()
  finally:
    del os.environ["JAX_HOCCL_TIMEUOT_S"]
  environment.check()  # the suite's own environment is valid


@pytest.mark.parametrize("name,raw", [("JAX_HOCCL_CHUNKS", "100"), ("JAX_HOCCL_CHANNELS", "99"),
                                      ("JAX_HOCCL_ASYNC_STREAMS", "9")])
def test_out_of_range_variables_fail_at_the_first_lowering(name, raw):
  """A documented limit is enforced where the variable is first read: the first lowering of
  any jax_hoccl program (here a psum, which has no async start), not silently capped."""
  res, _ = run_script(textwrap.dedent("""
      import json, os
      os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
      import jax
      from jax.sharding import PartitionSpec as P
      import jax_hoccl
      mesh = jax.make_mesh((2,), ("x",))
      f = jax.jit(jax.shard_map(lambda v: jax_hoccl.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                out_specs=P()))
      try:
          f.lower(jax.ShapeDtypeStruct((4,), "float32",
                                       sharding=jax.NamedSharding(mesh, P("x"))))
          print("RESULT" + json.dumps({"error": None}))
      except ValueError as e:
          print("RESULT" + json.dumps({"error": str(e)}))
  """), timeout=120, env_extra={name: raw})
  assert res["error"] and f"{name} must be an integer from" in res["error"], res
  assert repr(raw) in res["error"], res
