"""Trace-time checks of axis names and dtypes, and the group table a lowering passes to C++."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os

import numpy as np
import jax
import jax.numpy as jnp

from jax_hoccl._src import ffi_targets, job
from jax_hoccl._src import jax_internals as ji

# Dtypes the copy engines move (any whole-byte element type). Sub-byte types (int4, ...)
# have no byte address per element, so a byte mover cannot split them into chunks.
_MOVABLE = {
    np.dtype(t) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128)
} | {np.dtype(jnp.bfloat16)}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e4m3b11fnuz", "float8_e4m3", "float8_e8m0fnu", "float8_e3m4"):
  if hasattr(jnp, _name):
    _MOVABLE.add(np.dtype(getattr(jnp, _name)))

# Dtypes psum/psum_scatter add (bool is promoted to int32 first, like jax.lax.psum).
# Not `d.kind in "iufc"`: ml_dtypes' bfloat16 and most float8 types have kind "V".
_SUMMABLE = {d for d in _MOVABLE if d != np.dtype(np.bool_) and jnp.issubdtype(d, jnp.number)}


def normalize_axes(axis_name) -> tuple:
  if isinstance(axis_name, (tuple, list)):
    return tuple(axis_name)
  return (axis_name,)


def split_vmap_axes(axis_name) -> tuple[tuple, tuple]:
  """(vmap axes, the others) of axis_name. A vmap(axis_name=...) axis lives inside one device:
  nothing moves between devices for it, so jax.lax computes that part (as it would)."""
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
  axes = normalize_axes(axis_name)
  vmapped = tuple(a for a in axes if a not in manual and ji.bound_axis(a))
  return vmapped, tuple(a for a in axes if a not in vmapped)


def check_axes(axis_name, op: str) -> tuple[tuple, int]:
  """Checks the axes are manual mesh axes of the enclosing shard_map; returns (axes, size)."""
  axes = normalize_axes(axis_name)
  if not axes:
    raise ValueError(f"jax_hoccl.{op}: axis_name must name at least one mesh axis.")
  if len(set(axes)) != len(axes):
    raise ValueError(f"jax_hoccl.{op}: axis_name {axes} repeats an axis.")
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  if not manual:
    raise ValueError(
        f"jax_hoccl.{op}(axis_name={axis_name!r}) was called outside jax.shard_map. jax_hoccl "
        "collectives run per device: call them inside jax.shard_map(f, mesh=..., in_specs=..., "
        "out_specs=...).")
  missing = [a for a in axes if a not in manual]
  if missing:
    raise ValueError(
        f"jax_hoccl.{op}: axis name(s) {missing} not found among the manual axes "
        f"{sorted(manual, key=str)} of the enclosing shard_map mesh {dict(mesh.shape)}.")
  size = int(np.prod([mesh.shape[a] for a in axes]))
  return axes, size


def check_groups(axis_index_groups, n: int, op: str, even: bool = False):
  """axis_index_groups as a tuple of tuples (None stays None): subgroups of the indices
  0..n-1 along the axes (row-major over them in the order given, as jax.lax.axis_index), which
  must cover every index exactly once, like jax.lax's reductions require. even=True: all the
  same size (the ops whose output shape depends on the group size)."""
  if axis_index_groups is None:
    return None
  groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
  flat = [i for g in groups for i in g]
  if not groups or any(not g for g in groups) or sorted(flat) != list(range(n)):
    raise ValueError(
        f"jax_hoccl.{op}: axis_index_groups must cover all indices exactly once: got {groups} "
        f"for an axis of size {n}.")
  if even and len({len(g) for g in groups}) > 1:
    raise ValueError(
        f"jax_hoccl.{op}: axis_index_groups must all have the same size, got sizes "
        f"{[len(g) for g in groups]} (jax.lax's {op} cannot lower them either).")
  return groups


def groups_even(groups) -> bool:
  return groups is None or len({len(g) for g in groups}) == 1


def group_size(groups, n: int) -> int:
  """Ranks per group: the axis size without groups, else the (even) groups' size."""
  return n if groups is None else len(groups[0])


def rank_in_group(groups, n: int) -> np.ndarray:
  """[n]: each axis index's position in its group (its rank there)."""
  pos = np.zeros(n, np.int32)
  for g in groups:
    pos[list(g)] = np.arange(len(g), dtype=np.int32)
  return pos


def check_dtype(x, op: str, summable: bool = False) -> None:
  """Checks an input array of a collective: a dtype jax_hoccl moves (or sums), and a static
  shape."""
  check_static_shape(x, op)
  dt = np.dtype(x.dtype)
  allowed = _SUMMABLE if summable else _MOVABLE
  if summable and dt == np.bool_:
    return
  if dt not in allowed:
    kind = "summed" if summable else "moved"
    raise TypeError(
        f"jax_hoccl.{op}: dtype {dt} is not supported (it cannot be {kind} by jax_hoccl). "
        f"Supported: {sorted(str(d) for d in allowed)}.")


