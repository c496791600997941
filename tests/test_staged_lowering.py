"""The staged path's targets, lowered for CUDA on a CPU-only machine (jax lowers for another
platform without its devices), in one process of several devices: a mesh of one process's
devices, as on one host whose process drives several GPUs, takes the same captured path as one
process per GPU. Every collective whose block (what one rank sends one peer) is at most
JAX_HOCCL_STAGED_BYTES lowers to its command-buffer compatible `_staged` twin, which XLA may
capture into its CUDA graphs; a larger block, and any block with JAX_HOCCL_STAGED_BYTES=0,
lowers to the plain target, which XLA runs outside them. psum and psum_scatter of staged
float32, bfloat16 and float16 blocks lower to `hoccl_psum_staged` and
`hoccl_psum_scatter_staged`, whose exchange kernel sums as it copies out, unless
JAX_HOCCL_STAGED_SUM=0 (the mover, then XLA's sum). The values on a GPU:
tests/test_gpu_multiprocess.py (STAGED_WORKER, CAPTURE_WORKER)."""
import re

import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl
from conftest import CPUS

MOVER = {"psum": "all_gather", "pmax": "all_gather", "all_gather": "all_gather",
         "psum_scatter": "all_to_all", "all_to_all": "all_to_all", "ppermute": "ppermute"}


@pytest.fixture(autouse=True)
def cuda_targets(monkeypatch):
  """A build without the CUDA engine lowers the same program once its targets are listed for
  CUDA (lowering only names the handlers)."""
  from jax_hoccl._src import ffi_targets
  monkeypatch.setattr(ffi_targets, "TARGETS", {
      name: tuple(set(platforms) | {"CUDA"}) for name, platforms in ffi_targets.TARGETS.items()})


# psum and psum_scatter of the types the exchange kernel adds, unless JAX_HOCCL_STAGED_SUM=0:
# summed inside the exchange.
SUMMED = {"psum": "hoccl_psum_staged", "psum_scatter": "hoccl_psum_scatter_staged"}


def _targets(op, n, cols, dtype=jnp.float32):
  """The jax_hoccl custom calls of `op` over n devices of this process, each rank's input
  n x cols of `dtype`."""
  mesh = jax.make_mesh((n,), ("tp",), devices=CPUS[:n])
  shift = [(i, (i + 1) % n) for i in range(n)]
  body = {"psum": lambda v: jax_hoccl.psum(v, "tp"),
          "pmax": lambda v: jax_hoccl.pmax(v, "tp"),
          "all_gather": lambda v: jax_hoccl.all_gather(v, "tp", tiled=True),
          "psum_scatter": lambda v: jax_hoccl.psum_scatter(v, "tp", tiled=True),
          "all_to_all": lambda v: jax_hoccl.all_to_all(v, "tp", 0, 0, tiled=True),
          "ppermute": lambda v: jax_hoccl.ppermute(v, "tp", shift)}[op]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                            check_vma=False))
  x = jax.ShapeDtypeStruct((n * n, cols), dtype, sharding=NamedSharding(mesh, P("tp")))
  text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  return [a or b for a, b in re.findall(r'custom_call @(hoccl\w+)|call_target_name = "(hoccl\w+)"',
                                        text)]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("op", sorted(MOVER))
def test_blocks_up_to_the_crossover_lower_to_the_captured_targets(op, n, monkeypatch):
  monkeypatch.setenv("JAX_HOCCL_STAGED_BYTES", "4096")
  monkeypatch.setenv("JAX_HOCCL_STAGED_SUM", "0")  # the movers (the summed targets: below)
  mover = f"hoccl_{MOVER[op]}"
  # n x 256 float32 per rank: an all_gather's block n KiB, an all_to_all's 1 KiB
  assert _targets(op, n, 256) == [f"{mover}_staged"]
  # n x 4096: blocks of 16 KiB and more, above the crossover
  assert _targets(op, n, 4096) == [mover]
  monkeypatch.setenv("JAX_HOCCL_STAGED_BYTES", "0")
  assert _targets(op, n, 256) == [mover]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32])
@pytest.mark.parametrize("op", sorted(SUMMED))
def test_sums_of_staged_blocks_run_inside_the_exchange(op, dtype, monkeypatch):
  monkeypatch.setenv("JAX_HOCCL_STAGED_BYTES", "4096")
  mover = f"hoccl_{MOVER[op]}"
  summed = jnp.dtype(dtype) != jnp.int32  # the kernel adds floats; integers keep XLA's sum
  assert _targets(op, 2, 256, dtype) == [SUMMED[op] if summed else f"{mover}_staged"]
  monkeypatch.setenv("JAX_HOCCL_STAGED_SUM", "0")  # the mover, then XLA's sum
  assert _targets(op, 2, 256, dtype) == [f"{mover}_staged"]
  monkeypatch.setenv("JAX_HOCCL_STAGED_SUM", "1")
  assert _targets(op, 2, 256, dtype) == [SUMMED[op] if summed else f"{mover}_staged"]
  assert _targets(op, 2, 8192, dtype) == [mover]  # above the crossover: zero copy, XLA's sum
  # where the exchange kernel does not serve (copy calls): the mover, then XLA's sum
  monkeypatch.setenv("JAX_HOCCL_STAGED_KERNEL", "0")
  assert _targets(op, 2, 256, dtype) == [f"{mover}_staged"]


def test_two_step_psum_keeps_its_two_exchanges(monkeypatch):
  """psum_scatter summed inside its exchange, then an all_gather of the summed parts."""
  monkeypatch.setenv("JAX_HOCCL_STAGED_BYTES", "4096")
  with jax_hoccl.psum_algorithm("two_step"):
    assert _targets("psum", 2, 256) == ["hoccl_psum_scatter_staged", "hoccl_all_gather_staged"]


