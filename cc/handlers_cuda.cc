// XLA FFI handlers for platform "CUDA": the same attributes as the CPU handlers
// (handlers_cpu.cc), so the Python lowering is identical; the plan runs on the CUDA executor
// (cuda_executor.h) in "direct" mode on XLA's stream of this device.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "communicator.h"
#include "cuda_executor.h"
#include "driver_api.h"
#include "handler_common.h"
#include "handlers.h"
#include "host_profile.h"
#include "job.h"
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
                   int64_t group_size, ffi::Span<const int64_t> permute_dst, int64_t site,
                   bool skip_own = false) {
  HostTimer timer("collective");
  static const bool debug = [] {
    const char* v = std::getenv("JAX_HOCCL_DEBUG");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  if (debug) {
    std::fprintf(
        stderr,
        "[jax_hoccl] handler %s: device %lld, stream %p, %zu groups entries, group size %lld\n",
        OpName(op), static_cast<long long>(device), static_cast<void*>(stream), groups.size(),
        static_cast<long long>(group_size));
    std::fflush(stderr);
  }
  OpSpec spec;
  std::vector<int64_t> ids;
  ffi::Error decoded =
      DecodeOp(op, GlobalDeviceId(device), x.size_bytes(), out->size_bytes(), groups, group_size,
               permute_dst, false, &spec, &ids, false, false, skip_own);
  if (!decoded.success()) return decoded;
  // Every rank sees the same shapes, so all skip together and sequence numbers stay in step.
  if (spec.bytes == 0) return ffi::Error::Success();
  Communicator& comm = CudaCommunicator(ids);
  ExecStatus st = RunOnCuda(comm, spec, stream, x.untyped_data(), out->untyped_data(), 0,
                            SiteName(site, OpName(op)));
  if (!st.ok()) return ffi::Error(CodeFor(st.kind), st.message);
  return ffi::Error::Success();
}

// `site` only names the user's op in errors here (the CPU engine pairs calls by it): every
// GPU runs its thunks in schedule order, so the per-communicator sequence pairs calls.
// skip_own: my own slot of the output is left unwritten (plan.h).
ffi::Error AllGatherCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                         int64_t group_size, int64_t skip_own, int64_t site) {
  return RunCuda(OpKind::kAllGather, stream, device, x, out, groups, group_size, {}, site,
                 skip_own != 0);
}
ffi::Error AllToAllCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                        int64_t group_size, int64_t skip_own, int64_t site) {
  return RunCuda(OpKind::kAllToAll, stream, device, x, out, groups, group_size, {}, site,
                 skip_own != 0);
}
ffi::Error PermuteCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> groups,
                       int64_t group_size, ffi::Span<const int64_t> permute_dst, int64_t site) {
  return RunCuda(OpKind::kPermute, stream, device, x, out, groups, group_size, permute_dst, site);
}

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

// A start's stream: one of the device's async streams forked from XLA's (the input and the
// output are XLA's as of this point of its stream), or XLA's itself (stream_index -1: the
// exchange runs there, lane 0, and done has nothing left to wait for: the last exchange of a
// pipeline, which nothing can overlap).
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

// Records the event done waits for, after everything the start enqueued on `stream`.
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

// One exchange on a start's stream (StartStream).
ffi::Error EnqueueExchange(OpKind op, cudaStream_t stream, int lane, int32_t device, const void* in,
                           size_t in_bytes, void* out_data, size_t out_bytes,
                           ffi::Span<const int64_t> groups, int64_t group_size,
                           ffi::Span<const int64_t> permute_dst, int64_t site, bool peers_only,
                           bool at_source_slot, bool in_place, const Announce* announce) {
  OpSpec spec;
  std::vector<int64_t> ids;
  ffi::Error decoded = DecodeOp(op, GlobalDeviceId(device), in_bytes, out_bytes, groups, group_size,
                                permute_dst, peers_only, &spec, &ids, at_source_slot, in_place);
  if (!decoded.success()) return decoded;
  in = InputFor(spec, in, out_data);
  if (spec.bytes > 0 && OutputBytes(spec) > 0) {
    ExecStatus st = RunOnCuda(CudaCommunicator(ids), spec, stream, in, out_data, lane,
                              SiteName(site, OpName(op)), announce);
    if (!st.ok()) return ffi::Error(CodeFor(st.kind), st.message);
  }
  return ffi::Error::Success();
}

// in/in_bytes: the input (in_place: ignored, the input is my slot of the output, InputFor);
// out_data/out_bytes: where the result goes (the whole output, or for the "into" variant the
// rows [offset, offset + n * x rows) of a larger buffer).
ffi::Error StartCuda(OpKind op, cudaStream_t xla_stream, int32_t device, const void* in,
                     size_t in_bytes, void* out_data, size_t out_bytes,
                     ffi::Span<const int64_t> groups, int64_t group_size,
                     ffi::Span<const int64_t> permute_dst, int64_t stream_index, int64_t site,
                     bool peers_only, bool at_source_slot = false, bool in_place = false,
                     const Announce* announce = nullptr) {
  HostTimer timer("start");
  AsyncState& a = AsyncStateFor(device);
  auto stream = StartStream(a, xla_stream, stream_index);
  if (stream.has_error()) return stream.error();
  ffi::Error err = EnqueueExchange(op, stream->first, stream->second, device, in, in_bytes,
                                   out_data, out_bytes, groups, group_size, permute_dst, site,
                                   peers_only, at_source_slot, in_place, announce);
  if (!err.success()) return err;
  return FinishStart(a, stream->first, site);
}

