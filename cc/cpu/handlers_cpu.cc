// XLA FFI handlers for platform "cpu": decode buffers and attributes, find this device's
// group and rank, and meet the peers in the communicator's rendezvous; the last rank to
// arrive runs every rank's copies (cpu_executor.h). The handlers are asynchronous (they
// return an ffi::Future), so no thread of XLA:CPU's shared pool waits for a peer. The CUDA
// handlers (cuda/handlers_cuda.cc) take the same attributes, so the Python lowering is identical.
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "communicator.h"
#include "cpu/cpu_cross_process.h"
#include "cpu/cpu_executor.h"
#include "ffi/handler_common.h"
#include "ffi/handlers.h"
#include "host_profile.h"
#include "job.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hoccl {

// XLA:CPU runs independent thunks concurrently, in a different order on each device, so calls
// are paired by the instruction that makes them (and the n-th execution of it), not by
// arrival order. The FFI's instantiate stage gives every custom-call instruction of an
// executable one state object, shared by all its devices: its key names the instruction.
// (The lowering's `site` attribute cannot: an inner jit called several times is lowered
// once, so its instructions share a site.)
ffi::TypeId CpuCall::id = {};

namespace {

std::atomic<int64_t> g_next_call_key{1};

// Across processes the instruction is named by its lowering's site and how many
// instructions of that site this process instantiated before: every process compiles the
// same programs, so the names agree (a per-process counter alone would not, and a site alone
// is shared by every call of an inner jit).
// A shared site (job.h: the branches of one cond, each rank maybe in another) names one key
// for all its instructions, so a rank in one branch meets its peers in the other.
ffi::ErrorOr<std::unique_ptr<CpuCall>> InstantiateCpuCall(ffi::Dictionary attrs) {
  static std::mutex mu;
  static std::map<int64_t, uint64_t> per_site;
  static std::map<int64_t, int64_t> shared_keys;
  auto call = std::make_unique<CpuCall>();
  auto site = attrs.get<int64_t>("site");
  call->site = site.has_value() ? *site : 0;
  std::lock_guard<std::mutex> lock(mu);
  if (SiteShared(call->site)) {
    auto [it, fresh] = shared_keys.emplace(call->site, 0);
    if (fresh) it->second = g_next_call_key.fetch_add(1);
    call->key = it->second;
    call->cross_key = static_cast<uint64_t>(call->site) << 20;
    return call;
  }
  call->key = g_next_call_key.fetch_add(1);
  call->cross_key = (static_cast<uint64_t>(call->site) << 20) | per_site[call->site]++;
  return call;
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

// in_place: `in` is ignored, the input is my slot of the output (InputFor). A group that
// spans processes runs on cpu_cross_process.h, off XLA's threads.
ffi::Future RunCpu(OpKind op, int64_t device, const CpuCall* call, const void* in, size_t in_bytes,
                   void* out_data, size_t out_bytes, ffi::Span<const int64_t> groups,
                   int64_t group_size, const ExchangeOptions& options) {
  HostTimer timer("cpu handler");  // decode and rendezvous; the copies run at the last arrival
  OpSpec spec;
  std::vector<int64_t> ids;
  ffi::Error decoded =
      DecodeOp(op, device, in_bytes, out_bytes, groups, group_size, options, &spec, &ids);
  if (!decoded.success()) return Failed(std::move(decoded));
  in = InputFor(spec, in, out_data);
  std::string err = ValidateSpec(spec);
  if (!err.empty())
    return Failed(ffi::Error::InvalidArgument(std::string("jax_hoccl ") + OpName(op) + ": " + err));
  ffi::Promise promise;
  ffi::Future future(promise);
  if (!AllLocal(ids)) {
    const std::string name = SiteName(call->site, OpName(op));
    const std::string what = name + " of " + std::to_string(spec.bytes) + " bytes (site " +
                             std::to_string(call->site) + ")";
    RunDetached([=]() mutable {
      std::string err = RunCpuAcrossProcesses(spec, ids, call->cross_key, what, in, out_data, name);
      if (err.empty()) {
        promise.SetAvailable();
      } else {
        promise.SetError(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, err));
      }
    });
    return future;
  }
  Communicator& comm = GetCommunicator("cpu", ids);
  comm.ArriveAsync(
      comm.NextSeqAt(spec.rank, call->key), spec.rank, SiteName(call->site, OpName(op)).c_str(), in,
      out_data,
      [promise](const std::string& error) mutable {
        if (error.empty()) {
          promise.SetAvailable();
        } else {
          promise.SetError(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, error));
        }
      },
      [spec](const std::vector<const void*>& inputs, const std::vector<void*>& outputs) {
        return RunAllRanks(spec, inputs, outputs);
      });
  return future;
}

