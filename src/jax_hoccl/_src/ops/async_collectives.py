"""Async pairs: `<op>_start` enqueues the copies and returns at once; `done` waits for them
(and, for psum_start / psum_scatter_start, sums what arrived).

    pending = jax_hoccl.all_gather_start(x, "tp", tiled=True)
    y_mine = pending.input @ w                  # runs while peers' blocks are in flight
    gathered, y_mine = jax_hoccl.done(pending, y_mine)

start -> compute -> done is the only order XLA may schedule, by data dependencies alone:
- `pending.input` is x as an output of start (aliasing x: no copy, nothing runs), so compute
  that reads it depends on the start and cannot run before it. `pending.after_start(tree)`
  passes other arrays through a custom call (`hoccl_after`) that takes the start's token, to
  the same effect. (An optimization barrier would not do: on GPU XLA removes barriers before
  it schedules, and it ran such compute before the start.) Because the outputs alias their
  inputs, XLA copies an array first when it is still read after the start by something else,
  or is a jit argument: compute on pending.input, not on x, and pass fresh arrays (a slice,
  the previous step's result) through after_start.
- done takes the compute's results and hands them back aliased, so done runs after them.
done also takes x, which keeps x alive until done, because peers read it in between.
On GPU the copies run on side streams (copy engines) between start and done; on CPU start
does the whole exchange and done is free.
"""
from __future__ import annotations

import os

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import explicit_axes
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import ffi_lower
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops.ppermute import check_axis_order, check_perm, permute_dst
from jax_hoccl._src.ops.psum_scatter import scatter_blocks, scatter_result


# GPU: async streams a program's starts are spread over, round-robin by the order of their
# sites in the program (axes.site_order: every rank, lowering the same program, puts a start
# on the same stream); each stream has its own
# flag lane (cc/cuda/cuda_executor.h). Read from JAX_HOCCL_ASYNC_STREAMS when a program is lowered;
# at most MAX_ASYNC_STREAMS (cc: kMaxAsyncLanes). With one stream a pipeline's exchanges queue
# behind each other (docs/design.md, section 4).
MAX_ASYNC_STREAMS = 4


def async_stream(order: int) -> int:
  v = os.environ.get("JAX_HOCCL_ASYNC_STREAMS", "1")
  try:
    streams = int(v)
  except ValueError:
    raise ValueError(f"JAX_HOCCL_ASYNC_STREAMS must be an integer, got {v!r}") from None
  if not 1 <= streams <= MAX_ASYNC_STREAMS:
    raise ValueError(f"JAX_HOCCL_ASYNC_STREAMS must be 1 to {MAX_ASYNC_STREAMS}, got {streams}")
  return order % streams


start_p = ji.Primitive("hoccl_start")
start_p.multiple_results = True
done_p = ji.Primitive("hoccl_done")
done_p.multiple_results = True


def _start_abstract_eval(x, *, op, axes, axis_size, perm, peers_only, invariant, site,
                         order_input):
  vma = ji.varying_axes(x)
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl {op}_start: input must be varying over {axes}, got {set(vma)}")
  if op == "all_gather":
    blocks = axis_size - 1 if peers_only else axis_size
    out = ji.with_type(x, (blocks, *x.shape), vma - set(axes) if invariant else vma,
                      (None, *ji.spec_of(x)))
  else:
    out = ji.with_type(x, x.shape, vma)
  token = ji.with_type(x, (), vma).update(dtype=np.dtype(np.int32), weak_type=False)
  return [out, token, x] if order_input else [out, token]


def start_attrs(ctx, axes, op: str, site: int) -> dict:
  """Every start's attributes: its group's, and the async stream it runs on."""
  return {**axes_lib.ffi_group_attrs(ctx, axes, op, site),
          "stream": np.int64(async_stream(axes_lib.site_order(ctx, site)))}


def _start_lowering(ctx, x, *, op, axes, axis_size, perm, peers_only, invariant, site,
                    order_input):
  attrs = start_attrs(ctx, axes, op, site)
  if op == "all_gather":
    attrs["peers_only"] = np.int64(peers_only)
  if op == "ppermute":
    attrs["permute_dst"] = permute_dst(perm, axis_size)
  return ffi_lower(f"hoccl_{op}_start", op, ctx, x, **attrs,  # output 2: x, aliased
                   lowering_args=dict(operand_output_aliases={0: 2} if order_input else {}))


