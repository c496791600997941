#include "cuda/cuda_executor.h"

// No iostreams in this file (nor in the communicator): see the note in communicator.cc.

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "cuda/driver_api.h"
#include "cuda/transport/transport_direct.h"
#include "cuda/transport/transport_ipc.h"
#include "host_profile.h"
#include "job.h"

namespace hoccl {

// ---------------------------------------------------------------- options

size_t BlockBytes(const OpSpec& spec) {
  if (spec.op == OpKind::kAllToAll) return spec.group_size > 0 ? spec.bytes / spec.group_size : 0;
  return spec.bytes;
}

namespace {

// An integer >= `min` from the environment, or `fallback`.
long long EnvInt(const char* name, long long fallback, long long min = 1) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && x >= min) ? x : fallback;
}

bool DebugEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_HOCCL_DEBUG");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

#define HOCCL_TRACE(...)                                \
  do {                                                  \
    if (DebugEnabled()) {                               \
      std::fprintf(stderr, "[jax_hoccl] " __VA_ARGS__); \
      std::fflush(stderr);                              \
    }                                                   \
  } while (0)

}  // namespace

// The copy layout's overrides, read once at the first collective (0: not set).
struct CopyLayoutEnv {
  size_t multistream_min_bytes;
  long long chunks, channels;
};
const CopyLayoutEnv& CopyLayout() {
  static const CopyLayoutEnv env{
      static_cast<size_t>(EnvInt("JAX_HOCCL_MULTISTREAM_MIN_BYTES", kMultiStreamMinBytes)),
      EnvInt("JAX_HOCCL_CHUNKS", 0, 1), EnvInt("JAX_HOCCL_CHANNELS", 0, 1)};
  return env;
}

PlanOptions ChooseCudaPlanOptions(const OpSpec& spec) {
  PlanOptions o;
  const CopyLayoutEnv& env = CopyLayout();
  if (BlockBytes(spec) >= env.multistream_min_bytes) {
    o.chunks = 1;
    o.channels = kLargeMessageChannels;
  }
  if (env.chunks) o.chunks = static_cast<int>(std::min<long long>(env.chunks, 64));
  if (env.channels) o.channels = static_cast<int>(std::min<long long>(env.channels, 64));
  return o;
}

// ---------------------------------------------------------------- helpers

