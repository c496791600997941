"""Train a small data x tensor-parallel transformer with jax_hoccl collectives.

What it shows
  * A decoder-only transformer (token + position embedding, pre-norm attention + MLP blocks)
    sharded over a ('dp', 'tp') mesh inside one `jax.jit(jax.shard_map(...))` train step.
  * Megatron-style sequence parallelism over 'tp': between blocks the residual stream is
    sharded along the sequence; each block all_gathers it over 'tp' before its
    column-parallel matmul and psum_scatters after its row-parallel matmul (`ag_matmul` /
    `matmul_rs` below: the two call sites a fused op would replace).
  * Data parallelism over 'dp' with replicated parameters whose gradients are summed
    explicitly with `C.psum` inside the shard_map (no collective is left implicit).
  * Every collective goes through one module `C`: `jax_hoccl` (default) or `jax.lax`, with
    identical call sites. With --check (the default) the script trains the model with both,
    from the same init on the same data, and checks that the loss curves and the final
    parameters agree (float32, rtol 1e-4); it prints MATCH or exits non-zero. Both runs use
    matmul precision "highest" (GPUs otherwise run float32 matmuls as TF32 or bf16 passes,
    which two runs round differently). Where jax.lax cannot run across the processes (ranks
    sharing a GPU: NCCL refuses them) the reference is the same model on one device.
  * Parameters and batches reach the mesh through jax.make_array_from_callback (each process
    builds its own shards), not jax.device_put, which across processes starts an XLA
    collective: the jax_hoccl run compiles none.
  * --fused swaps the two tp call sites for jax_hoccl.all_gather_matmul /
    jax_hoccl.matmul_reduce_scatter (exchanges hidden behind the matmuls) and prints the
    step times of both runs.
  * --bf16 runs those matmuls (and what the tp collectives move) in bfloat16, parameters,
    norms, softmax and the optimizer staying float32 (mixed precision, how large models
    train). bf16 rounding then moves a run away from its float32 run, by an amount that
    compounds over the run and depends on the machine: the check measures it (the reference
    trained again in float32) and passes if jax_hoccl's bf16 run is at most twice as far from
    that float32 run as the reference's bf16 run is.

The task: next-token prediction on arithmetic sequences x[t+1] = (x[t] + k) mod V, with a
random start and a random stride k in 1..6 per sequence (fixed-seed generator). The stride is
not given: without attention the best loss is log(6) ~ 1.79 per token; reading k off the
previous tokens through attention brings it to ~log(6)/seq ~ 0.06. The script asserts the
final loss is below half the initial loss and below log(6)/2, i.e. that attention learned.

Run (CPU: 8 virtual devices, a 4x2 mesh; 1 GPU: 1x1; 2 GPUs: 1x2):
    python examples/train_transformer.py                    # hoccl, checked against lax
    python examples/train_transformer.py --fused --bf16
    python examples/train_transformer.py --impl lax --no-check --steps 500
    python examples/train_transformer.py --dp 2 --tp 4
    python -m jax_hoccl.launch -n 2 examples/train_transformer.py   # one process per GPU
                     # (1 GPU: 2 ranks share it; no GPU: 2 processes x 4 CPU devices)
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import os
import sys
import time
from typing import Callable, NamedTuple


def _gpu_available() -> bool:
  """Decided before importing jax (the CPU device count must be set before jax starts)."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return any(p in platforms for p in ("cuda", "gpu"))
  has_plugin = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
  return has_plugin and bool(glob.glob("/dev/nvidia[0-9]*"))


# Started as one of several processes by `python -m jax_hoccl.launch -n N` (one per GPU):
# the launcher chose the devices.
_LAUNCHED = bool(os.environ.get("JAX_HOCCL_LAUNCH"))

if not _LAUNCHED and not _gpu_available():
  # 8 virtual CPU devices so the dp x tp mesh is real; PJRT_NPROC lets XLA:CPU run 8 devices
  # (whose collectives wait on each other) on a machine with fewer cores.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("PJRT_NPROC", "16")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_hoccl  # noqa: E402
import jax_hoccl.launch  # noqa: E402

jax_hoccl.launch.initialize()  # joins the other processes when launched that way

DP, TP = "dp", "tp"


class Config(NamedTuple):
  vocab: int = 32
  seq: int = 32
  batch: int = 16  # global
  d_model: int = 64
  heads: int = 4
  d_ff: int = 256
  layers: int = 2
  max_stride: int = 6
  lr: float = 3e-3
  warmup: int = 20
  steps: int = 300  # the learning rate decays to 0 over the run (keeps the runs comparable)


