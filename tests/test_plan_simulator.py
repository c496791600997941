"""A simulator of the scheduler (cc/plan.cc through jax_hoccl._hoccl.plan): every rank's plan
is executed with random interleavings, where a rank blocks on WaitReady until the peer
signalled ready to it and on WaitDone until the reader signalled done. Checked for group
sizes 2..64, random chunkings, channel counts and byte counts (0, 1, not divisible):

  * no deadlock: every rank finishes;
  * every output byte of every rank is written exactly once (Copy or Zero), from the right
    source rank and offset (the op's semantics);
  * a Copy from peer p happens only after WaitReady(p) on that rank, and before the rank
    signalled done to p; never after p released its input for that reader (its WaitDone),
    nor after p finished;
  * copies stay inside the source's input and the rank's own output (a rank writes only its
    own output); every signal is consumed by exactly one wait and vice versa;
  * chunks: at most `chunks` nearly equal contiguous copies per peer block, spread over the
    channels round-robin.

Outputs are tracked as numpy arrays of (source rank, source offset) per byte, so a copy is a
slice assignment, not a Python loop over bytes.
"""
import collections

import numpy as np
import pytest

from jax_hoccl import _hoccl

SIGNAL_READY, WAIT_READY, COPY, ZERO, SIGNAL_DONE, WAIT_DONE = range(6)
ALL_GATHER, ALL_TO_ALL, PERMUTE = 0, 1, 2
ZERO_SRC = -2  # src_rank marker for bytes written by Zero


class Violation(AssertionError):
  pass


def expected_sources(op, n, nbytes, dst_of, peers_only):
  """(src_rank, src_offset) arrays per rank: the op's semantics."""
  out = []
  for r in range(n):
    if op == ALL_GATHER:
      order = [(r + 1 + k) % n for k in range(n - 1)] if peers_only else list(range(n))
      ranks = np.repeat(np.array(order, np.int64), nbytes)
      offs = np.tile(np.arange(nbytes, dtype=np.int64), len(order))
    elif op == ALL_TO_ALL:
      b = nbytes // n
      ranks = np.repeat(np.arange(n, dtype=np.int64), b)
      offs = np.tile(np.arange(b, dtype=np.int64), n) + r * b
    else:
      srcs = [s for s in range(n) if dst_of[s] == r]
      if srcs:
        ranks = np.full(nbytes, srcs[0], np.int64)
        offs = np.arange(nbytes, dtype=np.int64)
      else:
        ranks = np.full(nbytes, ZERO_SRC, np.int64)
        offs = np.full(nbytes, -1, np.int64)
    out.append((ranks, offs))
  return out


