"""The fused ops' building blocks on top of the async pairs (ops/async_collectives.py):
exchanges whose result lands in rows of a larger buffer (a fused op assembles its output
with them, no concatenate), and waits ordered after given arrays without returning them.

    done(all_gather_into_start(x, axes, into, row)) == into.at[row : row + n*len(x)].set(
                                                           all_gather(x, axes, tiled=True))
    done(ppermute_into_start(x, axes, perm, into))  == into.at[src * len(x) : ...].set(
                                                           ppermute(x, axes, perm))

  all_gather_into_start     all_gather into rows [row, ...) of a buffer (donated or new)
  all_gather_in_place_start all_gather of blocks every rank already wrote into its slot
  ppermute_into_start       a ppermute into the sender's slot (one round of an all_to_all)
  done_after / wait_after   done ordered after arrays it never reads (tokens, compute)
Not public API: the fused ops (row_pieces/pipeline.py, ring.py, the ops' files) are their
users.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from jax_hoccl._src import axes as axes_lib
from jax_hoccl._src import jax_internals as ji
from jax_hoccl._src.ffi_targets import ffi_lower
from jax_hoccl._src.ops import common
from jax_hoccl._src.ops.async_collectives import Pending, done_p, pending_of, start_attrs
from jax_hoccl._src.ops.ppermute import check_perm, permute_dst


# all_gather (perm empty), or a ppermute into the sender's slot, into rows of a larger buffer
# (operands x[, dst]; the output aliases dst). Its callers (the fused ops) order compute by the
# token, so it has no output 2 (x aliased) like start_p's. in_place_rows > 0: an all_gather in
# place, the only operand the buffer, in which every rank already wrote its block (that many
# rows) into its slot. sync: the exchange runs on XLA's stream, not an async one (cuda: stream
# attribute -1), for a pipeline's last exchange, which has nothing to overlap.
into_start_p = ji.Primitive("hoccl_into_start")
into_start_p.multiple_results = True


def _into_abstract_eval(x, *dst, axes, axis_size, shape, row, invariant, site, perm,
                        in_place_rows, sync):
  vma = ji.varying_axes(x)
  if ji.check_vma_enabled() and not set(axes) <= vma:
    raise ValueError(f"jax_hoccl {'ppermute' if perm else 'all_gather'}_into_start: input must "
                     f"be varying over {axes}, got {set(vma)}")
  out = dst[0] if dst else ji.with_type(x, shape, vma - set(axes) if invariant else vma)
  token = ji.with_type(x, (), vma).update(dtype=np.dtype(np.int32), weak_type=False)
  return [out, token]


def _into_lowering(ctx, x, *dst, axes, axis_size, shape, row, invariant, site, perm,
                   in_place_rows, sync):
  op = "ppermute_into" if perm else "all_gather_into"
  attrs = start_attrs(ctx, axes, op, site)
  if sync:
    attrs["stream"] = np.int64(-1)
  row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(ctx.avals_in[0].dtype).itemsize
  attrs["offset"] = np.int64(row * row_bytes)
  aliases = {0: 0} if in_place_rows else {1: 0} if dst else None
  return ffi_lower("hoccl_into_start", op, ctx, x, *dst, **attrs,
                   permute_dst=permute_dst(perm, axis_size if perm else 0),  # empty: gather
                   in_place=np.int64(in_place_rows * row_bytes),
                   lowering_args=dict(operand_output_aliases=aliases) if aliases else None)


def _into_batch(args, dims, *, shape, **params):
  # Rows stay the leading axis and the batch goes right behind it: rows [row, ...) of a
  # [total, batch, ...] buffer are still one contiguous range.
  x, *dst = args
  d, *dst_dims = dims
  size = x.shape[d]
  x = jnp.moveaxis(x, d, 1)
  if dst:
    buf, bd = dst[0], dst_dims[0]
    buf = (jnp.broadcast_to(buf[:, None], (buf.shape[0], size, *buf.shape[1:])) if bd is None
           else jnp.moveaxis(buf, bd, 1))
    dst = [buf]
  out, token = into_start_p.bind(x, *dst, shape=(shape[0], size, *shape[1:]), **params)
  return [out, token], [1, ji.not_mapped]


into_start_p.def_abstract_eval(_into_abstract_eval)
ji.register_lowering(into_start_p, _into_lowering)
ji.primitive_batchers[into_start_p] = _into_batch



def _into_target(into):
  """(dst operands, buffer shape) of an into start's `into`: an array (donated) or a shape."""
  if isinstance(into, (tuple, list)):
    return (), tuple(into)
  return (into,), into.shape


def _into_start(x, dst, axes, n, *, in_place_rows=0, sync=False, **params):
  x = common.ensure_varying(x, axes, "fused exchange")
  site = axes_lib.new_site()
  outs = into_start_p.bind(x, *dst, axes=tuple(axes), axis_size=int(n), site=site,
                           in_place_rows=int(in_place_rows), sync=bool(sync), **params)
  if in_place_rows:  # nothing to keep alive for the peers but the buffer, which goes to done
    return Pending(outs[0], outs[1], outs[1], site, lambda b: b)
  return pending_of(outs, x, site)


