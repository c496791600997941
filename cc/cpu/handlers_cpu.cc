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
#include "cpu/cpu_staged.h"
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

// Across processes the instruction is named by its lowered site (axes.lowered_site: its
// module's name and its place there, alike in every process) and how many instructions of
// that site this process instantiated before (an inner jit called twice is lowered once:
// XLA inlines two instructions of one site, in the same order in every process).
// A shared site (job.h: the branches of one cond, each rank maybe in another) names one key
// for all its instructions, so a rank in one branch meets its peers in the other.
ffi::ErrorOr<std::unique_ptr<CpuCall>> InstantiateCpuCall(ffi::Dictionary attrs) {
  static std::mutex mu;
  static std::map<int64_t, uint64_t> per_site;
  static std::map<int64_t, int64_t> shared_keys;
  auto call = std::make_unique<CpuCall>();
  auto group = attrs.get<Group>("group");
  call->site = group.has_value() ? group->site : 0;
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
// spans processes runs on cpu_staged.h or cpu_cross_process.h (off XLA's threads).
ffi::Future RunCpu(OpKind op, int64_t device, const CpuCall* call, ffi::DataType type,
                   const void* in, size_t in_bytes, void* out_data, size_t out_bytes,
                   const Group& group, const ExchangeOptions& options) {
  HostTimer timer("cpu handler");  // decode and rendezvous; the copies run at the last arrival
  OpSpec spec;
  std::vector<int64_t> ids;
  ffi::Error decoded = DecodeOp(op, device, in_bytes, out_bytes, group, options, &spec, &ids);
  if (!decoded.success()) return Failed(std::move(decoded));
  in = InputFor(spec, in, out_data);
  std::string err = ValidateSpec(spec);
  if (!err.empty())
    return Failed(ffi::Error::InvalidArgument(std::string("jax_hoccl ") + OpName(op) + ": " + err));
  ffi::Promise promise;
  ffi::Future future(promise);
  if (!AllLocal(ids)) {
    const std::string name = SiteName(call->site, OpName(op));
    const std::string what =
        name + " of " + std::to_string(spec.bytes) + " bytes of " + TypeName(type);
    auto finish = [promise](const std::string& err) mutable {
      if (err.empty()) {
        promise.SetAvailable();
      } else {
        promise.SetError(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, err));
      }
    };
    // Below the crossover the staged path (cpu_staged.h), else the per-call rendezvous.
    if (RunCpuStaged(spec, ids, call->cross_key, what, in, out_data, name, finish)) return future;
    RunDetached([=]() mutable {
      finish(RunCpuAcrossProcesses(spec, ids, call->cross_key, what, in, out_data, name));
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

}  // namespace

// A CPU handler's context: the device and the instruction's state (InstantiateCpuCall).
static auto CpuContext() {
  return ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().Ctx<ffi::State<CpuCall>>();
}
template <typename In = ffi::AnyBuffer>
static auto CpuSync() {
  return SyncBinding<In>(CpuContext);
}
template <typename In = ffi::AnyBuffer>
static auto CpuStart() {
  return StartBinding<In>(CpuContext);
}

// Async pairs on CPU: there are no streams to overlap with, so `start` runs the whole op and
// `done` has nothing left to wait for. A start's outputs are (out, token[, x]) (StartOutput),
// and done's outputs alias its inputs (set in the lowering), so neither copies. The async
// stream is the GPU's only.
static ffi::Future StartCpu(OpKind op, int32_t device, CpuCall* call, ffi::AnyBuffer x,
                            ffi::RemainingRets rets, const Group& group,
                            const ExchangeOptions& options) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return Failed(out_or.error());
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  return RunCpu(op, device, call, x.element_type(), x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), group, options);
}

static ffi::Future AllGatherStartCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                                     ffi::RemainingRets rets, Group group, int64_t /*stream*/,
                                     int64_t peers_only) {
  return StartCpu(OpKind::kAllGather, device, call, x, rets, group, PeersOnly(peers_only));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherStartCpu, AllGatherStartCpu,
                              CpuStart().Attr<int64_t>("peers_only"));

