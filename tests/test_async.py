"""Async start/done pairs vs jax.lax: values and typing of all_gather_start (tiled/untiled,
axis 0/1, peers_only), all_to_all_start (tiled/untiled) and ppermute_start (full and partial
permutations) on a 1-D mesh of 8 and a 2x4 mesh, check_vma True/False, float32/bfloat16;
the schedule XLA compiles (start -> compute -> done, no copies); several pairs in flight;
no rendezvous slot leaks; error messages.

Every per-device buffer stays <= 512 bytes (see test_collectives.py's docstring: above that
XLA:CPU may run independent custom calls concurrently).
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("PJRT_NPROC", "16")

import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_hoccl as hc  # noqa: E402
from jax_hoccl import _hoccl  # noqa: E402

CPUS = jax.devices("cpu")
MESH1 = jax.make_mesh((8,), ("x",), devices=CPUS[:8])
MESH2 = jax.make_mesh((2, 4), ("x", "y"), devices=CPUS[:8])

CASES = [
    pytest.param(MESH1, "x", id="1d-x"),
    pytest.param(MESH2, "y", id="2d-y"),  # groups of contiguous devices
    pytest.param(MESH2, "x", id="2d-x"),  # groups of strided devices (0, 4), (1, 5), ...
    pytest.param(MESH2, ("x", "y"), id="2d-xy"),
]
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
CHECK_VMA = [pytest.param(True, id="vma"), pytest.param(False, id="novma")]

M, K = 8, 2  # local x: [8, 2]; the gathered f32 result is 8 * 8 * 2 * 4 = 512 bytes


def spec_all(mesh):
  names = tuple(mesh.axis_names)
  return P(names if len(names) > 1 else names[0])


def put(mesh, a, spec=None):
  return jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec_all(mesh) if spec is None
                                                      else spec))


def rand(rng, shape, dtype):
  a = rng.standard_normal(shape).astype(np.float32)
  a[a == 0] = 0.5
  return jnp.asarray(a).astype(dtype)


def axis_size(mesh, ax):
  names = ax if isinstance(ax, tuple) else (ax,)
  return int(np.prod([mesh.shape[a] for a in names]))


def to_np(a):
  return np.asarray(jax.device_get(a))


def sds(shape, dtype=jnp.float32, mesh=MESH1):
  """An abstract input sharded over the mesh's axes on dim 0 (for trace-only tests)."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec_all(mesh)))


def smap(mesh, f, check_vma, in_specs=None, out_specs=None):
  s = spec_all(mesh)
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=s if in_specs is None else in_specs,
                               out_specs=s if out_specs is None else out_specs,
                               check_vma=check_vma))


_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[([\d,]*)\]")


def run_sequential(f, *args):
  """Runs jitted f after checking that no per-device buffer exceeds 512 bytes: above that
  XLA:CPU may run independent custom calls concurrently, in a different order per rank
  (which jax_hoccl's per-rank sequence numbers and XLA's own collectives do not survive)."""
  compiled = f.lower(*args).compile()
  text = compiled.as_text()
  for m in _SHAPE.finditer(text[text.index("ENTRY"):]):
    dt, dims = m.group(1), [int(v) for v in m.group(2).split(",") if v]
    size = {"pred": 1, "bf16": 2, "f16": 2}.get(dt) or int(dt[1:]) // 8
    assert int(np.prod(dims)) * size <= 512, f"test shapes too large: {m.group(0)}"
  return compiled(*args)


# ------------------------------------------------------------------------------------------
# values and typing vs jax.lax
# ------------------------------------------------------------------------------------------

def run_both(mesh, ours, lax, check_vma, x):
  """(ours(x), lax(x), their types by output name), both dicts, run in one program."""
  types = {}

  def body(x):
    a, b = ours(x), lax(x)
    types["ours"] = {k: jax.typeof(v) for k, v in a.items()}
    types["lax"] = {k: jax.typeof(v) for k, v in b.items()}
    return a, b

  got, ref = run_sequential(smap(mesh, body, check_vma), x)
  return got, ref, types


def _perms(n):
  rng = np.random.default_rng(n)
  shuffled = rng.permutation(n)
  return {
      "shift1": [(i, (i + 1) % n) for i in range(n)],
      "shuffle": [(i, int(shuffled[i])) for i in range(n)],
      "partial": [(0, n - 1), (n - 1, 1), (1, 2)] if n > 2 else [(0, 1)],
  }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("check_vma", CHECK_VMA)
