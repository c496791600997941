#include "cuda/staged/staged_exchange.h"

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/driver_api.h"
#include "cuda/staged/exchange_kernel.h"
#include "cuda/staged/staged_layout.h"
#include "cuda/staged/watchdog.h"
#include "cuda/stream_mem_ops.h"
#include "host_profile.h"

namespace hoccl {
namespace {

constexpr uint64_t kSizeMask = (uint64_t{1} << 48) - 1;

std::atomic<uint64_t> g_captured_calls{0};

struct CopyList {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> bytes;
  void Add(void* d, const void* s, size_t b) {
    dst.push_back(d);
    src.push_back(s);
    bytes.push_back(b);
  }
};

// The copies, as one host call where there are several (cudaMemcpyBatchAsync, sources read in
// stream order) unless `batch` is false (under stream capture: a graph node per copy).
// `kind`: cudaMemcpyDeviceToDevice within my device (no pointer lookup), else cudaMemcpyDefault.
std::string Enqueue(CopyList& copies, cudaStream_t stream, cudaMemcpyKind kind, bool batch) {
  if (copies.dst.empty()) return "";
  HostTimer timer("api: staged copies");
#if CUDART_VERSION >= 13000
  if (batch && copies.dst.size() > 1) {
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attr_index = 0;
    HOCCL_CUDA_RETURN(cudaMemcpyBatchAsync(copies.dst.data(), copies.src.data(),
                                           copies.bytes.data(), copies.dst.size(), &attr,
                                           &attr_index, 1, stream));
    return "";
  }
#endif
  for (size_t i = 0; i < copies.dst.size(); ++i)
    HOCCL_CUDA_RETURN(cudaMemcpyAsync(copies.dst[i], copies.src[i], copies.bytes[i], kind, stream));
  return "";
}

// The rank that sends to `rank` in a permute, or -1.
int PermuteSource(const OpSpec& spec, int rank) {
  for (int s = 0; s < spec.group_size; ++s)
    if (spec.permute_dst[s] == rank) return s;
  return -1;
}

}  // namespace

bool StagedKernelOn() {
  static const bool on = EnvInt("JAX_HOCCL_STAGED_KERNEL", 1, 0) != 0;
  return on;
}

uint64_t StagedCapturedCalls() { return g_captured_calls.load(); }

bool StagedEligible(const OpSpec& spec) {
  const size_t slot = StagedSlotBytes();
  if (!slot || spec.group_size < 2 || spec.peers_only || spec.at_source_slot || spec.in_place)
    return false;
  return BlockBytes(spec) <= slot;
}

uint64_t StagedFlagValue(const OpSpec& spec) {
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(spec.op) + 1) << 48 |
         (BlockBytes(spec) & kSizeMask);
}

std::string DescribeStagedFlag(uint64_t value) {
  const int op = static_cast<int>((value >> 48) & 0x7fff) - 1;
  if (!(value >> 63) || op < 0 || op > static_cast<int>(OpKind::kPermute))
    return "an unknown call (flag " + std::to_string(value) + ")";
  return std::string(OpName(static_cast<OpKind>(op))) + " of " + std::to_string(value & kSizeMask) +
         "-byte blocks";
}

