"""The flagged GEMM alone (fused/flagged/flagged_gemm.py, flags on) against XLA's dot on one Hopper GPU,
and how soon a copy-engine stream waiting on a flag moves once the flag is written. The gemm
section of `python -m jax_hoccl.bench`: rows {"impl", "m", "k", "n", "time_us"} (impl "xla" or
"jax_hoccl_flagged") and {"what", "time_us"} in "flag_latency".

Kernel times are CUPTI's (jax's Mosaic GPU profiler), median of CALLS calls, in ROUNDS
interleaved rounds (xla, flagged, then flagged, xla, ...): H200 clocks drift over a minute of
GEMMs (at M = 16384 three rounds of 20 calls gave 0.95-1.07x from run to run), so the ratio of
one round is what compares, and the median of the rounds' ratios is reported ("speed_vs_xla")
with their spread ((max - min) / median). Paired rounds beside them run XLA's dot and the
flagged GEMM back to back in one jit and take each call's ratio of the two kernels, so the
clocks cannot drift between the two; a kernel that follows another pays for what that one
left behind (its dirty lines in L2 written back, the clocks it left), so every round runs
both orders and takes the geometric mean of their ratios ("paired_speed_vs_xla",
"paired_spread": the median and spread of the rounds'; "paired_speed_by_order": the medians
with the dot first and with the flagged GEMM first).
"""
from __future__ import annotations

import math
import statistics

import numpy as np

ROUNDS = 15
CALLS = 10
# (M, K, N), bf16: the fused ops' shapes at M = 4096 and 16384 (K = N = 8192) and matmul_psum's
# per-rank GEMM on two GPUs (K = 4096)
SHAPES = [(4096, 8192, 8192), (16384, 8192, 8192), (4096, 4096, 8192)]
FLAG_ROWS = 1024


def _kernel_us(f, *args):
  from jax.experimental.mosaic.gpu import profiler
  _, times = profiler.measure(f, iterations=CALLS)(*args)
  return statistics.median(times) * 1e3


def kernel_names(exe, args) -> set[str]:
  """The names of the kernels one call of `exe` launches."""
  from jax.experimental.mosaic.gpu import profiler
  _, per_call = profiler.measure(exe, iterations=2, aggregate=False)(*args)
  return {name for name, _ in per_call[0]}


def beside_dot_us(exe, args, own, calls=CALLS) -> list[tuple[float, float]]:
  """Per call of `exe` (XLA's dot and a program in one jit): (the program's kernel time, the
  dot's, in us), the program's the longest kernel named in `own` (kernel_names of the program
  alone), the dot's the longest of the rest."""
  from jax.experimental.mosaic.gpu import profiler
  _, per_call = profiler.measure(exe, iterations=max(calls, 2), aggregate=False)(*args)
  out = []
  for kernels in per_call:
    mine = [t for name, t in kernels if name in own]
    dot = [t for name, t in kernels if name not in own]
    if not mine or not dot:
      raise RuntimeError(f"cannot tell the program's kernels {sorted(own)} from the dot's in "
                         f"{[name for name, _ in kernels]}")
    out.append((max(mine) * 1e3, max(dot) * 1e3))
  return out


def beside_dot(dot, program, dot_args: int):
  """XLA's dot and a program in one jit, in each order: (dot first, program first). Both take
  the dot's `dot_args` operands, then the program's; the second runs after the first (its
  operands pass an optimization barrier with the first's result)."""
  import jax

  def dot_first(*args):
    d, rest = jax.lax.optimization_barrier((dot(*args[:dot_args]), args[dot_args:]))
    return d, program(*rest)

  def program_first(*args):
    p, rest = jax.lax.optimization_barrier((program(*args[dot_args:]), args[:dot_args]))
    return dot(*rest), p

  return jax.jit(dot_first), jax.jit(program_first)


