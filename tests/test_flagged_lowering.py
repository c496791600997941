"""The fused ops' flagged-GEMM programs, lowered for CUDA on a CPU-only machine (jax lowers for
another platform without its devices): one start, one Mosaic GPU kernel, one done, and no XLA
collective, for 2 and 4 ranks, forward and backward; and the fallbacks where the kernel does
not apply. The values are checked on a GPU (tests/test_gpu_multiprocess.py,
tests/test_gpu_flagged_gemm.py)."""
import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_hoccl
from jax_hoccl._src.fused.flagged import flagged_gemm as fg
from conftest import CPUS, XLA_COLLECTIVES

START = {"all_gather_matmul": "hoccl_announced_gather_start",
         "matmul_reduce_scatter": "hoccl_gemm_ring_start",
         "matmul_psum": "hoccl_gemm_ring_start"}
K, N = 512, 768


@pytest.fixture(autouse=True)
def cuda_targets(monkeypatch):
  """Lowering for CUDA only names the handlers (they run on a GPU): a build without the CUDA
  engine (nvcc absent) lowers the same program once its targets are listed for CUDA."""
  from jax_hoccl._src import ffi_targets
  monkeypatch.setattr(ffi_targets, "TARGETS", {
      name: tuple(set(platforms) | {"CUDA"}) for name, platforms in ffi_targets.TARGETS.items()})


@pytest.fixture
def hopper(monkeypatch):
  """Trace as if the mesh's devices were Hopper GPUs with 132 SMs."""
  monkeypatch.setattr(fg, "_on_hopper", lambda: True)
  monkeypatch.setattr(fg, "_sm_count", lambda: 132)


def _program(op, n, dtype, rows, grad=False):
  mesh = jax.make_mesh((n,), ("tp",), devices=CPUS[:n])
  w = jnp.zeros((K, N), dtype)
  fused = getattr(jax_hoccl, op)
  out_spec = P() if op == "matmul_psum" else P("tp")

  def body(v):
    if grad:
      return jax.grad(lambda v: fused(v, w, "tp").astype(jnp.float32).sum())(v)
    return fused(v, w, "tp")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"),
                            out_specs=P("tp") if grad else out_spec))
  x = jax.ShapeDtypeStruct((n * rows, K), dtype, sharding=NamedSharding(mesh, P("tp")))
  return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text, target):
  return len(re.findall(rf'custom_call @{target}\b|call_target_name = "{target}"', text))


def _rows(op, n):
  # x rows per rank: all_gather_matmul's own rows (512-row chunks), the ring's M = n * R
  return 1024 if op == "all_gather_matmul" else n * 512


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("op", sorted(START))
def test_one_start_one_kernel_one_done(hopper, op, n, dtype):
  text = _program(op, n, dtype, _rows(op, n))
  assert _calls(text, START[op]) == 1, op
  assert _calls(text, "mosaic_gpu_v2") + _calls(text, "mosaic_gpu") == 1
  assert _calls(text, "hoccl_done") == 1
  # the start comes before the kernel, the done after it (program order of the module)
  start, kernel = text.index(START[op]), text.index("mosaic_gpu")
  assert start < kernel < text.rindex("hoccl_done")
  for c in XLA_COLLECTIVES:
    assert c not in text, c
  # nothing else moves data: no row-piece GEMM, no other jax_hoccl exchange
  assert "hoccl_rows_matmul" not in text and "hoccl_into_start" not in text


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_backward_runs_on_flagged_gemms(hopper, op):
  """Their gradients are each other's fused op: flagged GEMMs too. (matmul_psum's backward
  has no collective: the cotangent is the same on every rank.)"""
  text = _program(op, 2, jnp.bfloat16, _rows(op, 2), grad=True)
  assert _calls(text, "mosaic_gpu_v2") + _calls(text, "mosaic_gpu") >= 1
  assert "hoccl_announced_gather_start" in text or "hoccl_gemm_ring_start" in text
  for c in XLA_COLLECTIVES:
    assert c not in text, c


@pytest.mark.parametrize("op", sorted(START))
@pytest.mark.parametrize("case", ["float32", "unaligned rows", "not Hopper"])
def test_falls_back_where_the_kernel_does_not_apply(monkeypatch, op, case):
  monkeypatch.setattr(fg, "_sm_count", lambda: 132)
  monkeypatch.setattr(fg, "_on_hopper", lambda: case != "not Hopper")
  dtype = jnp.float32 if case == "float32" else jnp.bfloat16
  rows = 2 * 200 if case == "unaligned rows" else _rows(op, 2)
  text = _program(op, 2, dtype, rows)
  assert "mosaic_gpu" not in text and START[op] not in text
  assert "hoccl_" in text  # the row-piece form, still jax_hoccl's


