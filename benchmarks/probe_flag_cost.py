"""What the flagged GEMM's flag raises cost on one GPU: the kernel as shipped against variants
of the raise (CUPTI kernel time, 3 interleaved rounds of 20 calls, speed relative to XLA's dot
of the same round): no raise at all, a relaxed add instead of the release, no warpgroup
barrier before it."""
import statistics
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax_hoccl._src.fused.flagged import flagged_gemm as fg

def t(f, *args):
  _, ts = profiler.measure(f, iterations=20)(*args)
  return statistics.median(ts)

def raise_variant(barrier, relaxed):
  def raise_flag(flag_ref, ordered):
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def signal(_, ref):
      if barrier:
        mgpu.utils.warpgroup_barrier()
      mgpu.utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
      mgpu.utils.SemaphoreRef(mgpu.utils.memref_ptr(ref)).signal(1, relaxed=relaxed, memory_scope="gpu")
    signal(flag_ref)
  return raise_flag

shipped = fg._raise_flag
variants = {"shipped": shipped, "none": lambda *a, **k: None,
            "relaxed": raise_variant(True, True), "no barrier": raise_variant(False, False)}
for m, k, n in [(4096, 8192, 8192), (4096, 4096, 8192), (16384, 8192, 8192)]:
  a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
  b = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  out = jnp.zeros((m, n), jnp.bfloat16)
  flags = jnp.zeros((m // 1024,), jnp.int32)
  xla = jax.jit(lambda a, b: a @ b)
  fns = {}
  for name, fn in variants.items():
    fg._raise_flag = fn
    f = jax.jit(lambda a, b, o, fl: fg.flagged_matmul(a, b, out=o, flags=fl, flag_rows=1024))
    f(a, b, out, flags).block_until_ready()
    fns[name] = f
  fg._raise_flag = shipped
  ratios = {name: [] for name in fns}
  for _ in range(3):
    for name, f in fns.items():
      tx = t(xla, a, b)
      ratios[name].append(tx / t(f, a, b, out, flags))
  print(f"{m}x{k}x{n}: " + ", ".join(f"{name} {statistics.median(r):.3f}x" for name, r in ratios.items()), flush=True)
