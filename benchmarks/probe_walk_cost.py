"""What the fused ops' walks of the flagged GEMM cost on one GPU with nothing to wait for: each
walk (fused/flagged/gather_walk.py, fused/flagged/reduce_scatter_walk.py, rank 0) run with its
ready flags already up, against XLA's dot of the same M x K x N, and the plain flagged GEMM
(flags on) and the plain kernel adding into its output (the ring's partial
sums; flags on too).
What a walk costs over XLA's dot is compute-side cost that two GPUs cannot hide.

Kernel time by CUPTI, the GEMM kernel only (the longest kernel of a call: not the fill of the
ready flags). Rounds of CALLS calls per program, the programs in a rotated order each round;
a program's ratio to XLA's dot is taken within each round (H200 clocks drift from one round to
the next, the ratio much less), and the median of the rounds' ratios is reported with its
spread, (max - min) / median of those ratios.

  python benchmarks/probe_walk_cost.py [--m 4096,16384] [--ranks 2,4] [--rounds 12]
      [--calls 5] [--compare BAND_TILES=8,16 ...] [--waits sys,none,gpu] [--warm-partials]
      [--compare-at 4096] [--paired] [--json OUT.json]

--paired runs XLA's dot and the program back to back in one jit and takes each call's ratio
of their kernels (the program's kernels named as when it runs alone, the dot the longest of
the others): the two see the same clocks, where rounds of each in turn saw clocks drift
between them. The second of two kernels pays for what the first left (its dirty lines in L2,
the clocks), so each round runs both orders, half its calls each, and its ratio is the
geometric mean of the two orders' medians (jax_hoccl.bench.gemm.paired_round); the rows say
"paired": true, and "order_ratios": the medians over rounds with the dot first and with the
program first.

--compare NAME=V1,V2 measures each walk, and the kernel adding into its output, with each of
those values of the flagged_gemm module's NAME (ints, or on/off), each beside the module's own
values, at the M of --compare-at (elsewhere the module's own); e.g. CLAIM_GROUP=1,2 (tiles per
claim), BAND_TILES=8,16 (row tiles per band). The rows say which
("settings"; the walks' "claim_group" and "band_tiles" always).

--warm-partials measures the ring walks (matmul_reduce_scatter, matmul_psum) also with the
partial sums they add into written by a fusion just before the kernel, at the M of
--compare-at: in the fused op the copy engines write them moments before the tiles add into
them, so they may be in L2, where the other rows read them cold from HBM. The rows say so
("warm_partials").

--waits measures each walk with its tiles' waits for their ready flags as the kernel has them
("sys": a system-scope acquire), taken out ("none": right here only, where every flag is up
before the kernel), or with a GPU-scope acquire ("gpu"), at the M of --compare-at: what the
waits cost of a walk's time. The rows say which ("waits").
"""
import argparse
import concurrent.futures
import contextlib
import datetime
import json
import platform
import statistics

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler
from jax_hoccl._src.fused.flagged import flagged_gemm as fg
from jax_hoccl._src.fused.flagged import gather_walk as gig
from jax_hoccl._src.fused.flagged import reduce_scatter_walk as gr
from jax_hoccl.bench import __main__ as bench_main
from jax_hoccl.bench import gemm
from jax_hoccl.bench.gemm import kernel_names

K = N = 8192
bf = jnp.bfloat16


def ones_ready(one, count):
  """uint64 flags whose low words are `one` (1), then the tile claims, zero: made inside each
  call from a traced `one`, so every call counts its claims from zero (a constant would be one
  buffer for every call)."""
  return jnp.zeros((fg.ready_words(count),), jnp.int32).at[:2 * count:2].set(one)


def named(settings):
  """The module values a program was lowered with, as its name and its rows say them."""
  return {k.strip("_"): getattr(v, "__name__", v) for k, v in settings.items()}


def tag_of(settings):
  """How a program's name says which module values it was lowered with ("": its own)."""
  return "".join(f" {k}={v}" for k, v in named(settings).items())