def test_walks_name_their_blocks():
  """The ring's walk: block j of rank r multiplies x's block (r - 1 - j) % n; block 0 goes to
  `send`, and from block 1 on each adds into where the partial for its rows landed (recv
  block j - 1, the last into `last`, or for matmul_psum my slot of the output) once its
  arrival flags (block j - 1) are up."""
  from jax_hoccl._src.fused.flagged import gather_walk, reduce_scatter_walk as gr
  n = 4
  walk = gr.walk(n)
  assert [b.a.block for b in walk] == [(-1 - j) % n for j in range(n)]
  assert all(b.a.by_rank for b in walk)
  assert [b.add for b in walk] == [False] + [True] * (n - 1)
  assert [b.wait for b in walk] == [None] + ["out"] * (n - 1)
  assert [b.ready_block for b in walk[1:]] == list(range(n - 1))
  assert [b.out for b in walk] == [fg.Rows(gr.SEND, 0)] + [
      fg.Rows(gr.RECV, j) for j in range(n - 2)] + [fg.Rows(gr.LAST, 0)]
  assert [b.flag for b in walk] == [True] * (n - 1) + [False]
  psum_walk = gr.walk(n, gather=True)
  assert psum_walk[-1].out == fg.Rows(gr.LAST, 0, by_rank=True) and psum_walk[-1].flag
  walk_g = gather_walk.walk(n)
  assert walk_g[0].wait is None and all(b.wait == "a" for b in walk_g[1:])
  assert [b.ready_block for b in walk_g[1:]] == list(range(n - 1))
  assert [b.out.block for b in walk_g] == list(range(n))
  # a ring step's bands: at most 8, at least 256 rows, dividing the block
  for rows in (256, 512, 2048, 8192, 16384):
    band = gr.band_rows(rows)
    assert rows % band == 0 and band >= 256 and rows // band <= 8
  assert gr.band_rows(200) is None


@pytest.mark.parametrize("n", [2, 4, 8])
def test_alike_blocks_run_one_code_path_with_each_blocks_numbers(n):
  """The kernel runs each group of alike blocks by one copy of its code: a walk of n blocks
  holds at most three groups, every block in exactly one, and the block a group's code
  builds for walk block j (its numbers picked at run time) is block j."""
  from jax_hoccl._src.fused.flagged import gather_walk, reduce_scatter_walk as gr
  for walk in (gr.walk(n), gr.walk(n, gather=True), gather_walk.walk(n)):
    groups = fg._alike_blocks(walk)
    assert sorted(j for js in groups for j in js) == list(range(n))
    assert len(groups) <= 3
    for js in groups:
      for j in js:
        built = fg._block_of_group(walk, js, jnp.int32(j))
        as_ints = dataclasses.replace(
            built, a=dataclasses.replace(built.a, block=int(built.a.block)),
            out=dataclasses.replace(built.out, block=int(built.out.block)),
            ready_block=int(built.ready_block))
        assert as_ints == walk[j], (n, j)
  # the ring's middle blocks (recv j - 1) are one group from 4 ranks on
  assert (1, 2) in fg._alike_blocks(gr.walk(4))


def test_flag_target_counts_cta_tiles():
  # 1024 rows of 256-column CTA tiles over N = 8192: 8 row tiles x 32 column tiles
  assert fg.flag_target(8192, 1024) == 8 * 32
  assert np.dtype(jnp.bfloat16) in fg.DTYPES


def _walk_order(blocks, block_tiles, n_tiles):
  """The block of each tile of a walk, in the kernel's walk order (plgpu.planar_snake over
  bands of band_tiles row tiles), evaluated on the CPU."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  band = fg.band_tiles(block_tiles, blocks)
  m_tiles = blocks * block_tiles
  order = []
  for t in range(m_tiles * n_tiles):
    mi, _ = plgpu.planar_snake(jnp.int32(t), (m_tiles, n_tiles), 0, band)
    order.append(int(mi) // block_tiles)
  return order


@pytest.mark.parametrize("blocks,block_tiles", [(2, 4), (3, 12), (4, 8), (2, 10), (1, 10)])
def test_walk_order_finishes_each_block_before_the_next(blocks, block_tiles):
  """Forward progress needs every tile a tile waits for earlier in the walk order: a block's
  tiles all before the next block's, also where a block has fewer row tiles than a band."""
  order = _walk_order(blocks, block_tiles, n_tiles=3)
  assert order == sorted(order)
  assert fg.band_tiles(block_tiles, blocks) <= fg.BAND_TILES
  assert fg.band_tiles(32, 1) == fg.band_tiles(32, 4) == fg.BAND_TILES  # the fused ops' blocks


@pytest.mark.parametrize("group", [1, 2])
def test_claimed_walk_lowers_for_each_claim_group(hopper, monkeypatch, group):
  """The ring (its tiles claimed by the memory warpgroup and handed to the others) lowers
  with one tile or a group of consecutive tiles per claim."""
  monkeypatch.setattr(fg, "CLAIM_GROUP", group)
  text = _program("matmul_reduce_scatter", 2, jnp.bfloat16, _rows("matmul_reduce_scatter", 2))
  assert _calls(text, "mosaic_gpu_v2") + _calls(text, "mosaic_gpu") == 1
