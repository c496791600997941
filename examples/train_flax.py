"""Train a Flax NNX + optax model, data x tensor parallel, with jax_hoccl collectives.

What it shows
  * An ordinary Flax NNX model (nnx.Embed, nnx.LayerNorm, nnx.Linear, nnx.List) whose
    parameters are annotated with `nnx.with_partitioning`: created under `jax.set_mesh`, they
    are born sharded over a ('dp', 'tp') mesh, and `nnx.get_partition_spec` gives the
    shard_map specs. optax's adamw updates them outside the shard_map, on the global arrays.
  * Tensor parallelism over 'tp', Megatron style with sequence parallelism: between blocks
    the residual stream is split along the sequence; each MLP block all_gathers it before
    its column-parallel Linear and psum_scatters after its row-parallel one. The head is
    vocabulary-parallel: the cross-entropy takes a pmax and two psums over 'tp'. These are
    written as `C.all_gather`, `C.psum_scatter`, `C.pmax`, `C.psum`, with C = jax_hoccl (or
    jax.lax for the reference run): the explicit collectives of a tensor-parallel model.
  * Data parallelism over 'dp' left to JAX: the parameters are replicated over 'dp', so the
    gradient sum over 'dp' (and over 'tp' for the parameters replicated there) is the
    transpose of an implicit pvary that JAX inserts itself, and the reported loss is a plain
    `jax.lax.psum`. `jax_hoccl.route_collectives()` is the one switch that puts all of those on
    jax_hoccl. The script checks that the jax_hoccl train step compiles to no XLA
    collective at all.
  * With --check (the default) it trains twice from the same init on the same data: jax_hoccl
    (route_collectives on, C = jax_hoccl) and jax.lax (route_collectives off, C = jax.lax),
    compares the loss curves (float32, matmul precision "highest" in both runs, rtol 1e-4),
    prints MATCH or FAIL and exits non-zero on a mismatch. Where jax.lax cannot run across the
    processes (ranks sharing a GPU: NCCL refuses them) the reference is the same model on one
    device.
  * The parameters are created on one device in every process, then placed on the mesh with
    jax.make_array_from_callback (as the batches are): across processes that starts no XLA
    collective, where creating them sharded or jax.device_put would.

The task: next-token prediction on sequences x[t+1] = (3 x[t] + 7) mod V from random starts;
an MLP per token can learn it, and the script asserts the final loss is below half the first.

Needs flax and optax (`pip install ".[examples]"`). Run (CPU: 8 virtual devices, a 4 x 2 mesh;
1 GPU: 1 x 1; n GPUs: n/2 x 2):
    python examples/train_flax.py
    python examples/train_flax.py --dp 2 --tp 4 --steps 60
    python -m jax_hoccl.launch -n 2 examples/train_flax.py   # one process per GPU (1 GPU: shared)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # 8 virtual CPU devices when there is no GPU; PJRT_NPROC lets XLA:CPU run 8 devices
  # (whose collectives wait on each other) on a machine with fewer cores.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("PJRT_NPROC", "16")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

try:
  import flax  # noqa: E402
  import optax  # noqa: E402
  from flax import nnx  # noqa: E402
except ImportError as e:  # pragma: no cover - depends on the environment
  sys.exit(f"examples/train_flax.py needs flax and optax: pip install \".[examples]\" ({e})")

import jax_hoccl  # noqa: E402
import jax_hoccl.launch  # noqa: E402

jax_hoccl.launch.initialize()  # joins the other processes when launched that way

DP, TP = "dp", "tp"
XLA_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                   "collective-permute")


def sharded(init, *spec):
  """An initializer whose parameter is created sharded as `spec` over the mesh."""
  return nnx.with_partitioning(init, spec)


class MLPBlock(nnx.Module):
  """Pre-norm MLP with a residual, tensor-parallel over 'tp': `up` is column-parallel (its
  output features split over 'tp'), `down` row-parallel (its input features split), so each
  rank holds 1/tp of both and the block needs one all_gather and one psum_scatter."""

  def __init__(self, d: int, hidden: int, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, hidden, rngs=rngs,
                         kernel_init=sharded(nnx.initializers.lecun_normal(), None, TP),
                         bias_init=sharded(nnx.initializers.zeros_init(), TP))
    self.down = nnx.Linear(hidden, d, use_bias=False, rngs=rngs,
                           kernel_init=sharded(nnx.initializers.lecun_normal(), TP, None))
    self.bias = nnx.Param(jnp.zeros((d,)))  # added once, after the sum over 'tp'

  def __call__(self, x, C):  # x: [batch, seq / tp, d], this rank's part of the sequence
    h = C.all_gather(self.norm(x), TP, axis=1, tiled=True)           # [batch, seq, d]
    h = nnx.gelu(self.up(h))                                         # [batch, seq, hidden / tp]
    y = C.psum_scatter(self.down(h), TP, scatter_dimension=1, tiled=True)
    return x + y + self.bias


class Model(nnx.Module):
  def __init__(self, vocab: int, d: int, hidden: int, seq: int, layers: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, d)))
    self.blocks = nnx.List([MLPBlock(d, hidden, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs,  # vocabulary-parallel
                           kernel_init=sharded(nnx.initializers.lecun_normal(), None, TP))

  def __call__(self, tokens, C):
    """tokens: [batch, seq / tp], this rank's part of the sequence; returns this rank's
    logits [batch, seq, vocab / tp]."""
    part = tokens.shape[1]
    start = jax.lax.axis_index(TP) * part
    x = self.embed(tokens) + jax.lax.dynamic_slice_in_dim(self.pos[...], start, part)
    for block in self.blocks:
      x = block(x, C)
    return self.head(C.all_gather(self.norm(x), TP, axis=1, tiled=True))


def vocab_parallel_xent(logits, targets, C):
  """Mean cross-entropy of logits split over 'tp' along the vocabulary (rank r holds ids
  [r * V/tp, (r + 1) * V/tp)): the max, the sum of exponentials and the target's logit each
  combined over 'tp'."""
  part = logits.shape[-1]
  m = C.pmax(jax.lax.stop_gradient(logits.max(-1)), TP)             # (pmax has no gradient)
  lse = jnp.log(C.psum(jnp.exp(logits - m[..., None]).sum(-1), TP)) + m
  local = targets - jax.lax.axis_index(TP) * part
  mine = (local >= 0) & (local < part)
  picked = jnp.take_along_axis(logits, jnp.clip(local, 0, part - 1)[..., None], -1)[..., 0]
  return jnp.mean(lse - C.psum(jnp.where(mine, picked, 0.0), TP))


def make_train_step(C, graphdef, specs, mesh, tx, n_dp):
  """One jitted step: loss and gradients in a shard_map (C's tensor-parallel collectives,
  JAX's own data-parallel sums), then adamw on the global arrays."""

  def loss_and_grads(params, tokens, targets):
    def loss_fn(params):  # this dp rank's share of the global mean loss
      return vocab_parallel_xent(nnx.merge(graphdef, params)(tokens, C), targets, C) / n_dp

    loss, grads = jax.value_and_grad(loss_fn)(params)   # grads: summed over 'dp' by JAX
    return jax.lax.psum(loss, DP), grads

  grads_fn = jax.shard_map(loss_and_grads, mesh=mesh, in_specs=(specs, P(DP, TP), P(DP)),
                           out_specs=(P(), specs))

  @jax.jit
  def step(params, opt_state, tokens, targets):
    loss, grads = grads_fn(params, tokens, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def batches(args, vocab):
  rng = np.random.default_rng(args.seed)
  for _ in range(args.steps):
    start = rng.integers(0, vocab, size=(args.batch, 1))
    seq = [start]
    for _ in range(args.seq):
      seq.append((3 * seq[-1] + 7) % vocab)
    seq = np.concatenate(seq, axis=1).astype(np.int32)  # [batch, seq + 1]
    yield seq[:, :-1], seq[:, 1:]


def place(tree, specs, mesh):
  """Host values onto the mesh: each process builds its own devices' shards from its copy
  (jax.make_array_from_callback), which starts no XLA collective. (jax.device_put, or a
  parameter created sharded, across processes first checks or moves data with an XLA
  collective: NCCL on GPUs, which refuses ranks that share a GPU.)"""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), NamedSharding(mesh, s),
                                                lambda index: np.asarray(x)[index]),
      tree, specs, is_leaf=lambda s: isinstance(s, P))


