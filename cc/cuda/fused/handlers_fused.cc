// XLA FFI handlers of the fused ops' flagged GEMM on CUDA (fused/gather_into_gemm.py,
// fused/gemm_ring.py): starts whose exchanges follow a GEMM's flags, on the async streams of
// cuda/async_streams.h.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/async_streams.h"
#include "cuda/cuda_executor.h"
#include "cuda/driver_api.h"
#include "ffi/handler_common.h"
#include "ffi/handlers.h"
#include "group.h"
#include "host_profile.h"
#include "job.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hoccl {
namespace {

// all_gather of the peers' blocks (rotated, as peers_only) into output 0 whose rows a GEMM
// multiplies while they land: output 1 holds one uint64 flag per `announce_bytes` of output 0,
// zeroed on XLA's stream first and set to 1 once its rows are in (cuda_executor.h: Announce).
// Output 2 is the token the GEMM takes, so XLA runs it after this start.
ffi::Error AnnouncedGatherStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> flags, ffi::Result<ffi::AnyBuffer>,
                                    Group group, int64_t stream_index, int64_t announce_bytes) {
  if (announce_bytes <= 0 || flags->size_bytes() * static_cast<size_t>(announce_bytes) <
                                 out->size_bytes() * sizeof(uint64_t))
    return ffi::Error::InvalidArgument(
        "jax_hoccl announced gather: " + std::to_string(flags->size_bytes()) +
        " bytes of flags for " + std::to_string(out->size_bytes()) + " bytes in rows of " +
        std::to_string(announce_bytes));
  cudaError_t e = cudaMemsetAsync(flags->untyped_data(), 0, flags->size_bytes(), stream);
  if (e != cudaSuccess) return CudaFail("cudaMemsetAsync", e);
  Announce announce{static_cast<uint64_t*>(flags->untyped_data()),
                    static_cast<size_t>(announce_bytes)};
  return StartCuda(OpKind::kAllGather, stream, device, x.untyped_data(), x.size_bytes(),
                   out->untyped_data(), out->size_bytes(), group, stream_index, PeersOnly(true),
                   &announce);
}

