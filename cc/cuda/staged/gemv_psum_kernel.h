// matmul_psum's GEMV (docs/design.md, "Decode: the GEMV inside the psum's exchange"):
// out = psum(x @ w) for x [M, K] with few rows (a decode step's), w [K, N], in one launch that
// is also the staged psum's packed exchange. A CTA per column slab of w multiplies it, rounds
// it to the element type and pushes it to every peer as packed lines (packed_lines.cuh); the
// last CTAs to finish wait for every peer's lines and add them in rank order in float32 (one
// rounding), as the packed psum does, so the result is the same bits on every rank and the
// lines are those of a packed psum of the same block: either kernel reads the other's.
#ifndef JAX_HOCCL_STAGED_GEMV_PSUM_KERNEL_H_
#define JAX_HOCCL_STAGED_GEMV_PSUM_KERNEL_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/staged/exchange_kernel.h"
#include "plan.h"

namespace hoccl {

// Rows of x the kernel takes at most, and the columns of a slab (N must be a multiple).
constexpr int kGemvMaxRows = 8;
constexpr int kGemvSlabCols = 64;

// The GEMV's operands: x [m, k] and w [k, n] row-major, both of `type` (bf16 or f16).
struct GemvOperands {
  const void* x;
  const void* w;
  int m, k, n;
  SumType type;
};

// Why the kernel cannot multiply these shapes, or nullptr where it can: 1..kGemvMaxRows rows,
// k a multiple of 4, n of kGemvSlabCols, bf16 or f16.
const char* GemvPsumRefuses(const GemvOperands& g);

// Loads the kernel into the current context (before any stream capture needs it).
cudaError_t LoadGemvPsumKernel();

// Launches it on `stream`: `args` as for the packed exchange of the [m, n] block (value, set,
// layout, progress, the lane's CTA count), the result into args.out. `device`'s SMs bound the
// CTAs that wait: SMs / 2n of each rank, so ranks sharing a GPU leave half of it to CTAs that
// never wait.
cudaError_t LaunchGemvPsumKernel(const StagedKernelArgs& args, const GemvOperands& g, int device,
                                 cudaStream_t stream);

}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_GEMV_PSUM_KERNEL_H_
