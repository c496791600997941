// XLA FFI handlers for platform "CUDA": the same attributes as the CPU handlers
// (handlers_cpu.cc), so the Python lowering is identical; the plan runs on the CUDA executor
// (cuda_executor.h) in "direct" mode on XLA's stream of this device.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "communicator.h"
#include "cuda_executor.h"
#include "group.h"
#include "handlers.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hoccl {
namespace {

// GetCommunicator builds a string key under a global lock; the same few groups come back on
// every call, so each handler thread remembers them (communicators live for the process).
Communicator& CudaCommunicator(const std::vector<int64_t>& ids) {
  thread_local std::vector<std::pair<std::vector<int64_t>, Communicator*>> cache;
  for (auto& entry : cache)
    if (entry.first == ids) return *entry.second;
  Communicator& comm = GetCommunicator("cuda", ids);
  cache.emplace_back(ids, &comm);
  return comm;
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

ffi::Error RunCuda(OpKind op, cudaStream_t stream, int64_t device, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                   int64_t group_size, ffi::Span<const int64_t> permute_dst) {
  static const bool debug = [] {
    const char* v = std::getenv("JAX_HOCCL_DEBUG");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  if (debug) {
    std::fprintf(stderr, "[jax_hoccl] handler %s: device %lld, stream %p, %zu groups entries, group size %lld\n",
                 OpName(op), static_cast<long long>(device), static_cast<void*>(stream),
                 groups.size(), static_cast<long long>(group_size));
    std::fflush(stderr);
  }
  GroupPosition pos;
  std::string err = FindGroup(groups.begin(), groups.size(), group_size, device, &pos);
  if (!err.empty())
    return ffi::Error::InvalidArgument(std::string("jax_hoccl ") + OpName(op) + ": " + err);
  OpSpec spec{op, static_cast<int>(group_size), pos.rank, x.size_bytes(), {}};
  spec.permute_dst.assign(permute_dst.begin(), permute_dst.end());
  if (out->size_bytes() != OutputBytes(spec))
    return ffi::Error::InvalidArgument(std::string("jax_hoccl ") + OpName(op) +
                                       ": output size does not match the input");
  // Every rank sees the same shapes, so all skip together and sequence numbers stay in step.
  if (spec.bytes == 0) return ffi::Error::Success();
  Communicator& comm = CudaCommunicator(pos.device_ids);
  ExecStatus st = RunOnCuda(comm, spec, stream, x.untyped_data(), out->untyped_data());
  if (!st.ok()) return ffi::Error(CodeFor(st.kind), st.message);
  return ffi::Error::Success();
}

ffi::Error AllGatherCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                         int64_t group_size) {
  return RunCuda(OpKind::kAllGather, stream, device, x, out, groups, group_size, {});
}
ffi::Error AllToAllCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                        int64_t group_size) {
  return RunCuda(OpKind::kAllToAll, stream, device, x, out, groups, group_size, {});
}
ffi::Error PermuteCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                       int64_t group_size, ffi::Span<const int64_t> permute_dst) {
  return RunCuda(OpKind::kPermute, stream, device, x, out, groups, group_size, permute_dst);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherCuda, AllGatherCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllCuda, AllToAllCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteCuda, PermuteCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst"));

}  // namespace hoccl
