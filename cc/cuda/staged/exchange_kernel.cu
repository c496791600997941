#include "cuda/staged/exchange_kernel.h"

#include "cuda/staged/kernel_common.cuh"
#include "plan.h"

namespace hoccl {
namespace {

using namespace staged_device;

__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelease(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// This CTA's part of out = src[0] + src[1] + ... + src[n - 1], a left fold in rank order (the
// order of ops/common.py's sum_leading, so the bits match the XLA path's and are the same on
// every rank): 16-byte words when every end allows, elements for the rest. A thread takes
// kSumWords words at a time and loads two sources' at once: the sum is bound by load latency
// (a few CTAs per call), not by bandwidth.
constexpr int kSumWords = 8;
template <typename T>
__device__ void SumPart(char* out, const char* const* src, int n, size_t begin, size_t end) {
  if (begin >= end) return;
  constexpr int kPer = 16 / sizeof(T);
  size_t done = begin;
  uintptr_t align = reinterpret_cast<uintptr_t>(out + begin);
  for (int s = 0; s < n; ++s) align |= reinterpret_cast<uintptr_t>(src[s] + begin);
  if ((align & 15) == 0) {
    const size_t words = (end - begin) / 16;
    for (size_t i = threadIdx.x; i < words; i += kSumWords * kThreads) {
      float acc[kSumWords][kPer];
      // Two sources' loads in flight at once (one round trip for two ranks), added in order.
      for (int s = 0; s < n; s += 2) {
        const bool pair = s + 1 < n;
        const uint4* from = reinterpret_cast<const uint4*>(src[s] + begin);
        const uint4* next = reinterpret_cast<const uint4*>(src[pair ? s + 1 : s] + begin);
        uint4 w[kSumWords], v[kSumWords];
#pragma unroll
        for (int u = 0; u < kSumWords; ++u) {
          if (i + u * kThreads >= words) continue;
          w[u] = from[i + u * kThreads];
          if (pair) v[u] = next[i + u * kThreads];
        }
#pragma unroll
        for (int u = 0; u < kSumWords; ++u) {
          const T* e = reinterpret_cast<const T*>(&w[u]);
          const T* f = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
          for (int j = 0; j < kPer; ++j) {
            acc[u][j] = s ? acc[u][j] + ToFloat(e[j]) : ToFloat(e[j]);
            if (pair) acc[u][j] = acc[u][j] + ToFloat(f[j]);
          }
        }
      }
      uint4* to = reinterpret_cast<uint4*>(out + begin);
#pragma unroll
      for (int u = 0; u < kSumWords; ++u) {
        if (i + u * kThreads >= words) break;
        uint4 w;
        T* e = reinterpret_cast<T*>(&w);
#pragma unroll
        for (int j = 0; j < kPer; ++j) e[j] = FromFloat<T>(acc[u][j]);
        to[i + u * kThreads] = w;
      }
    }
    done = begin + words * 16;
  }
  for (size_t at = done + threadIdx.x * sizeof(T); at < end; at += kThreads * sizeof(T)) {
    float acc = ToFloat(*reinterpret_cast<const T*>(src[0] + at));
    for (int s = 1; s < n; ++s) acc += ToFloat(*reinterpret_cast<const T*>(src[s] + at));
    *reinterpret_cast<T*>(out + at) = FromFloat<T>(acc);
  }
}

// Thread 0 waits until *flag == value, then resets it. Returns false if the watchdog broke
// the group meanwhile (the wait is abandoned).
__device__ bool WaitAndReset(uint64_t* flag, uint64_t value, int sender,
                             const StagedKernelArgs& a) {
  StallClock clock;
  for (int spins = 0;; ++spins) {
    const uint64_t seen = LoadAcquire(flag);
    if (seen == value) break;
    if (spins % kSpinsPerBrokenCheck == kSpinsPerBrokenCheck - 1 &&
        !clock.Tick(a, sender, seen, value))
      return false;
  }
  *flag = 0;
  return true;
}

__device__ __forceinline__ uint64_t* Flag(const StagedKernelLayout& l, int owner, int n, int set,
                                          int sender) {
  return reinterpret_cast<uint64_t*>(l.base[owner] + l.flags) +
         (static_cast<size_t>(set) * n + sender) * kChunkFlags;
}

__device__ __forceinline__ char* Slot(const StagedKernelLayout& l, int owner, int n, int set,
                                      int sender) {
  return l.base[owner] + l.slots + (static_cast<size_t>(set) * n + sender) * l.slot_bytes;
}

// Thread 0 raises flags `set` of every peer for me (value), then waits for and resets every
// peer's in mine; false if the watchdog broke the group meanwhile.
__device__ bool Meet(const StagedKernelArgs& a, int set, int c) {
  const int n = a.n, r = a.rank;
  for (int k = 1; k < n; ++k) StoreRelease(Flag(a.layout, (r + k) % n, n, set, r) + c, a.value);
  for (int k = 1; k < n; ++k)
    if (!WaitAndReset(Flag(a.layout, r, n, set, (r + k) % n) + c, a.value, k - 1, a)) return false;
  return true;
}

__global__ void __launch_bounds__(kThreads) ExchangeKernel(const StagedKernelArgs a) {
  const int c = blockIdx.x, n = a.n, r = a.rank;
  const size_t begin = static_cast<size_t>(c) * a.chunk;
  const size_t end = begin + a.chunk < a.block ? begin + a.chunk : a.block;
  const bool all_to_all = a.kind == StagedKind::kAllToAll;
  __shared__ bool ok;
  __shared__ int set;
  if (threadIdx.x == 0) set = CallSet(a);
  __syncthreads();
  // My block into every peer's slot, and my own.
  if (a.kind == StagedKind::kPermute) {
    if (a.permute_dst == r)
      CopyPart(a.out, a.in, begin, end);
    else if (a.permute_dst >= 0)
      CopyPart(Slot(a.layout, a.permute_dst, n, set, r), a.in, begin, end);
  } else {
    for (int k = 1; k < n; ++k) {
      const int d = (r + k) % n;
      CopyPart(Slot(a.layout, d, n, set, r), a.in + (all_to_all ? d * a.block : 0), begin, end);
    }
    if (!a.skip_own && !a.sum)
      CopyPart(a.out + r * a.block, a.in + (all_to_all ? r * a.block : 0), begin, end);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the pushes (every thread's, ordered by the barrier) first
    ok = Meet(a, set, c);
  }
  __syncthreads();
  if (ok) {  // out of my slots
    if (a.kind == StagedKind::kPermute) {
      if (a.permute_src >= 0 && a.permute_src != r)
        CopyPart(a.out, Slot(a.layout, r, n, set, a.permute_src), begin, end);
    } else if (a.sum) {
      const char* src[kKernelMaxRanks];
      for (int s = 0; s < n; ++s)
        src[s] = s == r ? a.in + (all_to_all ? r * a.block : 0) : Slot(a.layout, r, n, set, s);
      switch (static_cast<SumType>(a.sum)) {
        case SumType::kF32: SumPart<float>(a.out, src, n, begin, end); break;
        case SumType::kBF16: SumPart<__nv_bfloat16>(a.out, src, n, begin, end); break;
        case SumType::kF16: SumPart<__half>(a.out, src, n, begin, end); break;
        default: break;
      }
    } else {
      for (int k = 1; k < n; ++k) {
        const int d = (r + k) % n;
        CopyPart(a.out + d * a.block, Slot(a.layout, r, n, set, d), begin, end);
      }
    }
  }
  if (a.kind == StagedKind::kPermute && a.permute_src < 0)
    for (size_t i = begin + threadIdx.x; i < end; i += kThreads) a.out[i] = 0;
  __syncthreads();
  FinishCall(a);
}

}  // namespace

cudaError_t LoadExchangeKernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, ExchangeKernel);
}

cudaError_t LaunchExchangeKernel(const StagedKernelArgs& args, int ctas, cudaStream_t stream) {
  ExchangeKernel<<<ctas, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace hoccl