ExecStatus RunStaged(Communicator& comm, RankState& st, const OpSpec& spec, cudaStream_t stream,
                     const void* input, void* output, int lane, const char* op) {
  HostTimer timer("staged");
  const int n = spec.group_size, r = spec.rank;
  const size_t block = BlockBytes(spec);
  const uint64_t value = StagedFlagValue(spec);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t ce = cudaStreamIsCapturing(stream, &capture);
  if (ce != cudaSuccess) return {ErrorKind::kInternal, CudaError("cudaStreamIsCapturing", ce)};
  // Captured into a CUDA graph: the handler runs once, its work is replayed. Nothing may
  // depend on a host-side count, so those calls take their own slot set (kCapturedSet) and
  // first meet their peers' arrival (their earlier captured calls are done with it).
  const bool captured = capture == cudaStreamCaptureStatusActive;
  if (captured && lane != 0)
    return {ErrorKind::kInternal, std::string("jax_hoccl ") + op +
                                      ": only calls on XLA's stream "
                                      "are captured into CUDA graphs"};
  StagedLaneState& sl = st.staged[lane];
  const uint64_t call = sl.calls;
  const int set = captured ? kCapturedSet : SlotSet(lane, static_cast<int>(call & 1));
  if (!captured && st.node) {  // a rank of another process gave up on the group
    std::string broken = st.node->Broken(op);
    if (!broken.empty()) {
      comm.Break(broken);
      return {ErrorKind::kDeadline, broken};
    }
  }
  if (!st.watched) {
    WatchStaged(&comm, &st, r);
    st.watched = true;
  }
  if (!captured) {
    // Far ahead of the GPU: wait for it (the watchdog's records of the oldest call stay).
    while (call - st.progress[lane] >= StagedLaneState::kNamed) {
      std::string broken = comm.Broken();
      if (!broken.empty()) return {ErrorKind::kDeadline, broken};
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    std::strncpy(sl.names[call % StagedLaneState::kNamed], op, sizeof(sl.names[0]) - 1);
    sl.values[call % StagedLaneState::kNamed] = value;
  }
  char* mine = st.peer_base[r];
  const char* in = static_cast<const char*>(input);
  char* out = static_cast<char*>(output);

  // 1. Pushes into the peers' slots, with my own block's local copy; 4. copies out of mine.
  CopyList push, pull;
  int source = -1;  // permute: who sends to me
  if (spec.op == OpKind::kPermute) {
    const int dst = spec.permute_dst[r];
    if (dst == r)
      push.Add(out, in, block);
    else if (dst >= 0)
      push.Add(StagedSlot(st.peer_base[dst], n, set, r), in, block);
    source = PermuteSource(spec, r);
    if (source >= 0 && source != r) pull.Add(out, StagedSlot(mine, n, set, source), block);
  } else {
    const bool all_to_all = spec.op == OpKind::kAllToAll;
    for (int k = 1; k < n; ++k) {
      const int d = (r + k) % n;
      push.Add(StagedSlot(st.peer_base[d], n, set, r), in + (all_to_all ? d * block : 0), block);
      pull.Add(out + d * block, StagedSlot(mine, n, set, d), block);
    }
    if (!spec.skip_own) push.Add(out + r * block, in + (all_to_all ? r * block : 0), block);
  }
  char* zero_fill = spec.op == OpKind::kPermute && source < 0 ? out : nullptr;
  int tag = -1;  // a captured call's entry in st.captured_names (watchdog messages)
  if (captured) {
    tag = static_cast<int>(st.captured_tags++ % RankState::kCapturedNames);
    std::strncpy(st.captured_names[tag], op, sizeof(st.captured_names[0]) - 1);
  }
  std::string err;
  if (n <= kKernelMaxRanks && StagedKernelOn()) {
    StagedKernelArgs a = {};
    a.block = block;
    a.value = value;
    const int ctas = ExchangeCtas(block, &a.chunk);
    a.pushes = static_cast<int>(push.dst.size());
    for (int i = 0; i < a.pushes; ++i)
      a.push[i] = {static_cast<char*>(push.dst[i]), static_cast<const char*>(push.src[i])};
    a.pulls = static_cast<int>(pull.dst.size());
    for (int i = 0; i < a.pulls; ++i)
      a.pull[i] = {static_cast<char*>(pull.dst[i]), static_cast<const char*>(pull.src[i])};
    a.peers = n - 1;
    for (int k = 1; k < n; ++k) {
      const int q = (r + k) % n;
      a.raise[k - 1] = StagedFlag(st.peer_base[q], n, set, r);
      a.wait[k - 1] = StagedFlag(mine, n, set, q);
      if (captured) {
        a.arrive_raise[k - 1] = ArrivalFlag(st.peer_base[q], n, r);
        a.arrive_wait[k - 1] = ArrivalFlag(mine, n, q);
      }
    }
    a.zero_fill = zero_fill;
    a.ctas_done = CtasDone(mine, n, lane);
    a.broken = BrokenWord(mine, n);
    a.lane = lane;
    a.progress_value = captured ? 0 : call + 1;
    a.tag = tag;
    a.host = st.host_words_device;
    HostTimer launch("api: exchange kernel");
    cudaError_t e = LaunchExchangeKernel(a, ctas, stream);
    if (e != cudaSuccess) err = CudaError("the exchange kernel's launch", e);
  } else {
    if (captured) {  // 0. every peer has arrived: its earlier captured calls left my slots
      MemOps ops(GetDriverApi(), stream);
      for (int k = 1; k < n; ++k) ops.Write(ArrivalFlag(st.peer_base[(r + k) % n], n, r), value);
      for (int k = 1; k < n; ++k) ops.Wait(ArrivalFlag(mine, n, (r + k) % n), value, true);
      for (int k = 1; k < n; ++k) ops.Write(ArrivalFlag(mine, n, (r + k) % n), 0);
      err = ops.Flush();
    }
    if (err.empty()) err = Enqueue(push, stream, cudaMemcpyDefault, /*batch=*/!captured);
    // 2-3. One batch: raise every peer's flag, wait for every peer's, reset mine; then say so.
    if (err.empty()) {
      MemOps ops(GetDriverApi(), stream);
      for (int k = 1; k < n; ++k)
        ops.Write(StagedFlag(st.peer_base[(r + k) % n], n, set, r), value);
      for (int k = 1; k < n; ++k) ops.Wait(StagedFlag(mine, n, set, (r + k) % n), value, true);
      for (int k = 1; k < n; ++k) ops.Write(StagedFlag(mine, n, set, (r + k) % n), 0);
      if (!captured) ops.WriteDevice(st.progress_device + lane * sizeof(uint64_t), call + 1);
      err = ops.Flush();
    }
    // 4. (a permute nobody sends to is zero-filled, like jax.lax's)
    if (err.empty()) err = Enqueue(pull, stream, cudaMemcpyDeviceToDevice, !captured);
    if (err.empty() && zero_fill) {
      cudaError_t e = cudaMemsetAsync(zero_fill, 0, block, stream);
      if (e != cudaSuccess) err = CudaError("cudaMemsetAsync", e);
    }
  }
  if (captured) {
    g_captured_calls.fetch_add(1);
  } else {  // counted even after an error: the watchdog sees through what was enqueued
    sl.calls = call + 1;
    sl.enqueued.store(call + 1, std::memory_order_release);
  }
  if (!err.empty()) {
    const std::string msg =
        std::string("jax_hoccl ") + op + " (rank " + std::to_string(r) + ", staged): " + err;
    comm.Break(msg);
    return {ErrorKind::kInternal, msg};
  }
  return ExecStatus::Ok();
}

}  // namespace hoccl