def simulate(op, n, nbytes, *, dst_of=(), chunks=1, channels=1, peers_only=False, seed=0):
  """Runs all ranks' plans with a random interleaving; raises Violation on any breach.
  Returns (per-rank plans, number of steps executed)."""
  rng = np.random.default_rng(seed)
  dst_of = list(dst_of)
  plans = [_hoccl.plan(op, n, r, nbytes, dst_of, chunks, channels, peers_only)
           for r in range(n)]
  in_bytes = nbytes
  out_bytes = (nbytes * (n - 1 if peers_only else n)) if op == ALL_GATHER else nbytes

  src_rank = [np.full(out_bytes, -1, np.int64) for _ in range(n)]
  src_off = [np.full(out_bytes, -1, np.int64) for _ in range(n)]
  writes = [np.zeros(out_bytes, np.int64) for _ in range(n)]

  pc = [0] * n
  finished = [not plans[r] for r in range(n)]  # an empty plan (e.g. 0-byte self-permute)
  ready = set()      # (owner, reader): owner signalled ready to reader, not yet waited
  done = set()       # (owner, reader): reader signalled done to owner, not yet waited
  ready_seen, done_seen = set(), set()  # every signal ever sent, to catch duplicates
  waited_ready = [set() for _ in range(n)]   # peers whose ready this rank has waited for
  done_sent = [set() for _ in range(n)]      # owners this rank told it is done reading
  released = [set() for _ in range(n)]       # readers this owner has seen done
  runnable = {r for r in range(n) if not finished[r]}
  blocked_on = {}  # ("ready"|"done", owner, reader) -> the rank waiting for it
  copies = collections.defaultdict(list)  # (rank, peer) -> [(src_off, dst_off, bytes)]
  channels_used = [[] for _ in range(n)]
  executed = 0

  def fail(r, step, why):
    raise Violation(f"op={op} n={n} bytes={nbytes} chunks={chunks} channels={channels} "
                    f"perm={dst_of} rank {r} step #{pc[r]} {step}: {why}")

  def wake(key):
    if key in blocked_on:
      runnable.add(blocked_on.pop(key))

  def try_step(r):
    """Executes rank r's next step if enabled; returns False if it must block."""
    step = plans[r][pc[r]]
    kind, peer, channel, so, do, nb = step
    if not 0 <= peer < n:
      fail(r, step, "peer out of range")
    if kind in (SIGNAL_READY, WAIT_READY, SIGNAL_DONE, WAIT_DONE) and peer == r:
      fail(r, step, "handshake with itself")
    if kind == SIGNAL_READY:
      if (r, peer) in ready_seen:
        fail(r, step, "ready signalled twice")
      ready.add((r, peer))
      ready_seen.add((r, peer))
      wake(("ready", r, peer))
    elif kind == WAIT_READY:
      if (peer, r) not in ready:
        blocked_on[("ready", peer, r)] = r
        return False
      ready.discard((peer, r))
      waited_ready[r].add(peer)
    elif kind == SIGNAL_DONE:
      if peer not in waited_ready[r]:
        fail(r, step, "done signalled to a peer never waited for")
      if (peer, r) in done_seen:
        fail(r, step, "done signalled twice")
      done.add((peer, r))
      done_seen.add((peer, r))
      done_sent[r].add(peer)
      wake(("done", peer, r))
    elif kind == WAIT_DONE:
      if (r, peer) not in done:
        blocked_on[("done", r, peer)] = r
        return False
      done.discard((r, peer))
      released[r].add(peer)
    elif kind == COPY:
      if nb <= 0:
        fail(r, step, "empty copy")
      if not 0 <= channel < channels:
        fail(r, step, f"channel {channel} not in [0, {channels})")
      if peer != r:
        if peer not in waited_ready[r]:
          fail(r, step, "copy from a peer before WaitReady")
        if peer in done_sent[r]:
          fail(r, step, "copy after signalling done to the peer")
        if finished[peer]:
          fail(r, step, "copy from a peer that already finished (input released)")
        if r in released[peer]:
          fail(r, step, "copy after the owner released its input for this reader")
      if so + nb > in_bytes:
        fail(r, step, f"reads past the source input ({so}+{nb} > {in_bytes})")
      if do + nb > out_bytes:
        fail(r, step, f"writes past its own output ({do}+{nb} > {out_bytes})")
      writes[r][do:do + nb] += 1
      src_rank[r][do:do + nb] = peer
      src_off[r][do:do + nb] = np.arange(so, so + nb)
      copies[(r, peer)].append((so, do, nb))
      channels_used[r].append(channel)
    elif kind == ZERO:
      if peer != r:
        fail(r, step, "zero of another rank's output")
      if do + nb > out_bytes or nb <= 0:
        fail(r, step, "zero out of bounds")
      writes[r][do:do + nb] += 1
      src_rank[r][do:do + nb] = ZERO_SRC
      src_off[r][do:do + nb] = -1
    else:
      fail(r, step, f"unknown step kind {kind}")
    pc[r] += 1
    if pc[r] == len(plans[r]):
      finished[r] = True
      runnable.discard(r)
    return True

  while runnable:
    r = int(rng.choice(sorted(runnable)))
    for _ in range(int(rng.integers(1, 4))):  # a short burst, then maybe another rank
      if finished[r]:
        break
      if not try_step(r):
        runnable.discard(r)
        break
      executed += 1

  stuck = [r for r in range(n) if not finished[r]]
  if stuck:
    raise Violation(f"deadlock: op={op} n={n} bytes={nbytes} perm={dst_of}: ranks {stuck} "
                    f"blocked at steps {[plans[r][pc[r]] for r in stuck]}")
  if ready or done:
    raise Violation(f"signals never waited for: ready={sorted(ready)} done={sorted(done)}")

  want = expected_sources(op, n, nbytes, dst_of, peers_only)
  for r in range(n):
    if not np.all(writes[r] == 1):
      bad = np.nonzero(writes[r] != 1)[0]
      raise Violation(f"rank {r}: output bytes {bad[:8]} written {writes[r][bad[:8]]} times")
    wr, wo = want[r]
    if not (np.array_equal(src_rank[r], wr) and np.array_equal(src_off[r], wo)):
      i = int(np.nonzero((src_rank[r] != wr) | (src_off[r] != wo))[0][0])
      raise Violation(f"rank {r} byte {i}: from rank {src_rank[r][i]} offset {src_off[r][i]},"
                      f" want rank {wr[i]} offset {wo[i]}")

  # Chunking: per (rank, peer) at most `chunks` contiguous, nearly equal copies.
  for (r, p), cs in copies.items():
    if len(cs) > chunks:
      raise Violation(f"rank {r} copies {len(cs)} pieces from {p} with chunks={chunks}")
    sizes = [c[2] for c in cs]
    if max(sizes) - min(sizes) > 1:
      raise Violation(f"rank {r} from {p}: uneven chunks {sizes}")
    for (so0, do0, nb0), (so1, do1, nb1) in zip(cs, cs[1:]):
      if so1 != so0 + nb0 or do1 != do0 + nb0:
        raise Violation(f"rank {r} from {p}: chunks not contiguous {cs}")
  for r in range(n):  # round-robin over channels
    used = channels_used[r]
    if used != [i % channels for i in range(len(used))]:
      raise Violation(f"rank {r}: channels {used[:12]} not round-robin over {channels}")
  return plans, executed