# after: (token, *arrays) -> arrays, each output aliasing its array (the handler does nothing):
# compute that reads the outputs depends on the token, i.e. runs after the start.
after_p = ji.Primitive("hoccl_after")
after_p.multiple_results = True
after_p.def_abstract_eval(lambda token, *arrays: list(arrays))
ji.register_lowering(after_p, lambda ctx, token, *arrays: ffi_lower(
    "hoccl_after", "after", ctx, token, *arrays, side_effect=False,
    lowering_args=dict(operand_output_aliases={1 + i: i for i in range(len(arrays))})))
ji.primitive_batchers[after_p] = lambda args, dims: (after_p.bind(*args), list(dims[1:]))
# Tangents need no order: they pass through untouched.
ji.primitive_jvps[after_p] = lambda primals, tangents: (after_p.bind(*primals),
                                                        list(tangents[1:]))


def after(token, tree):
  """`tree` (a pytree of arrays) ordered after the start that made `token`."""
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  return jax.tree.unflatten(treedef, after_p.bind(token, *leaves))


# done's operands: (buf, x, *deps, *after) -> (buf, *deps). deps come back aliased (the
# caller goes on with them); the last n_after operands only order done after them (tokens:
# aliasing those would make XLA copy them). wait_only: for a start of an `into` chain whose
# buffer went on to a later start, (x, *after) -> a fresh token (never written or read: it
# only orders what takes it after this wait, and keeps the wait from being dropped).
def _done_abstract_eval(*args, site, wait_only, n_after):
  if wait_only:
    return [ji.with_type(args[1], (), ji.varying_axes(args[1])).update(
        dtype=np.dtype(np.int32), weak_type=False)]
  return [args[0], *args[2:len(args) - n_after]]


def _done_lowering(ctx, *args, site, wait_only, n_after):
  if wait_only:
    aliases = {}
    args, ctx = args[1:], ctx.replace(avals_in=ctx.avals_in[1:])  # drop the placeholder
  else:
    aliases = {0: 0, **{2 + i: 1 + i for i in range(len(args) - 2 - n_after)}}
  return ffi_lower("hoccl_done", "done", ctx, *args,
                   site=np.int64(axes_lib.lowered_site(ctx, site)),
                   lowering_args=dict(operand_output_aliases=aliases))


# vmap: the exchange is the same per example, so the batch axis rides along: all_gather's
# result gains a leading stacked axis (batch axis + 1); all_to_all's leading axis must stay
# the n blocks (the batch axis moves behind it); done's results alias its operands.
def _start_batch(args, dims, *, op, **params):
  (x,), (d,) = args, dims
  if op == "all_to_all" and d == 0:
    x, d = jnp.moveaxis(x, 0, 1), 1
  outs = start_p.bind(x, op=op, **params)
  return outs, [d + 1 if op == "all_gather" else d, ji.not_mapped, d][:len(outs)]


def _done_batch(args, dims, *, site, wait_only, n_after):
  outs = done_p.bind(*args, site=site, wait_only=wait_only, n_after=n_after)
  if wait_only:
    return outs, [ji.not_mapped]
  return outs, [dims[0], *dims[2:len(args) - n_after]]


start_p.def_abstract_eval(_start_abstract_eval)
ji.register_lowering(start_p, _start_lowering)
ji.primitive_batchers[start_p] = _start_batch
done_p.def_abstract_eval(_done_abstract_eval)
ji.register_lowering(done_p, _done_lowering)
ji.primitive_batchers[done_p] = _done_batch

NOT_DIFFERENTIABLE = (
    "async pairs (jax_hoccl.*_start / done) are not differentiable. Differentiate the "
    "synchronous op instead (jax_hoccl.all_gather, psum, psum_scatter, all_to_all, ppermute), "
    "or a fused op (all_gather_matmul, matmul_reduce_scatter, matmul_psum, matmul_all_to_all, "
    "embedding_all_to_all), whose gradients overlap their exchanges themselves.")


def _start_jvp(primals, tangents, *, op, **params):
  # Called only when x carries a tangent (JAX skips rules whose tangents are all zero).
  raise NotImplementedError(f"jax_hoccl {op} start: {NOT_DIFFERENTIABLE}")


