// hoccl_one_kernel_call on CUDA: (x) -> out, a copy of x by one kernel on XLA's stream, bound
// as the staged handlers are (XLA's stream, the device, one buffer in and one out) and as
// command-buffer compatible. It is what any custom call of one kernel costs XLA and the host:
// bench --processes times it in the staged calls' place, so that their rows show what
// jax_hoccl adds beyond it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "cuda/async_streams.h"
#include "ffi/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hoccl {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxCtas = 132;

// out[0, bytes) = in[0, bytes): 16-byte words (XLA's buffers are aligned), then the tail.
__global__ void CopyKernel(const char* in, char* out, size_t bytes) {
  const size_t words = bytes / 16;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = first; i < words; i += stride)
    reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(in)[i];
  for (size_t i = words * 16 + first; i < bytes; i += stride) out[i] = in[i];
}

ffi::Error OneKernelCall(cudaStream_t stream, int32_t, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out) {
  const size_t bytes = x.size_bytes();
  if (out->size_bytes() != bytes)
    return ffi::Error::InvalidArgument("hoccl_one_kernel_call: out's size differs from x's");
  const size_t ctas = (bytes / 16 + kThreads) / kThreads;
  CopyKernel<<<static_cast<int>(std::min<size_t>(ctas, kMaxCtas)), kThreads, 0, stream>>>(
      static_cast<const char*>(x.untyped_data()), static_cast<char*>(out->untyped_data()), bytes);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("hoccl_one_kernel_call: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kOneKernelCallCuda, OneKernelCall,
                              CudaContext().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace hoccl