def matmul_operands(x, w, op: str):
  """x and w of a fused op in the type jnp.matmul multiplies them in (bf16 @ f32 is f32), a
  type jax_hoccl sums."""
  dt = jnp.result_type(x, w)
  x, w = (v if v.dtype == dt else v.astype(dt) for v in (x, w))
  check_dtype(x, op, summable=True)
  return x, w


def check_static_shape(x, op: str) -> None:
  """Symbolic dims (jax.export) are refused at trace time: with jaxlib 0.11.2, a module whose
  shard_map body holds a custom call of symbolic shape crashes (SIGSEGV) in the shape
  refinement that runs when the exported function is called, and jax's own reshapes of
  symbolic shapes in a shard_map body fail there too (docs/design.md, "Symbolic shapes")."""
  if not all(ji.is_static(d) for d in np.shape(x)):
    raise NotImplementedError(
        f"jax_hoccl.{op}: symbolic shapes (jax.export) are not supported, got shape "
        f"{tuple(np.shape(x))}: jaxlib 0.11.2 cannot compile a custom call of symbolic shape "
        "inside shard_map (its shape refinement crashes). Export with concrete shapes, or use "
        "jax.lax's collectives where the shapes are symbolic.")


def _by_group(values: np.ndarray, axis_names, axes) -> np.ndarray:
  """A per-device array of the mesh regrouped [num_groups, group_size], rows in rank order
  (row-major over `axes` in the order given, as jax.lax.axis_index does)."""
  names = list(axis_names)
  others = [a for a in names if a not in axes]
  perm = [names.index(a) for a in others] + [names.index(a) for a in axes]
  n = int(np.prod([values.shape[names.index(a)] for a in axes]))
  return np.ascontiguousarray(values.transpose(perm).reshape(-1, n))


def group_table(mesh, axes, groups=None) -> np.ndarray:
  """Device ids of every group along `axes`: shape [num_groups, group_size]. With (even)
  axis_index_groups each group along the axes splits into those subgroups, as jax.lax's
  replica groups do; the C++ handlers find their row and rank in the table all the same."""
  table = _by_group(np.asarray(mesh.device_ids), mesh.axis_names, axes).astype(np.int64)
  if groups is None:
    return table
  return np.concatenate([table[:, list(g)] for g in groups], axis=0)


_sites = itertools.count(1)
_user_ops: list[str] = []
_names: dict[int, str] = {}  # site -> the op the user called there (errors name it)
_lines: dict[int, str] = {}  # site -> the user's line that made it (ji.user_line)
_shared: set[int] = set()  # sites shared by the branches of a cond (branches.py)
_scopes: list = []  # per enclosing user_op: None, or [its shared site, sites made so far]
_derived: dict[tuple[int, int], int] = {}  # (shared site, k) -> its k-th inner site
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jax_hoccl's folder
SHARED_SITE = 1 << 42  # marks a lowered site the branches of a cond share (cc/job.h)
_MODULE_SITES = ("jax_hoccl", "sites")  # ji.module_state: {site: (lowered site, order)}


@contextlib.contextmanager
def user_op(name: str, site: int | None = None):
  """Sites made inside (e.g. psum's lowering, which runs on all_gather) are reported in
  errors as the op the user called. When `site` (the op's own) is shared by cond branches,
  the k-th site made inside is the same in every branch, and shared too; an op without a
  site of its own inside such an op counts on in the enclosing one's scope."""
  _user_ops.append(name)
  if site in _shared:
    _scopes.append([site, 0])
  else:
    _scopes.append(_scopes[-1] if site is None and _scopes else None)
  try:
    yield
  finally:
    _scopes.pop()
    _user_ops.pop()


def names_errors(name: str):
  """Decorator: collectives made while the function runs (traces) are reported in errors as
  `name`, the op the user called (a fused op's exchanges, its backward pass's)."""
  def wrap(f):
    @functools.wraps(f)
    def inner(*args, **kwargs):
      with user_op(name):
        return f(*args, **kwargs)
    return inner
  return wrap


def share_site(site: int) -> int:
  """Marks `site` as shared by alternative instructions (branches.py); returns it."""
  _shared.add(site)
  return site