def _done_jvp(primals, tangents, *, site, wait_only, n_after):
  # Arrays computed between start and done (deps) may carry tangents: they pass through
  # unchanged, as done hands them back. The exchanged buffer may not.
  if not wait_only and type(tangents[0]) is not ji.Zero:
    raise NotImplementedError(f"jax_hoccl done: {NOT_DIFFERENTIABLE}")
  outs = done_p.bind(*primals, site=site, wait_only=wait_only, n_after=n_after)
  if wait_only:
    return outs, [ji.zero_tangent(outs[0])]
  return outs, [ji.zero_tangent(outs[0]), *tangents[2:len(primals) - n_after]]


ji.primitive_jvps[start_p] = _start_jvp
ji.primitive_jvps[done_p] = _done_jvp


@jax.tree_util.register_pytree_node_class
class Pending:
  """An exchange in flight. `input` is x ordered after start: compute on it to overlap.
  Pass the Pending to `jax_hoccl.done` exactly once."""

  def __init__(self, buffer, input, token, site, finish):
    self.buffer, self.input, self.token = buffer, input, token
    self.site, self.finish = site, finish
    self.waited = False  # done was called (a second call would sum or wait twice)

  def tree_flatten(self):
    return (self.buffer, self.input, self.token), (self.site, self.finish)

  def after_start(self, tree):
    """`tree` (arrays) ordered after this start: compute on the result overlaps the exchange
    instead of running before it. No copy, unless an array is still read after the start by
    something else (then XLA copies it first; see the module docstring)."""
    return after(self.token, tree)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)


def pending_of(outs, x, site, finish=None):
  """The Pending of a start that returned (buf, token[, x aliased, ordered after it])."""
  buf, token, *x_after = outs
  return Pending(buf, x_after[0] if x_after else x, token, site, finish or (lambda b: b))


def _start(op, x, axes, n, order_input, *, perm=(), peers_only=False, invariant=False,
           finish=None):
  site = axes_lib.new_site()
  outs = start_p.bind(x, op=op, axes=tuple(axes), axis_size=int(n), perm=tuple(perm),
                      peers_only=bool(peers_only), invariant=bool(invariant), site=site,
                      order_input=bool(order_input))
  return pending_of(outs, x, site, finish)


def done(pending: Pending, *deps):
  """Waits for `pending` and returns (result, *deps): pass the arrays computed between start
  and done as `deps` so XLA cannot move that compute after the wait."""
  if not isinstance(pending, Pending):
    raise TypeError(f"jax_hoccl.done expects what a *_start returned, got {type(pending)}")
  if pending.waited:
    raise ValueError("jax_hoccl.done: this Pending was already passed to done; each start's "
                     "Pending goes to done exactly once (done's result is the exchange's).")
  pending.waited = True
  flat, tree = jax.tree.flatten(deps)
  buf, *flat = done_p.bind(pending.buffer, pending.input, *flat, site=pending.site,
                           wait_only=False, n_after=0)
  return (pending.finish(buf), *jax.tree.unflatten(tree, flat))


ORDER_INPUT_DOC = """
  order_input: pending.input is x as an output of the start (aliased), so compute on it runs
  after the start (the default). With False it is x itself: order compute with after_start
  or the token instead, when x is still read after the start elsewhere (XLA would copy it)."""


@explicit_axes.typed_like()
def all_gather_start(x, axis_name, *, axis=0, tiled=False, peers_only=False, to="varying",
                     order_input=True):
  """Starts jax_hoccl.all_gather(x, ...). With peers_only=True the result holds only the
  n - 1 peers' blocks, stacked on a new leading axis in rotated order (rank+1, rank+2, ...):
  fused ops multiply their own block meanwhile. axis/tiled apply when peers_only=False."""
  axes, n = axes_lib.check_axes(axis_name, "all_gather_start")
  x = jnp.asarray(x)
  axes_lib.check_dtype(x, "all_gather_start")
  if to == "reduced":
    raise NotImplementedError(
        "jax_hoccl.all_gather_start: to='reduced' is not supported (a reduced type is for "
        "autodiff, which async pairs do not have); use jax_hoccl.all_gather(..., to='reduced').")
  x = common.ensure_varying(x, axes, "all_gather_start")
  if peers_only:
    return _start("all_gather", x, axes, n, order_input, peers_only=True)
  nd = x.ndim
  ax = common.canonical_axis(axis, nd if tiled else nd + 1, "all_gather_start", "axis")

  def finish(y):
    y = jnp.moveaxis(y, 0, ax)
    if tiled:
      shape = list(x.shape)
      shape[ax] *= n
      y = y.reshape(shape)
    return y

  return _start("all_gather", x, axes, n, order_input, invariant=(to != "varying"),
                finish=finish)


