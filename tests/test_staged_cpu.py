"""The CPU engine's staged one-hop path across processes (cc/cpu/cpu_staged.h): below the
crossover (JAX_HOCCL_STAGED_BYTES per peer) a call copies into its peers' slots and waits for
their flags, with no rendezvous; above it the per-call rendezvous runs as before. Each test is
a jax.distributed job of 2 or 4 processes of one CPU device each, checked against numpy on
random data; failures end the survivor's call with a clear error and leave nothing of the job
in /dev/shm."""
import os
import textwrap

import pytest

from conftest import run_processes

COMMON = textwrap.dedent("""
    import json, os, signal, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    me, n = int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(sys.argv[1], num_processes=n, process_id=me)
    from jax._src import distributed
    import numpy as np, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    from jax_hoccl import _hoccl
    mesh = jax.make_mesh((n,), ("tp",))
    spec = P("tp")
    shift = [(i, (i + 1) % n) for i in range(n)]

    def data(rank, shape, dtype, seed):
        rng = np.random.default_rng([seed, rank])
        if np.dtype(dtype).kind == "i":
            return rng.integers(-10, 11, shape).astype(dtype)
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    def shard(local):
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)

    def jit(fn, n_in=1):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * n_in, out_specs=spec))

    def mine(y):
        return np.asarray(y.addressable_shards[0].data).astype(np.float64)

    def paths():
        return dict(_hoccl.cpu_calls_by_path())

    def ran(before):
        now = paths()
        return {k for k in now if now[k] > before[k]}

    def secret():
        return distributed.global_state.client.blocking_key_value_get("jax_hoccl/job/secret", 60_000)

    def finish(word):  # process 0 holds the job's coordinator: nobody leaves before the others
        print(word, flush=True)  # (once it has left, the others may die of it)
        distributed.global_state.client.wait_at_barrier("test/finish", 120_000)
        os._exit(0)
""")

OPS_WORKER = COMMON + textwrap.dedent("""
    ops = {
        "psum": lambda v: jax_hoccl.psum(v, "tp"),
        "pmean": lambda v: jax_hoccl.pmean(v, "tp"),
        "pmax": lambda v: jax_hoccl.pmax(v, "tp"),
        "all_gather": lambda v: jax_hoccl.all_gather(v, "tp", tiled=True),
        "psum_scatter": lambda v: jax_hoccl.psum_scatter(v, "tp", tiled=True),
        "all_to_all": lambda v: jax_hoccl.all_to_all(v, "tp", 0, 0, tiled=True),
        "ppermute": lambda v: jax_hoccl.ppermute(v, "tp", shift),
        "ppermute partial": lambda v: jax_hoccl.ppermute(v, "tp", [(0, n - 1)]),
    }

    def expected(name, xs):  # rank me's result from every rank's input (float64)
        rows = xs[0].shape[0] // n
        if name == "psum": return sum(xs)
        if name == "pmean": return sum(xs) / n
        if name == "pmax": return np.maximum.reduce(xs)
        if name == "all_gather": return np.concatenate(xs)
        if name == "psum_scatter": return sum(xs)[me * rows:(me + 1) * rows]
        if name == "all_to_all": return np.concatenate([x[me * rows:(me + 1) * rows] for x in xs])
        if name == "ppermute": return xs[(me - 1) % n]
        if name == "ppermute partial": return xs[0] if me == n - 1 else 0 * xs[0]

    # (rows per rank, columns, the path every mover of the call takes)
    sizes = json.loads(os.environ["SIZES"])
    for seed, (rows, cols, path) in enumerate(sizes):
        for dtype in (np.float32, jnp.bfloat16, np.int32):
            xs = [data(r, (rows, cols), dtype, seed) for r in range(n)]
            x = shard(xs[me])
            for name, op in ops.items():
                if name == "pmean" and dtype == np.int32:
                    continue
                before = paths()
                got = mine(jit(op)(x))
                assert ran(before) == {path}, (name, rows, cols, ran(before), paths())
                want = expected(name, [v.astype(np.float64) for v in xs])
                reduces = name in ("psum", "pmean", "psum_scatter")
                tol = 0.06 if reduces and dtype == jnp.bfloat16 else 1e-5 if reduces else 0
                err = float(np.abs(got - want).max())
                assert got.shape == want.shape and err <= tol, (name, np.dtype(dtype).name, err)
            print("OK", rows, cols, path, np.dtype(dtype).name, flush=True)
    finish("OPS_OK")
""")