static ffi::Future AllToAllStartCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                                    ffi::RemainingRets rets, Group group, int64_t /*stream*/) {
  return StartCpu(OpKind::kAllToAll, device, call, x, rets, group, {});
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllStartCpu, AllToAllStartCpu, CpuStart());

static ffi::Future PermuteStartCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                                   ffi::RemainingRets rets, Group group, int64_t /*stream*/,
                                   ffi::Span<const int64_t> permute_dst) {
  return StartCpu(OpKind::kPermute, device, call, x, rets, group, PermuteTo(permute_dst));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteStartCpu, PermuteStartCpu,
                              CpuStart().Attr<ffi::Span<const int64_t>>("permute_dst"));

// all_gather, or a ppermute into the sender's slot, into rows [offset, ...) of a larger
// buffer: args (x[, dst]), the output aliasing dst when given (cuda/handlers_cuda.cc says more).
static ffi::Future IntoStartCpu(int32_t device, CpuCall* call, ffi::RemainingArgs args,
                                ffi::RemainingRets rets, Group group, int64_t /*stream*/,
                                int64_t offset, ffi::Span<const int64_t> permute_dst,
                                int64_t in_place) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return Failed(out_or.error());
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  auto into = DecodeInto(args, *out, group, offset, in_place);
  if (into.has_error()) return Failed(into.error());
  ExchangeOptions options = PermuteTo(permute_dst);
  options.at_source_slot = permute_dst.size() > 0;  // a ppermute lands in the sender's slot
  options.in_place = into->in_place;
  return RunCpu(options.at_source_slot ? OpKind::kPermute : OpKind::kAllGather, device, call,
                out->element_type(), into->x, into->x_bytes, into->dst, into->bytes, group,
                options);
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIntoStartCpu, IntoStartCpu,
                              CpuStart<ffi::RemainingArgs>()
                                  .Attr<int64_t>("offset")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("in_place"));

static ffi::Error DoneCpu(ffi::RemainingArgs, ffi::RemainingRets, int64_t /*site of the start*/) {
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kDoneCpu, DoneCpu, ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int64_t>("site"));

// hoccl_after (token, *arrays) -> arrays, each output aliasing its array: nothing to do at run
// time. It exists for XLA: compute that reads the outputs depends on the token, so it cannot
// run before the start that made the token (an optimization barrier does not hold on GPU).
// Touches no stream, so the one handler serves CPU and CUDA (module.cc).
static ffi::Error OrderAfter(ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kOrderAfter, OrderAfter,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kInstantiateCpuCall, InstantiateCpuCall,
                              ffi::Ffi::BindInstantiate().Attrs());

// skip_own: my own slot of the output is left unwritten (plan.h).
static ffi::Future AllGatherCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer> out, Group group, int64_t skip_own) {
  return RunCpu(OpKind::kAllGather, device, call, x.element_type(), x.untyped_data(),
                x.size_bytes(), out->untyped_data(), out->size_bytes(), group, SkipOwn(skip_own));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherCpu, AllGatherCpu, CpuSync().Attr<int64_t>("skip_own"));

static ffi::Future AllToAllCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                               ffi::Result<ffi::AnyBuffer> out, Group group, int64_t skip_own) {
  return RunCpu(OpKind::kAllToAll, device, call, x.element_type(), x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), group, SkipOwn(skip_own));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllCpu, AllToAllCpu, CpuSync().Attr<int64_t>("skip_own"));

static ffi::Future PermuteCpu(int32_t device, CpuCall* call, ffi::AnyBuffer x,
                              ffi::Result<ffi::AnyBuffer> out, Group group,
                              ffi::Span<const int64_t> permute_dst) {
  return RunCpu(OpKind::kPermute, device, call, x.element_type(), x.untyped_data(), x.size_bytes(),
                out->untyped_data(), out->size_bytes(), group, PermuteTo(permute_dst));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteCpu, PermuteCpu,
                              CpuSync().Attr<ffi::Span<const int64_t>>("permute_dst"));

}  // namespace hoccl