@explicit_axes.typed_like()
def all_to_all_start(x, axis_name, *, tiled=True, order_input=True):
  """Starts an all_to_all of x's leading axis (size n, or divisible by n with tiled=True):
  block j goes to rank j; done returns the received blocks stacked in rank order."""
  axes, n = axes_lib.check_axes(axis_name, "all_to_all_start")
  x = jnp.asarray(x)
  axes_lib.check_dtype(x, "all_to_all_start")
  if x.ndim == 0 or x.shape[0] % n or (not tiled and x.shape[0] != n):
    raise ValueError(f"jax_hoccl.all_to_all_start: leading axis {x.shape[:1]} must split into "
                     f"{n} blocks (the size of {axes}).")
  shape = x.shape
  blocks = common.ensure_varying(x, axes, "all_to_all_start").reshape(n, shape[0] // n, *shape[1:])
  pending = _start("all_to_all", blocks, axes, n, order_input, finish=lambda y: y.reshape(shape))
  # pending.input in x's shape, as the other starts' (the blocks' reshape undone: a bitcast)
  pending.input = pending.input.reshape(shape)
  return pending


@explicit_axes.typed_like()
def ppermute_start(x, axis_name, perm, *, order_input=True):
  """Starts jax_hoccl.ppermute(x, axis_name, perm)."""
  axes, n = axes_lib.check_axes(axis_name, "ppermute_start")
  check_axis_order(axes, "ppermute_start")
  x = jnp.asarray(x)
  axes_lib.check_dtype(x, "ppermute_start")
  return _start("ppermute", common.ensure_varying(x, axes, "ppermute_start"), axes, n, order_input,
                perm=check_perm(perm, n))


@explicit_axes.typed_like()
def psum_start(x, axis_name, *, order_input=True):
  """Starts jax_hoccl.psum(x, axis_name) of one array: the copy engines bring every rank's x
  between start and done, and done sums them in rank order (an XLA fusion; bf16/f16
  accumulate in f32), the result typed invariant over the axes like jax.lax.psum's. One
  exchange of (n - 1) x the bytes (psum's one_shot): over more than two ranks, a large array
  moves fewer bytes as psum_scatter_start, then all_gather_start of the result."""
  axes, n = axes_lib.check_axes(axis_name, "psum_start")
  x = common.ensure_varying(common.summable(x, "psum_start"), axes, "psum_start")
  return _start("all_gather", x, axes, n, order_input, invariant=True,
                finish=common.sum_leading)


@explicit_axes.typed_like()
def psum_scatter_start(x, axis_name, *, scatter_dimension=0, tiled=False, order_input=True):
  """Starts jax_hoccl.psum_scatter(x, axis_name, ...): the copy engines bring me every
  rank's block of x between start and done; done sums them in rank order (an XLA fusion;
  bf16/f16 accumulate in f32)."""
  axes, n = axes_lib.check_axes(axis_name, "psum_scatter_start")
  shape = jnp.shape(x)
  x = common.ensure_varying(jnp.asarray(x), axes, "psum_scatter_start")  # (unreduced: no)
  blocks = scatter_blocks(x, axes, n, scatter_dimension, tiled, "psum_scatter_start")

  def finish(got):  # got[j]: rank j's block for me
    return scatter_result(common.sum_leading(got), scatter_dimension, tiled)

  pending = _start("all_to_all", blocks, axes, n, order_input, finish=finish)
  # pending.input in x's layout (rank_blocks undone; a bitcast for axis 0)
  d = scatter_dimension % len(shape)
  pending.input = jnp.moveaxis(pending.input, 0, d).reshape(shape)
  return pending


for _f in (all_gather_start, all_to_all_start, ppermute_start, psum_start, psum_scatter_start):
  _f.__doc__ += ORDER_INPUT_DOC
