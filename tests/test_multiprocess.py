"""Several processes (jax.distributed, the multi-node case on CPU): groups that span
processes are rejected at lowering with a clear error instead of hanging in a rendezvous the
other process can never join; psum is the exception and runs hierarchically."""
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
    f = jax.jit(jax.shard_map(lambda v: jax_hoccl.all_gather(v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
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
    local = rng.standard_normal((2 * 6, 5)).astype(np.float32)  # 2 local devices x 6 rows
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)
    # The local part really runs on jax_hoccl's engine.
    assert "hoccl_" in jax.jit(jax.shard_map(lambda v: jax_hoccl.psum(v, ("node", "local")),
        mesh=mesh, in_specs=spec, out_specs=spec)).lower(x).as_text()
    for axes, check_vma in [(("node", "local"), True), ("node", True), (("local", "node"), True),
                            (("node", "local"), False)]:
        outs = []
        for mod in (jax_hoccl, jax.lax):
            f = jax.jit(jax.shard_map(lambda v: mod.psum(v, axes), mesh=mesh, in_specs=spec,
                                      out_specs=spec, check_vma=check_vma))
            outs.append(np.asarray(f(x).addressable_data(0)))
        err = float(np.abs(outs[0] - outs[1]).max())
        print("AXES", axes, "MAXERR", err, flush=True)
        assert err < 1e-5, err
    print("HIERARCHICAL_OK", flush=True)
""")


def test_psum_across_processes_is_hierarchical(tmp_path):
  """psum over an axis that spans processes ("nodes"): jax_hoccl inside each process, XLA's
  collective across them; equal to jax.lax.psum."""
  for out in _run_two_processes(tmp_path, HIERARCHICAL_WORKER, timeout=180):
    assert "HIERARCHICAL_OK" in out, out[-3000:]