# ------------------------------------------------------------------------------- cases
SIZES = [2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 64]


def _byte_counts(op, n, rng):
  if op == ALL_TO_ALL:
    return [0, n, n * int(rng.integers(2, 9))]
  return [0, 1, int(rng.integers(2, 200))]


def _cases():
  cases = []
  for n in SIZES:
    rng = np.random.default_rng(1000 + n)
    for op, label in ((ALL_GATHER, "all_gather"), (ALL_TO_ALL, "all_to_all"),
                      (PERMUTE, "permute_full"), (PERMUTE, "permute_partial"),
                      (ALL_GATHER, "all_gather_peers_only")):
      for nbytes in _byte_counts(op, n, rng):
        chunks, channels = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        dst = []
        if label == "permute_full":
          dst = [int(d) for d in rng.permutation(n)]
        elif label == "permute_partial":
          dst = [-1] * n
          k = int(rng.integers(1, n))  # 1..n-1 senders: some ranks receive zeros
          for s, d in zip(rng.permutation(n)[:k], rng.permutation(n)[:k]):
            dst[int(s)] = int(d)
        cases.append(pytest.param(op, n, nbytes, dst, chunks, channels,
                                  label == "all_gather_peers_only",
                                  id=f"{label}-n{n}-b{nbytes}-c{chunks}-ch{channels}"))
  return cases


