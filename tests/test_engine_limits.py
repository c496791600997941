"""The lowering picks the staged, summed and GEMV targets by limits the C++ engine also holds
(cc/cuda/staged/), and the engine refuses at run time what its limits exclude: the two must
agree. Reads the headers, so it runs on the checkout (scripts/run_tests.sh runs it there:
Bazel's copy of the tests holds no cc/)."""
import pathlib
import re

import pytest

CC = pathlib.Path(__file__).resolve().parent.parent / "cc" / "cuda" / "staged"


def _constant(header, name):
  """The value of `constexpr ... name = <expression>;` in cc/cuda/staged/<header>."""
  found = re.search(rf"constexpr [\w: ]+ {name} = ([^;]+);", (CC / header).read_text())
  assert found, (header, name)
  return eval(re.sub(r"\w+\{(\d+)\}", r"\1", found[1]), {})  # size_t{1} << 23 -> 1 << 23


@pytest.mark.skipif(not CC.exists(), reason="needs the checkout (not Bazel's copy)")
def test_the_lowering_mirrors_the_cuda_engines_limits():
  from jax_hoccl._src import ffi_targets
  from jax_hoccl._src.fused import gemv_psum
  assert ffi_targets.KERNEL_MAX_RANKS == _constant("exchange_kernel.h", "kKernelMaxRanks")
  assert ffi_targets.DEFAULT_STAGED_BYTES == _constant("staged_layout.h", "kDefaultStagedBytes")
  assert ffi_targets.DEFAULT_PACKED_BYTES == _constant("staged_layout.h", "kDefaultPackedBytes")
  assert ffi_targets.PACKED_MAX_BYTES == _constant("packed_kernel.h", "kPackedMaxBytes")
  assert gemv_psum.GEMV_MAX_ROWS == _constant("gemv_psum_kernel.h", "kGemvMaxRows")
  assert gemv_psum.SLAB_COLS == _constant("gemv_psum_kernel.h", "kGemvSlabCols")
