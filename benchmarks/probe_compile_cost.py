"""What jax_hoccl adds to compile time: lowering (jit(f).lower) and XLA compiling
(lowered.compile()) measured apart, jax_hoccl against jax.lax, for a one-psum program and for
examples/train_flax.py's train step (when flax and optax are installed). Each repetition
lowers a new function (nothing cached by jax), after one warm-up (imports, FFI registration);
the medians are printed in ms.

    python benchmarks/probe_compile_cost.py [repetitions, default 20]
PROBE_PROFILE=1 also prints the 25 functions with the most cumulative time while jax_hoccl
lowers the one-psum program (cProfile).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("PJRT_NPROC", "16")
import numpy as np  # noqa: E402
import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_hoccl  # noqa: E402

REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def one_psum(lib, mesh):
  x = jax.device_put(np.ones((8 * 64, 256), np.float32), NamedSharding(mesh, P("x")))

  def make():
    return jax.jit(jax.shard_map(lambda a: lib.psum(a, "x"), mesh=mesh, in_specs=P("x"),
                                 out_specs=P())), (x,)

  return make


def flax_step(lib, mesh):
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "examples"))
  import train_flax as ex  # noqa: E402
  from flax import nnx  # noqa: E402
  import optax  # noqa: E402

  args = ex.argparse.Namespace(vocab=64, d=64, hidden=256, seq=16, layers=2, seed=0, lr=1e-2,
                               steps=10, batch=16)
  with jax.set_mesh(mesh):
    model = ex.Model(args.vocab, args.d, args.hidden, args.seq, args.layers, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    specs = nnx.get_partition_spec(params)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
  tokens, targets = next(ex.batches(args, args.vocab))
  tokens = jax.device_put(tokens, NamedSharding(mesh, P(ex.DP, ex.TP)))
  targets = jax.device_put(targets, NamedSharding(mesh, P(ex.DP)))

  def make():
    return (ex.make_train_step(lib, graphdef, specs, mesh, tx, mesh.shape[ex.DP]),
            (params, opt_state, tokens, targets))

  return make


def measure(make, lib, mesh, reps):
  jax_hoccl.route_collectives(lib is jax_hoccl)
  try:
    with jax.set_mesh(mesh):
      low, comp = [], []
      for i in range(reps + 1):
        f, args = make()
        t0 = time.perf_counter()
        lowered = f.lower(*args)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        if i:  # the first one also pays imports and the FFI registration
          low.append(t1 - t0)
          comp.append(t2 - t1)
      return 1e3 * statistics.median(low), 1e3 * statistics.median(comp), lowered
  finally:
    jax_hoccl.route_collectives(False)


def main():
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{os.cpu_count()} CPU cores, median of {REPS}")
  programs = {"one psum (8 ranks, 64 KiB each)": (one_psum, jax.make_mesh((8,), ("x",)))}
  try:
    import flax  # noqa: F401
    import optax  # noqa: F401
    programs["train_flax.py step (dp 4 x tp 2)"] = (flax_step, jax.make_mesh((4, 2),
                                                                             ("dp", "tp")))
  except ImportError:
    print("(flax/optax not installed: the train_flax.py step is skipped)")
  for name, (program, mesh) in programs.items():
    row = {}
    for lib in (jax.lax, jax_hoccl):
      low, comp, lowered = measure(program(lib, mesh), lib, mesh, REPS)
      row[lib.__name__] = (low, comp, len(lowered.as_text()))
    (ll, lc, lt), (hl, hc, ht) = row["jax.lax"], row["jax_hoccl"]
    print(f"{name}: lower {hl:.1f} ms vs jax.lax {ll:.1f} ({hl / ll:.2f}x), compile "
          f"{hc:.1f} ms vs {lc:.1f} ({hc / lc:.2f}x); StableHLO {ht} vs {lt} characters")
  if os.environ.get("PROBE_PROFILE"):
    program, mesh = programs["one psum (8 ranks, 64 KiB each)"]
    make = program(jax_hoccl, mesh)
    with jax.set_mesh(mesh):
      f, args = make()
      f.lower(*args)
      prof = cProfile.Profile()
      prof.enable()
      for _ in range(REPS):
        f, args = make()
        f.lower(*args)
      prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
  main()
