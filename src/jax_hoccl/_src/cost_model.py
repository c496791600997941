"""An alpha-beta cost model of jax_hoccl's collectives and XLA's, and the algorithm choice it
makes (psum's one_shot vs two_step).

Each jax_hoccl collective is a sequence of exchanges (one mover call each, docs/design.md
section 3) plus XLA fusions. One exchange at group size n costs

    alpha[op]                       host enqueue, rendezvous, launch (fitted per op; includes
                                    the one peer copy an exchange issues at n = 2)
  + 2 * hop_us                      the ready and done flag hops between GPUs
  + (copies - 1) * copy_issue_us    host cost of every further peer copy (n > 2)
  + link_bytes / min(link_gbps, min(copies, engines) * engine_gbps)
                                    bytes this GPU pulls from its peers, all ranks pulling
  + sum_bytes / sum_gbps            bytes XLA's sum fusion (and the local copies) read + write

and the model is the sum over its exchanges. XLA's own collectives (NCCL on GPU) are
alpha + busbw_factor * bytes / busbw, per op; across nodes XLA's rings go through the NICs.

On the staged path (blocks up to the crossover) a call is one exchange kernel instead:
staged_alpha_us + hop_us + link_bytes / link_gbps + sum_bytes / sum_gbps (`staged_us`); a
block up to staged_packed_bytes (not ppermute's) takes the packed exchange, whose fixed cost is
staged_packed_alpha_us and whose words carry a flag beside every 4 data bytes (twice the link
bytes).

What is fitted and what is not: `src/jax_hoccl/bench/model.py` fits alpha, link_gbps,
sum_gbps (jax_hoccl rows), engine_gbps (the raw copy-engine rows), XLA's alpha/busbw per op
(jax.lax rows) by least squares on relative error, and staged_alpha_us and
staged_packed_alpha_us on chains of staged calls (one GPU; the mean of what the local terms
leave, over the chains of each exchange). FITTED holds the values it found on
the committed results (`python -m jax_hoccl.bench --model` prints them and each row's
error). Two ranks cannot separate hop_us and copy_issue_us from alpha, so they are fixed from
single measurements (docs/design.md section 1, benchmarks/README.md "Small messages"), and
the inter-node figures are assumptions (see Params), not measurements.

Sizes are bytes per device as the benchmark counts them (`bench/collectives.py`):
all_gather's is its output, the others' their input.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

OPS = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")
PSUM_ALGORITHMS = ("one_shot", "two_step")


@dataclasses.dataclass(frozen=True)
class Params:
  """Times in microseconds, bandwidths in GB/s (1e9 bytes per second)."""
  # Fitted to jax_hoccl rows: per-exchange fixed cost of each op, and the two bandwidths.
  alpha_us: Mapping[str, float]
  link_gbps: float    # what one GPU pulls over NVLink while every rank pulls (both directions busy)
  # XLA's sum bandwidth: bytes XLA's sum fusions and the local copies read + write per
  # second. Effective, not HBM's: the fit gives more than an H200's 4.8 TB/s, so part of
  # that traffic is off the critical path (overlapping the copies of other channels).
  sum_gbps: float
  # Fitted to the raw copy-engine rows (one cudaMemcpyPeerAsync chain, one direction).
  engine_gbps: float
  engine_alpha_us: float
  # Fitted to jax.lax rows: XLA's collectives inside a node, per op.
  xla_alpha_us: Mapping[str, float]
  xla_busbw_gbps: Mapping[str, float]
  # Fixed from single measurements (two ranks cannot separate them from alpha).
  hop_us: float = 4.8          # flag ping-pong between the two H200s: 9.6 us per round trip
  copy_issue_us: float = 5.0   # host time of one more cudaMemcpyAsync (5.1-6.6 us measured)
  engines: int = 3             # asyncEngineCount of an H200: copies spread over 3 side streams
  # Assumed for several nodes (not measured here): one 400 Gb/s NIC per GPU (the DGX/HGX H200
  # reference design, 8 per node) is 50 GB/s per direction; NCCL reaches ~90% of it.
  gpus_per_node: int = 8
  nic_gbps: float = 45.0
  nic_latency_us: float = 5.0  # per level of NCCL's tree across nodes
  # The staged path (docs/design.md, "The staged path"): one exchange kernel per call, its fixed
  # device cost fitted to chains of staged calls on one GPU (two ranks under MPS: the kernel,
  # its flag exchange through the GPU's own memory, XLA's fusion after it). Across GPUs a
  # call's flags cross NVLink once (hop_us) and its pushes go over the links (link_gbps). The
  # packed exchange (blocks up to staged_packed_bytes, JAX_HOCCL_STAGED_PACKED_BYTES's
  # default) has its own fixed cost; its flags ride with the data, one hop all the same.
  # Both fitted on benchmarks/results/2026-12-04-1xH200-steps-packed-5671fa3.json.
  staged_alpha_us: float = 9.44
  staged_packed_alpha_us: float = 8.75
  staged_packed_bytes: int = 128 << 10


# Fitted by `python -m jax_hoccl.bench --model` on benchmarks/results/2026-11-30-2xNVIDIA-H200.json
# and 2026-11-30-2xNVIDIA-H200-psum-one-shot-collectives.json (rows >= 1 MiB).
# tests/test_cost_model.py checks that refitting gives these values back.
FITTED = Params(
    alpha_us={"psum": 26.1, "all_gather": 26.6, "psum_scatter": 27.5, "all_to_all": 28.0,
              "ppermute": 10.0},
    link_gbps=326.1, sum_gbps=9981.0, engine_gbps=390.0, engine_alpha_us=2.08,
    xla_alpha_us={"psum": 20.9, "all_gather": 27.6, "psum_scatter": 28.4, "all_to_all": 29.2,
                  "ppermute": 18.6},
    xla_busbw_gbps={"psum": 265.0, "all_gather": 222.0, "psum_scatter": 219.0,
                    "all_to_all": 254.0, "ppermute": 276.0})


def busbw_factor(op: str, n: int) -> float:
  """nccl-tests' bus bandwidth factors (bytes on the busiest link per byte of the op)."""
  return {"psum": 2 * (n - 1) / n, "ppermute": 1.0}.get(op, (n - 1) / n)


