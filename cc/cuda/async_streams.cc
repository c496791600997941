#include "cuda/async_streams.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "communicator.h"
#include "cuda/cuda_executor.h"
#include "ffi/handler_common.h"
#include "host_profile.h"
#include "job.h"
#include "plan.h"

namespace hoccl {

ffi::ErrorOr<const CudaGroup*> FindCudaGroup(OpKind op, const Group& group, int32_t device) {
  struct Met {
    std::vector<int64_t> table;
    int64_t size;
    int32_t device;
    CudaGroup group;
  };
  thread_local std::vector<std::unique_ptr<Met>> met;
  for (const auto& m : met)
    if (m->device == device && m->size == group.size &&
        std::equal(m->table.begin(), m->table.end(), group.ids.begin(), group.ids.end()))
      return &m->group;
  GroupPosition pos;
  ffi::Error found = FindGroupOf(op, group, GlobalDeviceId(device), &pos);
  if (!found.success()) return found;
  auto m = std::make_unique<Met>();
  m->table.assign(group.ids.begin(), group.ids.end());
  m->size = group.size;
  m->device = device;
  m->group.rank = pos.rank;
  m->group.comm = &GetCommunicator("cuda", pos.device_ids);
  m->group.ids = std::move(pos.device_ids);
  met.push_back(std::move(m));
  return &met.back()->group;
}

ffi::ErrorCode CodeFor(ErrorKind k) {
  switch (k) {
    case ErrorKind::kNone: return ffi::ErrorCode::kOk;
    case ErrorKind::kInvalidArgument: return ffi::ErrorCode::kInvalidArgument;
    case ErrorKind::kDeadline: return ffi::ErrorCode::kDeadlineExceeded;
    case ErrorKind::kUnavailable: return ffi::ErrorCode::kUnavailable;
    case ErrorKind::kInternal: return ffi::ErrorCode::kInternal;
  }
  return ffi::ErrorCode::kInternal;
}

AsyncState& AsyncStateFor(int device) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<AsyncState>>* states =
      new std::map<int, std::unique_ptr<AsyncState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& s = (*states)[device];
  if (!s) s = std::make_unique<AsyncState>();
  return *s;  // used only by this device's handler thread
}

ffi::Error CudaFail(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_hoccl async: ") + what + ": " +
                              cudaGetErrorString(e));
}

ffi::ErrorOr<std::pair<cudaStream_t, int>> StartStream(AsyncState& a, cudaStream_t xla_stream,
                                                       int64_t stream_index) {
  if (stream_index < -1 || stream_index >= kMaxAsyncLanes)
    return ffi::Error::InvalidArgument("jax_hoccl async: stream " + std::to_string(stream_index) +
                                       " out of range");
  if (stream_index < 0) return std::make_pair(xla_stream, 0);
  cudaError_t e;
  cudaStream_t& async = a.streams[stream_index];
  if (!a.fork && (e = cudaEventCreateWithFlags(&a.fork, cudaEventDisableTiming)) != cudaSuccess)
    return CudaFail("cudaEventCreateWithFlags", e);
  if (!async && (e = cudaStreamCreateWithFlags(&async, cudaStreamNonBlocking)) != cudaSuccess)
    return CudaFail("cudaStreamCreateWithFlags", e);
  if ((e = cudaEventRecord(a.fork, xla_stream)) != cudaSuccess)
    return CudaFail("cudaEventRecord", e);
  if ((e = cudaStreamWaitEvent(async, a.fork, 0)) != cudaSuccess)
    return CudaFail("cudaStreamWaitEvent", e);
  return std::make_pair(async, 1 + static_cast<int>(stream_index));
}

ffi::Error FinishStart(AsyncState& a, cudaStream_t stream, int64_t site) {
  cudaError_t e;
  cudaEvent_t finished;
  if (!a.free_events.empty()) {
    finished = a.free_events.back();
    a.free_events.pop_back();
  } else if ((e = cudaEventCreateWithFlags(&finished, cudaEventDisableTiming)) != cudaSuccess) {
    return CudaFail("cudaEventCreateWithFlags", e);
  }
  if ((e = cudaEventRecord(finished, stream)) != cudaSuccess) return CudaFail("cudaEventRecord", e);
  a.pending[site].push_back(finished);
  return ffi::Error::Success();
}

ffi::Error EnqueueExchange(OpKind op, cudaStream_t stream, int lane, int32_t device, const void* in,
                           size_t in_bytes, void* out_data, size_t out_bytes, const Group& group,
                           const ExchangeOptions& options, const Announce* announce,
                           const GemvOperands* gemv) {
  auto found = FindCudaGroup(op, group, device);
  if (found.has_error()) return found.error();
  OpSpec spec;
  ffi::Error made = MakeSpec(op, (*found)->rank, group, in_bytes, out_bytes, options, &spec);
  if (!made.success()) return made;
  in = InputFor(spec, in, out_data);
  // Every rank sees the same shapes, so all skip together and sequence numbers stay in step.
  if (spec.bytes > 0 && OutputBytes(spec) > 0) {
    ExecStatus st = RunOnCuda(*(*found)->comm, spec, stream, in, out_data, lane,
                              OpLabel{group.site, OpName(op), options.type}, announce, gemv);
    if (!st.ok()) return ffi::Error(CodeFor(st.kind), st.message);
  }
  return ffi::Error::Success();
}

ffi::Error StartCuda(OpKind op, cudaStream_t xla_stream, int32_t device, const void* in,
                     size_t in_bytes, void* out_data, size_t out_bytes, const Group& group,
                     int64_t stream_index, const ExchangeOptions& options,
                     const Announce* announce) {
  HostTimer timer("start");
  AsyncState& a = AsyncStateFor(device);
  auto stream = StartStream(a, xla_stream, stream_index);
  if (stream.has_error()) return stream.error();
  ffi::Error err = EnqueueExchange(op, stream->first, stream->second, device, in, in_bytes,
                                   out_data, out_bytes, group, options, announce);
  if (!err.success()) return err;
  return FinishStart(a, stream->first, group.site);
}

}  // namespace hoccl