@pytest.mark.parametrize("mesh,ax", CASES)
def test_pairs_match_lax(mesh, ax, check_vma, dtype):
  """Every start/done variant equals jax.lax's collective bit for bit, with the same type."""
  n = axis_size(mesh, ax)
  perms = _perms(n)
  rng = np.random.default_rng(1)
  x = put(mesh, rand(rng, (8 * M, K), dtype))

  def ours(x):
    o = {}
    for tiled in (True, False):
      for axis in (0, 1):
        o[f"ag_t{int(tiled)}_a{axis}"] = hc.done(
            hc.all_gather_start(x, ax, axis=axis, tiled=tiled))[0]
    o["ag_peers"] = hc.done(hc.all_gather_start(x, ax, peers_only=True))[0]
    o["a2a_tiled"] = hc.done(hc.all_to_all_start(x, ax))[0]
    o["a2a_untiled"] = hc.done(hc.all_to_all_start(x[:n], ax, tiled=False))[0]
    for name, perm in perms.items():
      o[f"pp_{name}"] = hc.done(hc.ppermute_start(x, ax, perm))[0]
    return o

  def lax(x):
    o = {}
    for tiled in (True, False):
      for axis in (0, 1):
        o[f"ag_t{int(tiled)}_a{axis}"] = jax.lax.all_gather(x, ax, axis=axis, tiled=tiled)
    gathered = jax.lax.all_gather(x, ax)  # [n, M, K], index j = rank j's x
    r = jax.lax.axis_index(ax)
    o["ag_peers"] = jnp.take(gathered, (r + 1 + jnp.arange(n - 1)) % n, axis=0)
    o["a2a_tiled"] = jax.lax.all_to_all(x, ax, 0, 0, tiled=True)
    o["a2a_untiled"] = jax.lax.all_to_all(x[:n], ax, 0, 0, tiled=False)
    for name, perm in perms.items():
      o[f"pp_{name}"] = jax.lax.ppermute(x, ax, perm)
    return o

  got, ref, types = run_both(mesh, ours, lax, check_vma, x)
  assert set(got) == set(ref)
  for k in ref:
    a, b = to_np(got[k]), to_np(ref[k])
    assert a.dtype == b.dtype == np.dtype(dtype), (k, a.dtype, b.dtype)
    assert a.shape == b.shape, (k, a.shape, b.shape)
    np.testing.assert_array_equal(a, b, err_msg=k)
    assert str(types["ours"][k]) == str(types["lax"][k]), (k, types["ours"][k],
                                                           types["lax"][k])
  # Non-trivial data: the movers really moved something (a gather is not the input tiled).
  assert not np.array_equal(to_np(got["pp_shift1"]), to_np(x))
  # Partial permutation: ranks that receive nothing get zeros, like jax.lax.
  assert (to_np(got["pp_partial"]) == 0).any()


@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(jnp.int32, id="i32")])
@pytest.mark.parametrize("check_vma", CHECK_VMA)
@pytest.mark.parametrize("mesh,ax", CASES)
def test_reducing_pairs_match_lax(mesh, ax, check_vma, dtype):
  """psum_start / psum_scatter_start (tiled and not, scatter_dimension 0 and 1) equal
  jax.lax's psum / psum_scatter, typed the same, with compute on pending.input between."""
  n = axis_size(mesh, ax)
  rng = np.random.default_rng(7)
  x = put(mesh, rand(rng, (8 * M, K), dtype) if dtype != jnp.int32
          else rng.integers(-40, 40, (8 * M, K)).astype(np.int32))

  def ours(x):
    o = {}
    p = hc.psum_start(x, ax)
    o["psum"], o["psum_between"] = hc.done(p, p.input * 2)
    o["ps_t0"] = hc.done(hc.psum_scatter_start(x, ax, tiled=True))[0]
    q = hc.psum_scatter_start(x, ax, tiled=True)
    o["ps_t0_input"], = hc.done(q, q.input)[1:]
    o["ps_u0"] = hc.done(hc.psum_scatter_start(x[:n], ax))[0]
    o["ps_u1"] = hc.done(hc.psum_scatter_start(x[:M, :1].repeat(n, 1), ax, scatter_dimension=1))[0]
    return o

  def lax(x):
    up = (lambda v: v.astype(jnp.float32)) if dtype == jnp.bfloat16 else (lambda v: v)
    down = lambda v: v.astype(dtype)  # noqa: E731
    return {
        "psum": down(jax.lax.psum(up(x), ax)), "psum_between": x * 2,
        "ps_t0": down(jax.lax.psum_scatter(up(x), ax, tiled=True)), "ps_t0_input": x,
        "ps_u0": down(jax.lax.psum_scatter(up(x[:n]), ax)),
        "ps_u1": down(jax.lax.psum_scatter(up(x[:M, :1].repeat(n, 1)), ax, scatter_dimension=1)),
    }

  got, ref, types = run_both(mesh, ours, lax, check_vma, x)
  for k in ref:
    a, b = to_np(got[k]), to_np(ref[k])
    assert a.dtype == b.dtype == np.dtype(dtype) and a.shape == b.shape, (k, a.dtype, a.shape)
    if dtype == jnp.bfloat16:  # both sum in f32 and round once; the order may differ
      np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-2,
                                 atol=1e-2, err_msg=k)
    else:
      np.testing.assert_array_equal(a, b, err_msg=k)
    assert str(types["ours"][k]) == str(types["lax"][k]), (k, types["ours"][k],
                                                           types["lax"][k])
  assert not np.array_equal(to_np(got["psum"]), to_np(x)[:M])  # the sum is not my x