# ---------------------------------------------------------------------------------------
# Data: a fixed-seed generator, so both implementations see exactly the same batches.
# ---------------------------------------------------------------------------------------

def make_batches(cfg: Config, steps: int, seed: int = 0) -> np.ndarray:
  """int32 [steps, seq + 1, batch]: column b is x[t] = (x0 + k*t) mod V (sequence-major,
  the layout the model uses)."""
  rng = np.random.default_rng(seed)
  x0 = rng.integers(0, cfg.vocab, size=(steps, 1, cfg.batch))
  k = rng.integers(1, cfg.max_stride + 1, size=(steps, 1, cfg.batch))
  t = np.arange(cfg.seq + 1)[None, :, None]
  return ((x0 + k * t) % cfg.vocab).astype(np.int32)


# ---------------------------------------------------------------------------------------
# Parameters: global shapes and how each is sharded over the mesh.
# ---------------------------------------------------------------------------------------

def param_specs(cfg: Config) -> dict:
  """Column-parallel weights are split over 'tp' on their output dim, row-parallel ones on
  their input dim; everything else is replicated. Nothing is split over 'dp'."""
  layer = {
      "ln1": P(), "wqkv": P(None, TP), "wo": P(TP, None),   # attention
      "ln2": P(), "w1": P(None, TP), "w2": P(TP, None),     # MLP
  }
  return {"embed": P(), "pos": P(TP, None), "layers": [layer] * cfg.layers,
          "ln_f": P(), "head": P()}


def init_params(cfg: Config, key) -> dict:
  """Global (unsharded) float32 parameters. wqkv's columns are ordered [head, q|k|v, d_head]
  so that a 'tp' shard holds whole heads."""
  d, f, dh = cfg.d_model, cfg.d_ff, cfg.d_model // cfg.heads
  keys = iter(jax.random.split(key, 3 + 4 * cfg.layers))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)

  layers = [{
      "ln1": jnp.ones(d), "wqkv": normal((d, cfg.heads * 3 * dh), d),
      "wo": normal((d, d), d) / np.sqrt(2 * cfg.layers),
      "ln2": jnp.ones(d), "w1": normal((d, f), d),
      "w2": normal((f, d), f) / np.sqrt(2 * cfg.layers),
  } for _ in range(cfg.layers)]
  return {"embed": normal((cfg.vocab, d), 1.0), "pos": normal((cfg.seq, d), 1.0) * 0.1,
          "layers": layers, "ln_f": jnp.ones(d), "head": normal((d, cfg.vocab), d)}


# ---------------------------------------------------------------------------------------
# Model (runs per device inside shard_map). Activations are sequence-major, [s, b, d], and
# flattened to [s*b, d] around the matmuls: gathering/scattering rows over 'tp' is then
# gathering/scattering the sequence.
# ---------------------------------------------------------------------------------------

class TPMatmuls(NamedTuple):
  ag_matmul: Callable  # x [s/tp*b, d] (sequence shard), w [d, n/tp] -> [s*b, n/tp]
  matmul_rs: Callable  # x [s*b, n/tp], w [n/tp, d] -> [s/tp*b, d] (summed, sequence shard)


def tp_matmuls(C, fused: bool = False, dtype=jnp.float32) -> TPMatmuls:
  """The only places a layer talks to the other 'tp' ranks. With fused=True (jax_hoccl
  only) the exchanges hide behind the matmuls: all_gather_matmul / matmul_reduce_scatter.
  Inputs are cast to `dtype` (bfloat16 with --bf16) and results back to float32."""
  if fused:
    ag, rs = (lambda x, w: jax_hoccl.all_gather_matmul(x, w, TP),
              lambda x, w: jax_hoccl.matmul_reduce_scatter(x, w, TP))
  else:
    ag = lambda x, w: C.all_gather(x, TP, axis=0, tiled=True) @ w  # noqa: E731
    rs = lambda x, w: C.psum_scatter(x @ w, TP, scatter_dimension=0, tiled=True)  # noqa: E731

  def cast(f):
    return lambda x, w: f(x.astype(dtype), w.astype(dtype)).astype(jnp.float32)

  return TPMatmuls(cast(ag), cast(rs))


def rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def attention(mm: TPMatmuls, p, x, cfg: Config):
  """Causal self-attention; this 'tp' rank computes its heads over the full sequence."""
  s_local, b, d = x.shape
  dh = cfg.d_model // cfg.heads
  qkv = mm.ag_matmul(rms_norm(x, p["ln1"]).reshape(-1, d), p["wqkv"])
  qkv = qkv.reshape(-1, b, qkv.shape[-1] // (3 * dh), 3, dh)  # [s, b, heads/tp, 3, dh]
  q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
  s = q.shape[0]
  scores = jnp.einsum("qbhd,kbhd->bhqk", q, k) / np.sqrt(dh)
  causal = jnp.tril(jnp.ones((s, s), bool))
  probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  out = jnp.einsum("bhqk,kbhd->qbhd", probs, v).reshape(s * b, -1)
  return x + mm.matmul_rs(out, p["wo"]).reshape(s_local, b, d)


def mlp(mm: TPMatmuls, p, x):
  s_local, b, d = x.shape
  h = jax.nn.gelu(mm.ag_matmul(rms_norm(x, p["ln2"]).reshape(-1, d), p["w1"]))
  return x + mm.matmul_rs(h, p["w2"]).reshape(s_local, b, d)


def local_loss(mm: TPMatmuls, params, tokens, targets, cfg: Config):
  """This device's share of the global mean cross-entropy: the sum over all devices is the
  loss. tokens/targets: [seq/tp, batch/dp] (this device's sequence and batch shard)."""
  x = params["embed"][tokens] + params["pos"][:, None, :]
  for p in params["layers"]:
    x = mlp(mm, p, attention(mm, p, x, cfg))
  logits = rms_norm(x, params["ln_f"]) @ params["head"]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)
  return jnp.sum(nll) / (cfg.seq * cfg.batch)


# ---------------------------------------------------------------------------------------
# Optimizer: Adam with linear warmup and cosine decay, applied per shard (element-wise, so
# sharding-agnostic).
# ---------------------------------------------------------------------------------------

def adam_init(params):
  """On the host, like the parameters it is given (placed on the mesh with them)."""
  zeros = lambda: jax.tree.map(np.zeros_like, params)  # noqa: E731 (m, v: separate buffers)
  return {"m": zeros(), "v": zeros(), "count": np.zeros((), np.int32)}


def adam_update(params, grads, state, cfg: Config, b1=0.9, b2=0.99, eps=1e-8):
  count = state["count"] + 1
  t = count.astype(jnp.float32)
  lr = cfg.lr * jnp.minimum(1.0, t / cfg.warmup) * 0.5 * (1 + jnp.cos(jnp.pi * t / cfg.steps))
  m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
  v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
  scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
  params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
  return params, {"m": m, "v": v, "count": count}


# ---------------------------------------------------------------------------------------
# Train step: one jit(shard_map) with every collective explicit.
# ---------------------------------------------------------------------------------------

def replicated_axes(spec: P, mesh) -> tuple:
  """Mesh axes a parameter is replicated over: each device holds a partial gradient for it
  there, to be summed over those axes."""
  used = {a for part in spec if part is not None
          for a in (part if isinstance(part, tuple) else (part,))}
  return tuple(a for a in mesh.axis_names if a not in used)


def sum_over_replicas(C, grads, sync_axes):
  """Each gradient summed over the axes its parameter is replicated on, with one C.psum per
  set of axes on all of those gradients at once: jax_hoccl then sums them in one exchange per
  dtype (up to its bucket size), as XLA combines jax.lax's all-reduces, instead of paying a
  small exchange per gradient."""
  leaves, treedef = jax.tree.flatten(grads)
  groups = {}
  for i, ax in enumerate(treedef.flatten_up_to(sync_axes)):
    groups.setdefault(ax, []).append(i)
  for ax, idx in groups.items():
    if ax:
      for i, g in zip(idx, C.psum([leaves[i] for i in idx], ax)):
        leaves[i] = g
  return jax.tree.unflatten(treedef, leaves)