def test_staged_sums_over_axis_index_groups_and_pytrees(monkeypatch):
  """Even axis_index_groups take the summed targets with their group table; a pytree's leaves
  of one dtype share one summed exchange (buckets.py); pmean is psum's."""
  monkeypatch.setenv("JAX_HOCCL_STAGED_BYTES", "4096")
  mesh = jax.make_mesh((4,), ("tp",), devices=CPUS[:4])
  groups = [[0, 2], [1, 3]]

  def body(v):
    return (jax_hoccl.psum(v, "tp", axis_index_groups=groups),
            jax_hoccl.psum({"a": v, "b": v * 2}, "tp"), jax_hoccl.pmean(v, "tp"),
            jax_hoccl.psum_scatter(v, "tp", axis_index_groups=groups, tiled=True))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                            check_vma=False))
  x = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
  text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  found = re.findall(r'custom_call @(hoccl\w+)|call_target_name = "(hoccl\w+)"', text)
  assert [a or b for a, b in found] == ["hoccl_psum_staged"] * 3 + ["hoccl_psum_scatter_staged"]
  assert "group_size = 2" in text  # the groups' table, not the whole axis


def test_summed_calls_are_named_for_the_op_the_user_called(monkeypatch):
  """A summed call's site is named for errors (cc/job.h: SiteName), as the mover's site is on
  XLA's sum: a peer that never comes to it is reported as the user's psum or psum_scatter."""
  from jax_hoccl._src import ffi_targets
  monkeypatch.setenv("JAX_HOCCL_STAGED_BYTES", "4096")
  names = {}
  monkeypatch.setattr(ffi_targets, "name_site", lambda site, name: names.__setitem__(site, name))
  mesh = jax.make_mesh((2,), ("tp",), devices=CPUS[:2])
  f = jax.jit(jax.shard_map(
      lambda v: (jax_hoccl.psum(v, "tp"), jax_hoccl.psum_scatter(v, "tp", tiled=True)),
      mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
  x = jax.ShapeDtypeStruct((4, 64), jnp.float32, sharding=NamedSharding(mesh, P("tp")))
  text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r'(?:custom_call @|call_target_name = ")(hoccl\w+).*?site = (\d+)', text)
  assert [t for t, _ in calls] == ["hoccl_psum_staged", "hoccl_psum_scatter_staged"], text
  assert [names.get(int(s)) for _, s in calls] == ["psum", "psum_scatter"], (calls, names)


def _matmul_psum_targets(m, k, cols, dtype=jnp.bfloat16, n=2):
  """The jax_hoccl custom calls of matmul_psum over n devices: x [m, n k] split by columns, w
  [n k, cols] by rows."""
  mesh = jax.make_mesh((n,), ("tp",), devices=CPUS[:n])
  f = jax.jit(jax.shard_map(lambda a, b: jax_hoccl.matmul_psum(a, b, "tp"), mesh=mesh,
                            in_specs=(P(None, "tp"), P("tp")), out_specs=P(), check_vma=True))
  x = jax.ShapeDtypeStruct((m, n * k), dtype, sharding=NamedSharding(mesh, P(None, "tp")))
  w = jax.ShapeDtypeStruct((n * k, cols), dtype, sharding=NamedSharding(mesh, P("tp")))
  text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  return [a or b for a, b in re.findall(r'custom_call @(hoccl\w+)|call_target_name = "(hoccl\w+)"',
                                        text)]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_decode_gemv_multiplies_inside_the_packed_exchange(dtype, n, monkeypatch):
  """With JAX_HOCCL_GEMV_PSUM=1, matmul_psum of 1..8 rows, bf16 or f16, K % 4 == 0,
  N % 64 == 0, whose block fits the packed exchange: one custom call, the GEMV inside the
  staged psum's kernel (cc/cuda/staged/gemv_psum_kernel.h). Any other case, and by default:
  XLA's dot, then the staged psum."""
  gemv = ["hoccl_matmul_psum_staged"]
  assert _matmul_psum_targets(1, 256, 512, dtype, n) == ["hoccl_psum_staged"]  # off by default
  monkeypatch.setenv("JAX_HOCCL_GEMV_PSUM", "1")
  for m in (1, 3, 8):
    assert _matmul_psum_targets(m, 256, 512, dtype, n) == gemv
  assert _matmul_psum_targets(2, 256, 512, jnp.float32, n) == ["hoccl_psum_staged"]  # f32
  assert _matmul_psum_targets(9, 256, 512, dtype, n) == ["hoccl_psum_staged"]  # 9 rows
  assert _matmul_psum_targets(2, 254, 512, dtype, n) == ["hoccl_psum_staged"]  # K % 4
  assert _matmul_psum_targets(2, 256, 480, dtype, n) == ["hoccl_psum_staged"]  # N % 64
  assert gemv[0] not in _matmul_psum_targets(2, 256, 0, dtype, n)  # N = 0: nothing to send
  # a block over the packed crossover (8 x 16384 x 2 bytes = 256 KiB > 128 KiB)
  assert _matmul_psum_targets(8, 256, 16384, dtype, n) == ["hoccl_psum_staged"]
  monkeypatch.setenv("JAX_HOCCL_STAGED_PACKED_BYTES", "1024")
  assert _matmul_psum_targets(1, 256, 512, dtype, n) == gemv  # 1 KiB: still packed
  assert _matmul_psum_targets(2, 256, 512, dtype, n) == ["hoccl_psum_staged"]
  monkeypatch.setenv("JAX_HOCCL_STAGED_SUM", "0")  # no sum inside the exchange at all
  assert _matmul_psum_targets(1, 256, 512, dtype, n) == ["hoccl_all_gather_staged"]