namespace {

std::string Prefix(const OpSpec& spec, const char* op, int device) {
  return std::string("jax_hoccl ") + op + " (rank " + std::to_string(spec.rank) + ", CUDA device " +
         std::to_string(device) + "): ";
}

std::string CudaError(const char* call, cudaError_t e) {
  return std::string(call) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

#define HOCCL_CUDA_RETURN(call)                                     \
  do {                                                              \
    cudaError_t hoccl_e_ = (call);                                  \
    if (hoccl_e_ != cudaSuccess) return CudaError(#call, hoccl_e_); \
  } while (0)

CUdeviceptr DevPtr(const uint64_t* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
}

// Consecutive stream memory operations on one stream: one cuStreamWriteValue64 /
// cuStreamWaitValue64 each, or all as one cuStreamBatchMemOp where the driver has it (on
// H200 the two measured the same within noise, benchmarks/results/raw/
// 2026-11-30-2xH200-probe_op_cost-batch-memops-on-off.txt; one call is fewer host calls).
class MemOps {
 public:
  MemOps(const DriverApi& api, cudaStream_t stream) : api_(api), stream_(stream) {}

  void Write(uint64_t* addr, uint64_t value) {
    CUstreamBatchMemOpParams p;
    std::memset(&p, 0, sizeof(p));
    p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    p.writeValue.address = DevPtr(addr);
    p.writeValue.value64 = value;
    p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;  // fenced after earlier work
    ops_.push_back(p);
  }
  void Wait(uint64_t* addr, uint64_t value) {
    CUstreamBatchMemOpParams p;
    std::memset(&p, 0, sizeof(p));
    p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    p.waitValue.address = DevPtr(addr);
    p.waitValue.value64 = value;
    p.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    ops_.push_back(p);
  }

  std::string Flush() {
    if (ops_.empty()) return "";
    HostTimer timer("api: stream memops");
    std::string err;
    CUstream s = reinterpret_cast<CUstream>(stream_);
    if (ops_.size() > 1 && api_.batch_mem_op) {
      constexpr size_t kMaxBatch = 256;  // cuStreamBatchMemOp's limit per call
      for (size_t i = 0; i < ops_.size() && err.empty(); i += kMaxBatch) {
        unsigned count = static_cast<unsigned>(std::min(kMaxBatch, ops_.size() - i));
        CUresult r = api_.batch_mem_op(s, count, ops_.data() + i, 0);
        if (r != CUDA_SUCCESS) err = api_.Describe("cuStreamBatchMemOp", r);
      }
    } else {
      for (const CUstreamBatchMemOpParams& p : ops_) {
        CUresult r;
        if (p.operation == CU_STREAM_MEM_OP_WRITE_VALUE_64) {
          r = api_.write_value64(s, p.writeValue.address, p.writeValue.value64, p.writeValue.flags);
          if (r != CUDA_SUCCESS) {
            err = api_.Describe("cuStreamWriteValue64", r);
            break;
          }
        } else {
          r = api_.wait_value64(s, p.waitValue.address, p.waitValue.value64, p.waitValue.flags);
          if (r != CUDA_SUCCESS) {
            err = api_.Describe("cuStreamWaitValue64", r);
            break;
          }
        }
      }
    }
    ops_.clear();
    return err;
  }

 private:
  const DriverApi& api_;
  cudaStream_t stream_;
  std::vector<CUstreamBatchMemOpParams> ops_;
};

// ---------------------------------------------------------------- per-device resources

// Side streams and events of one device, created once and reused by every call (the
// fork/join pattern makes reuse safe: a wait captures an event's state when enqueued).
struct DeviceResources {
  std::mutex mu;  // held while a call enqueues on the side streams
  bool initialized = false;
  cudaStream_t side[kMaxSideStreams] = {};
  cudaEvent_t fork = nullptr;
  cudaEvent_t join[kMaxSideStreams] = {};
};

DeviceResources& ResourcesFor(int device) {
  static std::mutex mu;
  static auto* all = new std::map<int, std::unique_ptr<DeviceResources>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& r = (*all)[device];
  if (!r) r = std::make_unique<DeviceResources>();
  return *r;
}

std::string InitResources(DeviceResources& r) {  // requires r.mu; current device set
  if (r.initialized) return "";
  for (int i = 0; i < kMaxSideStreams; ++i)
    HOCCL_CUDA_RETURN(cudaStreamCreateWithFlags(&r.side[i], cudaStreamNonBlocking));
  HOCCL_CUDA_RETURN(cudaEventCreateWithFlags(&r.fork, cudaEventDisableTiming));
  for (int i = 0; i < kMaxSideStreams; ++i)
    HOCCL_CUDA_RETURN(cudaEventCreateWithFlags(&r.join[i], cudaEventDisableTiming));
  r.initialized = true;
  return "";
}

// ---------------------------------------------------------------- per-(communicator, rank)

struct RankState {
  std::mutex mu;
  bool ready = false;
  std::string setup_error;            // a failed setup is final
  uint64_t* flags = nullptr;          // mine: kLanes x [ready_from[n], done_from[n]]
  std::vector<uint64_t*> peer_flags;  // every rank's flag array, by rank
};

RankState& RankStateFor(const Communicator* comm, int rank) {
  static std::mutex mu;
  static auto* all =
      new std::map<std::pair<const Communicator*, int>, std::unique_ptr<RankState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& s = (*all)[{comm, rank}];
  if (!s) s = std::make_unique<RankState>();
  return *s;
}

// Turns on peer access from `device` (current) to `peer`; XLA usually did already.
std::string EnablePeerAccess(int device, int peer) {
  static std::mutex mu;
  static auto* done = new std::set<std::pair<int, int>>();
  std::lock_guard<std::mutex> lock(mu);
  if (device == peer || done->count({device, peer})) return "";
  int can = 0;
  HOCCL_CUDA_RETURN(cudaDeviceCanAccessPeer(&can, device, peer));
  if (!can) {
    return "CUDA device " + std::to_string(device) + " cannot access device " +
           std::to_string(peer) +
           " as a peer (no NVLink/PCIe P2P); the copy-engine collectives need peer access";
  }
  cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // clear it
  } else if (e != cudaSuccess) {
    return CudaError("cudaDeviceEnablePeerAccess", e);
  }
  done->insert({device, peer});
  return "";
}

std::string SetupRank(RankState& st, PeerTransport& transport, const OpSpec& spec, int device,
                      cudaStream_t stream) {
  const int n = spec.group_size;
  const char* op = OpName(spec.op);
  std::string err;
  // Allocate and zero my flags before anyone can learn their address.
  size_t bytes = (kLanes * 2 * static_cast<size_t>(n) * sizeof(uint64_t) + 255) / 256 * 256;
  void* p = nullptr;
  cudaError_t e = cudaSuccess;
  err = transport.AllocFlags(bytes, &p);
  if (err.empty()) {
    e = cudaMemsetAsync(p, 0, bytes, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) err = CudaError("cudaMemsetAsync/cudaStreamSynchronize(flags)", e);
  }
  // Publish even on failure (as null) so peers fail fast instead of timing out.
  std::vector<uint64_t*> all;
  std::string xerr = transport.ExchangeFlags(
      spec.rank, err.empty() ? static_cast<uint64_t*>(p) : nullptr, &all, op);
  if (!err.empty()) return err;
  if (!xerr.empty()) return xerr;
  for (int q = 0; q < n; ++q) {
    if (!all[q]) {
      return "rank " + std::to_string(q) +
             " of the group failed its one-time setup (see its error)";
    }
    if (q == spec.rank || !transport.NeedsPeerAccess()) continue;
    cudaPointerAttributes attr;
    HOCCL_CUDA_RETURN(cudaPointerGetAttributes(&attr, all[q]));
    err = EnablePeerAccess(device, attr.device);
    if (!err.empty()) return err;
  }
  st.flags = static_cast<uint64_t*>(p);
  st.peer_flags = std::move(all);
  return "";
}

// ---------------------------------------------------------------- enqueueing

struct CallContext {
  const DriverApi& api;
  const OpSpec& spec;
  const std::vector<Step>& steps;
  cudaStream_t stream;                     // XLA's
  const std::vector<const void*>& inputs;  // by rank
  void* output;
  const RankState& st;
  uint64_t value;            // flag value of this call (sequence + 1)
  int lane;                  // which row of every flag array (cuda_executor.h: kLanes)
  const Announce* announce;  // or null
};

size_t Row(const CallContext& c) { return 2 * static_cast<size_t>(c.spec.group_size) * c.lane; }
uint64_t* ReadyFlagAt(const CallContext& c, int reader) {  // in reader's array: ready_from[me]
  return c.st.peer_flags[reader] + Row(c) + c.spec.rank;
}
uint64_t* DoneFlagAt(const CallContext& c, int owner) {  // in owner's array: done_from[me]
  return c.st.peer_flags[owner] + Row(c) + c.spec.group_size + c.spec.rank;
}
uint64_t* MyReadyFrom(const CallContext& c, int owner) { return c.st.flags + Row(c) + owner; }
uint64_t* MyDoneFrom(const CallContext& c, int reader) {
  return c.st.flags + Row(c) + c.spec.group_size + reader;
}

std::string Copy(const CallContext& c, const Step& s, cudaStream_t stream) {
  HostTimer timer(s.peer == c.spec.rank ? "api: memcpy local" : "api: memcpy peer");
  const char* src = static_cast<const char*>(c.inputs[s.peer]) + s.src_offset;
  char* dst = static_cast<char*>(c.output) + s.dst_offset;
  cudaMemcpyKind kind = s.peer == c.spec.rank ? cudaMemcpyDeviceToDevice : cudaMemcpyDefault;
#if CUDART_VERSION >= 13000
  if (c.announce) {  // a GEMM waits for these rows: copy engines only (cuda_executor.h)
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    void* dsts[1] = {dst};
    const void* srcs[1] = {src};
    size_t sizes[1] = {s.bytes}, attr_index = 0;
    HOCCL_CUDA_RETURN(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &attr_index, 1, stream));
    return "";
  }
#endif
  HOCCL_CUDA_RETURN(cudaMemcpyAsync(dst, src, s.bytes, kind, stream));
  return "";
}

std::string Zero(const CallContext& c, const Step& s, cudaStream_t stream) {
  HOCCL_CUDA_RETURN(
      cudaMemsetAsync(static_cast<char*>(c.output) + s.dst_offset, 0, s.bytes, stream));
  return "";
}

// Everything on XLA's stream, in plan order; consecutive flag operations are batched.
std::string EnqueueSingleStream(const CallContext& c) {
  MemOps ops(c.api, c.stream);
  std::string err;
  for (const Step& s : c.steps) {
    switch (s.kind) {
      case StepKind::kSignalReady: ops.Write(ReadyFlagAt(c, s.peer), c.value); break;
      case StepKind::kWaitReady: ops.Wait(MyReadyFrom(c, s.peer), c.value); break;
      case StepKind::kSignalDone: ops.Write(DoneFlagAt(c, s.peer), c.value); break;
      case StepKind::kWaitDone: ops.Wait(MyDoneFrom(c, s.peer), c.value); break;
      case StepKind::kCopy:
        err = ops.Flush();
        if (err.empty()) err = Copy(c, s, c.stream);
        if (c.announce) ops.Write(c.announce->flags + s.dst_offset / c.announce->bytes, 1);
        break;
      case StepKind::kZero:
        err = ops.Flush();
        if (err.empty()) err = Zero(c, s, c.stream);
        break;
    }
    if (!err.empty()) return err;
  }
  return ops.Flush();
}

// Signals on XLA's stream, then copies forked by channel (channel 0 stays on XLA's stream,
// channel c >= 1 goes to side stream (c-1) % kMaxSideStreams, each waiting for a peer's ready
// flag before its first copy from that peer), joined back, then done signals and waits.
std::string EnqueueMultiStream(const CallContext& c, DeviceResources& res) {
  const int n = c.spec.group_size, r = c.spec.rank;
  auto stream_index = [](int channel) {
    return channel == 0 ? 0 : 1 + (channel - 1) % kMaxSideStreams;
  };
  cudaStream_t streams[1 + kMaxSideStreams] = {c.stream};
  for (int i = 0; i < kMaxSideStreams; ++i) streams[1 + i] = res.side[i];
  bool used[1 + kMaxSideStreams] = {};
  for (const Step& s : c.steps)
    if (s.kind == StepKind::kCopy) used[stream_index(s.channel)] = true;

  std::string err;
  MemOps xla_ops(c.api, c.stream);
  for (const Step& s : c.steps)
    if (s.kind == StepKind::kSignalReady) xla_ops.Write(ReadyFlagAt(c, s.peer), c.value);
  if (!(err = xla_ops.Flush()).empty()) return err;

  // Fork: side streams start after everything XLA enqueued before us (our output may be
  // memory XLA just released on its stream; the local copy reads our input).
  HOCCL_CUDA_RETURN(cudaEventRecord(res.fork, c.stream));
  for (int i = 1; i <= kMaxSideStreams; ++i)
    if (used[i]) HOCCL_CUDA_RETURN(cudaStreamWaitEvent(streams[i], res.fork, 0));

  std::vector<char> waited(static_cast<size_t>(1 + kMaxSideStreams) * n, 0);
  for (const Step& s : c.steps) {
    if (s.kind == StepKind::kCopy) {
      int si = stream_index(s.channel);
      char& w = waited[static_cast<size_t>(si) * n + s.peer];
      if (s.peer != r && !w) {
        MemOps wait(c.api, streams[si]);
        wait.Wait(MyReadyFrom(c, s.peer), c.value);
        if (!(err = wait.Flush()).empty()) return err;
        w = 1;
      }
      if (!(err = Copy(c, s, streams[si])).empty()) return err;
    } else if (s.kind == StepKind::kZero) {
      if (!(err = Zero(c, s, c.stream)).empty()) return err;
    }
  }

  // Join.
  for (int i = 1; i <= kMaxSideStreams; ++i) {
    if (!used[i]) continue;
    HOCCL_CUDA_RETURN(cudaEventRecord(res.join[i - 1], streams[i]));
    HOCCL_CUDA_RETURN(cudaStreamWaitEvent(c.stream, res.join[i - 1], 0));
  }
  // Everything I read is copied: tell the owners; then wait until my readers are done with
  // my input, so XLA may reuse it once this op completes on its stream.
  for (const Step& s : c.steps)
    if (s.kind == StepKind::kSignalDone) xla_ops.Write(DoneFlagAt(c, s.peer), c.value);
  for (const Step& s : c.steps)
    if (s.kind == StepKind::kWaitDone) xla_ops.Wait(MyDoneFrom(c, s.peer), c.value);
  return xla_ops.Flush();
}

std::string CurrentDevice(cudaStream_t stream, int* device) {
#if CUDART_VERSION >= 12080
  HOCCL_CUDA_RETURN(cudaStreamGetDevice(stream, device));
  int current = -1;
  HOCCL_CUDA_RETURN(cudaGetDevice(&current));
  if (current != *device) HOCCL_CUDA_RETURN(cudaSetDevice(*device));
#else
  (void)stream;
  HOCCL_CUDA_RETURN(cudaGetDevice(device));
#endif
  return "";
}

}  // namespace