def test_psum_scatter_start_checks_its_input():
  f = smap(MESH1, lambda v: hc.done(hc.psum_scatter_start(v, "x", tiled=True))[0], True)
  with pytest.raises(ValueError, match="divide by the axis size"):
    f.lower(sds((8 * 3, 2)))
  g = smap(MESH1, lambda v: hc.done(hc.psum_start(v, "nope"))[0], True)
  with pytest.raises((NameError, ValueError), match="psum_start"):
    g.lower(sds((8 * 2, 2)))


def test_peers_only_rotation_explicit():
  """peers_only block k on rank r is rank (r+1+k) % n's x, checked against numpy directly
  (not through jax.lax) on the 1-D mesh."""
  n = 8
  rng = np.random.default_rng(2)
  xg = rng.standard_normal((n * 2, 3)).astype(np.float32)
  f = smap(MESH1, lambda x: hc.done(hc.all_gather_start(x, "x", peers_only=True))[0][None],
           True)
  got = to_np(f(put(MESH1, xg)))  # [n, n-1, 2, 3]
  shards = xg.reshape(n, 2, 3)
  assert got.shape == (n, n - 1, 2, 3)
  for r in range(n):
    for k in range(n - 1):
      np.testing.assert_array_equal(got[r, k], shards[(r + 1 + k) % n], err_msg=f"r={r} k={k}")


# ------------------------------------------------------------------------------------------
# The schedule XLA compiles
# ------------------------------------------------------------------------------------------

def parse_hlo(text):
  """{computation name: [instruction dicts in schedule order]}; an instruction has name,
  opcode, operands (names), line, calls (the computations it calls), is_root."""
  comps, cur, entry = {}, None, None
  for line in text.splitlines():
    s = line.strip()
    if cur is None:
      if s.endswith("{") and ("(" in s or s.startswith("ENTRY") or re.match(r"^[\w.\-%]+ \{$", s)):
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)", s)
        if m and not s.startswith("HloModule"):
          cur = m.group(2)
          comps[cur] = []
          if m.group(1):
            entry = cur
      continue
    if s == "}":
      cur = None
      continue
    inst = _parse_instruction(s)
    if inst:
      comps[cur].append(inst)
  return comps, entry


def _matching(s, i):
  """Index just after the bracket group opening at s[i]."""
  depth = 0
  for j in range(i, len(s)):
    if s[j] in "([{":
      depth += 1
    elif s[j] in ")]}":
      depth -= 1
      if depth == 0:
        return j + 1
  return len(s)


def _parse_instruction(s):
  m = re.match(r"^(ROOT\s+)?%?([\w.\-]+)\s*=\s*", s)
  if not m:
    return None
  rest = s[m.end():]
  # the result type: a tuple "(...)" or one token like f32[8,4]{1,0}
  i = _matching(rest, 0) if rest.startswith("(") else rest.index(" ")
  rest = rest[i:].lstrip()
  om = re.match(r"^([\w\-]+)\(", rest)
  if not om:
    return None
  end = _matching(rest, om.end() - 1)
  args = rest[om.end():end - 1]
  operands = []
  depth, cur = 0, ""
  for ch in args + ",":
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      if cur.strip():
        operands.append(cur.strip().split()[-1].lstrip("%"))
      cur = ""
    else:
      cur += ch
  calls = re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rest[end:])
  target = re.search(r'custom_call_target="([^"]+)"', rest[end:])
  return dict(name=m.group(2), opcode=om.group(1), operands=operands, line=s,
              calls=calls, target=target.group(1) if target else None,
              is_root=bool(m.group(1)))


def _contains_dot(comps, comp_name, seen=()):
  for inst in comps.get(comp_name, []):
    if inst["opcode"] == "dot" or (inst["opcode"] == "custom-call" and
                                   "matmul" in (inst["target"] or "").lower()):
      return True
    for c in inst["calls"]:
      if c not in seen and _contains_dot(comps, c, seen + (comp_name,)):
        return True
  return False