def paired_round(pairs, args, own, calls=CALLS) -> tuple[float, float, float, float, float]:
  """One paired round of the two orders (`pairs`: beside_dot's, jitted or compiled), half the
  calls each: (the program's time over the dot's, the geometric mean of the two orders'
  medians of the calls' ratios; that with the dot first; with the program first; the
  program's median time, the dot's, in us)."""
  by_order, program_us, dot_us = [], [], []
  for pair in pairs:
    got = beside_dot_us(pair, args, own, max(calls // 2, 2))
    by_order.append(statistics.median(p / d for p, d in got))
    program_us += [p for p, _ in got]
    dot_us += [d for _, d in got]
  return (math.sqrt(by_order[0] * by_order[1]), *by_order, statistics.median(program_us),
          statistics.median(dot_us))


def bench_gemm(shapes=SHAPES):
  """Rows of the gemm section (empty where the flagged GEMM cannot run)."""
  import jax
  import jax.numpy as jnp
  from jax_hoccl._src.fused.flagged import flagged_gemm as fg

  rows = []
  for m, k, n in shapes:
    if fg.unsupported_reason(m, k, n, jnp.bfloat16):
      continue
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    out = jnp.zeros((m, n), jnp.bfloat16)
    flags = jnp.zeros((m // FLAG_ROWS,), jnp.int32)
    xla = jax.jit(lambda a, b: a @ b)
    flagged = jax.jit(lambda a, b, o, f: fg.flagged_matmul(a, b, out=o, flags=f,
                                                           flag_rows=FLAG_ROWS))
    pairs = beside_dot(lambda a, b: a @ b, lambda a, b, o, f: fg.flagged_matmul(
        a, b, out=o, flags=f, flag_rows=FLAG_ROWS), 2)
    own = kernel_names(flagged, (a, b, out, flags))
    times = {"xla": [], "jax_hoccl_flagged": []}
    calls = {"xla": lambda: _kernel_us(xla, a, b),
             "jax_hoccl_flagged": lambda: _kernel_us(flagged, a, b, out, flags)}
    paired = []  # per round: paired_round's ratios (the flagged GEMM's time over the dot's)
    for r in range(ROUNDS):
      for impl in (("xla", "jax_hoccl_flagged") if r % 2 == 0 else ("jax_hoccl_flagged", "xla")):
        times[impl].append(calls[impl]())
      paired.append(paired_round(pairs, (a, b, a, b, out, flags), own)[:3])
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - xla(a, b).astype(jnp.float32))))
    if err > 0.05:
      raise AssertionError(f"flagged GEMM {m}x{k}x{n} differs from XLA's dot by {err}")
    ratios = [x / f for x, f in zip(times["xla"], times["jax_hoccl_flagged"])]
    speed = statistics.median(ratios)
    paired_speeds = [1 / q for q, _, _ in paired]
    paired_speed = statistics.median(paired_speeds)
    for impl, ts in times.items():
      rows.append(dict(impl=impl, m=m, k=k, n=n, time_us=statistics.median(ts),
                       **({"speed_vs_xla": speed, "spread": (max(ratios) - min(ratios)) / speed,
                           "paired_speed_vs_xla": paired_speed,
                           "paired_spread": (max(paired_speeds) - min(paired_speeds)) / paired_speed,
                           "paired_speed_by_order": [statistics.median(1 / r[i] for r in paired)
                                                     for i in (1, 2)]}
                          if impl != "xla" else {})))
  return rows


def cuda_driver():
  """(cuda.bindings' driver module, ck): ck(result) raises on an error and unwraps a value."""
  from cuda.bindings import driver as cu

  def ck(r):
    err = r[0] if isinstance(r, tuple) else r
    if int(err) != 0:
      raise RuntimeError(f"CUDA driver error {err}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r

  ck(cu.cuInit(0))
  return cu, ck


def bench_flag_latency(reps=50):
  """[{"what", "time_us"}]: a stream's cuStreamWaitValue32 released by a cuStreamWriteValue32
  on another stream, from an event just before the write to one just after the wait (median):
  the latency between a raised flag and the start of the copy waiting on it."""
  import jax.numpy as jnp
  try:
    cu, ck = cuda_driver()
  except ImportError:
    return []
  flags = jnp.zeros((2 * reps,), jnp.int32)
  flags.block_until_ready()
  base = flags.unsafe_buffer_pointer()
  writer, waiter = ck(cu.cuStreamCreate(1)), ck(cu.cuStreamCreate(1))
  ev = [(ck(cu.cuEventCreate(0)), ck(cu.cuEventCreate(0))) for _ in range(reps)]
  gaps = []
  for i, (before, released) in enumerate(ev):
    flag = cu.CUdeviceptr(base + 8 * i)
    ck(cu.cuStreamWaitValue32(waiter, flag, 1, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))
    ck(cu.cuEventRecord(released, waiter))
    ck(cu.cuEventRecord(before, writer))
    ck(cu.cuStreamWriteValue32(writer, flag, 1, 0))
    ck(cu.cuStreamSynchronize(waiter))
    ck(cu.cuStreamSynchronize(writer))
    gaps.append(ck(cu.cuEventElapsedTime(before, released)) * 1e3)
  for s in (writer, waiter):
    ck(cu.cuStreamDestroy(s))
  return [dict(what="stream wait released by a flag write on another stream",
               time_us=float(statistics.median(gaps)))]
