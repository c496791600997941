// hoccl_matmul_psum_staged on CUDA: out [M, N] = psum(x [M, K] @ w [K, N]) for a GEMV's few
// rows (fused/matmul_psum.py: decode), in one kernel that multiplies and is the staged psum's
// packed exchange (cuda/staged/gemv_psum_kernel.h). The same device work at every call, so XLA
// may capture it into its CUDA graphs; the lowering picks this target only where the block
// takes the packed exchange (fused/gemv_psum.py).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda/async_streams.h"
#include "cuda/staged/gemv_psum_kernel.h"
#include "ffi/handler_common.h"
#include "ffi/handlers.h"
#include "host_profile.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hoccl {

static ffi::Error MatmulPsumStagedCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                       ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                                       Group group) {
  HostTimer timer("collective");
  auto options = SumOf(x.element_type(), "matmul_psum");
  if (options.has_error()) return options.error();
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || w.element_type() != x.element_type() ||
      out->element_type() != x.element_type())
    return ffi::Error::InvalidArgument(
        "jax_hoccl matmul_psum: the GEMV takes x [M, K] and w [K, N] of one type");
  const GemvOperands g{x.untyped_data(),        w.untyped_data(),        static_cast<int>(xd[0]),
                       static_cast<int>(xd[1]), static_cast<int>(wd[1]), options->sum};
  if (const char* refused = GemvPsumRefuses(g))
    return ffi::Error::InvalidArgument(std::string("jax_hoccl matmul_psum: ") + refused);
  // The kernel's loads and stores (XLA's buffers always allow them; a fault would end the
  // process's CUDA context).
  if ((reinterpret_cast<uintptr_t>(g.w) & 15) || (reinterpret_cast<uintptr_t>(g.x) & 7) ||
      (reinterpret_cast<uintptr_t>(out->untyped_data()) & 7))
    return ffi::Error::InvalidArgument(
        "jax_hoccl matmul_psum: the GEMV needs w 16-byte aligned, x and the output 8-byte");
  // A summed all_gather of the product's block, on XLA's stream (lane 0).
  const size_t block = static_cast<size_t>(g.m) * g.n * ffi::ByteWidth(x.element_type());
  return EnqueueExchange(OpKind::kAllGather, stream, 0, device, nullptr, block, out->untyped_data(),
                         out->size_bytes(), group, *options, nullptr, &g);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kMatmulPsumStagedCuda, MatmulPsumStagedCuda,
    CudaContext().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<Group>(
        "group"),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace hoccl
