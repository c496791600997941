"""Several processes (jax.distributed, the multi-node case on CPU): the collectives over
groups that span processes compose jax_hoccl inside each process with XLA's collectives
across them (ops/across_processes.py) and equal jax.lax; async pairs over such groups are
rejected at lowering with a clear error instead of hanging in a rendezvous the other process
can never join."""
import os
import socket
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import numpy as np, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    mesh = jax.make_mesh((2,), ("x",))
    f = jax.jit(jax.shard_map(lambda v: jax_hoccl.done(jax_hoccl.all_gather_start(v, "x"))[0],
                              mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(4, np.float32))
    try:
        f.lower(x)
    except NotImplementedError as e:
        print("REJECTED:", e)
    else:
        print("LOWERED")
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_two_processes(tmp_path, worker: str, timeout: float):
  """Runs `worker` as processes 0 and 1 of a jax.distributed job on localhost; their output."""
  script = tmp_path / "worker.py"
  script.write_text(worker)
  addr = f"127.0.0.1:{_free_port()}"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, "-P", str(script), addr, str(i)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  return [p.communicate(timeout=timeout)[0] for p in procs]


def test_group_across_processes_is_rejected(tmp_path):
  for out in _run_two_processes(tmp_path, WORKER, timeout=120):
    assert "REJECTED:" in out, out[-2000:]
    assert "spans several processes" in out


HIERARCHICAL_WORKER = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import numpy as np, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_hoccl
    # 2 "nodes" (processes) x 2 local devices each.
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devs).reshape(2, 2), ("node", "local"))
    spec = P(("node", "local"))
    rng = np.random.default_rng(int(sys.argv[2]))
    local = rng.standard_normal((2 * 8, 5)).astype(np.float32)  # 2 local devices x 8 rows
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)

    def run(fn, out_specs=spec, check_vma=True, grad=False):
        sm = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=out_specs, check_vma=check_vma)
        f = jax.grad(lambda v: jnp.sum(jnp.sin(sm(v)))) if grad else sm
        return [np.asarray(s.data) for s in jax.jit(f)(x).addressable_shards]

    def size(axes):
        return 4 if isinstance(axes, tuple) else 2

    cases = {
        "psum": lambda m, a: (lambda v: m.psum(v, a)),
        "all_gather tiled": lambda m, a: (lambda v: m.all_gather(v, a, tiled=True)),
        "all_gather axis=1": lambda m, a: (lambda v: m.all_gather(v, a, axis=1)),
        "psum_scatter tiled": lambda m, a: (lambda v: m.psum_scatter(v, a, tiled=True)),
        "psum_scatter": lambda m, a: (lambda v: m.psum_scatter(v[:size(a)], a)),
        "all_to_all": lambda m, a: (lambda v: m.all_to_all(v, a, 0, 0, tiled=True)),
        "ppermute": lambda m, a: (lambda v: m.ppermute(
            v, a, [(i, (i + 1) % size(a)) for i in range(size(a))])),
        "pmean": lambda m, a: (lambda v: m.pmean(v, a)),
        "pmax": lambda m, a: (lambda v: m.pmax(v, a)),  # no grad (nor has jax.lax's)
        "pmin": lambda m, a: (lambda v: m.pmin(v, a)),
    }
    for axes in [("node", "local"), "node", ("local", "node")]:
        for name, make in cases.items():
            lax_make = make
            if name == "ppermute" and axes == ("local", "node"):
                # jax.lax.ppermute takes axes only in the mesh's order: the same shift over
                # (local, node) written as pairs over (node, local).
                n_of = lambda i: (i % 2) * 2 + i // 2  # (local, node) index -> (node, local)
                pairs = [(n_of(i), n_of((i + 1) % 4)) for i in range(4)]
                lax_make = lambda m, a: (lambda v: m.ppermute(v, ("node", "local"), pairs))
            for check_vma in (True, False):
                got = run(make(jax_hoccl, axes), check_vma=check_vma)
                ref = run(lax_make(jax.lax, axes), check_vma=check_vma)
                err = max(float(np.abs(g - r).max()) for g, r in zip(got, ref))
                assert err < 1e-5, (name, axes, check_vma, err)
            if name not in ("pmax", "pmin"):
              g1 = run(make(jax_hoccl, axes), grad=True)
              g2 = run(lax_make(jax.lax, axes), grad=True)
              err = max(float(np.abs(g - r).max()) for g, r in zip(g1, g2))
              assert err < 1e-5, (name, axes, "grad", err)
            print("OK", name, axes, flush=True)
    # Invariant gather over every device: the same everywhere.
    got, ref = (run(lambda v: m.all_gather(v, ("node", "local"), tiled=True, to="invarying"),
                    out_specs=P()) for m in (jax_hoccl, jax.lax))
    assert max(float(np.abs(g - r).max()) for g, r in zip(got, ref)) < 1e-5
    # The local part really runs on jax_hoccl's engine, the cross part on XLA's.
    for name, make in cases.items():
        text = jax.jit(jax.shard_map(make(jax_hoccl, ("node", "local")), mesh=mesh,
                                     in_specs=spec, out_specs=spec)).lower(x).as_text()
        assert "hoccl_" in text or name in ("all_to_all", "ppermute"), name
    print("HIERARCHICAL_OK", flush=True)
""")


def test_collectives_across_processes_equal_lax(tmp_path):
  """Every collective over axes that span processes ("nodes") — both axes, the cross one
  alone, both in the other order — with check_vma on and off and under grad: jax_hoccl
  inside each process, XLA's collective across them; equal to jax.lax."""
  for out in _run_two_processes(tmp_path, HIERARCHICAL_WORKER, timeout=300):
    assert "HIERARCHICAL_OK" in out, out[-3000:]