ExecStatus RunOnCuda(Communicator& comm, const OpSpec& spec, cudaStream_t stream, const void* input,
                     void* output, int lane, const std::string& user_op, const Announce* announce) {
  const std::string op_name = user_op.empty() ? std::string(OpName(spec.op)) : user_op;
  const char* op = op_name.c_str();
  std::string err = comm.Broken();
  if (!err.empty()) return {ErrorKind::kDeadline, err};
  err = ValidateSpec(spec);
  if (err.empty() && (lane < 0 || lane >= kLanes))
    err = "lane " + std::to_string(lane) + " out of range";
  if (!err.empty())
    return {ErrorKind::kInvalidArgument, std::string("jax_hoccl ") + op + ": " + err};
  HOCCL_TRACE("%s rank %d/%d: enter, %zu bytes, stream %p, in %p out %p\n", op, spec.rank,
              spec.group_size, spec.bytes, static_cast<void*>(stream), input, output);
  const DriverApi& api = GetDriverApi();
  HOCCL_TRACE("driver api: write %p wait %p batch %p err '%s'\n",
              reinterpret_cast<void*>(api.write_value64), reinterpret_cast<void*>(api.wait_value64),
              reinterpret_cast<void*>(api.batch_mem_op), api.error.c_str());
  if (!api.error.empty())
    return {ErrorKind::kUnavailable, std::string("jax_hoccl ") + op + ": " + api.error};

  int device = -1;
  err = CurrentDevice(stream, &device);
  if (!err.empty()) return {ErrorKind::kInternal, std::string("jax_hoccl ") + op + ": " + err};
  const std::string prefix = Prefix(spec, op, device);
  HOCCL_TRACE("%s rank %d: CUDA device %d\n", op, spec.rank, device);
  // Peers in this process: their buffers' addresses are ours. Else the node's IPC transport.
  static const long long spin_us = EnvInt("JAX_HOCCL_SPIN_US", kDefaultSpinMicros, 0);
  DirectTransport direct(comm, spin_us);
  std::unique_ptr<PeerTransport> ipc;
  if (!AllLocal(comm.device_ids())) {
    err = IpcTransport::Make(comm, device, op, &ipc);
    if (!err.empty()) return {ErrorKind::kUnavailable, prefix + err};
  }
  PeerTransport& transport = ipc ? *ipc : static_cast<PeerTransport&>(direct);

  RankState& st = RankStateFor(&comm, spec.rank);
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (!st.ready && st.setup_error.empty()) {
      err = SetupRank(st, transport, spec, device, stream);
      if (err.empty())
        st.ready = true;
      else
        st.setup_error = err;
      HOCCL_TRACE("%s rank %d: setup flags %p -> '%s'\n", op, spec.rank,
                  static_cast<void*>(st.flags), err.c_str());
    }
    if (!st.ready) {
      ErrorKind k = comm.Broken().empty() ? ErrorKind::kInternal : ErrorKind::kDeadline;
      return {k, prefix + st.setup_error};
    }
  }

  const int n = spec.group_size, r = spec.rank;
  std::vector<Step> steps;
  {
    HostTimer timer("plan");
    PlanOptions options = ChooseCudaPlanOptions(spec);
    if (announce) {  // one flag per chunk, one stream (cuda_executor.h: Announce)
      const size_t block = BlockBytes(spec);
      if (announce->bytes == 0 || block % announce->bytes)
        return {ErrorKind::kInvalidArgument,
                std::string("jax_hoccl ") + op + ": announced rows of " +
                    std::to_string(announce->bytes) + " bytes do not divide a block of " +
                    std::to_string(block)};
      options.chunks = static_cast<int>(block / announce->bytes);
      options.channels = 1;
    }
    steps = MakePlan(spec, options);
  }
  std::vector<char> involved(n, 0);
  bool multi = false;
  for (const Step& s : steps) {
    if (s.peer != r && s.kind != StepKind::kZero) involved[s.peer] = 1;
    if (s.kind == StepKind::kCopy && s.channel != 0) multi = true;
  }
  std::vector<int> peers;
  for (int k = 1; k < n; ++k)  // rotated, like the plan
    if (involved[(r + k) % n]) peers.push_back((r + k) % n);

  // Host rendezvous with every peer involved *before* enqueueing anything: a peer that never
  // comes is reported here (JAX_HOCCL_TIMEOUT_S) instead of hanging a device-side wait.
  const uint64_t seq = comm.NextSeq(r);
  std::vector<const void*> inputs(n, nullptr);
  inputs[r] = input;
  {
    HostTimer timer("rendezvous");  // mostly waiting for the peers' handler threads
    const std::string what = op_name + " of " + std::to_string(spec.bytes) + " bytes (lane " +
                             std::to_string(lane) + ")";
    err = transport.ExchangeBuffers(seq, r, input, output, peers, &inputs, op, what);
  }
  if (!err.empty()) return {ErrorKind::kDeadline, err};
  HOCCL_TRACE("%s rank %d: seq %llu rendezvous done, %zu steps, multi %d\n", op, r,
              static_cast<unsigned long long>(seq), steps.size(), multi ? 1 : 0);

  CallContext ctx{api, spec, steps, stream, inputs, output, st, seq + 1, lane, announce};
  HostTimer enqueue_timer(multi ? "enqueue multi-stream" : "enqueue one stream");
  if (multi) {
    DeviceResources& res = ResourcesFor(device);
    std::lock_guard<std::mutex> lock(res.mu);
    err = InitResources(res);
    if (err.empty()) err = EnqueueMultiStream(ctx, res);
  } else {
    err = EnqueueSingleStream(ctx);
  }
  transport.Release(seq, r);
  HOCCL_TRACE("%s rank %d: seq %llu enqueued '%s'\n", op, r, static_cast<unsigned long long>(seq),
              err.c_str());
  if (!err.empty()) return {ErrorKind::kInternal, prefix + err};
  return ExecStatus::Ok();
}

}  // namespace hoccl
