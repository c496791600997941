"""rows_matmul's cuBLASLt path on one GPU (skipped without a GPU): row offsets of x by rank,
the received partial added in the epilogue, rows written in place into a chained buffer,
against XLA's dot on the same rows. The fused ops on two GPUs are in test_gpu.py."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_hoccl._src.fused.row_pieces.rows_matmul import rows_matmul
from conftest import gpus


GPUS = gpus()
pytestmark = pytest.mark.skipif(not GPUS, reason="needs a GPU")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("k,n", [(256, 512), (40, 24)])
def test_rows_matmul_matches_xla(dtype, k, n, monkeypatch):
  """Out of 96 rows of x: pieces of 16, 32 and 48 rows (block_rows 48: the second block),
  the second and third with a c to add, written into one [96, n] buffer at rows 0, 16, 48."""
  monkeypatch.setenv("JAX_HOCCL_CUBLASLT", "1")
  mesh = jax.make_mesh((1,), ("x",), devices=GPUS[:1])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((96, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
  c = jnp.asarray(rng.standard_normal((96, n)), dtype)

  def ours(x, w, c):
    kw = dict(block_rows=48)
    out = rows_matmul(x, w, ("x",), 1, shift=1, piece_row0=0, rows=16, out_rows=96, **kw)
    out = rows_matmul(x, w, ("x",), 1, shift=1, piece_row0=16, rows=32, c=c[16:48], into=out,
                      out_row0=16, **kw)
    return rows_matmul(x, w, ("x",), 1, shift=0, piece_row0=48, rows=48, c=c[48:], into=out,
                       out_row0=48, **kw)

  def ref(x, w, c):
    y = (x @ w).astype(jnp.float32)
    return jnp.concatenate([y[:16], y[16:48] + c[16:48], y[48:] + c[48:]]).astype(dtype)

  # shift=1 over 1 rank is block 0 again: x rows [0, 48) and [48, 96) for the last piece.
  f = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                            check_vma=False))
  text = f.lower(x, w, c).as_text()
  assert "hoccl_rows_matmul" in text and "dot_general" not in text
  got = np.asarray(f(x, w, c)).astype(np.float32)
  want = np.asarray(jax.jit(ref)(x, w, c)).astype(np.float32)
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 2e-2 * scale, np.abs(got - want).max() / scale
