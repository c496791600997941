// What the CUDA handlers share (handlers_cuda.cc, fused/handlers_fused.cc): a group's
// communicator, the executor's errors as FFI errors, and the async streams of a device on
// which starts run their exchanges.
#ifndef JAX_HOCCL_CUDA_ASYNC_STREAMS_H_
#define JAX_HOCCL_CUDA_ASYNC_STREAMS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "communicator.h"
#include "cuda/cuda_executor.h"
#include "ffi/handler_common.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace hoccl {

namespace ffi = xla::ffi;

// A group as a device's handlers meet it: the device's rank, the group's device ids in rank
// order, its communicator (which lives for the process).
struct CudaGroup {
  int rank = -1;
  std::vector<int64_t> ids;
  Communicator* comm = nullptr;
};
// `device`'s (XLA's ordinal) group in the table. Finding it maps the ordinal and builds the
// communicator's key under global locks; the same few tables come back on every call, so each
// handler thread remembers what it found for each.
ffi::ErrorOr<const CudaGroup*> FindCudaGroup(OpKind op, const Group& group, int32_t device);

ffi::ErrorCode CodeFor(ErrorKind k);

// ---- async pairs: start forks XLA's stream onto one of this device's async streams and
// runs the whole exchange there (handshakes, copies, the wait for readers), so XLA's stream
// goes on with the user's compute; done makes XLA's stream wait for the event start recorded.
//
// Async streams: the lowering picks one per start (attribute `stream`, the same on every
// rank, async_collectives.py says how); a start runs on that stream and uses its flag lane,
// 1 + stream (or -1: XLA's stream, lane 0). With one stream, starts run one after another: a
// pipeline of many exchanges (the fused ops' pieces) can queue up behind each other there.

struct AsyncState {
  cudaStream_t streams[kMaxAsyncLanes] = {};  // the device's async streams, created once
  cudaEvent_t fork = nullptr;
  // Events of starts not yet done, FIFO per start site (done pairs with the oldest start of
  // its site: pairs of one site complete in program order).
  std::map<int64_t, std::deque<cudaEvent_t>> pending;
  std::vector<cudaEvent_t> free_events;
};

AsyncState& AsyncStateFor(int device);  // used only by this device's handler thread

ffi::Error CudaFail(const char* what, cudaError_t e);

// A start's stream: one of the device's async streams forked from XLA's (the input and the
// output are XLA's as of this point of its stream), or XLA's itself (stream_index -1: the
// exchange runs there, lane 0, and done has nothing left to wait for: the last exchange of a
// pipeline, which nothing can overlap).
ffi::ErrorOr<std::pair<cudaStream_t, int>> StartStream(AsyncState& a, cudaStream_t xla_stream,
                                                       int64_t stream_index);

// Records the event done waits for, after everything the start enqueued on `stream`.
ffi::Error FinishStart(AsyncState& a, cudaStream_t stream, int64_t site);

// One exchange on `stream` with its flags of lane `lane`: XLA's stream (lane 0) for a
// synchronous handler, a start's stream (StartStream) for a start. `gemv`: matmul_psum's GEMV
// multiplied inside the exchange (cuda_executor.h: RunOnCuda).
ffi::Error EnqueueExchange(OpKind op, cudaStream_t stream, int lane, int32_t device, const void* in,
                           size_t in_bytes, void* out_data, size_t out_bytes, const Group& group,
                           const ExchangeOptions& options, const Announce* announce = nullptr,
                           const GemvOperands* gemv = nullptr);

// in/in_bytes: the input (in_place: ignored, the input is my slot of the output, InputFor);
// out_data/out_bytes: where the result goes (the whole output, or for the "into" variant the
// rows [offset, offset + n * x rows) of a larger buffer).
ffi::Error StartCuda(OpKind op, cudaStream_t xla_stream, int32_t device, const void* in,
                     size_t in_bytes, void* out_data, size_t out_bytes, const Group& group,
                     int64_t stream_index, const ExchangeOptions& options,
                     const Announce* announce = nullptr);

// A CUDA handler's context (XLA's stream and the device), and its bindings
// (ffi/handler_common.h).
inline auto CudaContext() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}
template <typename In = ffi::AnyBuffer>
auto CudaSync() {
  return SyncBinding<In>(CudaContext);
}
template <typename In = ffi::AnyBuffer>
auto CudaStart() {
  return StartBinding<In>(CudaContext);
}

}  // namespace hoccl

#endif  // JAX_HOCCL_CUDA_ASYNC_STREAMS_H_