def make_train_step(C, cfg: Config, mesh, specs, fused: bool = False, dtype=jnp.float32):
  mm = tp_matmuls(C, fused, dtype)
  is_spec = lambda s: isinstance(s, P)  # noqa: E731
  sync_axes = jax.tree.map(lambda s: replicated_axes(s, mesh), specs, is_leaf=is_spec)
  opt_specs = {"m": specs, "v": specs, "count": P()}
  data_spec = P(TP, DP)  # [seq, batch]: sequence over 'tp', batch over 'dp'

  def step(params, opt_state, tokens, targets):
    # Mark each parameter varying over the axes it is replicated on *before* differentiating:
    # jax then leaves its gradient per-device (instead of inserting jax.lax's psum in the
    # backward pass), and we sum it below with C.psum.
    params_v = jax.tree.map(lambda p, ax: jax.lax.pcast(p, ax, to="varying") if ax else p,
                            params, sync_axes)
    loss, grads = jax.value_and_grad(local_loss, argnums=1)(mm, params_v, tokens, targets, cfg)
    grads = sum_over_replicas(C, grads, sync_axes)
    params, opt_state = adam_update(params, grads, opt_state, cfg)
    return params, opt_state, C.psum(loss, (DP, TP))

  sharded = jax.shard_map(step, mesh=mesh,
                          in_specs=(specs, opt_specs, data_spec, data_spec),
                          out_specs=(specs, opt_specs, P()))
  return jax.jit(sharded, donate_argnums=(0, 1))


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------

def progress(step: int, steps: int, loss: float, ms: float | None, width: int = 30):
  """One line redrawn with \\r on a terminal; a line every tenth of the run otherwise."""
  done = (step + 1) * width // steps
  timing = f"{ms:6.2f} ms/step" if ms is not None else "compiling..."
  line = f"  [{'#' * done}{'.' * (width - done)}] {step + 1:4d}/{steps}  loss {loss:.4f}  {timing}"
  if sys.stdout.isatty():
    print("\r" + line, end="\n" if step + 1 == steps else "", flush=True)
  elif (step + 1) % max(1, steps // 10) == 0 or step == 0:
    print(line, flush=True)


def place(tree, specs, mesh):
  """Host (numpy) arrays onto the mesh: each process builds its own devices' shards from its
  copy (jax.make_array_from_callback), which starts no XLA collective. (jax.device_put of host
  data to a mesh spanning processes first checks that every process passed the same value, with
  an all-gather: NCCL on GPUs, which refuses ranks that share a GPU.)"""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), NamedSharding(mesh, s),
                                                lambda index: np.asarray(x)[index]),
      tree, specs, is_leaf=lambda s: isinstance(s, P))


def local_pieces(x: jax.Array) -> dict:
  """This process's shards of `x` as numpy, keyed by their (start, stop) per dimension: a job
  spanning processes holds no whole tp-sharded parameter in any one process."""
  def key(index):
    return tuple(sl.indices(d)[:2] for sl, d in zip(index, x.shape))
  return {key(s.index): np.asarray(s.data) for s in x.addressable_shards}


def train(impl: str, cfg: Config, mesh, batches: np.ndarray, seed: int, fused: bool = False,
          dtype=jnp.float32, label: str | None = None):
  """Returns (losses [steps], final params as this process's local pieces, mean step time in
  ms)."""
  C = jax_hoccl if impl == "hoccl" else jax.lax
  fused = fused and impl == "hoccl"
  specs = param_specs(cfg)
  opt_specs = {"m": specs, "v": specs, "count": P()}
  params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(seed)))
  params, opt_state = place(params, specs, mesh), place(adam_init(params), opt_specs, mesh)
  data_spec = P(TP, DP)
  train_step = make_train_step(C, cfg, mesh, specs, fused, dtype)

  print(f"[{label or impl}{' fused' if fused else ''}] training {len(batches)} steps")
  losses, times = [], []
  for i, batch in enumerate(batches):
    tokens, targets = place((batch[:-1], batch[1:]), (data_spec, data_spec), mesh)
    t0 = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, tokens, targets)
    losses.append(float(loss))  # blocks: the step time is the real one
    if i > 0:  # step 0 is compilation
      times.append(time.perf_counter() - t0)
    progress(i, len(batches), losses[-1], 1e3 * np.mean(times) if times else None)
  ms = 1e3 * float(np.mean(times)) if times else float("nan")
  return np.array(losses), [local_pieces(x) for x in jax.tree.leaves(params)], ms


def default_mesh_shape(n: int) -> tuple[int, int]:
  tp = 2 if n >= 2 and n % 2 == 0 else 1
  return n // tp, tp


def check_config(cfg: Config, dp: int, tp: int):
  for what, size, by in (("batch", cfg.batch, dp), ("seq", cfg.seq, tp),
                         ("heads", cfg.heads, tp), ("d_ff", cfg.d_ff, tp)):
    if size % by:
      sys.exit(f"{what}={size} must divide by the mesh axis size {by}")


