"""Groups that span processes (jax.distributed) are rejected at lowering with a clear
error, instead of hanging in a rendezvous the other process can never join."""
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
    f = jax.jit(jax.shard_map(lambda v: jax_hoccl.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P()))
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


def test_group_across_processes_is_rejected(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(WORKER)
  addr = f"127.0.0.1:{_free_port()}"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, "-P", str(script), addr, str(i)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  for out in outs:
    assert "REJECTED:" in out, out[-2000:]
    assert "spans several processes" in out
