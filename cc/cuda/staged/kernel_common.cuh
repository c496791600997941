// Device code both staged exchange kernels share (exchange_kernel.cu, packed_kernel.cu): the
// call's slot set, stall reports to the watchdog, copies, element conversions for sums, and
// the grid's last CTA reporting the call done.
#ifndef JAX_HOCCL_STAGED_KERNEL_COMMON_CUH_
#define JAX_HOCCL_STAGED_KERNEL_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/staged/exchange_kernel.h"

namespace hoccl {
namespace staged_device {

constexpr int kThreads = 256;
// How often a waiting thread looks at the watchdog's broken word.
constexpr int kSpinsPerBrokenCheck = 256;
constexpr uint64_t kStallReportNs = 1000000000ull;  // first report after a second
constexpr uint64_t kStallBeatNs = 100000000ull;     // then every 100 ms

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A wait's clock: Tick() every kSpinsPerBrokenCheck spins says whether to give up (the
// watchdog broke the group), and past a second reports to the host what the wait sees.
struct StallClock {
  uint64_t start = 0, beat = 0;
  // false: the group is broken, abandon the wait. `sender`: the peer's offset - 1 from me.
  __device__ bool Tick(const StagedKernelArgs& a, int sender, uint64_t seen, uint64_t expected) {
    if (*a.broken) return false;
    const uint64_t now = GlobalTimer();
    if (!start) start = now;
    if (now - start >= kStallReportNs && now - beat >= kStallBeatNs) {
      beat = now;
      a.host->stall_sender = sender;
      a.host->stall_seen = seen;
      a.host->stall_expected = expected;
      a.host->stall_tag = a.tag;
      __threadfence_system();
      a.host->stall_beats = a.host->stall_beats + 1;
    }
    return true;
  }
};

// The call's slot set (thread 0; the CTA shares it). A captured call's is the parity of the
// count of captured calls: my earlier captured kernels, which counted themselves, ended before
// this one started.
__device__ __forceinline__ int CallSet(const StagedKernelArgs& a) {
  return a.captured ? a.layout.captured_set + static_cast<int>(*a.captured_count & 1) : a.set;
}

// This CTA's part of a copy: 16-byte words when both ends allow, bytes for the rest.
__device__ inline void CopyPart(char* dst, const char* src, size_t begin, size_t end) {
  if (begin >= end) return;
  dst += begin;
  src += begin;
  const size_t bytes = end - begin;
  size_t done = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const size_t words = bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    size_t i = threadIdx.x;
    for (; i + 3 * kThreads < words; i += 4 * kThreads) {
      const uint4 a = s[i], b = s[i + kThreads], c = s[i + 2 * kThreads], e = s[i + 3 * kThreads];
      d[i] = a;
      d[i + kThreads] = b;
      d[i + 2 * kThreads] = c;
      d[i + 3 * kThreads] = e;
    }
    for (; i < words; i += kThreads) d[i] = s[i];
    done = words * 16;
  }
  for (size_t i = done + threadIdx.x; i < bytes; i += kThreads) dst[i] = src[i];
}

// Element conversions of the summed exchanges: float32 accumulation, one rounding at the end.
__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// The call's last CTA: counts a captured call and reports an uncaptured one's progress to the
// host.
__device__ inline void ReportCallDone(const StagedKernelArgs& a) {
  if (a.captured) *a.captured_count += 1;  // read by the next captured call's kernel
  // The count needs no fence: the next captured call's kernel follows in stream order. The
  // host's progress word does (the watchdog reads it from the host).
  if (a.progress_value) {
    __threadfence_system();
    a.host->progress[a.lane] = a.progress_value;
  }
}

// After the CTA's last barrier, thread 0: the grid's last CTA (a count of them; one CTA alone
// needs none) reports the call done.
__device__ inline void FinishCall(const StagedKernelArgs& a) {
  if (threadIdx.x != 0 || !(a.progress_value || a.captured)) return;
  bool last = gridDim.x == 1;
  if (!last) {
    __threadfence();
    last = atomicAdd(a.ctas_done, 1u) == gridDim.x - 1;
    if (last) *a.ctas_done = 0;
  }
  if (last) ReportCallDone(a);
}

}  // namespace staged_device
}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_KERNEL_COMMON_CUH_
