#include "cuda/staged/staged_exchange.h"

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/driver_api.h"
#include "cuda/staged/exchange_kernel.h"
#include "cuda/staged/gemv_psum_kernel.h"
#include "cuda/staged/packed_kernel.h"
#include "cuda/staged/staged_layout.h"
#include "cuda/staged/watchdog.h"
#include "cuda/stream_mem_ops.h"
#include "host_profile.h"

namespace hoccl {
namespace {

std::atomic<uint64_t> g_captured_calls{0};
std::atomic<uint64_t> g_packed_calls{0};

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

// What one staged call is, for either exchange.
struct Call {
  const OpSpec& spec;
  cudaStream_t stream;
  const char* in;
  char* out;
  size_t block;
  uint64_t value;
  int set, source, captured, lane;
  uint64_t call;
  int tag;
  const GemvOperands* gemv;
};

// The exchange as one kernel (exchange_kernel.h).
std::string KernelExchange(const RankState& st, const Call& c) {
  const OpSpec& spec = c.spec;
  const int n = spec.group_size, r = spec.rank;
  StagedKernelArgs a = {};
  a.in = c.in;
  a.out = c.out;
  a.block = c.block;
  a.value = c.value;
  a.kind = spec.op == OpKind::kPermute    ? StagedKind::kPermute
           : spec.op == OpKind::kAllToAll ? StagedKind::kAllToAll
                                          : StagedKind::kGather;
  const bool packed = PackedServes(a.kind, c.block, PackedSlotBytes());
  if (c.gemv && !packed)
    return "matmul_psum's GEMV needs its block of " + std::to_string(c.block) +
           " bytes to take the packed exchange (JAX_HOCCL_STAGED_PACKED_BYTES, " +
           std::to_string(PackedSlotBytes()) + " here, differs from the lowering's?)";
  const int ctas = packed ? PackedCtas(c.block, &a.chunk) : ExchangeCtas(c.block, &a.chunk);
  if (packed) g_packed_calls.fetch_add(1);
  a.n = n;
  a.rank = r;
  a.set = c.set;
  a.skip_own = spec.skip_own;
  a.sum = static_cast<int>(spec.sum);
  a.permute_dst = spec.op == OpKind::kPermute ? spec.permute_dst[r] : -1;
  a.permute_src = c.source;
  a.captured = c.captured;
  a.lane = c.lane;
  a.tag = c.tag;
  a.progress_value = c.captured ? 0 : c.call + 1;
  char* mine = st.peer_base[r];
  a.ctas_done = CtasDone(mine, n, c.lane);
  a.captured_count = CapturedCount(mine, n);
  a.broken = &st.host_words_device->broken;
  a.host = st.host_words_device;
  a.layout = st.kernel_layout;
  HostTimer launch("api: exchange kernel");
  cudaError_t e = c.gemv   ? LaunchGemvPsumKernel(a, *c.gemv, st.device, c.stream)
                  : packed ? LaunchPackedKernel(a, ctas, c.stream)
                           : LaunchExchangeKernel(a, ctas, c.stream);
  return e == cudaSuccess ? "" : CudaError("the exchange kernel's launch", e);
}

// The exchange as copy calls and one batch of stream memory operations.
std::string CopyCallExchange(const RankState& st, const Call& c) {
  const OpSpec& spec = c.spec;
  const int n = spec.group_size, r = spec.rank, set = c.set;
  const size_t block = c.block;
  char* mine = st.peer_base[r];
  const char* in = c.in;
  char* out = c.out;
  // 1. Pushes into the peers' slots, with my own block's local copy; 4. copies out of mine.
  CopyList push, pull;
  if (spec.op == OpKind::kPermute) {
    const int dst = spec.permute_dst[r];
    if (dst == r)
      push.Add(out, in, block);
    else if (dst >= 0)
      push.Add(StagedSlot(st.peer_base[dst], n, set, r), in, block);
    if (c.source >= 0 && c.source != r) pull.Add(out, StagedSlot(mine, n, set, c.source), block);
  } else {
    const bool all_to_all = spec.op == OpKind::kAllToAll;
    for (int k = 1; k < n; ++k) {
      const int d = (r + k) % n;
      push.Add(StagedSlot(st.peer_base[d], n, set, r), in + (all_to_all ? d * block : 0), block);
      pull.Add(out + d * block, StagedSlot(mine, n, set, d), block);
    }
    if (!spec.skip_own) push.Add(out + r * block, in + (all_to_all ? r * block : 0), block);
  }
  std::string err;
  if (c.captured) {  // 0. every peer has arrived: its earlier captured calls left my slots
    MemOps ops(GetDriverApi(), c.stream);
    for (int k = 1; k < n; ++k) ops.Write(ArrivalFlag(st.peer_base[(r + k) % n], n, r), c.value);
    for (int k = 1; k < n; ++k) ops.Wait(ArrivalFlag(mine, n, (r + k) % n), c.value, true);
    for (int k = 1; k < n; ++k) ops.Write(ArrivalFlag(mine, n, (r + k) % n), 0);
    err = ops.Flush();
  }
  if (err.empty()) err = Enqueue(push, c.stream, cudaMemcpyDefault, /*batch=*/!c.captured);
  // 2-3. One batch: raise every peer's flag, wait for every peer's, reset mine; then say so.
  if (err.empty()) {
    MemOps ops(GetDriverApi(), c.stream);
    for (int k = 1; k < n; ++k)
      ops.Write(StagedFlag(st.peer_base[(r + k) % n], n, set, r), c.value);
    for (int k = 1; k < n; ++k) ops.Wait(StagedFlag(mine, n, set, (r + k) % n), c.value, true);
    for (int k = 1; k < n; ++k) ops.Write(StagedFlag(mine, n, set, (r + k) % n), 0);
    if (!c.captured) ops.WriteDevice(st.progress_device + c.lane * sizeof(uint64_t), c.call + 1);
    err = ops.Flush();
  }
  if (err.empty()) err = Enqueue(pull, c.stream, cudaMemcpyDeviceToDevice, !c.captured);
  if (err.empty() && spec.op == OpKind::kPermute && c.source < 0) {  // zero-filled, as jax.lax
    cudaError_t e = cudaMemsetAsync(out, 0, block, c.stream);
    if (e != cudaSuccess) err = CudaError("cudaMemsetAsync", e);
  }
  return err;
}

}  // namespace

bool StagedKernelServes(int n) {
  static const bool on = EnvInt("JAX_HOCCL_STAGED_KERNEL", 1, 0) != 0;
  return on && n <= kKernelMaxRanks;
}

uint64_t StagedCapturedCalls() { return g_captured_calls.load(); }
uint64_t StagedPackedCalls() { return g_packed_calls.load(); }

bool StagedEligible(const OpSpec& spec) {
  const size_t slot = StagedSlotBytes();
  if (!slot || spec.group_size < 2 || spec.peers_only || spec.at_source_slot || spec.in_place)
    return false;
  return BlockBytes(spec) <= slot;
}

// The layout: exchange_kernel.h, kFlagMark and the fields after it.
uint64_t StagedFlagValue(const OpSpec& spec) {
  return kFlagMark | (static_cast<uint64_t>(spec.op) + 1) << kFlagOpShift |
         static_cast<uint64_t>(spec.sum) << kFlagSumShift | (BlockBytes(spec) & kFlagSizeMask);
}

std::string DescribeStagedFlag(uint64_t value) {
  static const char* const kSumTypes[] = {"", "float32", "bfloat16", "float16"};
  const int op = static_cast<int>((value >> kFlagOpShift) & 0xff) - 1;
  const int sum = static_cast<int>((value >> kFlagSumShift) & 3);
  if (!(value & kFlagMark) || op < 0 || op > static_cast<int>(OpKind::kPermute) ||
      (sum && op == static_cast<int>(OpKind::kPermute)) || ((value >> (kFlagSumShift + 2)) & 0x1f))
    return "an unknown call (flag " + std::to_string(value) + ")";
  if (!sum)
    return std::string(OpName(static_cast<OpKind>(op))) + " of " +
           std::to_string(value & kFlagSizeMask) + "-byte blocks";
  const char* name = static_cast<OpKind>(op) == OpKind::kAllGather ? "psum" : "psum_scatter";
  return std::string(name) + " of " + std::to_string(value & kFlagSizeMask) + "-byte blocks of " +
         kSumTypes[sum];
}

ExecStatus RunStaged(Communicator& comm, RankState& st, const OpSpec& spec, cudaStream_t stream,
                     bool captured, const void* input, void* output, int lane, const OpLabel& label,
                     const GemvOperands* gemv) {
  HostTimer timer("staged");
  const int n = spec.group_size, r = spec.rank;
  const size_t block = BlockBytes(spec);
  const uint64_t value = StagedFlagValue(spec);
  // Captured into a CUDA graph: the handler runs once, its work is replayed. Nothing may
  // depend on a host-side count, so those calls take slot sets of their own: on the exchange
  // kernel two, by the parity of a count on the device; as copy calls one (kCapturedSet),
  // after meeting their peers' arrival (their earlier captured calls are done with it).
  if (captured && lane != 0)
    return {ErrorKind::kInternal, "jax_hoccl " + label.Name() +
                                      ": only calls on XLA's stream are captured into CUDA graphs"};
  if (spec.sum != SumType::kNone && !StagedKernelServes(n))  // (a GEMV's spec is summed)
    return {ErrorKind::kInvalidArgument,
            "jax_hoccl " + label.Name() + ": a sum inside the exchange needs the exchange " +
                "kernel (groups of at most " + std::to_string(kKernelMaxRanks) +
                " ranks, JAX_HOCCL_STAGED_KERNEL unset or 1 in every process when the program " +
                "was lowered and run)"};
  StagedLaneState& sl = st.staged[lane];
  const uint64_t call = sl.calls;
  const int set = captured ? kCapturedSet : SlotSet(lane, static_cast<int>(call & 1));
  if (!captured && st.node && st.node->Failed()) {  // a rank of another process gave up
    std::string broken = st.node->Broken(label.Name().c_str());
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
    sl.names[call % StagedLaneState::kNamed] = label;
    sl.values[call % StagedLaneState::kNamed] = value;
  }
  const int source = spec.op == OpKind::kPermute ? PermuteSource(spec, r) : -1;
  int tag = -1;  // a captured call's entry in st.captured_names (watchdog messages)
  if (captured) {
    tag = static_cast<int>(st.captured_tags++ % RankState::kCapturedNames);
    st.captured_names[tag] = label;
  }
  const Call c{spec,
               stream,
               static_cast<const char*>(input),
               static_cast<char*>(output),
               block,
               value,
               set,
               source,
               captured,
               lane,
               call,
               tag,
               gemv};
  const std::string err = StagedKernelServes(n) ? KernelExchange(st, c) : CopyCallExchange(st, c);
  if (captured) {
    g_captured_calls.fetch_add(1);
  } else {  // counted even after an error: the watchdog sees through what was enqueued
    sl.calls = call + 1;
    sl.enqueued.store(call + 1, std::memory_order_release);
  }
  if (!err.empty()) {
    const std::string msg =
        "jax_hoccl " + label.Name() + " (rank " + std::to_string(r) + ", staged): " + err;
    comm.Break(msg);
    return {ErrorKind::kInternal, msg};
  }
  return ExecStatus::Ok();
}

}  // namespace hoccl
