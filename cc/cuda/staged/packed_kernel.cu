#include "cuda/staged/packed_kernel.h"

#include "cuda/staged/kernel_common.cuh"
#include "cuda/staged/packed_lines.cuh"
#include "plan.h"

namespace hoccl {
namespace {

using namespace staged_device;

// Lines (16 bytes: two 8-byte words, each 4 bytes of data and the flag) a thread moves of
// each block: a CTA's chunk is kLines * kThreads lines.
constexpr int kLines = 4;
constexpr size_t kChunkLines = kPackedChunkBytes / 8;
static_assert(kChunkLines == kLines * kThreads, "a CTA's chunk is its threads' lines");

// Bytes [off, off + 8) of a block of `bytes` (zero past its end).
__device__ __forceinline__ uint2 LoadData(const char* block, size_t off, size_t bytes) {
  const char* p = block + off;
  if (off + 8 <= bytes && (reinterpret_cast<uintptr_t>(p) & 7) == 0)
    return *reinterpret_cast<const uint2*>(p);
  uint64_t v = 0;
  for (int b = 0; b < 8 && off + b < bytes; ++b)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[b])) << (8 * b);
  return make_uint2(static_cast<uint32_t>(v), static_cast<uint32_t>(v >> 32));
}

__device__ __forceinline__ void StoreData(char* block, size_t off, size_t bytes, uint2 d) {
  char* p = block + off;
  if (off + 8 <= bytes && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
    *reinterpret_cast<uint2*>(p) = d;
    return;
  }
  const uint64_t v = d.x | static_cast<uint64_t>(d.y) << 32;
  for (int b = 0; b < 8 && off + b < bytes; ++b) p[b] = static_cast<char>(v >> (8 * b));
}

// A thread's lines of a block: line first + j * kThreads for j < count.
struct Lines {
  size_t first;
  int count;
  __device__ size_t At(int j) const { return first + static_cast<size_t>(j) * kThreads; }
};

// Waits until each of my lines in `slot` holds `flag` in both words and takes their data;
// false if the watchdog broke the group meanwhile. `sender`: the peer's offset - 1 from me.
__device__ bool ReadLines(const char* slot, Lines my, uint32_t flag, int sender,
                          const StagedKernelArgs& a, uint2* data) {
  unsigned pending = (1u << my.count) - 1;
  uint32_t seen = 0;
  StallClock clock;
  for (int spins = 0; pending; ++spins) {
#pragma unroll
    for (int j = 0; j < kLines; ++j) {
      if (!((pending >> j) & 1)) continue;
      const uint4 v = LoadLine(slot + 16 * my.At(j));
      if (LineArrived(v, flag, &seen)) {
        data[j] = make_uint2(v.x, v.z);
        pending &= ~(1u << j);
      }
    }
    if (pending && spins % kSpinsPerBrokenCheck == kSpinsPerBrokenCheck - 1 &&
        !clock.Tick(a, sender, PackedFlagValue(seen), PackedFlagValue(flag)))
      return false;
  }
  return true;
}

// My lines of `slot` read: zero again, so that none holds a flag before its next writer's
// store (two calls later, after this kernel ended).
__device__ __forceinline__ void ZeroLines(char* slot, Lines my) {
  for (int j = 0; j < my.count; ++j) StoreLine(slot + 16 * my.At(j), make_uint2(0, 0), 0);
}