def gpus_shared() -> bool:
  """Whether two processes of this job share a GPU (`python -m jax_hoccl.launch` with fewer GPUs
  than processes). jax.lax across processes runs on NCCL, which refuses that."""
  if jax.process_count() == 1 or jax.devices()[0].platform != "gpu":
    return False
  return jax_hoccl.gpus_shared("examples/train_flax.py")


def train(impl: str, args, mesh):
  """Trains from the same init on the same data; returns (losses, XLA collectives in the
  compiled step)."""
  C = jax_hoccl if impl == "hoccl" else jax.lax
  was = jax_hoccl.route_collectives(impl == "hoccl")  # jax.lax's and JAX's own collectives: jax_hoccl's or XLA's
  try:
    with jax.set_mesh(mesh), nnx.use_eager_sharding(False):
      # Created on this process's default device, then placed: the same init in every process.
      model = Model(args.vocab, args.d, args.hidden, args.seq, args.layers, nnx.Rngs(args.seed))
      graphdef, params = nnx.split(model, nnx.Param)
      specs = nnx.get_partition_spec(params)
      params = place(jax.tree.map(np.asarray, params), specs, mesh)
      tx = optax.adamw(optax.cosine_decay_schedule(args.lr, args.steps), weight_decay=1e-4)
      # optax's moments take the parameters' shardings; its step count, made on one device,
      # is placed on the mesh (replicated) like the rest.
      opt_state = jax.tree.map(
          lambda x: x if x.sharding.device_set == set(mesh.devices.flat)
          else place(np.asarray(x), P(), mesh), tx.init(params))
      step = make_train_step(C, graphdef, specs, mesh, tx, mesh.shape[DP])
      losses, found = [], None
      for tokens, targets in batches(args, args.vocab):
        tokens, targets = place((tokens, targets), (P(DP, TP), P(DP)), mesh)
        if found is None:
          hlo = step.lower(params, opt_state, tokens, targets).compile().as_text()
          found = sorted({c for c in XLA_COLLECTIVES if c in hlo})
        params, opt_state, loss = step(params, opt_state, tokens, targets)
        losses.append(float(loss))
  finally:
    jax_hoccl.route_collectives(was)
  return np.array(losses), found


