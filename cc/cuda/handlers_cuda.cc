// XLA FFI handlers for platform "CUDA": the same attributes as the CPU handlers
// (cpu/handlers_cpu.cc), so the Python lowering is identical; the plan runs on the CUDA executor
// (cuda_executor.h) in "direct" mode on XLA's stream of this device. The fused ops' own
// handlers are in fused/handlers_fused.cc.
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "communicator.h"
#include "cuda/async_streams.h"
#include "cuda/cuda_executor.h"
#include "cuda/cuda_util.h"
#include "ffi/handler_common.h"
#include "ffi/handlers.h"
#include "host_profile.h"
#include "job.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hoccl {
namespace {

ffi::Error RunCuda(OpKind op, cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> out, const Group& group,
                   const ExchangeOptions& options) {
  HostTimer timer("collective");
  HOCCL_TRACE("handler %s: device %lld, stream %p, %zu groups entries, group size %lld\n",
              OpName(op), static_cast<long long>(device), static_cast<void*>(stream),
              group.ids.size(), static_cast<long long>(group.size));
  ExchangeOptions typed = options;
  typed.type = TypeName(x.element_type());
  return EnqueueExchange(op, stream, 0, device, x.untyped_data(), x.size_bytes(),
                         out->untyped_data(), out->size_bytes(), group, typed);
}

// A start of (x) -> (out, token[, x]) (StartOutput) on its async stream.
ffi::Error StartOne(OpKind op, cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                    ffi::RemainingRets rets, const Group& group, int64_t stream_index,
                    const ExchangeOptions& options) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return out_or.error();
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  ExchangeOptions typed = options;
  typed.type = TypeName(x.element_type());
  return StartCuda(op, stream, device, x.untyped_data(), x.size_bytes(), out->untyped_data(),
                   out->size_bytes(), group, stream_index, typed);
}

}  // namespace

// `site` only names the user's op in errors here (the CPU engine pairs calls by it): every
// GPU runs its thunks in schedule order, so the per-communicator sequence pairs calls.
// skip_own: my own slot of the output is left unwritten (plan.h).
static ffi::Error AllGatherCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer> out, Group group, int64_t skip_own) {
  return RunCuda(OpKind::kAllGather, stream, device, x, out, group, SkipOwn(skip_own));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherCuda, AllGatherCuda, CudaSync().Attr<int64_t>("skip_own"));

static ffi::Error AllToAllCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                               ffi::Result<ffi::AnyBuffer> out, Group group, int64_t skip_own) {
  return RunCuda(OpKind::kAllToAll, stream, device, x, out, group, SkipOwn(skip_own));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllCuda, AllToAllCuda, CudaSync().Attr<int64_t>("skip_own"));

static ffi::Error PermuteCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::Result<ffi::AnyBuffer> out, Group group,
                              ffi::Span<const int64_t> permute_dst) {
  return RunCuda(OpKind::kPermute, stream, device, x, out, group, PermuteTo(permute_dst));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteCuda, PermuteCuda,
                              CudaSync().Attr<ffi::Span<const int64_t>>("permute_dst"));

// ---- the same movers for blocks the staged path takes (the lowering picks these targets up
// to JAX_HOCCL_STAGED_BYTES): the same work on every call, so XLA may capture them into its
// command buffers (CUDA graphs); cuda/staged/staged_exchange.h says how a captured call runs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherStagedCuda, AllGatherCuda,
                              CudaSync().Attr<int64_t>("skip_own"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllStagedCuda, AllToAllCuda,
                              CudaSync().Attr<int64_t>("skip_own"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteStagedCuda, PermuteCuda,
                              CudaSync().Attr<ffi::Span<const int64_t>>("permute_dst"),
                              {ffi::Traits::kCmdBufferCompatible});

// ---- psum (one shot) and psum_scatter of staged blocks with the sum inside the exchange
// (plan.h: OpSpec::sum): the movers' exchange, whose copies out add every rank's block in rank
// order. Only on the staged path, which the lowering guarantees (ffi_targets.py,
// lower_staged_sum); command-buffer compatible like the movers above.
static ffi::Error SummedCuda(OpKind op, const char* name, cudaStream_t stream, int32_t device,
                             ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, Group group) {
  auto options = SumOf(x.element_type(), name);
  if (options.has_error()) return options.error();
  return RunCuda(op, stream, device, x, out, group, *options);
}

static ffi::Error PsumStagedCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                 ffi::Result<ffi::AnyBuffer> out, Group group) {
  return SummedCuda(OpKind::kAllGather, "psum", stream, device, x, out, group);
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPsumStagedCuda, PsumStagedCuda, CudaSync(),
                              {ffi::Traits::kCmdBufferCompatible});