// Async pairs on CPU: there are no streams to overlap with, so `start` runs the whole op and
// `done` has nothing left to wait for. A start's outputs are (out, token[, x]) (StartOutput),
// and done's outputs alias its inputs (set in the lowering), so neither copies.
ffi::Future AllGatherStartCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                              ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                              int64_t group_size, int64_t peers_only, int64_t /*stream: GPU only*/,
                              int64_t /*site*/) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return Failed(out_or.error());
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  return RunCpu(OpKind::kAllGather, device, call, x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), groups, group_size, PeersOnly(peers_only));
}
// all_gather, or a ppermute into the sender's slot, into rows [offset, ...) of a larger
// buffer: args (x[, dst]), the output aliasing dst when given (cuda/handlers_cuda.cc says more).
ffi::Future IntoStartCpu(int32_t device, CpuCall* call, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                         int64_t group_size, int64_t offset, ffi::Span<const int64_t> permute_dst,
                         int64_t in_place, int64_t /*stream: GPU only*/, int64_t /*site*/) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return Failed(out_or.error());
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  auto into = DecodeInto(args, *out, group_size, offset, in_place);
  if (into.has_error()) return Failed(into.error());
  ExchangeOptions options;
  options.permute_dst = permute_dst;
  options.at_source_slot = permute_dst.size() > 0;  // a ppermute lands in the sender's slot
  options.in_place = into->in_place;
  return RunCpu(options.at_source_slot ? OpKind::kPermute : OpKind::kAllGather, device, call,
                into->x, into->x_bytes, into->dst, into->bytes, groups, group_size, options);
}
ffi::Future AllToAllStartCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                             ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                             int64_t group_size, int64_t /*stream: GPU only*/, int64_t /*site*/) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return Failed(out_or.error());
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  return RunCpu(OpKind::kAllToAll, device, call, x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), groups, group_size, {});
}
ffi::Future PermuteStartCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                            ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                            int64_t group_size, ffi::Span<const int64_t> permute_dst,
                            int64_t /*stream: GPU only*/, int64_t /*site*/) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return Failed(out_or.error());
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  return RunCpu(OpKind::kPermute, device, call, x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), groups, group_size, PermuteTo(permute_dst));
}
ffi::Error DoneCpu(ffi::RemainingArgs, ffi::RemainingRets, int64_t /*site of the start*/) {
  return ffi::Error::Success();
}

// hoccl_after (token, *arrays) -> arrays, each output aliasing its array: nothing to do at run
// time. It exists for XLA: compute that reads the outputs depends on the token, so it cannot
// run before the start that made the token (an optimization barrier does not hold on GPU).
// Touches no stream, so the one handler serves CPU and CUDA (module.cc).
ffi::Error OrderAfter(ffi::RemainingArgs, ffi::RemainingRets) { return ffi::Error::Success(); }

// skip_own: my own slot of the output is left unwritten (plan.h).
ffi::Future AllGatherCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                         int64_t group_size, int64_t skip_own, int64_t /*site*/) {
  return RunCpu(OpKind::kAllGather, device, call, x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), groups, group_size, SkipOwn(skip_own));
}
ffi::Future AllToAllCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                        int64_t group_size, int64_t skip_own, int64_t /*site*/) {
  return RunCpu(OpKind::kAllToAll, device, call, x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), groups, group_size, SkipOwn(skip_own));
}
ffi::Future PermuteCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                       int64_t group_size, ffi::Span<const int64_t> permute_dst, int64_t /*site*/) {
  return RunCpu(OpKind::kPermute, device, call, x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), groups, group_size, PermuteTo(permute_dst));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherStartCpu, AllGatherStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<CpuCall>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("peers_only")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIntoStartCpu, IntoStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<CpuCall>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("offset")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("in_place")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllStartCpu, AllToAllStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<CpuCall>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteStartCpu, PermuteStartCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<CpuCall>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kInstantiateCpuCall, InstantiateCpuCall,
                              ffi::Ffi::BindInstantiate().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kOrderAfter, OrderAfter,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kDoneCpu, DoneCpu, ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int64_t>("site"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherCpu, AllGatherCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<CpuCall>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("skip_own")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllCpu, AllToAllCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<CpuCall>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("skip_own")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteCpu, PermuteCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<CpuCall>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("site"));

}  // namespace hoccl
