"""Collectives in the branches of jax.lax.cond / jax.lax.switch, of which each rank may take
another (a rank-dependent predicate).

The CPU engine pairs the ranks' calls by the instruction that makes them (cc/cpu/handlers_cpu.cc):
a psum in branch 0 and the same psum in branch 1 are two instructions, so a rank in one
branch never met its peers in the other and both timed out, where jax.lax's work. So the cond
lowering is wrapped: before jax lowers the branches, the n-th collective of one signature
(primitive, parameters, input types) in each branch gets one site, shared by all branches,
which the CPU engine pairs as one instruction (cc/job.h SiteShared); the movers such an op
lowers to inherit shared sites in the same order (axes.user_op). And each branch's
collectives are chained in program order (_in_program_order): XLA would otherwise schedule a
branch's independent collectives as it likes, each branch its own way. Collectives whose
signatures differ between the branches still do not meet (jax.lax's would not agree either).
jax.lax's collectives that route_collectives() takes get their sites here first
(routing.in_branches, a rewrite registered with register).
Not covered: async pairs (their start and done pair by site on GPUs), a cond nested in a
branch (its own lowering shares its branches' sites, not the outer cond's), and an inner
jit holding such a cond called twice in one program with both calls independent (the
instances share the site, so XLA:CPU running them in different orders on different devices
could pair them wrongly).

The GPU engine pairs calls by per-group sequence numbers: sharing sites changes nothing
there, and the chaining keeps the branches' sequences alike.
"""
from __future__ import annotations

import threading

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji

_pairable = set()  # the primitives of collectives that may be paired across branches
_rewrites = []  # functions each branch goes through first (routing.in_branches)
_lock = threading.Lock()
_installed = False


def register(prim, rewrite=None) -> None:
  """A collective primitive (with a `site` parameter) whose calls are paired across branches,
  and `rewrite`: a function each branch goes through first that may make such calls (of
  collectives that have no site until then); the first registration wraps jax's cond lowering
  (install)."""
  with _lock:
    _pairable.add(prim)
    if rewrite is not None and rewrite not in _rewrites:
      _rewrites.append(rewrite)
  install()


def _signature(eqn):
  params = tuple(sorted((k, repr(v)) for k, v in eqn.params.items() if k != "site"))
  return eqn.primitive, params, tuple(str(v.aval) for v in eqn.invars)


def _share_sites(branches):
  """The branches with the n-th collective of each signature on one shared site."""
  shared = {}

  def one(branch):
    seen = {}

    def rewrite(eqn):
      if eqn.primitive not in _pairable:
        return eqn
      sig = _signature(eqn)
      k = seen[sig] = seen.get(sig, -1) + 1
      if (sig, k) not in shared:
        shared[(sig, k)] = axes_lib.share_site(eqn.params["site"])
      return eqn.replace(params={**eqn.params, "site": shared[(sig, k)]})

    return ji.map_eqns(branch, rewrite, skip=(ji.cond_primitive(),))

  return tuple(one(b) for b in branches)


def _in_program_order(branch):
  """The branch with each of its collectives (at its top level) reading its first operand
  through an optimization barrier with the results of the one before, so that XLA runs them
  in program order: the same order in every branch. Left free, XLA may schedule a branch's
  independent collectives in another order than its sibling's, and ranks in the two branches
  would each wait for a call the other makes only later. The barrier comes as early as its
  operand allows, and every later reader of the previous results reads them from it: a
  barrier output nobody reads, XLA:CPU drops (in one branch and not the other), and the
  order with it."""
  eqns = branch.jaxpr.eqns
  defined = {v: i for i, e in enumerate(eqns) for v in e.outvars}
  colls = [i for i, e in enumerate(eqns) if e.primitive in _pairable]
  barriers = {}  # eqn index -> [(previous collective, next collective)] to chain after it
  for prev, nxt in zip(colls, colls[1:]):
    if ji.is_variable(eqns[nxt].invars[0]):
      at = max(prev, defined.get(eqns[nxt].invars[0], -1))
      barriers.setdefault(at, []).append((prev, nxt))
  out, renamed, operand = [], {}, {}

  def read(v):
    return renamed.get(v, v) if ji.is_variable(v) else v

  for i, e in enumerate(eqns):
    invars = [read(v) for v in e.invars]
    if i in operand:
      invars[0] = operand[i]
    out.append(e.replace(invars=invars))
    for prev, nxt in barriers.get(i, ()):
      barrier, x, passed = ji.barrier_eqn(read(eqns[nxt].invars[0]), eqns[prev])
      out.append(barrier)
      operand[nxt] = x
      renamed.update(passed)
  return ji.with_eqns(branch, out, [read(v) for v in branch.jaxpr.outvars])


def _has_collective(branch) -> bool:
  found = []
  ji.map_eqns(branch, lambda e: (found.append(e) if e.primitive in _pairable else None) or e,
              skip=(ji.cond_primitive(),))
  return bool(found)


def install() -> None:
  """Wraps jax's cond lowering, once: branches holding jax_hoccl collectives get shared
  sites; every other cond lowers exactly as before."""
  global _installed
  with _lock:
    if _installed:
      return
    jax_rule = {}

    def rule(ctx, index, *args, branches, **params):
      for rewrite in _rewrites:
        branches = tuple(rewrite(b) for b in branches)
      if (params.get("branches_platforms") is None  # (per-platform branches: all ranks alike)
          and sum(_has_collective(b) for b in branches) > 1):
        branches = tuple(_in_program_order(b) for b in _share_sites(branches))
      jax_own = jax_rule["old"](ctx.module_context.platforms[0])
      return jax_own(ctx, index, *args, branches=branches, **params)

    jax_rule["old"], _ = ji.swap_lowering(ji.cond_primitive(), rule)
    _installed = True