// out = the sum of every rank's block in rank order (float32, one rounding), my own from
// `own`: the order of ops/common.py's sum_leading, as the exchange kernel's SumPart.
template <typename T>
__device__ bool SumLines(const StagedKernelArgs& a, int set, Lines my, uint32_t flag,
                         const char* own) {
  constexpr int kPer = 8 / sizeof(T);
  const int n = a.n, r = a.rank;
  float acc[kLines][kPer];
  for (int s = 0; s < n; ++s) {
    uint2 data[kLines];
    if (s == r) {
      for (int j = 0; j < my.count; ++j) data[j] = LoadData(own, 8 * my.At(j), a.block);
    } else if (!ReadLines(PackedSlot(a.layout, r, n, set, s), my, flag, (s - r + n) % n - 1, a,
                          data)) {
      return false;
    }
#pragma unroll
    for (int j = 0; j < kLines; ++j) {
      if (j >= my.count) break;
      const T* e = reinterpret_cast<const T*>(&data[j]);
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[j][i] = s ? acc[j][i] + ToFloat(e[i]) : ToFloat(e[i]);
    }
  }
#pragma unroll
  for (int j = 0; j < kLines; ++j) {
    if (j >= my.count) break;
    uint2 d;
    T* e = reinterpret_cast<T*>(&d);
#pragma unroll
    for (int i = 0; i < kPer; ++i) e[i] = FromFloat<T>(acc[j][i]);
    StoreData(a.out, 8 * my.At(j), a.block, d);
  }
  return true;
}

__global__ void __launch_bounds__(kThreads) PackedKernel(const StagedKernelArgs a) {
  const int n = a.n, r = a.rank;
  const bool all_to_all = a.kind == StagedKind::kAllToAll;
  const uint32_t flag = PackedFlag(a.value);
  // This CTA's lines [begin, end), taken kChunkLines (kLines per thread) at a time.
  const size_t lines = (a.block + 7) / 8, per_cta = a.chunk / 8;
  const size_t begin = blockIdx.x * per_cta;
  const size_t end = begin + per_cta < lines ? begin + per_cta : lines;
  auto lines_from = [&](size_t pass) {
    Lines my{pass + threadIdx.x, 0};
    while (my.count < kLines && my.At(my.count) < end) ++my.count;
    return my;
  };
  __shared__ int call_set;
  if (threadIdx.x == 0) call_set = CallSet(a);
  __syncthreads();
  const int set = call_set;
  // My block into every peer's slot, data and flag in each word; and my own.
  const char* own = a.in + (all_to_all ? r * a.block : 0);
  for (size_t pass = begin; pass < end; pass += kChunkLines) {
    const Lines my = lines_from(pass);
    for (int k = 1; k < n; ++k) {
      const int d = (r + k) % n;
      const char* src = a.in + (all_to_all ? d * a.block : 0);
      char* slot = PackedSlot(a.layout, d, n, set, r);
      for (int j = 0; j < my.count; ++j)
        StoreLine(slot + 16 * my.At(j), LoadData(src, 8 * my.At(j), a.block), flag);
    }
    if (!a.skip_own && !a.sum)
      for (int j = 0; j < my.count; ++j)
        StoreData(a.out + r * a.block, 8 * my.At(j), a.block, LoadData(own, 8 * my.At(j), a.block));
  }
  // Every peer's block out of my slots as its words arrive (or summed).
  bool ok = true;
  for (size_t pass = begin; ok && pass < end; pass += kChunkLines) {
    const Lines my = lines_from(pass);
    if (a.sum) {
      switch (static_cast<SumType>(a.sum)) {
        case SumType::kF32: ok = SumLines<float>(a, set, my, flag, own); break;
        case SumType::kBF16: ok = SumLines<__nv_bfloat16>(a, set, my, flag, own); break;
        case SumType::kF16: ok = SumLines<__half>(a, set, my, flag, own); break;
        default: break;
      }
      for (int s = 0; ok && s < n; ++s)
        if (s != r) ZeroLines(PackedSlot(a.layout, r, n, set, s), my);
      continue;
    }
    for (int k = 1; ok && k < n; ++k) {
      const int s = (r + k) % n;
      char* slot = PackedSlot(a.layout, r, n, set, s);
      uint2 data[kLines];
      ok = ReadLines(slot, my, flag, k - 1, a, data);
      if (!ok) break;
      for (int j = 0; j < my.count; ++j)
        StoreData(a.out + s * a.block, 8 * my.At(j), a.block, data[j]);
      ZeroLines(slot, my);
    }
  }
  __syncthreads();
  FinishCall(a);
}

}  // namespace

cudaError_t LoadPackedKernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, PackedKernel);
}

cudaError_t LaunchPackedKernel(const StagedKernelArgs& args, int ctas, cudaStream_t stream) {
  PackedKernel<<<ctas, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace hoccl