def find_schedule(text):
  """(computation, its instructions, index of start, of the dot-computing instruction, of
  done) in the computation that holds hoccl_all_gather_start."""
  comps, _ = parse_hlo(text)
  for cname, insts in comps.items():
    starts = [i for i, x in enumerate(insts) if x["target"] == "hoccl_all_gather_start"]
    if not starts:
      continue
    dones = [i for i, x in enumerate(insts) if x["target"] == "hoccl_done"]
    dots = [i for i, x in enumerate(insts)
            if x["opcode"] == "dot" or
            (x["opcode"] in ("fusion", "call", "custom-call") and x["target"] != "hoccl_done"
             and x["target"] != "hoccl_all_gather_start" and
             (any(_contains_dot(comps, c) for c in x["calls"]) or
              "matmul" in (x["target"] or "").lower()))]
    assert len(starts) == 1 and len(dones) == 1 and len(dots) == 1, (starts, dones, dots)
    return comps, cname, insts, starts[0], dots[0], dones[0]
  raise AssertionError("no hoccl_all_gather_start in the module")


def order_forced(hlo_text):
  """Is start -> dot -> done forced by data dependencies in this HLO (before or after XLA's
  optimisations: custom calls, which no pass removes)? The dot's lhs must be the start's
  output 2 (x, aliased) or come from a hoccl_after whose token operand is the start's output
  1, and done must take the dot's result."""
  comps, cname, insts, i_start, i_dot, i_done = find_schedule(hlo_text)
  by = {x["name"]: x for x in insts}
  start, dot, done = insts[i_start], insts[i_dot], insts[i_done]

  def output_of_start(name, index):  # (through bitcasts) get-tuple-element(start), index
    inst = by.get(name)
    while inst is not None and inst["opcode"] == "bitcast":
      inst = by.get(inst["operands"][0])
    if inst is None or inst["opcode"] != "get-tuple-element":
      return False, inst
    src = by.get(inst["operands"][0])
    return inst["operands"][0] == start["name"] and f"index={index}" in inst["line"], src

  is_x, src = output_of_start(dot["operands"][0], 2)
  via_after = (src is not None and src["target"] == "hoccl_after" and
               output_of_start(src["operands"][0], 1)[0])
  after_start = is_x or via_after
  done_waits_for_dot = dot["name"] in done["operands"]
  return after_start, done_waits_for_dot


W_SHAPE = (K, 4)


def _sched_fns():
  def forced(x, w):
    p = hc.all_gather_start(x, "x", tiled=True)
    y = p.input @ w
    g, y = hc.done(p, y)
    return g, y

  def unforced(x, w):
    p = hc.all_gather_start(x, "x", tiled=True)
    y = x @ w  # on x, not p.input; y not passed to done
    g, = hc.done(p)
    return g, y

  def after_started(x, w):
    p = hc.all_gather_start(x, "x", tiled=True, order_input=False)
    y = p.after_start(x * 2.0) @ w
    g, y = hc.done(p, y)
    return g, y

  return forced, unforced, after_started