static ffi::Error PsumScatterStagedCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                        ffi::Result<ffi::AnyBuffer> out, Group group) {
  return SummedCuda(OpKind::kAllToAll, "psum_scatter", stream, device, x, out, group);
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPsumScatterStagedCuda, PsumScatterStagedCuda, CudaSync(),
                              {ffi::Traits::kCmdBufferCompatible});

// ---- async pairs: each start runs its exchange on an async stream (cuda/async_streams.h).
static ffi::Error AllGatherStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                     ffi::RemainingRets rets, Group group, int64_t stream_index,
                                     int64_t peers_only) {
  return StartOne(OpKind::kAllGather, stream, device, x, rets, group, stream_index,
                  PeersOnly(peers_only));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherStartCuda, AllGatherStartCuda,
                              CudaStart().Attr<int64_t>("peers_only"));

static ffi::Error AllToAllStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                    ffi::RemainingRets rets, Group group, int64_t stream_index) {
  return StartOne(OpKind::kAllToAll, stream, device, x, rets, group, stream_index, {});
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllStartCuda, AllToAllStartCuda, CudaStart());

static ffi::Error PermuteStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                   ffi::RemainingRets rets, Group group, int64_t stream_index,
                                   ffi::Span<const int64_t> permute_dst) {
  return StartOne(OpKind::kPermute, stream, device, x, rets, group, stream_index,
                  PermuteTo(permute_dst));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteStartCuda, PermuteStartCuda,
                              CudaStart().Attr<ffi::Span<const int64_t>>("permute_dst"));

// all_gather (permute_dst empty), or a ppermute into the sender's slot, into rows of a larger
// buffer: args (x[, dst]); when dst is given the output aliases it (set in the lowering),
// else XLA allocates it and the other rows stay unwritten for later calls of the chain.
static ffi::Error IntoStartCuda(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                                ffi::RemainingRets rets, Group group, int64_t stream_index,
                                int64_t offset, ffi::Span<const int64_t> permute_dst,
                                int64_t in_place) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return out_or.error();
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  auto into = DecodeInto(args, *out, group, offset, in_place);
  if (into.has_error()) return into.error();
  ExchangeOptions options = PermuteTo(permute_dst);
  options.at_source_slot = permute_dst.size() > 0;  // a ppermute lands in the sender's slot
  options.in_place = into->in_place;
  options.type = TypeName(out->element_type());
  return StartCuda(options.at_source_slot ? OpKind::kPermute : OpKind::kAllGather, stream, device,
                   into->x, into->x_bytes, into->dst, into->bytes, group, stream_index, options);
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIntoStartCuda, IntoStartCuda,
                              CudaStart<ffi::RemainingArgs>()
                                  .Attr<int64_t>("offset")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("in_place"));

static ffi::Error DoneCuda(cudaStream_t xla_stream, int32_t device, ffi::RemainingArgs,
                           ffi::RemainingRets, int64_t site) {
  HostTimer timer("done");
  AsyncState& a = AsyncStateFor(device);
  auto it = a.pending.find(site);
  if (it == a.pending.end() || it->second.empty())
    return ffi::Error::Internal("jax_hoccl done: no pending start for this done (site " +
                                std::to_string(site) + ")");
  cudaEvent_t finished = it->second.front();
  it->second.pop_front();
  cudaError_t e = cudaStreamWaitEvent(xla_stream, finished, 0);
  a.free_events.push_back(finished);  // reusable: the wait above captured this record
  if (e != cudaSuccess) return CudaFail("cudaStreamWaitEvent", e);
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(kDoneCuda, DoneCuda,
                              CudaContext().RemainingArgs().RemainingRets().Attr<int64_t>("site"));

}  // namespace hoccl