@dataclasses.dataclass(frozen=True)
class Exchange:
  """One mover call: whose fixed cost it pays, its peer copies, bytes in over the links, bytes
  read + written locally (XLA's sum after it, the local copy of its own block)."""
  alpha: str
  copies: int
  link_bytes: float
  sum_bytes: float


def exchanges(op: str, algorithm: str | None, nbytes: float, n: int) -> list[Exchange]:
  """The exchanges of jax_hoccl's `op` on `nbytes` per device over n ranks of one node."""
  if n < 2:
    return []
  if op == "psum":
    if algorithm == "one_shot":  # gather n-1 peers' arrays (skip_own), sum n arrays into one
      return [Exchange("psum", n - 1, (n - 1) * nbytes, (n + 1) * nbytes)]
    if algorithm == "two_step":  # psum_scatter of the whole array, all_gather of its 1/n
      return exchanges("psum_scatter", None, nbytes, n) + exchanges("all_gather", None, nbytes, n)
    raise ValueError(f"psum algorithm must be one of {PSUM_ALGORITHMS}, got {algorithm!r}")
  block = nbytes / n
  if op in ("all_gather", "all_to_all"):  # n-1 peer blocks in, my own block copied locally
    return [Exchange(op, n - 1, (n - 1) * block, 2 * block)]
  if op == "psum_scatter":  # all_to_all with skip_own, then XLA sums n blocks into one
    return [Exchange(op, n - 1, (n - 1) * block, nbytes + block)]
  if op == "ppermute":
    return [Exchange(op, 1, nbytes, 0.0)]
  raise ValueError(f"unknown op {op!r}; choose from {OPS}")


def exchange_us(e: Exchange, p: Params) -> float:
  bw = min(p.link_gbps, min(e.copies, p.engines) * p.engine_gbps)
  return (p.alpha_us[e.alpha] + 2 * p.hop_us + (e.copies - 1) * p.copy_issue_us
          + e.link_bytes / bw / 1e3 + e.sum_bytes / p.sum_gbps / 1e3)


def hoccl_us(op: str, algorithm: str | None, nbytes: float, n: int, p: Params = None) -> float:
  """jax_hoccl's `op` over n ranks inside one node (NVLink, copy engines)."""
  p = p or FITTED
  return sum(exchange_us(e, p) for e in exchanges(op, algorithm, nbytes, n))


def staged_us(op: str, nbytes: float, n: int, p: Params = None) -> float:
  """jax_hoccl's `op` on the staged path over n GPUs of one node, as XLA replays it in a CUDA
  graph (no host work): per exchange (psum's: one_shot) the kernel's fixed cost, one flag hop,
  the pushes over the links (packed: twice the bytes) and the bytes the sum reads and
  writes."""
  p = p or FITTED
  algorithm = "one_shot" if op == "psum" else None
  total = 0.0
  for e in exchanges(op, algorithm, nbytes, n):
    packed = op != "ppermute" and e.link_bytes / e.copies <= p.staged_packed_bytes
    alpha = p.staged_packed_alpha_us if packed else p.staged_alpha_us
    total += (alpha + p.hop_us + (2 if packed else 1) * e.link_bytes / p.link_gbps / 1e3
              + e.sum_bytes / p.sum_gbps / 1e3)
  return total


