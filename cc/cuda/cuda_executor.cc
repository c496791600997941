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

#include "cuda/cuda_util.h"
#include "cuda/driver_api.h"
#include "cuda/rank_state.h"
#include "cuda/staged/staged_exchange.h"
#include "cuda/stream_mem_ops.h"
#include "host_profile.h"
#include "job.h"

namespace hoccl {

// ---------------------------------------------------------------- options

size_t BlockBytes(const OpSpec& spec) {
  if (spec.op == OpKind::kAllToAll) return spec.group_size > 0 ? spec.bytes / spec.group_size : 0;
  return spec.bytes;
}

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

}  // namespace

ExecStatus RunOnCuda(Communicator& comm, const OpSpec& spec, cudaStream_t stream, const void* input,
                     void* output, int lane, const OpLabel& label, const Announce* announce,
                     const GemvOperands* gemv) {
  std::string err = comm.Broken();
  if (!err.empty()) return {ErrorKind::kDeadline, err};
  err = ValidateSpec(spec);
  if (err.empty() && (lane < 0 || lane >= kLanes))
    err = "lane " + std::to_string(lane) + " out of range";
  if (!err.empty()) return {ErrorKind::kInvalidArgument, "jax_hoccl " + label.Name() + ": " + err};
  HOCCL_TRACE("%s rank %d/%d: enter, %zu bytes, stream %p, in %p out %p\n", label.mover, spec.rank,
              spec.group_size, spec.bytes, static_cast<void*>(stream), input, output);
  const DriverApi& api = GetDriverApi();
  HOCCL_TRACE("driver api: write %p wait %p batch %p err '%s'\n",
              reinterpret_cast<void*>(api.write_value64), reinterpret_cast<void*>(api.wait_value64),
              reinterpret_cast<void*>(api.batch_mem_op), api.error.c_str());
  if (!api.error.empty())
    return {ErrorKind::kUnavailable, "jax_hoccl " + label.Name() + ": " + api.error};

  int device = -1;
  bool capturing = false;
  RankState* rs = nullptr;
  err = RankStateOn(comm, spec, stream, label, &rs, &device, &capturing);
  if (!err.empty()) {
    if (device < 0) return {ErrorKind::kInternal, "jax_hoccl " + label.Name() + ": " + err};
    ErrorKind k = comm.Broken().empty() ? ErrorKind::kInternal : ErrorKind::kDeadline;
    return {k, Prefix(spec, label.Name().c_str(), device) + err};
  }
  HOCCL_TRACE("%s rank %d: CUDA device %d\n", label.mover, spec.rank, device);
  RankState& st = *rs;
  // Async starts are staged where the exchange kernel serves (staged_exchange.h), else they
  // keep the zero-copy path; announced rows (a flagged GEMM waits for each chunk's flag)
  // always do.
  if (!announce && (lane == 0 || StagedKernelServes(spec.group_size)) && st.progress &&
      StagedEligible(spec))
    return RunStaged(comm, st, spec, stream, capturing, input, output, lane, label, gemv);
  const std::string op_name = label.Name();
  const char* op = op_name.c_str();
  if (spec.sum != SumType::kNone)  // the lowering picks summed targets for staged blocks only
    return {ErrorKind::kInvalidArgument,
            Prefix(spec, op, device) +
                "a sum inside the exchange runs on the staged path only, which this call cannot "
                "take (JAX_HOCCL_STAGED_BYTES differs from the lowering's, or this GPU cannot "
                "write mapped host memory from a stream)"};
  if (capturing)
    return {ErrorKind::kInternal,
            Prefix(spec, op, device) +
                "a zero-copy call (blocks above JAX_HOCCL_STAGED_BYTES) meets its peers on the "
                "host at every call and cannot be captured into a CUDA graph"};
  PeerTransport& transport = *st.transport;

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
    const std::string what = op_name + " of " + std::to_string(spec.bytes) + " bytes" +
                             (*label.type ? std::string(" of ") + label.type : std::string()) +
                             " (lane " + std::to_string(lane) + ")";
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
  if (!err.empty()) return {ErrorKind::kInternal, Prefix(spec, op, device) + err};
  return ExecStatus::Ok();
}

}  // namespace hoccl