@pytest.mark.parametrize("op,n,nbytes,dst,chunks,channels,peers_only", _cases())
def test_plans_simulate_correctly(op, n, nbytes, dst, chunks, channels, peers_only):
  seed = hash((op, n, nbytes, chunks, channels)) % 2**32
  plans, executed = simulate(op, n, nbytes, dst_of=dst, chunks=chunks, channels=channels,
                             peers_only=peers_only, seed=seed)
  assert executed == sum(len(p) for p in plans)
  if nbytes and op != PERMUTE:
    # rotated order: in handshake round k rank r reads from (r + k) % n
    for r in range(n):
      peers = [p for kind, p, *_ in plans[r] if kind == WAIT_READY]
      assert peers == [(r + k) % n for k in range(1, n)], (r, peers)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_many_interleavings(n):
  """The same plans under many random interleavings (several seeds), chunked."""
  rng = np.random.default_rng(n)
  dst = [int(d) for d in rng.permutation(n)]
  for seed in range(15):
    simulate(ALL_GATHER, n, 37, chunks=3, channels=2, seed=seed)
    simulate(ALL_TO_ALL, n, 5 * n, chunks=2, channels=3, seed=seed)
    simulate(PERMUTE, n, 11, dst_of=dst, chunks=4, seed=seed)


def test_simulator_catches_broken_plans(monkeypatch):
  """The simulator itself: plans with a missing wait, a swapped source or a lost signal
  are reported (so a passing run means something)."""
  real = _hoccl.plan

  def drop_first_wait(*a, **k):
    steps = real(*a, **k)
    i = next((i for i, s in enumerate(steps) if s[0] == WAIT_READY), None)
    return steps if i is None else steps[:i] + steps[i + 1:]

  def wrong_offset(*a, **k):
    return [(s[0], s[1], s[2], s[3] + 1, s[4], s[5]) if s[0] == COPY and s[1] != a[2] else s
            for s in real(*a, **k)]

  def no_done_signal(*a, **k):
    return [s for s in real(*a, **k) if s[0] != SIGNAL_DONE]

  def wait_done_first(*a, **k):  # wait for readers before reading from anyone
    steps = real(*a, **k)
    waits = [s for s in steps if s[0] == WAIT_DONE]
    signals = [s for s in steps if s[0] == SIGNAL_READY]
    rest = [s for s in steps if s[0] not in (WAIT_DONE, SIGNAL_READY)]
    return signals + waits + rest

  def no_wait_done(*a, **k):  # release the input without waiting for readers
    return [s for s in real(*a, **k) if s[0] != WAIT_DONE]

  for fake, match in ((drop_first_wait, "before WaitReady|never waited"),
                      (wrong_offset, "reads past|want rank"),
                      (no_done_signal, "deadlock"),
                      (wait_done_first, "deadlock"),
                      (no_wait_done, "finished|never waited")):
    monkeypatch.setattr(_hoccl, "plan", fake)
    with pytest.raises(Violation, match=match):
      simulate(ALL_GATHER, 4, 8, chunks=2, seed=1)


@pytest.mark.parametrize("args,match", [
    ((ALL_TO_ALL, 4, 0, 10), "divide"),
    ((PERMUTE, 4, 0, 8, [1, 2, 3]), "one entry per rank"),
    ((PERMUTE, 4, 0, 8, [1, 1, 2, 3]), "two buffers to one rank"),
    ((PERMUTE, 4, 0, 8, [1, 2, 3, 4]), "out of range"),
    ((ALL_GATHER, 4, 4, 8), "rank out of range"),
    ((ALL_GATHER, 0, 0, 8), "group size"),
])
def test_invalid_specs_rejected(args, match):
  with pytest.raises(ValueError, match=match):
    _hoccl.plan(*args)


def test_single_rank_group():
  """n = 1: a local copy, no handshakes."""
  for op, dst in ((ALL_GATHER, []), (ALL_TO_ALL, []), (PERMUTE, [0])):
    steps = _hoccl.plan(op, 1, 0, 16, dst, 2, 2)
    assert [s[0] for s in steps] == [COPY, COPY]
    assert sum(s[5] for s in steps) == 16
  assert _hoccl.plan(PERMUTE, 1, 0, 16, [-1]) == [(ZERO, 0, 0, 0, 0, 16)]