def xla_us(op: str, nbytes: float, n: int, p: Params = None, nodes: int = 1) -> float:
  """XLA's own collective (NCCL) over n ranks spread evenly over `nodes` nodes. Across nodes
  NCCL runs its rings through the NICs of the group's GPUs in a node (one ring per NIC), so
  the ring collectives' bus bandwidth is capped by n / nodes NICs: 8 for a whole-cluster
  group, one for jax_hoccl's cross-node part (one rank per node); all_to_all and ppermute
  send what leaves a node through each GPU's own NIC."""
  p = p or FITTED
  if n < 2:
    return 0.0
  alpha, bw = p.xla_alpha_us[op], p.xla_busbw_gbps[op]
  if nodes <= 1:
    return alpha + busbw_factor(op, n) * nbytes / bw / 1e3
  latency = alpha + math.ceil(math.log2(nodes)) * p.nic_latency_us
  if op == "all_to_all":  # the blocks for other nodes leave through my NIC
    local = n / nodes
    return latency + nbytes * (n - local) / n / p.nic_gbps / 1e3
  if op == "ppermute":  # a neighbour shift: the ranks at a node's edge send all through a NIC
    return latency + nbytes / p.nic_gbps / 1e3
  ring_bw = min(bw, n / nodes * p.nic_gbps)  # the NICs of this group's GPUs in one node
  return latency + busbw_factor(op, n) * nbytes / ring_bw / 1e3


def time_us(op: str, algorithm: str | None, nbytes: float, n: int, *, impl: str = "jax_hoccl",
            nodes: int = 1, p: Params = None) -> float:
  """Predicted device time per op: `impl` "jax_hoccl" or "xla"; n ranks spread evenly over
  `nodes` nodes. jax_hoccl over several nodes composes as `_src/ops/across_processes.py` does:
  psum = psum_scatter inside, XLA's psum across on 1/n_local, all_gather inside;
  psum_scatter = inside, then XLA across on 1/n_local; all_gather = XLA across, then inside;
  all_to_all and ppermute = XLA's over the whole group."""
  p = p or FITTED
  if impl == "xla":
    return xla_us(op, nbytes, n, p, nodes)
  if impl != "jax_hoccl":
    raise ValueError(f"impl must be 'jax_hoccl' or 'xla', got {impl!r}")
  if nodes <= 1:
    return hoccl_us(op, algorithm, nbytes, n, p)
  local = n // nodes
  if op == "psum":
    return (hoccl_us("psum_scatter", None, nbytes, local, p)
            + xla_us("psum", nbytes / local, n // local, p, nodes)
            + hoccl_us("all_gather", None, nbytes, local, p))
  if op == "psum_scatter":
    return (hoccl_us("psum_scatter", None, nbytes, local, p)
            + xla_us("psum_scatter", nbytes / local, n // local, p, nodes))
  if op == "all_gather":  # XLA gathers the input (nbytes / n) across into nbytes / local
    return (xla_us("all_gather", nbytes / local, n // local, p, nodes)
            + hoccl_us("all_gather", None, nbytes, local, p))
  return xla_us(op, nbytes, n, p, nodes)


def choose_psum(nbytes: int, n: int, p: Params = None) -> str:
  """psum's algorithm for `nbytes` per device over n ranks of one node: the faster one by the
  model (one_shot on a tie). A pure function of its arguments, so every rank, tracing the
  same program, picks the same."""
  return min(PSUM_ALGORITHMS, key=lambda a: hoccl_us("psum", a, nbytes, n, p))


def psum_crossover_bytes(n: int, p: Params = None) -> float | None:
  """The size from which the model prefers two_step over one_shot at group size n, or None
  if one_shot wins at every size. Both times are linear in the size for a fixed n."""
  def gap(s):  # one_shot - two_step
    return hoccl_us("psum", "one_shot", s, n, p) - hoccl_us("psum", "two_step", s, n, p)
  g0, g1 = gap(0.0), gap(float(1 << 30))
  slope = (g1 - g0) / (1 << 30)
  if slope <= 0:
    return None if g0 <= 0 else 0.0
  return max(0.0, -g0 / slope)