# The least tolerance of a bf16 run against the float32 run. Of CPUs, one measured the
# reference's drift at 0.9e-2 to 2.6e-2 over six seeds and jax_hoccl's within 1.4x of it;
# another (other matmul kernels) 0.9e-2 for the reference and 4.3e-2 for jax_hoccl. A
# collective that sums or places wrongly moves the run further, or it does not learn.
BF16_FLOOR = 5e-2


def differences(run, ref) -> tuple[float, float]:
  """The largest relative differences of two runs: of their loss curves, and of their final
  parameters (per leaf, relative to the leaf's scale: parameters near zero have no relative
  error) over this process's pieces. `ref` may hold each parameter whole (one device)."""
  (loss_a, pieces_a, _), (loss_b, pieces_b, _) = run, ref
  curve = float(np.max(np.abs(loss_a - loss_b) / np.abs(loss_b)))
  param = 0.0
  for a, b in zip(pieces_a, pieces_b):
    pairs = [(v, b[k] if k in b else next(iter(b.values()))[tuple(slice(*r) for r in k)])
             for k, v in a.items()]
    scale = max(float(np.max(np.abs(w))) for _, w in pairs)
    param = max(param, max(float(np.max(np.abs(v - w))) for v, w in pairs) / scale)
  return curve, param


