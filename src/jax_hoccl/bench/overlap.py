"""The fused ops' overlap with several ranks on one GPU: two processes under an MPS daemon of
their own, the SMs split evenly between them (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), as if each
had a GPU. Each fused op against what it hides its exchange behind, run by every rank at once:
the GEMMs alone (all_gather_matmul, matmul_reduce_scatter, matmul_psum) or the unfused
composition on jax_hoccl's collectives (matmul_all_to_all, embedding_all_to_all: jax.lax's own
NCCL refuses two ranks on one GPU). HBM is shared and there is no NVLink, so the copies are
SM copies: the ratios say what is exposed, not what two GPUs would show.

    python -m jax_hoccl.bench --overlap [--out DIR]

Rows: {"op", "m", "k", "n", "ranks", "sm_percent", "fused_us", "reference_us"}, the median
over rounds of each rank's time per call (10 chained calls in one jit), the larger rank's.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import textwrap

from jax_hoccl.bench import machine, ranks
from jax_hoccl.launch import mps_daemon, run_workers

RANKS = 2
ROUNDS = 5

WORKER = textwrap.dedent("""
    import json, os, sys
    import jax
    addr, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(addr, num_processes=n, process_id=me, local_device_ids=[0])
    import numpy as np, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    from jax_hoccl.bench import fused
    mesh = jax.make_mesh((n,), ("x",))
    rng = np.random.default_rng(0)
    rnd = lambda *s, dtype=jnp.bfloat16: (rng.standard_normal(s, dtype=np.float32) * 0.05).astype(dtype)
    sync = jax.jit(jax.shard_map(lambda v: jax_hoccl.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                 out_specs=P()))
    token = jax.make_array_from_callback((n,), NamedSharding(mesh, P("x")),
                                         lambda i: np.zeros((n,), np.float32)[i])
    rows = []

    def measure(op, m, k, nout, reference, fused_body, args, specs, ref_args=None):
        ref = fused._compiled(mesh, reference, ref_args or args, specs)
        run = fused._compiled(mesh, fused_body, args, specs)
        r_t, f_t = [], []
        for _ in range(int(os.environ["ROUNDS"])):
            sync(token).block_until_ready()  # every rank starts each timing together
            r_t.append(ref())
            sync(token).block_until_ready()
            f_t.append(run())
        us = lambda ts: float(np.median(ts)) / fused.ITERS * 1e6
        rows.append(dict(op=op, m=m, k=k, n=nout, ranks=n,
                         sm_percent=int(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", 100)),
                         fused_us=us(f_t), reference_us=us(r_t)))
        print(f"{op:22s} M={m:6d} fused {us(f_t):9.1f} us  reference {us(r_t):9.1f} us  "
              f"x{us(f_t) / us(r_t):.3f}", flush=True)

    k = nout = 8192
    for m in (4096, 16384):
        x, w = rnd(m, k), rnd(k, nout)
        measure("all_gather_matmul", m, k, nout, lambda xf, w: xf @ w,
                lambda x, w: jax_hoccl.all_gather_matmul(x, w, "x"), (x, w), (P("x"), P(None, "x")),
                ref_args=(np.tile(x, (n, 1)), w))
        measure("matmul_reduce_scatter", m, k, nout, lambda x, w: x @ w,
                lambda x, w: jax_hoccl.matmul_reduce_scatter(x, w, "x"), (x, w), (P(None, "x"), P("x")))
        measure("matmul_psum", m, k, nout, lambda x, w: x @ w,
                lambda x, w: jax_hoccl.matmul_psum(x, w, "x"), (x, w), (P(None, "x"), P("x")))
    e, c, h, d = fused.MOE_ECHD
    x, w = rnd(n * n, e, c, h), rnd(n * e, h, d)
    measure("matmul_all_to_all", n * e * c, h, d,
            lambda x, w: jax_hoccl.all_to_all(jnp.matmul(x, w), "x", 0, 0, tiled=True),
            lambda x, w: jax_hoccl.matmul_all_to_all(x, w, "x"), (x, w), (P("x"), P("x")))
    v, dim, b, l = fused.EMBEDDING_VDBL
    table = rng.standard_normal((n * v, dim), dtype=np.float32)
    ids = rng.integers(0, v, (n * n, b, l)).astype(np.int32)
    measure("embedding_all_to_all", n * b, l, dim,
            lambda t, i: jax_hoccl.all_to_all(fused.embedding_lookup(t, i), "x", 0, 0, tiled=True),
            lambda t, i: jax_hoccl.embedding_all_to_all(t, i, "x"), (table, ids), (P("x"), P("x")))
    print("RESULT" + json.dumps(rows), flush=True)
    os._exit(0)
""")


def run(out_dir: str, commit: str, sm_percent: int = 100 // RANKS) -> str:
  """Runs the ranks under an MPS daemon of their own; writes and returns the results JSON."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(ROUNDS=str(ROUNDS), JAX_HOCCL_TIMEOUT_S="120",
             CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(sm_percent),
             XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.8 / RANKS:.2f}",
             XLA_FLAGS="--xla_gpu_shard_autotuning=false")
  with mps_daemon() as mps:
    found = ranks.results(run_workers(WORKER, RANKS, {**env, **mps}, 900))
  rows = ranks.slowest(found, ("fused_us", "reference_us"))
  import jax
  gpus = machine.gpu_names()[:1] or ["GPU"]
  result = {"what": "fused op vs its reference, every rank at once, ranks sharing one GPU "
                    "under MPS with the SMs split (jax_hoccl/bench/overlap.py)",
            "machine": f"{gpus[0]} ({RANKS} ranks under MPS, {sm_percent}% of the SMs each), "
                       f"{platform.machine()}, {os.cpu_count()} CPUs",
            "devices": gpus,
            "jax": jax.__version__, "commit": commit, "date": str(datetime.date.today()),
            "overlap": rows}
  print(f"{'op':22s} {'M':>6s} {'fused us':>10s} {'reference us':>13s} ratio")
  for r in rows:
    print(f"{r['op']:22s} {r['m']:6d} {r['fused_us']:10.1f} {r['reference_us']:13.1f} "
          f"{r['fused_us'] / r['reference_us']:.3f}")
  os.makedirs(out_dir, exist_ok=True)
  name = os.path.join(out_dir, f"{result['date']}-{machine.file_tag(True)}-overlap.json")
  with open(name, "w") as f:
    json.dump(result, f, indent=1)
  return name