def plain_programs(x, w, c, variants=({},)):
  """{name: (op, ranks, settings, jitted, args)} of the GEMMs without waits (settings: the
  flagged_gemm module's values they are lowered with; {}: its own), the one adding into its
  output under each of `variants`. Both raise flags, as the walks' blocks that add do: the
  kernel without flags runs slower whether it adds or not (benchmarks/README.md), so only
  like against like tells what the add costs."""
  m = x.shape[0]
  out = jnp.zeros((m, N), bf)
  flags = jnp.zeros((m // 1024,), jnp.int32)
  return {
      "xla dot": ("xla_dot", 1, {}, jax.jit(lambda x, w: x @ w), (x, w)),
      "flagged": ("flagged_matmul", 1, {}, jax.jit(
          lambda x, w, o, f: fg.flagged_matmul(x, w, out=o, flags=f, flag_rows=1024)),
          (x, w, out, flags)),
      **{"flagged, adding into out" + tag_of(v): ("flagged_matmul_add", 1, v, jax.jit(
          lambda x, w, c, f: fg.flagged_matmul(x, w, out=c, add=True, flags=f, flag_rows=1024)),
          (x, w, c, flags)) for v in variants if "_await_flag" not in v}}


def _await_at_gpu_scope(flag_ref, value, _await=fg._await_flag):
  """fg._await_flag with a GPU-scope acquire (--waits gpu)."""
  _await(flag_ref, value, memory_scope="gpu")


def _no_wait(flag_ref, value):
  """fg._await_flag taken out (--waits none: every flag is up before the kernel)."""


# --waits: the flagged_gemm module's _await_flag for each (None: its own)
WAITS = {"sys": None, "none": _no_wait, "gpu": _await_at_gpu_scope}


def walk_programs(x, w, c, n, settings, warm=False):
  """The three walks for n ranks (rank 0), lowered with the flagged_gemm module's `settings`;
  warm: the ring's partial sums written just before the kernel (as the copy engines leave
  them, in L2 where they fit), not read cold from HBM."""
  m_total = x.shape[0]
  m = m_total // n
  own, gathered = x[:m], x[m:]
  one = jnp.ones((), jnp.int32)
  count = (n - 1) * m // gig.READY_ROWS
  tag = f" n={n}" + tag_of(settings) + (" warm" if warm else "")
  fresh = (lambda a, one: a * one.astype(a.dtype)) if warm else (lambda a, one: a)
  p = {}
  if not warm:  # (the gather walk adds into nothing)
    p[f"all_gather_matmul walk{tag}"] = ("all_gather_matmul", n, settings, jax.jit(
        lambda own, g, w, one: fg.walk_matmul(
            w, [own, g], gig.walk(n), m, result=(n * m, bf), rank=0,
            ready=ones_ready(one, count), ready_rows=gig.READY_ROWS)), (own, gathered, w, one))
  rows = m_total // n
  band = gr.band_rows(rows)
  send = jnp.zeros((rows, N), bf)
  recv = c[:(n - 2) * rows]
  for gather in (False, True):
    name = "matmul_psum" if gather else "matmul_reduce_scatter"
    last = jnp.zeros(((n if gather else 1) * rows, N), bf)
    ring_flags = jnp.zeros((n * rows // band,), jnp.int32)
    bands = (n - 1) * rows // band
    p[f"{name} walk{tag}"] = (name, n, settings, jax.jit(
        lambda x, w, s, l, r, f, one, gather=gather: fg.walk_matmul(
            w, [x, s, fresh(l, one)] + ([fresh(r, one)] if n > 2 else []), gr.walk(n, gather),
            rows, rank=0, ready=ones_ready(one, bands), ready_rows=band, flags=f,
            flag_rows=band)),
        (x, w, send, last, recv, ring_flags, one))
  return p


@contextlib.contextmanager
def flagged_gemm_settings(settings):
  """The flagged_gemm module's values (e.g. {"BAND_TILES": 16}) set inside, restored after:
  a program lowered inside keeps them."""
  default = {k: getattr(fg, k) for k in settings}
  try:
    for k, v in settings.items():
      setattr(fg, k, v)
    yield
  finally:
    for k, v in default.items():
      setattr(fg, k, v)


def compile_all(progs):
  """Lowers each program (with its settings), then compiles and warms them up in threads:
  the compilers run outside Python's lock."""
  lowered = {}
  for name, (_, _, settings, f, args) in progs.items():
    with flagged_gemm_settings(settings):
      lowered[name] = f.lower(*args)

  def build(name):
    exe = lowered[name].compile()
    jax.block_until_ready(exe(*progs[name][4]))
    return name, exe

  with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
    return dict(pool.map(build, progs))


def gemm_us(exe, args, calls):
  """Median over `calls` calls of the longest kernel of each call, in us."""
  _, per_call = profiler.measure(exe, iterations=max(calls, 2), aggregate=False)(*args)
  return statistics.median(max(t for _, t in kernels) for kernels in per_call) * 1e3


def beside_dot(progs):
  """{(name, order): program} of each program but XLA's dot in one jit with the dot, in each
  order (gemm.beside_dot; order 0: the dot first)."""
  dot_args = progs["xla dot"][4]
  pairs = {}
  for k, (op, n, settings, f, args) in progs.items():
    if k != "xla dot":
      for order, pair in enumerate(gemm.beside_dot(lambda x, w: x @ w, f, len(dot_args))):
        pairs[(k, order)] = (op, n, settings, pair, dot_args + args)
  return pairs


def measure_paired(progs, exes, pairs, paired_exes, rounds, calls):
  """{name: per-round (ratio, with the dot first, with the program first, program us, dot
  us)}: rounds of every program beside XLA's dot in one jit, both orders (beside_dot,
  gemm.paired_round), the programs in an order rotated each round. The program's kernels
  are those it launches alone (`exes`)."""
  names = [k for k in progs if k != "xla dot"]
  own = {k: kernel_names(exes[k], progs[k][4]) for k in names}
  times = {k: [] for k in names}
  for r in range(rounds):
    for k in names[r % len(names):] + names[:r % len(names)]:
      times[k].append(gemm.paired_round((paired_exes[(k, 0)], paired_exes[(k, 1)]),
                                        pairs[(k, 0)][4], own[k], calls))
  return times


def measure(progs, exes, rounds, calls):
  """{name: per-round times}: rounds of every program, in an order rotated each round."""
  names = list(progs)
  times = {k: [] for k in names}
  for r in range(rounds):
    for k in names[r % len(names):] + names[:r % len(names)]:
      times[k].append(gemm_us(exes[k], progs[k][4], calls))
  return times


def write_json(path, rows):
  dev = jax.devices()[0]
  result = dict(machine=f"{platform.node()} (1x{dev.device_kind.replace(' ', '-')})", gpus=1,
                devices=[str(dev.device_kind)], jax=jax.__version__,
                date=datetime.date.today().isoformat(), commit=bench_main._commit(),
                python=platform.python_version(), dtype="bfloat16", walk_cost=rows)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {path}", flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--m", default="4096,16384", help="M of the GEMM (all ranks' rows)")
  ap.add_argument("--ranks", default="2,4")
  ap.add_argument("--rounds", type=int, default=12)
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--compare", action="append", default=[], metavar="NAME=V1,V2",
                  help="flagged_gemm values to compare, e.g. BAND_TILES=8,16 (see above)")
  ap.add_argument("--waits", default="", help="waits to compare, e.g. sys,none,gpu")
  ap.add_argument("--warm-partials", action="store_true",
                  help="also the ring walks with their partial sums just written (see above)")
  ap.add_argument("--compare-at", default="4096", help="the M where they are compared")
  ap.add_argument("--paired", action="store_true",
                  help="each call beside XLA's dot in one jit (see above)")
  ap.add_argument("--json", default="", help="write the walk_cost rows here")
  a = ap.parse_args(argv)
  variants = [{}]  # the module's own values, then each other value compared
  for spec in a.compare:
    name, values = spec.split("=")
    for v in values.split(","):
      value = {"on": True, "off": False}[v] if v in ("on", "off") else int(v)
      if value != getattr(fg, name):
        variants.append({name: value})
  variants += [{"_await_flag": WAITS[v]} for v in a.waits.split(",") if v and v != "sys"]
  compare_at = {int(m) for m in a.compare_at.split(",") if m}
  key = jax.random.split(jax.random.key(0), 3)
  w = (jax.random.normal(key[0], (K, N), jnp.float32) / np.sqrt(K)).astype(bf)
  rows = []
  for m_total in [int(m) for m in a.m.split(",")]:
    x = jax.random.normal(key[1], (m_total, K), bf)
    c = jax.random.normal(key[2], (m_total, N), bf)
    here = variants if m_total in compare_at else [{}]
    progs = plain_programs(x, w, c, here)
    for n in [int(r) for r in a.ranks.split(",")]:
      for v in here:
        progs.update(walk_programs(x, w, c, n, v))
      if a.warm_partials and m_total in compare_at:
        progs.update(walk_programs(x, w, c, n, {}, warm=True))
    exes = compile_all(progs)
    # every tile computed once, whatever claimed it: the gather walk's product is x @ w
    ref = exes["xla dot"](x, w).astype(jnp.float32)
    for k, (op, n, _, _, args) in progs.items():
      if op == "all_gather_matmul":
        err = float(jnp.max(jnp.abs(exes[k](*args).astype(jnp.float32) - ref)))
        if err > 0.1:
          raise AssertionError(f"{k}: differs from XLA's dot by {err}")
    if a.paired:
      pairs = beside_dot(progs)
      rounds = measure_paired(progs, exes, pairs, compile_all(pairs), a.rounds, a.calls)
      # (ratios, the program's time, the dot's) per round
      times = {k: ([q[0] for q in v], [q[3] for q in v], [q[4] for q in v])
               for k, v in rounds.items()}
      by_order = {k: [statistics.median(q[i] for q in v) for i in (1, 2)]
                  for k, v in rounds.items()}
    else:
      plain = measure(progs, exes, a.rounds, a.calls)
      times = {k: ([t / t_xla for t, t_xla in zip(v, plain["xla dot"])], v, plain["xla dot"])
               for k, v in plain.items() if k != "xla dot"}
    print(f"M={m_total} K={K} N={N}: {a.rounds} rounds of {a.calls} calls"
          + (", each beside XLA's dot" if a.paired else ""), flush=True)
    for k, (ratios, t, t_xla) in times.items():
      op, n, settings, _, _ = progs[k]
      ratio = statistics.median(ratios)
      spread = (max(ratios) - min(ratios)) / ratio
      t_us = statistics.median(t)
      print(f"  {k:40s} {t_us:8.1f} us  {ratio:.3f}x XLA's dot time  (spread {spread:.1%})",
            flush=True)
      rows.append(dict(op=op, m=m_total, k=K, n=N, ranks=n, ratio_to_xla_dot=ratio,
                       spread=spread, time_us=t_us, xla_dot_us=statistics.median(t_xla),
                       claim_group=None if n == 1 else settings.get("CLAIM_GROUP", fg.CLAIM_GROUP),
                       band_tiles=None if n == 1 else settings.get("BAND_TILES", fg.BAND_TILES),
                       settings=named(settings),
                       warm_partials=k.endswith(" warm"),
                       rounds=a.rounds, calls=a.calls, paired=a.paired,
                       **({"order_ratios": by_order[k]} if a.paired else {})))
    del exes, progs
    if a.json:  # after each M: a run cut short keeps what it measured
      write_json(a.json, rows)
  return rows


if __name__ == "__main__":
  main()