@pytest.mark.parametrize("n", [2, 4])
def test_every_op_on_the_staged_path_equals_numpy(tmp_path, n):
  """Below the default crossover (1 MiB) every op, float32, bfloat16 and int32, runs staged."""
  sizes = [[2 * n, 13, "staged"], [8 * n, 257, "staged"]]
  for out in run_processes(tmp_path, OPS_WORKER, 600, n, {"SIZES": str(sizes).replace("'", '"')}):
    assert "OPS_OK" in out, out[-3000:]


@pytest.mark.parametrize("n", [2, 4])
def test_both_sides_of_the_crossover_equal_numpy(tmp_path, n):
  """JAX_HOCCL_STAGED_BYTES=2048: small calls staged, larger ones on the rendezvous, each
  right; calls of both kinds in one job."""
  sizes = [[2 * n, 13, "staged"], [8 * n, 160, "rendezvous"], [n, 3, "staged"]]
  outs = run_processes(tmp_path, OPS_WORKER, 600, n,
                       {"SIZES": str(sizes).replace("'", '"'), "JAX_HOCCL_STAGED_BYTES": "2048"})
  for out in outs:
    assert "OPS_OK" in out, out[-3000:]


def test_staged_bytes_zero_keeps_the_rendezvous(tmp_path):
  sizes = [[4, 13, "rendezvous"]]
  for out in run_processes(tmp_path, OPS_WORKER, 600, 2,
                           {"SIZES": str(sizes).replace("'", '"'), "JAX_HOCCL_STAGED_BYTES": "0"}):
    assert "OPS_OK" in out, out[-3000:]


LANES_WORKER = COMMON + textwrap.dedent("""
    # Two independent instructions in one program (XLA:CPU may run them in either order, or
    # at once), each call on fresh data: two lanes, each alternating its slots.
    two = jit(lambda v, w: (jax_hoccl.psum(v, "tp"), jax_hoccl.all_gather(w, "tp", tiled=True)), 2)
    for i in range(60):
        vs = [data(r, (n, 5), np.float32, 2 * i) for r in range(n)]
        ws = [data(r, (3, 7), np.int32, 2 * i + 1) for r in range(n)]
        a, b = two(shard(vs[me]), shard(ws[me]))
        assert np.abs(mine(a) - sum(v.astype(np.float64) for v in vs)).max() < 1e-5, i
        assert (mine(b) == np.concatenate(ws)).all(), i

    # One lane called 9 times in a loop per execution (an odd count: the next execution
    # starts on the other parity), beside a psum in the same body.
    def body(i, c):
        return 0.5 * jax_hoccl.ppermute(c, "tp", shift) + jax_hoccl.psum(c, "tp") / (2 * n)
    loop = jit(lambda v: jax.lax.fori_loop(0, 9, body, v))
    for k in range(3):
        cs = [data(r, (4, 6), np.float32, 100 + k).astype(np.float64) for r in range(n)]
        got = mine(loop(shard(cs[me].astype(np.float32))))
        for _ in range(9):
            cs = [0.5 * cs[(r - 1) % n] + sum(cs) / (2 * n) for r in range(n)]
        assert np.abs(got - cs[me]).max() < 1e-5, (k, np.abs(got - cs[me]).max())
    print("OK lanes", flush=True)

    # 2000 calls back to back: the lanes' mappings, fds, mappings of the process and its
    # memory stay where they were after the first 100.
    def rss():
        with open("/proc/self/status") as f:
            return [int(l.split()[1]) for l in f if l.startswith("VmRSS")][0] * 1024
    def state():
        with open("/proc/self/maps") as f:
            maps = len(f.readlines())
        return (_hoccl.live_staged_mappings(), len(os.listdir("/proc/self/fd")), maps, rss())
    f = jit(lambda v: jax_hoccl.psum(v, "tp") / n)
    y = shard(np.full((n, 256), 1.0, np.float32))
    for i in range(100):
        y = f(y)
    y.block_until_ready()
    before, calls = state(), paths()
    for i in range(2000):
        y = f(y)
    y.block_until_ready()
    after, now = state(), paths()
    assert np.allclose(mine(y), 1.0)
    assert now["staged"] - calls["staged"] >= 2000 and now["rendezvous"] == calls["rendezvous"]
    assert after[0] == before[0] and after[1] <= before[1] + 2, (before, after)
    assert after[2] <= before[2] + 8 and after[3] - before[3] < (32 << 20), (before, after)
    assert not _hoccl.linked_shared_memory(), _hoccl.linked_shared_memory()
    print("OK flat", before, after, flush=True)
    print("SECRET", secret(), flush=True)
    finish("LANES_OK")
""")