def default_mesh_shape(n: int) -> tuple[int, int]:
  tp = 2 if n >= 2 and n % 2 == 0 else 1
  return n // tp, tp


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--impl", choices=("hoccl", "lax"), default="hoccl")
  ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                  help="also train with jax.lax and compare the loss curves (default on)")
  ap.add_argument("--dp", type=int, default=None, help="default: devices / tp")
  ap.add_argument("--tp", type=int, help="default 2 if the devices divide by 2, else 1")
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=16)
  ap.add_argument("--vocab", type=int, default=64)
  ap.add_argument("--d", type=int, default=64)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--lr", type=float, default=1e-2)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--reference", choices=("mesh", "one-device"),
                  help="the check's reference: jax.lax on the same mesh, or the same model on "
                       "one device (default: mesh, one-device where ranks share a GPU)")
  args = ap.parse_args(argv)
  n = jax.device_count()
  dp, tp = default_mesh_shape(n)
  if args.tp:
    tp, dp = args.tp, args.dp or n // args.tp
  elif args.dp:
    dp, tp = args.dp, n // args.dp
  if dp * tp > n or dp * tp == 0:
    sys.exit(f"mesh {dp}x{tp} needs {dp * tp} devices, have {n}")
  mesh = jax.make_mesh((dp, tp), (DP, TP), devices=jax.devices()[:dp * tp])
  # The reference: jax.lax on the same mesh, or where it cannot run across the processes (ranks
  # sharing a GPU) the same model on one device of this process.
  reference = args.reference or ("one-device" if gpus_shared() else "mesh")
  ref_mesh = (jax.make_mesh((1, 1), (DP, TP), devices=jax.local_devices()[:1])
              if reference == "one-device" else mesh)
  ref_name = "lax, one device" if reference == "one-device" else "lax"
  if args.impl == "lax" and gpus_shared():
    sys.exit("--impl lax: jax.lax across processes cannot run where ranks share a GPU (NCCL "
             "refuses them)")
  print(f"Flax {flax.__version__} NNX model, optax {optax.__version__}, dp={dp} x "
        f"tp={tp} on {n} {jax.devices()[0].platform} devices, {args.steps} steps")

  # GPUs run float32 matmuls at a lower precision by default (TF32 or bf16 passes), which two
  # runs round differently: the check runs both at "highest", the precision of CPUs.
  with jax.default_matmul_precision("highest") if args.check else contextlib.nullcontext():
    losses, found = train(args.impl, args, mesh)
    print(f"{args.impl}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; XLA collectives in the "
          f"compiled step: {', '.join(found) or 'none'}")
    if args.check:
      other = "lax" if args.impl == "hoccl" else "hoccl"
      ref, ref_found = train(other, args, ref_mesh if other == "lax" else mesh)
  ok = True
  if args.impl == "hoccl" and found:
    print("FAIL: the jax_hoccl step still has XLA collectives")
    ok = False
  if not losses[-1] < losses[0] / 2:
    print(f"FAIL: the model did not learn (loss {losses[0]:.4f} -> {losses[-1]:.4f})")
    ok = False
  if args.check:
    err = float(np.max(np.abs(losses - ref) / np.maximum(np.abs(ref), 1e-6)))
    same = bool(np.allclose(losses, ref, rtol=1e-4, atol=0))
    print(f"{ref_name if other == 'lax' else other}: loss {ref[0]:.4f} -> {ref[-1]:.4f}; XLA "
          f"collectives in the compiled step: {', '.join(ref_found) or 'none'}")
    print(f"largest relative difference of the two loss curves {err:.2e} (float32, matmul "
          f"precision 'highest' in both runs, rtol 1e-4): {'MATCH' if same else 'FAIL'}")
    ok = ok and same
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