ffi::Error AllGatherStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                              int64_t group_size, int64_t peers_only, int64_t stream_index,
                              int64_t site) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return out_or.error();
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  return StartCuda(OpKind::kAllGather, stream, device, x.untyped_data(), x.size_bytes(),
                   out->untyped_data(), out->size_bytes(), groups, group_size, {}, stream_index,
                   site, peers_only != 0);
}
// all_gather (permute_dst empty), or a ppermute into the sender's slot, into rows of a larger
// buffer: args (x[, dst]); when dst is given the output aliases it (set in the lowering),
// else XLA allocates it and the other rows stay unwritten for later calls of the chain.
ffi::Error IntoStartCuda(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                         int64_t group_size, int64_t offset, ffi::Span<const int64_t> permute_dst,
                         int64_t in_place, int64_t stream_index, int64_t site) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return out_or.error();
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  auto into = DecodeInto(args, *out, group_size, offset, in_place);
  if (into.has_error()) return into.error();
  const bool permute = permute_dst.size() > 0;
  return StartCuda(permute ? OpKind::kPermute : OpKind::kAllGather, stream, device, into->x,
                   into->x_bytes, into->dst, into->bytes, groups, group_size, permute_dst,
                   stream_index, site, false, permute, into->in_place);
}
ffi::Error AllToAllStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                             ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                             int64_t group_size, int64_t stream_index, int64_t site) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return out_or.error();
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  return StartCuda(OpKind::kAllToAll, stream, device, x.untyped_data(), x.size_bytes(),
                   out->untyped_data(), out->size_bytes(), groups, group_size, {}, stream_index,
                   site, false);
}
ffi::Error PermuteStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                            int64_t group_size, ffi::Span<const int64_t> permute_dst,
                            int64_t stream_index, int64_t site) {
  auto out_or = StartOutput(rets);
  if (out_or.has_error()) return out_or.error();
  ffi::Result<ffi::AnyBuffer> out = *out_or;
  return StartCuda(OpKind::kPermute, stream, device, x.untyped_data(), x.size_bytes(),
                   out->untyped_data(), out->size_bytes(), groups, group_size, permute_dst,
                   stream_index, site, false);
}

// all_gather of the peers' blocks (rotated, as peers_only) into output 0 whose rows a GEMM
// multiplies while they land: output 1 holds one uint64 flag per `announce_bytes` of output 0,
// zeroed on XLA's stream first and set to 1 once its rows are in (cuda_executor.h: Announce).
// Output 2 is the token the GEMM takes, so XLA runs it after this start.
ffi::Error AnnouncedGatherStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> flags, ffi::Result<ffi::AnyBuffer>,
                                    ffi::Span<const int64_t> groups, int64_t group_size,
                                    int64_t announce_bytes, int64_t stream_index, int64_t site) {
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
                   out->untyped_data(), out->size_bytes(), groups, group_size, {}, stream_index,
                   site, true, false, false, &announce);
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
                             ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                             int64_t group_size, int64_t band_bytes, int64_t flag_target,
                             int64_t gather, int64_t stream_index, int64_t site) {
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
  const size_t n = static_cast<size_t>(group_size);
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
      FindGroup(groups.begin(), groups.size(), group_size, GlobalDeviceId(device), &pos);
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
                          into, band_bytes, groups, group_size, next, site, false, false, false,
                          &announce);
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
                              groups, group_size, ffi::Span<const int64_t>(dst.data(), dst.size()),
                              site, false, false, false, nullptr);
        if (!err.success()) return err;
      }
    }
  }
  return FinishStart(a, stream->first, site);
}

ffi::Error DoneCuda(cudaStream_t xla_stream, int32_t device, ffi::RemainingArgs, ffi::RemainingRets,
                    int64_t site) {
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherStartCuda, AllGatherStartCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("peers_only")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIntoStartCuda, IntoStartCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("offset")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("in_place")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllStartCuda, AllToAllStartCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteStartCuda, PermuteStartCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAnnouncedGatherStartCuda, AnnouncedGatherStartCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("announce_bytes")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGemmRingStartCuda, GemmRingStartCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("band_bytes")
                                  .Attr<int64_t>("flag_target")
                                  .Attr<int64_t>("gather")
                                  .Attr<int64_t>("stream")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kDoneCuda, DoneCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("site"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherCuda, AllGatherCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("skip_own")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllCuda, AllToAllCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("skip_own")
                                  .Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kPermuteCuda, PermuteCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("group_size")
                                  .Attr<ffi::Span<const int64_t>>("permute_dst")
                                  .Attr<int64_t>("site"));

}  // namespace hoccl