def _left_by(outs):
  """Names in /dev/shm of the job whose workers printed its secret."""
  secrets = {line.split()[1] for out in outs for line in out.splitlines()
             if line.startswith("SECRET ")}
  assert secrets, outs[0][-2000:]
  return [f for f in os.listdir("/dev/shm") for s in secrets if f.startswith(f"jax_hoccl-{s[:32]}")]


@pytest.mark.parametrize("n", [2, 4])
def test_lanes_interleaved_in_a_loop_and_2000_calls(tmp_path, n):
  outs = run_processes(tmp_path, LANES_WORKER, 600, n)
  for out in outs:
    assert "LANES_OK" in out, out[-3000:]
  assert not _left_by(outs)


FAILURE_WORKER = COMMON + textwrap.dedent("""
    mode = os.environ["MODE"]
    x = shard(np.ones((1, 4), np.float32))
    psum = jit(lambda v: jax_hoccl.psum(v, "tp"))
    gather = jit(lambda v: jax_hoccl.all_gather(v, "tp", tiled=True))
    psum(x).block_until_ready()  # a good call: the job and psum's lane are set up
    print("SECRET", secret(), flush=True)
    first = mode.endswith("first")  # the peer fails at a lane's first call
    call = gather if first else psum
    if me == 1 and mode.startswith("absent"):
        distributed.global_state.client.blocking_key_value_get("test/failed", 120_000)
        os._exit(0)
    if me == 1 and mode == "exit":
        os._exit(0)
    if me == 1 and mode.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "mismatch":  # the same instruction (site: one line of code) in both, another op
        call = jit(lambda v: (jax_hoccl.all_gather(v, "tp", tiled=True) if me == 0 else jax_hoccl.ppermute(v, "tp", shift)))
    if mode == "dtype":  # the same op and bytes, another element type in each
        call = jit(lambda v: jax_hoccl.psum(v, "tp"))
        x = shard(np.ones((1, 4), np.float32 if me == 0 else np.int32))
    t0 = time.time()
    try:
        call(x).block_until_ready()
    except Exception as e:
        print("ERROR after %.1f s:" % (time.time() - t0), str(e).replace(chr(10), " "), flush=True)
    else:
        print("NO ERROR", flush=True)
    t0 = time.time()
    try:  # the group is broken: the next call fails at once, with the same error
        psum(x).block_until_ready()
    except Exception as e:
        print("AGAIN after %.1f s:" % (time.time() - t0), str(e).replace(chr(10), " "), flush=True)
    else:
        print("AGAIN NO ERROR", flush=True)
    if me == 0:
        distributed.global_state.client.key_value_set("test/failed", "1")
    time.sleep(1)
    os._exit(0)  # skip jax.distributed's shutdown barrier, which a dead peer cannot join
""")