@pytest.mark.parametrize("check_vma", CHECK_VMA)
def test_schedule_start_compute_done(check_vma):
  """Compiled, scheduled HLO: start, then the dot (or the fusion computing it), then done;
  done takes the dot's result; x (a fresh array) is neither copied nor computed twice. The
  HLO before and after XLA's optimisations shows the edges that force it (the dot reads x as
  the start's output 2; with after_start, through hoccl_after with the start's token); with
  the dependency removed the same helper reports the order as not forced."""
  rng = np.random.default_rng(3)
  x = put(MESH1, rand(rng, (8 * M, K), jnp.float32))
  w = put(MESH1, rand(rng, W_SHAPE, jnp.float32), P())
  forced, unforced, after_started = _sched_fns()
  # the gather is varying (to="varying"): each device's copy is one block of the output
  specs = dict(in_specs=(P("x"), P()), out_specs=(P("x"), P("x")))
  # on x + 1, a fresh array as activations are: pending.input aliases its x, so XLA copies a
  # jit argument first, which it may not overwrite (async_collectives' docstring; checked
  # below on the argument itself)
  f = smap(MESH1, lambda x, w: forced(x + 1.0, w), check_vma, **specs)
  lowered = f.lower(x, w)
  hlo = lowered.compile().as_text()
  try:
    comps, cname, insts, i_start, i_dot, i_done = find_schedule(hlo)
    assert i_start < i_dot < i_done, (i_start, i_dot, i_done)
    dot, done = insts[i_dot], insts[i_done]
    assert dot["name"] in done["operands"], (dot["name"], done["operands"])
    # x (what the start reads and aliases) is neither copied nor computed twice
    assert not [i for i in insts if i["opcode"] == "copy"], "copy in HLO"
    assert sum('op_name="' in i["line"] and '/add"' in i["line"] for i in insts) == 1
    # done's outputs alias its inputs (buffer 0 and the dot's result): no copy there either
    assert "output_to_operand_aliasing" in done["line"]
  except AssertionError:
    print(hlo)
    raise
  pre = lowered.as_text(dialect="hlo")
  for text in (pre, hlo):
    try:
      assert order_forced(text) == (True, True)
    except AssertionError:
      print(text)
      raise
  # pending.after_start on another fresh array orders the dot the same way
  via_after = smap(MESH1, after_started, check_vma, **specs).lower(x, w)
  for text in (via_after.as_text(dialect="hlo"), via_after.compile().as_text()):
    try:
      _, _, _, i_start, i_dot, i_done = find_schedule(text)
      assert order_forced(text) == (True, True) and i_start < i_dot < i_done
    except AssertionError:
      print(text)
      raise
  on_arg = smap(MESH1, forced, check_vma, **specs).lower(x, w).compile().as_text()
  assert " copy(" in on_arg, "no copy of the argument x, which pending.input aliases"
  # Negative control: the helper sees that nothing forces the order any more.
  g = smap(MESH1, unforced, check_vma, **specs)
  lowered_u = g.lower(x, w)
  pre_u = lowered_u.as_text(dialect="hlo")
  try:
    assert order_forced(pre_u) == (False, False)
    _, _, insts_u, _, i_dot_u, i_done_u = find_schedule(lowered_u.compile().as_text())
    assert insts_u[i_dot_u]["name"] not in insts_u[i_done_u]["operands"]
  except AssertionError:
    print(pre_u)
    raise
  # and both compute the right thing
  for fn, x_in in ((f, to_np(x) + 1.0), (g, to_np(x))):
    gathered, y = fn(x, w)
    np.testing.assert_array_equal(to_np(gathered)[:8 * M], x_in)
    np.testing.assert_allclose(to_np(y), x_in @ to_np(w), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Several pairs in flight; slot leaks
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh,ax", [CASES[0], CASES[1]])
def test_multiple_pairs_in_flight(mesh, ax):
  """Two starts, compute on both inputs, then the dones in reverse order: each result is
  jax.lax's, and the compute results pass through done unchanged."""
  n = axis_size(mesh, ax)
  rng = np.random.default_rng(4)
  x1 = put(mesh, rand(rng, (8 * M, K), jnp.float32))
  x2 = put(mesh, rand(rng, (8 * M, K), jnp.float32))
  w = put(mesh, rand(rng, (K, 3), jnp.float32), P())
  perm = [(i, (i + 3) % n) for i in range(n)]

  def body(x1, x2, w):
    p = hc.all_gather_start(x1, ax, tiled=True)
    q = hc.ppermute_start(x2, ax, perm)
    y1 = p.input @ w
    y2 = q.input @ w
    b, y2 = hc.done(q, y2)
    a, y1 = hc.done(p, y1)
    ref = (jax.lax.all_gather(x1, ax, tiled=True), jax.lax.ppermute(x2, ax, perm),
           x1 @ w, x2 @ w)
    return (a, b, y1, y2), ref

  s = spec_all(mesh)
  f = smap(mesh, body, True, in_specs=(s, s, P()), out_specs=s)
  got, ref = run_sequential(f, x1, x2, w)
  for i, (a, b) in enumerate(zip(got, ref)):
    np.testing.assert_array_equal(to_np(a), to_np(b), err_msg=str(i))


def test_no_slot_leak_after_300_launches():
  """300 launches of a jitted start/done program leave no rendezvous slot behind, and the
  last launch is still correct."""
  rng = np.random.default_rng(5)
  x = put(MESH1, rand(rng, (8 * M, K), jnp.float32))

  def body(x):
    p = hc.all_gather_start(x, "x", tiled=True)
    y = p.input * 2
    g, y = hc.done(p, y)
    q = hc.all_to_all_start(y, "x")
    return g, hc.done(q)[0]

  f = smap(MESH1, body, True, out_specs=(P("x"), P("x")))
  ref = smap(MESH1, lambda x: (jax.lax.all_gather(x, "x", tiled=True),
                               jax.lax.all_to_all(x * 2, "x", 0, 0, tiled=True)), True,
             out_specs=(P("x"), P("x")))(x)
  out = None
  for _ in range(300):
    out = f(x)
  jax.block_until_ready(out)
  for a, b in zip(out, ref):
    np.testing.assert_array_equal(to_np(a), to_np(b))
  assert _hoccl.live_slot_count() == 0


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------

def test_done_of_non_pending_raises_type_error():
  with pytest.raises(TypeError, match="done"):
    hc.done(jnp.ones(3))

  def body(x):
    return hc.done((x, x))[0]

  with pytest.raises(TypeError, match="done"):
    jax.eval_shape(jax.shard_map(body, mesh=MESH1, in_specs=P("x"), out_specs=P("x")),
                   sds((16, 2)))


@pytest.mark.parametrize("order_input", [True, False])
def test_every_start_keeps_x_shape_as_its_input(order_input):
  """pending.input is x as an output of the start: x's shape and type for every start
  (all_to_all_start moves x as blocks, which must not show), and compute on it is right."""
  rng = np.random.default_rng(12)
  x = put(MESH1, rand(rng, (8 * 8, 3), jnp.float32))
  starts = {
      "all_gather": lambda v: hc.all_gather_start(v, "x", tiled=True, order_input=order_input),
      "all_to_all tiled": lambda v: hc.all_to_all_start(v, "x", tiled=True,
                                                        order_input=order_input),
      "all_to_all": lambda v: hc.all_to_all_start(v, "x", tiled=False, order_input=order_input),
      "ppermute": lambda v: hc.ppermute_start(v, "x", [(i, (i + 1) % 8) for i in range(8)],
                                              order_input=order_input),
      "psum": lambda v: hc.psum_start(v, "x", order_input=order_input),
      "psum_scatter": lambda v: hc.psum_scatter_start(v, "x", tiled=True,
                                                      order_input=order_input),
  }
  for name, start in starts.items():
    def body(v, start=start, name=name):
      pending = start(v)
      assert pending.input.shape == v.shape, (name, pending.input.shape, v.shape)
      assert jax.typeof(pending.input) == jax.typeof(v), (name, jax.typeof(pending.input))
      y = pending.input * 2.0 + 1.0  # compute on the start's input, as documented
      _, y = hc.done(pending, y)
      return y
    got = smap(MESH1, body, True)(x)
    np.testing.assert_array_equal(to_np(got), to_np(x) * 2.0 + 1.0, err_msg=name)


def test_done_twice_on_one_pending_raises():
  """done takes each Pending exactly once: a second done would wait (and sum) again."""
  def body(v):
    pending = hc.psum_start(v, "x")
    out, = hc.done(pending)
    with pytest.raises(ValueError, match="already passed to done.*exactly once"):
      hc.done(pending)
    return out

  jax.eval_shape(jax.shard_map(body, mesh=MESH1, in_specs=P("x"), out_specs=P()),
                 sds((16, 2)))


@pytest.mark.parametrize("start", [
    lambda v: hc.psum_start(v, "x"),
    lambda v: hc.all_gather_start(v, "x", tiled=True),
    lambda v: hc.ppermute_start(v, "x", [(i, (i + 1) % 8) for i in range(8)]),
], ids=["psum", "all_gather", "ppermute"])
@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_gradient_through_an_async_pair_says_what_to_use(start, mode):
  """Async pairs have no derivative: the error says so and names the differentiable ops,
  instead of JAX's "Differentiation rule for 'hoccl_start' not implemented"."""
  f = jax.shard_map(lambda v: hc.done(start(v))[0].sum(), mesh=MESH1, in_specs=P("x"),
                    out_specs=P(), check_vma=False)
  x = put(MESH1, jnp.ones((16, 2), jnp.float32))
  with pytest.raises(NotImplementedError, match="async pairs .* are not differentiable") as e:
    jax.grad(f)(x) if mode == "grad" else jax.jvp(f, (x,), (x,))
  assert "synchronous op" in str(e.value) and "all_gather_matmul" in str(e.value)


def test_gradient_of_compute_between_start_and_done():
  """Compute between start and done may be differentiated when the exchanged input is not:
  done hands the deps back, their tangents pass through; equal to the same without the pair."""
  rng = np.random.default_rng(13)
  x = put(MESH1, rand(rng, (16, 2), jnp.float32))
  w = jnp.asarray(rand(rng, (2, 2), jnp.float32))

  def loss(w, v, pair):
    y = jnp.tanh(v @ w)
    if pair:
      pending = hc.all_gather_start(jax.lax.stop_gradient(v), "x", tiled=True)
      g, y = hc.done(pending, y)
      y = y + 0.0 * g[:2].sum()
    return jax.lax.psum(jnp.sum(y * y), "x")

  def grads(pair):
    return jax.jit(jax.shard_map(jax.grad(lambda w, v: loss(w, v, pair)), mesh=MESH1,
                                 in_specs=(P(), P("x")), out_specs=P()))(w, x)
  np.testing.assert_allclose(to_np(grads(True)), to_np(grads(False)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tiled,rows", [(True, 6), (False, 16)])
def test_all_to_all_start_bad_leading_dim(tiled, rows):
  """Leading dim 6 does not split into 8 blocks; untiled needs exactly 8 rows (got 2 local)."""
  f = jax.shard_map(lambda x: hc.done(hc.all_to_all_start(x, "x", tiled=tiled))[0],
                    mesh=MESH1, in_specs=P("x"), out_specs=P("x"))
  local = rows // 8 if not tiled else rows
  with pytest.raises(ValueError, match="all_to_all_start"):
    jax.eval_shape(f, sds((8 * local, 2)))


@pytest.mark.parametrize("start", [
    lambda x: hc.all_gather_start(x, "x"),
    lambda x: hc.all_to_all_start(x, "x"),
    lambda x: hc.ppermute_start(x, "x", [(0, 1)]),
], ids=["all_gather", "all_to_all", "ppermute"])
def test_start_outside_shard_map(start):
  x = jnp.ones((8, 2), jnp.float32)
  with pytest.raises(ValueError, match="outside jax.shard_map"):
    start(x)
  with pytest.raises(ValueError, match="outside jax.shard_map"):
    jax.jit(start)(x)


def test_start_unknown_axis():
  f = jax.shard_map(lambda x: hc.done(hc.all_gather_start(x, "nope"))[0], mesh=MESH1,
                    in_specs=P("x"), out_specs=P("x"))
  with pytest.raises(ValueError, match="nope"):
    jax.eval_shape(f, sds((16, 2)))


# ------------------------------------------------------------------------------------------
# all_gather_into_start: a chain of gathers filling one buffer (how matmul_psum assembles)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_all_gather_into_chain_matches_lax(dtype):
  """Two gathers write rows [0, 8*2) and [16, 16+8*1) of a new [24, 3] buffer, the second
  into the first's buffer (donated, no copy), waited in the order matmul_psum uses: the
  buffer equals the concatenation of jax.lax.all_gathers."""
  from jax_hoccl._src.fused.row_pieces import exchanges as ex
  rng = np.random.default_rng(7)
  a, b = put(MESH1, rand(rng, (16, 3), dtype)), put(MESH1, rand(rng, (8, 3), dtype))

  def ours(a, b):
    p1 = ex.all_gather_into_start(a, "x", (24, 3), 0, to="invariant")
    p2 = ex.all_gather_into_start(b, "x", p1.buffer, 16, to="invariant")
    token = ex.wait_after(p1, p2.token)
    return ex.done_after(p2, token)

  def lax(a, b):
    return jnp.concatenate([jax.lax.all_gather(a, "x", tiled=True),
                            jax.lax.all_gather(b, "x", tiled=True)])

  got = smap(MESH1, ours, True, in_specs=(P("x"), P("x")), out_specs=P())(a, b)
  ref = smap(MESH1, lax, False, in_specs=(P("x"), P("x")), out_specs=P())(a, b)
  np.testing.assert_array_equal(to_np(got), to_np(ref))


@pytest.mark.parametrize("streams", [None, "2", "3"])
def test_starts_spread_over_async_streams(streams, monkeypatch):
  """JAX_HOCCL_ASYNC_STREAMS=s: matmul_psum's starts (ppermute and all_gather in place) carry
  stream = site % s in the lowered program, round-robin in program order (every rank lowers
  the same program, so every rank picks the same stream; default one stream), but the last
  gather, which runs on XLA's stream (-1); and the values stay jax.lax's. A value out of 1..4
  fails when the program is lowered."""
  if streams:
    monkeypatch.setenv("JAX_HOCCL_ASYNC_STREAMS", streams)
  rng = np.random.default_rng(8)
  x = put(MESH1, rand(rng, (64, 8 * 8), jnp.bfloat16), P(None, "x"))
  w = put(MESH1, rand(rng, (8 * 8, 8), jnp.bfloat16), P("x"))
  f = smap(MESH1, lambda x, w: hc.matmul_psum(x, w, "x", chunks=4), True,
           in_specs=(P(None, "x"), P("x")), out_specs=P())
  text = jax.jit(f).lower(x, w).as_text()
  got = [int(v) for v in re.findall(r"stream = (\d+) : i64", text)]
  s = int(streams or 1)
  assert len(got) == 4 * 7 + 3  # 7 ppermute steps and one gather per piece, but the last
  assert len(re.findall(r"stream = -1 : i64", text)) == 1
  assert got == [i % s for i in range(len(got))]  # round-robin in program order
  ref = smap(MESH1, lambda x, w: jax.lax.psum(x @ w, "x"), False,
             in_specs=(P(None, "x"), P("x")), out_specs=P())
  got_v, ref_v = to_np(jax.jit(f)(x, w)), to_np(jax.jit(ref)(x, w))
  np.testing.assert_allclose(got_v.astype(np.float32), ref_v.astype(np.float32),
                             rtol=5e-2, atol=5e-2)
  monkeypatch.setenv("JAX_HOCCL_ASYNC_STREAMS", "5")
  g = smap(MESH1, lambda x, w: hc.matmul_psum(x, w, "x", chunks=2), True,  # not cached
           in_specs=(P(None, "x"), P("x")), out_specs=P())
  with pytest.raises(ValueError, match="JAX_HOCCL_ASYNC_STREAMS must be 1 to 4"):
    jax.jit(g).lower(x, w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("batched", [False, True])
def test_all_gather_in_place_chain_matches_lax(dtype, batched):
  """matmul_psum's assembly: each rank writes its blocks into its slots of one buffer, then
  gathers them in place (its own block not copied): rows [0, 8*2) by an async start, rows
  [16, 16+8*1) by one on XLA's stream (sync), waited in matmul_psum's order. The buffer equals
  the concatenation of jax.lax.all_gathers, also under vmap."""
  from jax_hoccl._src.fused.row_pieces import exchanges as ex
  rng = np.random.default_rng(9)
  lead = (2,) if batched else ()
  a = put(MESH1, rand(rng, (*lead, 16, 3), dtype), P(*((None,) * len(lead)), "x"))
  b = put(MESH1, rand(rng, (*lead, 8, 3), dtype), P(*((None,) * len(lead)), "x"))

  def ours(a, b):
    r = jax.lax.axis_index("x")
    buf = jax.lax.dynamic_update_slice_in_dim(jnp.full((24, 3), 7, dtype), a, 2 * r, axis=0)
    p1 = ex.all_gather_in_place_start(buf, "x", 0, 2, to="invariant")
    buf = jax.lax.dynamic_update_slice_in_dim(p1.buffer, b, 16 + r, axis=0)
    p2 = ex.all_gather_in_place_start(buf, "x", 16, 1, to="invariant", sync=True)
    token = ex.wait_after(p1, p2.token)
    return ex.done_after(p2, token)

  def lax(a, b):
    return jnp.concatenate([jax.lax.all_gather(a, "x", tiled=True),
                            jax.lax.all_gather(b, "x", tiled=True)])

  spec = P(*((None,) * len(lead)), "x")
  wrap = (lambda f: jax.vmap(f)) if batched else (lambda f: f)
  got = smap(MESH1, wrap(ours), True, in_specs=(spec, spec), out_specs=P())(a, b)
  ref = smap(MESH1, wrap(lax), False, in_specs=(spec, spec), out_specs=P())(a, b)
  np.testing.assert_array_equal(to_np(got), to_np(ref))


def test_all_gather_in_place_rows_must_fit():
  from jax_hoccl._src.fused.row_pieces import exchanges as ex
  f = smap(MESH1, lambda a: ex.all_gather_in_place_start(a, "x", 8, 2).buffer, True,
           in_specs=P("x"), out_specs=P("x"))
  with pytest.raises(ValueError, match=r"rows \[8, 24\) do not fit into \(20, 3\)"):
    jax.jit(f).lower(sds((8 * 20, 3)))


def test_all_gather_into_rows_must_fit():
  from jax_hoccl._src.fused.row_pieces import exchanges as ex
  f = smap(MESH1, lambda a: ex.all_gather_into_start(a, "x", (20, 3), 8).buffer, True,
           in_specs=P("x"), out_specs=P("x"))
  with pytest.raises(ValueError, match=r"rows \[8, 24\).*do not fit into \(20, 3\)"):
    jax.jit(f).lower(sds((16, 3)))


# ------------------------------------------------------------------------------------------
# vmap of the async pairs
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("in_axis", [0, 1])
def test_async_pairs_under_vmap(in_axis):
  """vmap over a function that starts all_gather, ppermute and all_to_all, computes on the
  pending inputs, and waits: equal to vmap over jax.lax's collectives, for a batch axis in
  front of and behind the exchanged one."""
  n = 8
  perm = [(i, (i + 3) % n) for i in range(n)]
  rng = np.random.default_rng(11)
  x = put(MESH1, rand(rng, (n * 8, 8), jnp.float32))  # local [8, 8]: examples of 8 (n blocks)

  def ours(v):
    g, p, a = (hc.all_gather_start(v, "x", tiled=True), hc.ppermute_start(v, "x", perm),
               hc.all_to_all_start(v, "x"))
    s = (g.input * 2).sum()  # compute while the exchanges are in flight
    g, s = hc.done(g, s)
    p, s = hc.done(p, s)
    a, s = hc.done(a, s)
    return g + s, p, a

  def lax(v):
    s = (v * 2).sum()
    return (jax.lax.all_gather(v, "x", tiled=True) + s, jax.lax.ppermute(v, "x", perm),
            jax.lax.all_to_all(v, "x", 0, 0, tiled=True))

  specs = dict(in_specs=P("x"), out_specs=(P("x"), P("x"), P("x")))
  got = smap(MESH1, lambda x: jax.vmap(ours, in_axes=in_axis, out_axes=in_axis)(x), True,
             **specs)(x)
  ref = smap(MESH1, lambda x: jax.vmap(lax, in_axes=in_axis, out_axes=in_axis)(x), True,
             **specs)(x)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(to_np(a), to_np(b), rtol=1e-6, atol=1e-6)
