// XLA FFI handlers for platform "cpu": decode buffers and attributes, find this device's
// group and rank, run the plan with the CPU executor. The CUDA handlers (handlers_cuda.cc)
// take the same attributes, so the Python lowering is identical for both platforms.
#include <string>
#include <vector>

#include "communicator.h"
#include "cpu_executor.h"
#include "handler_common.h"
#include "handlers.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hoccl {
namespace {

ffi::Error RunCpuInto(OpKind op, int64_t device, ffi::AnyBuffer x, void* out_data,
                      size_t out_bytes, ffi::Span<const int64_t> groups, int64_t group_size,
                      ffi::Span<const int64_t> permute_dst, int64_t site, bool peers_only) {
  OpSpec spec;
  std::vector<int64_t> ids;
  ffi::Error decoded = DecodeOp(op, device, x.size_bytes(), out_bytes, groups, group_size,
                                permute_dst, peers_only, &spec, &ids);
  if (!decoded.success()) return decoded;
  Communicator& comm = GetCommunicator("cpu", ids);
  std::string err = RunOnCpu(comm, spec, site, x.untyped_data(), out_data);
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, err);
  return ffi::Error::Success();
}

ffi::Error RunCpu(OpKind op, int64_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                  ffi::Span<const int64_t> groups, int64_t group_size,
                  ffi::Span<const int64_t> permute_dst, int64_t site, bool peers_only = false) {
  return RunCpuInto(op, device, x, out->untyped_data(), out->size_bytes(), groups, group_size,
                    permute_dst, site, peers_only);
}

// Async pairs on CPU: the host engine has no streams to overlap with, so `start` runs the
// whole op and `done` has nothing left to wait for. Output 1 of start is an ordering token
// nobody reads, and done's outputs alias its inputs (set in the lowering), so neither copies.
ffi::Error AllGatherStartCpu(int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer>, ffi::Span<const int64_t> groups,
                             int64_t group_size, int64_t peers_only, int64_t site) {
  return RunCpu(OpKind::kAllGather, device, x, out, groups, group_size, {}, site, peers_only != 0);
}
// all_gather into rows [offset, ...) of a larger buffer: args (x[, dst]), the output aliasing
// dst when given (handlers_cuda.cc says more).
ffi::Error AllGatherIntoStartCpu(int32_t device, ffi::RemainingArgs args,
                                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer>,
                                 ffi::Span<const int64_t> groups, int64_t group_size,
                                 int64_t offset, int64_t site) {
  auto into = DecodeInto(args, *out, group_size, offset);
  if (into.has_error()) return into.error();
  return RunCpuInto(OpKind::kAllGather, device, into->x, into->dst, into->bytes, groups,
                    group_size, {}, site, false);
}
ffi::Error AllToAllStartCpu(int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer>, ffi::Span<const int64_t> groups,
                            int64_t group_size, int64_t site) {
  return RunCpu(OpKind::kAllToAll, device, x, out, groups, group_size, {}, site);
}
ffi::Error PermuteStartCpu(int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer>, ffi::Span<const int64_t> groups,
                           int64_t group_size, ffi::Span<const int64_t> permute_dst,
                           int64_t site) {
  return RunCpu(OpKind::kPermute, device, x, out, groups, group_size, permute_dst, site);
}
ffi::Error DoneCpu(ffi::RemainingArgs, ffi::RemainingRets, int64_t /*site of the start*/) {
  return ffi::Error::Success();
}

ffi::Error AllGatherCpu(int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Span<const int64_t> groups, int64_t group_size, int64_t site) {
  return RunCpu(OpKind::kAllGather, device, x, out, groups, group_size, {}, site);
}
ffi::Error AllToAllCpu(int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Span<const int64_t> groups, int64_t group_size, int64_t site) {
  return RunCpu(OpKind::kAllToAll, device, x, out, groups, group_size, {}, site);
}
ffi::Error PermuteCpu(int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Span<const int64_t> groups, int64_t group_size,
                      ffi::Span<const int64_t> permute_dst, int64_t site) {
  return RunCpu(OpKind::kPermute, device, x, out, groups, group_size, permute_dst, site);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherStartCpu, AllGatherStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("peers_only")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherIntoStartCpu, AllGatherIntoStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllStartCpu, AllToAllStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteStartCpu, PermuteStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kDoneCpu, DoneCpu,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int64_t>(
                                  "site"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherCpu, AllGatherCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllCpu, AllToAllCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteCpu, PermuteCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("site"));

}  // namespace hoccl