def new_site() -> int:
  """A fresh call-site id. Every collective a lowering emits carries one: XLA:CPU may run
  independent ops concurrently, in a different order per device, so the CPU engine pairs
  the ranks' calls by (site, n-th call from it), as XLA's own CPU collectives key by op id."""
  scope = _scopes[-1] if _scopes else None
  if scope is not None:  # inside an op whose site the branches of a cond share
    key = (scope[0], scope[1])
    scope[1] += 1
    if key not in _derived:
      _derived[key] = share_site(next(_sites))
      _names[_derived[key]] = _user_ops[0]
      _lines[_derived[key]] = ji.user_line(skip=_PACKAGE)
    return _derived[key]
  site = next(_sites)
  if _user_ops:  # the outermost: the op the user called
    _names[site] = _user_ops[0]
  _lines[site] = ji.user_line(skip=_PACKAGE)
  return site


def lowered_site(ctx, site: int) -> int:
  """The site as the program being lowered names it, alike in every process: drawn from the
  module's name, the order in which its sites first appear in it, and the user's line that
  made the call (modules of jax.jit(lambda ...) share a name). Not the op or its types:
  ranks that call different ones there meet, and fail at once as mismatched. A site
  from new_site() is a count of what this process traced before, which differs where one
  process traces another program (one it only lowers for its text, say) or the same ones in
  another order; the CPU engine pairs calls across processes by the lowered site (async
  starts pick their stream by its order: site_order). Site 0 stays 0 (names no user op)."""
  if not site:
    return 0
  return _lowered(ctx, site)[0]


def site_order(ctx, site: int) -> int:
  """The order in which `site` first appeared in the program being lowered (0, 1, ...), alike
  in every process: async starts take their stream round-robin by it."""
  return _lowered(ctx, site)[1] if site else 0


def _lowered(ctx, site: int) -> tuple[int, int]:
  """(lowered site, order of first appearance) of `site` in the module being lowered."""
  sites = ji.module_state(ctx, _MODULE_SITES, {})
  if site not in sites:
    call = (ji.module_name(ctx), len(sites), _lines.get(site, ""))
    digest = hashlib.blake2b(repr(call).encode(), digest_size=8).digest()
    # 42 bits, and SHARED_SITE (cc/job.h kSharedSite) for a site the branches of a cond
    # share: the CPU engine keeps the low 20 of its 63-bit keys for the instance count
    lowered = (int.from_bytes(digest, "little") & (SHARED_SITE - 1)) or 1
    if site in _shared:
      lowered |= SHARED_SITE
    sites[site] = (lowered, len(sites))
    if site in _names:
      ffi_targets.name_site(lowered, _names[site])
  return sites[site]


def _spans(mesh, axes, of_device) -> bool:
  owners = np.vectorize(of_device, otypes=[object])(np.asarray(mesh.devices))
  table = _by_group(owners, mesh.axis_names, axes)
  return bool((table != table[:, :1]).any())


def spans_processes(mesh, axes) -> bool:
  """Whether some group along `axes` holds devices of more than one process."""
  return _spans(mesh, axes, lambda d: d.process_index)


def calling_op(op: str) -> str:
  """The op the user called: the innermost user_op being lowered, else `op` itself."""
  return _user_ops[-1] if _user_ops else op


def spans_nodes(mesh, axes, op: str = "collective") -> bool:
  """Whether some group along `axes` holds devices of more than one node (job.py). Groups
  inside a node run on jax_hoccl's engines, one process or several; groups across nodes are
  composed with XLA's collectives (ops/across_processes.py). `op`: the mover or op asking,
  named in job.py's errors."""
  if not spans_processes(mesh, axes):
    return False
  name = calling_op(op)
  return _spans(mesh, axes, lambda d: job.node_of_device(d, name))


def check_single_node(mesh, axes, op: str) -> None:
  """An FFI call's group must live in one node: its ranks meet in an in-process rendezvous or
  in shared memory of the node (cc/node_rendezvous.h). The collectives compose across nodes
  before they get here (ops/across_processes.py); async pairs and fused ops cannot."""
  if spans_nodes(mesh, axes, op):
    raise NotImplementedError(
        f"jax_hoccl.{op}: the group over {axes} spans several nodes; async pairs and fused "
        "ops run among the devices of one node only (psum, all_gather, psum_scatter, "
        "all_to_all, ppermute, pmean, pmax and pmin work across nodes: jax_hoccl inside each, "
        "XLA's collectives across). Use mesh axes whose groups stay inside a node for them.")


def ffi_group_attrs(ctx, axes, op: str, site: int, groups=None) -> dict:
  mesh = ji.concrete_mesh_from_lowering(ctx, op)
  check_single_node(mesh, axes, op)
  if spans_processes(mesh, axes):
    job.nodes(calling_op(op))  # the C++ engines learn the job before the first call
  table = group_table(mesh, axes, groups)
  # One dictionary attribute, decoded whole as a struct by every handler (cc/ffi/handler_common.h).
  return dict(group=dict(groups=table.reshape(-1), group_size=np.int64(table.shape[1]),
                         site=np.int64(lowered_site(ctx, site))))