def all_gather_into_start(x, axis_name, into, row, *, to="varying", sync=False):
  """Starts all_gather(x, axis_name, tiled=True) written into rows [row, row + n * len(x))
  of a larger buffer. `into` is either an array of x's dtype and trailing shape, donated
  (done returns it, those rows filled), or a shape: a new buffer whose other rows stay
  uninitialised for later calls of the chain to fill. Fused ops assemble their output so,
  with no concatenate. `to` is the new buffer's type over the axes ("invariant": the same
  on every rank, as when the chain covers every row). sync: as all_gather_in_place_start's."""
  axes, n = axes_lib.check_axes(axis_name, "all_gather_into_start")
  x = jnp.asarray(x)
  axes_lib.check_dtype(x, "all_gather_into_start")
  if x.ndim == 0:
    raise ValueError("jax_hoccl.all_gather_into_start: x needs a leading axis")
  dst, shape = _into_target(into)
  if (shape[1:] != x.shape[1:] or not 0 <= row <= shape[0] - n * x.shape[0]
      or (dst and into.dtype != x.dtype)):
    raise ValueError(f"jax_hoccl.all_gather_into_start: rows [{row}, {row + n * x.shape[0]}) "
                     f"of {x.dtype}{list(x.shape[1:])} do not fit into {shape}"
                     + (f" {into.dtype}" if dst else ""))
  return _into_start(x, dst, axes, n, shape=shape, row=int(row), invariant=(to != "varying"),
                     perm=(), sync=sync)


def all_gather_in_place_start(buf, axis_name, row, rows, *, to="varying", sync=False):
  """Starts the all_gather of blocks every rank already wrote into its slot of `buf`
  (donated): rank r's `rows` rows at [row + r * rows, row + (r + 1) * rows). done returns buf
  with rows [row, row + n * rows) holding every rank's block; my own block is not copied.
  matmul_psum's GEMMs write their summed pieces so. sync=True runs the exchange on XLA's
  stream rather than an async one, for a pipeline's last exchange (nothing left to overlap):
  it saves the hops between streams, and done is then free."""
  axes, n = axes_lib.check_axes(axis_name, "all_gather_in_place_start")
  buf = jnp.asarray(buf)
  axes_lib.check_dtype(buf, "all_gather_in_place_start")
  if buf.ndim == 0 or rows < 1 or not 0 <= row <= buf.shape[0] - n * rows:
    raise ValueError(f"jax_hoccl.all_gather_in_place_start: rows [{row}, {row + n * rows}) do "
                     f"not fit into {buf.shape}")
  return _into_start(buf, (), axes, n, shape=buf.shape, row=int(row),
                     invariant=(to != "varying"), perm=(), in_place_rows=rows, sync=sync)


def ppermute_into_start(x, axis_name, perm, into):
  """Starts a ppermute whose received x lands in its sender's slot of a larger buffer: rank s's
  x at rows [s * len(x), (s + 1) * len(x)) of `into` (donated; done returns it) or of a new
  buffer when `into` is a shape ([n * len(x), ...]; rows nobody sends to stay uninitialised,
  for later calls of a chain to fill). One round of an all_to_all split by shift: the
  pipelines of the fused all_to_all ops assemble their output so, with no stack or gather."""
  axes, n = axes_lib.check_axes(axis_name, "ppermute_into_start")
  x = jnp.asarray(x)
  axes_lib.check_dtype(x, "ppermute_into_start")
  dst, shape = _into_target(into)
  if (x.ndim == 0 or shape != (n * x.shape[0], *x.shape[1:])
      or (dst and into.dtype != x.dtype)):
    raise ValueError(f"jax_hoccl.ppermute_into_start: {n} slots of {x.dtype}{list(x.shape)} "
                     f"do not make {shape}" + (f" {into.dtype}" if dst else ""))
  return _into_start(x, dst, axes, n, shape=shape, row=0, invariant=False,
                     perm=tuple(check_perm(perm, n)))



def done_after(pending: Pending, *after):
  """done's result, the wait ordered after the arrays `after` (a start's token, the result of
  the compute before the wait): operands it never reads, a data dependency that keeps the done
  behind that compute without aliasing (and copying) them."""
  buf, = done_p.bind(pending.buffer, pending.input, *after, site=pending.site, wait_only=False,
                     n_after=len(after))
  return pending.finish(buf)


def wait_after(pending: Pending, *after):
  """done_after without the result, for a start of an `into` chain whose buffer went on to
  the next start of the chain (which owns it now). Returns a token ordered after the wait."""
  token, = done_p.bind(pending.input, pending.input, *after, site=pending.site,
                       wait_only=True, n_after=len(after))
  return token
