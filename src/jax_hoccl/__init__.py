"""jax_hoccl: collectives on GPU copy engines (no SMs taken from your GEMMs), as drop-in
replacements for jax.lax's inside jax.shard_map, plus matmul-collective ops that hide the
communication behind XLA's GEMMs.

    y = jax_hoccl.psum(x, "tp")                    # where you wrote jax.lax.psum(x, "tp")
    h = jax_hoccl.all_gather_matmul(x, w, "tp")    # all_gather(x, "tp", tiled=True) @ w
"""
from jax_hoccl._src.ffi_targets import WITH_CUDA as with_cuda
from jax_hoccl._src.fused.all_gather_matmul import all_gather_matmul
from jax_hoccl._src.fused.embedding_all_to_all import embedding_all_to_all
from jax_hoccl._src.fused.matmul_all_to_all import matmul_all_to_all
from jax_hoccl._src.fused.matmul_psum import matmul_psum
from jax_hoccl._src.fused.matmul_reduce_scatter import matmul_reduce_scatter
from jax_hoccl._src.ops.all_gather import all_gather
from jax_hoccl._src.ops.all_to_all import all_to_all
from jax_hoccl._src.ops.async_collectives import (Pending, all_gather_start, all_to_all_start,
                                                  done, ppermute_start, psum_scatter_start,
                                                  psum_start)
from jax_hoccl._src.ops.ppermute import ppermute
from jax_hoccl._src.ops.pmax import pmax, pmin
from jax_hoccl._src.ops.psum import pmean, psum, psum_algorithm
from jax_hoccl._src.ops.psum_scatter import psum_scatter
from jax_hoccl._src.job import gpus_shared
from jax_hoccl._src.routing import route_collectives

__version__ = "0.1.0"
__all__ = [
    # collectives (jax.lax signatures)
    "psum", "all_gather", "psum_scatter", "all_to_all", "ppermute", "pmean", "pmax", "pmin",
    "psum_algorithm",
    # async pairs
    "all_gather_start", "all_to_all_start", "ppermute_start", "psum_start",
    "psum_scatter_start", "done", "Pending",
    # fused matmul-collective ops
    "all_gather_matmul", "matmul_reduce_scatter", "matmul_psum", "matmul_all_to_all",
    "embedding_all_to_all",
    # JAX's own psums (jax.lax.psum, implicit gradient sums) on jax_hoccl
    "route_collectives",
    "with_cuda",
    # whether ranks of this job share a GPU (their copies then run on SMs; NCCL refuses them)
    "gpus_shared",
]