// The reduce-scatter ring walked by one flagged GEMM (fused/gemm_ring.py): matmul_reduce_scatter,
// and with `gather` matmul_psum. Outputs: send [R, N] (the GEMM's first partial sums, written
// in place later), recv [(n-2) R, N] (rank r-1's partial sums, into which my GEMM adds its
// own, in place), gemm_flags (int32, one per band of `band_bytes` of the GEMM's walk, raised
// to `flag_target`), ready (uint64, one per band that lands), last: [R, N] (where rank r-1's
// partial of my block lands and my GEMM completes the sum) or, with gather, out [n R, N]
// (the same in my slot; the peers' sums land in theirs); the token last. Zeroes both flag
// arrays on XLA's stream; then on the start's stream, in order: for each band of the walk's
// blocks 0..n-2, wait until my GEMM stored it (send, then recv) and pass it to rank r+1 (a
// one-band ppermute into its recv, or its last for block n-2; copy engines only), announcing
// it there; with gather, for each band of my summed block, wait for it and send it to every
// peer's slot (n-1 one-band ppermutes).
ffi::Error GemmRingStartCuda(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer /*x*/,
                             ffi::RemainingRets rets, Group group, int64_t stream_index,
                             int64_t band_bytes, int64_t flag_target, int64_t gather) {
  HostTimer timer("start");
  const char* op =
      gather ? "jax_hoccl matmul_psum ring: " : "jax_hoccl matmul_reduce_scatter ring: ";
  auto send = rets.get<ffi::AnyBuffer>(0), recv = rets.get<ffi::AnyBuffer>(1);
  auto gemm_flags = rets.get<ffi::AnyBuffer>(2), ready = rets.get<ffi::AnyBuffer>(3);
  auto last = rets.get<ffi::AnyBuffer>(4);
  if (send.has_error() || recv.has_error() || gemm_flags.has_error() || ready.has_error() ||
      last.has_error())
    return ffi::Error::InvalidArgument(std::string(op) + "missing outputs");
  const size_t block_bytes = (*send)->size_bytes();
  const size_t n = static_cast<size_t>(group.size);
  if (band_bytes <= 0 || n < 2 || block_bytes % band_bytes ||
      (*recv)->size_bytes() != block_bytes * (n - 2) ||
      (*last)->size_bytes() != block_bytes * (gather ? n : 1))
    return ffi::Error::InvalidArgument(std::string(op) + "bands of " + std::to_string(band_bytes) +
                                       " bytes in blocks of " + std::to_string(block_bytes));
  const size_t block_bands = block_bytes / band_bytes, bands = (n - 1) * block_bands;
  if ((*gemm_flags)->size_bytes() < (bands + (gather ? block_bands : 0)) * sizeof(int32_t) ||
      (*ready)->size_bytes() < bands * sizeof(uint64_t))
    return ffi::Error::InvalidArgument(std::string(op) + "too few flags");
  const DriverApi& api = GetDriverApi();
  if (!api.wait_value32)
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      std::string(op) + "the CUDA driver has no cuStreamWaitValue32");
  GroupPosition pos;  // my rank
  std::string found =
      FindGroup(group.ids.begin(), group.ids.size(), group.size, GlobalDeviceId(device), &pos);
  if (!found.empty()) return ffi::Error::InvalidArgument(std::string(op) + found);
  const size_t r = static_cast<size_t>(pos.rank);
  cudaError_t e;
  if ((e = cudaMemsetAsync((*gemm_flags)->untyped_data(), 0, (*gemm_flags)->size_bytes(),
                           xla_stream)) != cudaSuccess ||
      (e = cudaMemsetAsync((*ready)->untyped_data(), 0, (*ready)->size_bytes(), xla_stream)) !=
          cudaSuccess)
    return CudaFail("cudaMemsetAsync", e);
  AsyncState& a = AsyncStateFor(device);
  auto stream = StartStream(a, xla_stream, stream_index);
  if (stream.has_error()) return stream.error();
  auto* flags = static_cast<int32_t*>((*gemm_flags)->untyped_data());
  auto gate = [&](size_t flag) -> ffi::Error {  // my GEMM stored band `flag` of its walk
    CUresult res = api.wait_value32(reinterpret_cast<CUstream>(stream->first),
                                    reinterpret_cast<CUdeviceptr>(flags + flag),
                                    static_cast<cuuint32_t>(flag_target), CU_STREAM_WAIT_VALUE_GEQ);
    if (res != CUDA_SUCCESS)
      return ffi::Error::Internal(std::string(op) + api.Describe("cuStreamWaitValue32", res));
    return ffi::Error::Success();
  };
  auto shift = [&](size_t k) {  // permute_dst of a ppermute to rank r + k
    std::vector<int64_t> dst(n);
    for (size_t src = 0; src < n; ++src) dst[src] = static_cast<int64_t>((src + k) % n);
    return dst;
  };
  const std::vector<int64_t> to_next = shift(1);
  const ffi::Span<const int64_t> next(to_next.data(), to_next.size());
  char* send_at = static_cast<char*>((*send)->untyped_data());
  char* recv_at = static_cast<char*>((*recv)->untyped_data());
  // my block's sum: where rank r-1's partial of it lands (my slot of the output with gather)
  char* last_at = static_cast<char*>((*last)->untyped_data()) + (gather ? r * block_bytes : 0);
  auto* announced = static_cast<uint64_t*>((*ready)->untyped_data());
  for (size_t b = 0; b < bands; ++b) {
    ffi::Error err = gate(b);
    if (!err.success()) return err;
    const size_t j = b / block_bands, at = (b % block_bands) * band_bytes;  // walk block j
    char* from = j == 0 ? send_at + at : recv_at + (j - 1) * block_bytes + at;
    char* into = j + 2 < n ? recv_at + j * block_bytes + at : last_at + at;  // on rank r+1
    Announce announce{announced + b, static_cast<size_t>(band_bytes)};
    err = EnqueueExchange(OpKind::kPermute, stream->first, stream->second, device, from, band_bytes,
                          into, band_bytes, group, PermuteTo(next), &announce);
    if (!err.success()) return err;
  }
  if (gather) {
    char* out_at = static_cast<char*>((*last)->untyped_data());
    for (size_t b = 0; b < block_bands; ++b) {
      ffi::Error err = gate(bands + b);
      if (!err.success()) return err;
      for (size_t k = 1; k < n; ++k) {  // my band to rank r + k; rank r - k's into its slot
        const std::vector<int64_t> dst = shift(k);
        err = EnqueueExchange(OpKind::kPermute, stream->first, stream->second, device,
                              last_at + b * band_bytes, band_bytes,
                              out_at + ((r + n - k) % n) * block_bytes + b * band_bytes, band_bytes,
                              group, PermuteTo(ffi::Span<const int64_t>(dst.data(), dst.size())));
        if (!err.success()) return err;
      }
    }
  }
  return FinishStart(a, stream->first, group.site);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAnnouncedGatherStartCuda, AnnouncedGatherStartCuda,
                              CudaContext()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // flags
                                  .Ret<ffi::AnyBuffer>()  // token
                                  .Attr<Group>("group")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("announce_bytes"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kGemmRingStartCuda, GemmRingStartCuda,
    CudaStart().Attr<int64_t>("band_bytes").Attr<int64_t>("flag_target").Attr<int64_t>("gather"));

}  // namespace hoccl