def _failure(tmp_path, mode, env=None):
  return run_processes(tmp_path, FAILURE_WORKER, 180, 2,
                       {"MODE": mode, "JAX_HOCCL_TIMEOUT_S": "5", **(env or {})})


def _message(line):
  return line[line.index("jax_hoccl "):line.index("This group is now unusable")]


def _error(out, word="ERROR"):
  line = [l for l in out.splitlines() if l.startswith(word + " after")]
  assert line, out[-3000:]
  return float(line[0].split(" after ")[1].split(" s")[0]), line[0]


@pytest.mark.parametrize("mode", ["absent", "absent first"])
def test_a_peer_that_never_calls_times_out_naming_it(tmp_path, mode):
  """After a good call (psum's lane) and at a lane's first call (all_gather's)."""
  outs = _failure(tmp_path, mode)
  seconds, line = _error(outs[0])
  op = "all_gather" if mode.endswith("first") else "psum (all_gather)"
  assert f"jax_hoccl {op}: rank 0 (device 0, process 0, pid" in line, line
  assert "timed out after 5 s (JAX_HOCCL_TIMEOUT_S)" in line, line
  assert "from peer(s): rank 1 (device " in line and ", process 1, pid" in line, line
  assert "(in no jax_hoccl call)" in line, line
  assert 4.5 < seconds < 60, line
  again, line2 = _error(outs[0], "AGAIN")
  assert _message(line) == _message(line2) and again < 4.5, (line, line2)
  assert not _left_by(outs)


@pytest.mark.parametrize("mode", ["exit", "kill", "kill first"])
def test_a_peer_that_exits_or_is_killed_is_named(tmp_path, mode):
  outs = _failure(tmp_path, mode)
  seconds, line = _error(outs[0])
  assert "lost its peer(s) while waiting for" in line and "rank 1 (device " in line, line
  assert "exited" in line and seconds < 4.5, line  # found dead, not timed out
  assert "AGAIN after" in outs[0], outs[0][-2000:]
  assert not _left_by(outs)


def test_a_peer_in_another_op_at_the_same_instruction_is_a_mismatch(tmp_path):
  outs = _failure(tmp_path, "mismatch")
  for me, out in enumerate(outs):
    seconds, line = _error(out)
    assert "mismatched collectives" in line and seconds < 4.5, line
    assert "called all_gather of 16 bytes" in line and "called ppermute of 16 bytes" in line, line
    assert "AGAIN after" in out, out[-2000:]
  assert not _left_by(outs)


@pytest.mark.parametrize("staged_bytes", ["1048576", "0"], ids=["staged", "rendezvous"])
def test_peers_moving_as_many_bytes_of_other_types_are_a_mismatch(tmp_path, staged_bytes):
  """float32 on one rank, int32 on the other, one shape: a mismatch naming both types, not
  an exchange of the bits."""
  outs = _failure(tmp_path, "dtype", {"JAX_HOCCL_STAGED_BYTES": staged_bytes})
  for out in outs:
    seconds, line = _error(out)
    assert "mismatched collectives" in line and seconds < 4.5, line
    assert "of 16 bytes of float32" in line and "of 16 bytes of int32" in line, line
  assert not _left_by(outs)


@pytest.mark.parametrize("raw", ["-1", "1MiB", "0.5"])
def test_a_malformed_crossover_fails_naming_it(raw, monkeypatch):
  from jax_hoccl._src import environment
  monkeypatch.setenv("JAX_HOCCL_STAGED_BYTES", raw)
  with pytest.raises(ValueError, match="JAX_HOCCL_STAGED_BYTES must be an integer >= 0"):
    environment.check()
