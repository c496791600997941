"""jax_hoccl: collectives on GPU copy engines (no SMs taken from your GEMMs), as drop-in
replacements for jax.lax's inside jax.shard_map.

    y = jax_hoccl.psum(x, "tp")          # where you wrote jax.lax.psum(x, "tp")
"""
from jax_hoccl._src.ffi_targets import WITH_CUDA as with_cuda
from jax_hoccl._src.ops.all_gather import all_gather
from jax_hoccl._src.ops.all_to_all import all_to_all
from jax_hoccl._src.ops.ppermute import ppermute
from jax_hoccl._src.ops.psum import psum, psum_algorithm
from jax_hoccl._src.ops.psum_scatter import psum_scatter

__version__ = "0.1.0"
__all__ = ["all_gather", "all_to_all", "ppermute", "psum", "psum_algorithm", "psum_scatter",
           "with_cuda"]