def gpus_shared() -> bool:
  """Whether two processes of this job share a GPU (`python -m jax_hoccl.launch` with fewer GPUs
  than processes). jax.lax across processes runs on NCCL, which refuses that."""
  if jax.process_count() == 1 or jax.devices()[0].platform != "gpu":
    return False
  return jax_hoccl.gpus_shared("examples/train_transformer.py")


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--impl", choices=("hoccl", "lax"), default="hoccl",
                  help="collective module for the main run (default hoccl)")
  ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                  help="also train with the other module and compare (default on)")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--dp", type=int, help="data-parallel size (default: devices / tp)")
  ap.add_argument("--tp", type=int, help="tensor-parallel size (default 2 if possible)")
  ap.add_argument("--fused", action="store_true",
                  help="hoccl: use all_gather_matmul / matmul_reduce_scatter in the layers")
  ap.add_argument("--size", choices=("small", "large"), default="small",
                  help="model size: small (CPU, default) or large (d_model 1024, seq 1024)")
  ap.add_argument("--bf16", action="store_true",
                  help="tp matmuls and their collectives in bfloat16 (mixed precision)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--rtol", type=float,
                  help="run comparison tolerance (default 1e-4; with --bf16 derived from the "
                       "reference run)")
  ap.add_argument("--reference", choices=("mesh", "one-device"),
                  help="the check's reference: jax.lax on the same mesh, or the same model on "
                       "one device (default: mesh, one-device where ranks share a GPU)")
  return ap.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  devices = jax.devices()
  dp, tp = default_mesh_shape(len(devices))
  if args.tp:
    tp = args.tp
    dp = args.dp or len(devices) // tp
  elif args.dp:
    dp, tp = args.dp, len(devices) // args.dp
  if dp * tp > len(devices) or dp * tp == 0:
    sys.exit(f"mesh {dp}x{tp} needs {dp * tp} devices, have {len(devices)}")
  cfg = Config(steps=args.steps)
  if args.size == "large":  # big enough that the collectives move megabytes (GPU timing)
    cfg = cfg._replace(seq=1024, batch=16, d_model=1024, heads=16, d_ff=4096, layers=4,
                       lr=1e-3)
  check_config(cfg, dp, tp)
  mesh = jax.make_mesh((dp, tp), (DP, TP), devices=devices[:dp * tp])
  print(f"{len(devices)} {devices[0].platform} devices, mesh dp={dp} x tp={tp}; "
        f"model d={cfg.d_model} layers={cfg.layers} heads={cfg.heads} seq={cfg.seq} "
        f"batch={cfg.batch}")

  # The reference: jax.lax on the same mesh, or where it cannot run across the processes (ranks
  # sharing a GPU) the same model on one device of this process (a 1 x 1 mesh).
  reference = args.reference or ("one-device" if gpus_shared() else "mesh")
  if reference == "one-device":
    if args.impl == "lax" and gpus_shared():
      sys.exit("--impl lax: jax.lax across processes cannot run where ranks share a GPU (NCCL "
               "refuses them)")
    ref_mesh = jax.make_mesh((1, 1), (DP, TP), devices=jax.local_devices()[:1])
    ref_name = "lax, one device"
  else:
    ref_mesh, ref_name = mesh, "lax"
  batches = make_batches(cfg, args.steps, args.seed)
  dtype = jnp.bfloat16 if args.bf16 else jnp.float32
  runs = {}
  # GPUs run float32 matmuls at a lower precision by default (TF32 or bf16 passes), which two
  # runs round differently: the check runs both at "highest", the precision of CPUs.
  with jax.default_matmul_precision("highest") if args.check else contextlib.nullcontext():
    for impl in [args.impl] + ([{"hoccl": "lax", "lax": "hoccl"}[args.impl]] if args.check else []):
      if impl == "hoccl":
        runs["hoccl"] = train("hoccl", cfg, mesh, batches, args.seed, args.fused, dtype)
      else:
        runs["lax"] = train("lax", cfg, ref_mesh if args.check else mesh, batches, args.seed,
                            dtype=dtype, label=ref_name if args.check else "lax")
    if args.check and args.bf16 and args.rtol is None:
      # The yardstick of bf16 rounding over this run: the reference again in float32.
      yardstick = train("lax", cfg, ref_mesh, batches, args.seed, label=f"{ref_name}, float32")

  ok = True
  for impl, (losses, _, ms) in runs.items():
    first, last = losses[0], np.mean(losses[-10:])
    # log(max_stride) is the best loss a model that ignores the context can reach.
    target = min(0.5 * first, 0.5 * np.log(cfg.max_stride))
    learned = last < target
    print(f"[{impl}] loss {first:.4f} -> {last:.4f} (mean of last 10), {ms:.2f} ms/step: "
          f"{'learned' if learned else f'DID NOT LEARN (needs < {target:.3f})'}")
    ok &= learned
  if args.check:
    against, against_name = runs["lax"], ref_name
    if args.rtol is not None:
      tol_curve = tol_param = args.rtol
      how = f"rtol {args.rtol:.0e} (--rtol)"
    elif args.bf16:
      # bf16 rounding moves a run away from its float32 run by an amount that compounds over the
      # run: measured on the reference, not fixed. jax_hoccl's bf16 run may be up to twice as
      # far (it sums in float32 and rounds once, where jax.lax's bf16 collectives round as they
      # go, but its tp partial products are rounded where one device's matmul is not), and
      # never held closer than BF16_FLOOR: how a run's bf16 matmuls round depends on the
      # kernels the machine picks for each shape, which differ between the two runs' shapes.
      bf_curve, bf_param = differences(runs["lax"], yardstick)
      tol_curve = tol_param = max(2 * max(bf_curve, bf_param), BF16_FLOOR)  # one drift, 2 measures
      against, against_name = yardstick, f"{ref_name}, float32"
      how = (f"bfloat16 rounding moves the {ref_name} run from its float32 run by {bf_curve:.2e} "
             f"(loss curve), {bf_param:.2e} (params); jax_hoccl's bf16 run may be twice as far, "
             f"or {BF16_FLOOR:.0e}")
      print("hoccl vs {}, both bfloat16: loss curve {:.2e}, params {:.2e}".format(
          ref_name, *differences(runs["hoccl"], runs["lax"])))
    else:
      tol_curve = tol_param = 1e-4
      how = "float32, matmul precision 'highest' in both runs, rtol 1e-4"
    curve_err, param_err = differences(runs["hoccl"], against)
    print(f"final loss  hoccl: {runs['hoccl'][0][-1]:.6f}   {ref_name}: {runs['lax'][0][-1]:.6f}")
    print(f"compared with {against_name}: {how}")
    print(f"max rel. difference: loss curve {curve_err:.2e} (tolerance {tol_curve:.1e}), params "
          f"{param_err:.2e} (tolerance {tol_param:.1e})")
    match = curve_err <= tol_curve and param_err <= tol_param
    print("MATCH" if match else "MISMATCH")
    ok &= match
    hoccl_ms, lax_ms = runs["hoccl"][2], runs["lax"][2]
    print(f"step time: hoccl{' fused' if args.fused else ''} {hoccl_ms:.2f} ms, {ref_name} "
          f"{lax_ms:.2f} ms ({lax_ms / hoccl_ms:.2f}x speed-up)")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
