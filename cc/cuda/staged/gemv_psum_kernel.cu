#include "cuda/staged/gemv_psum_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <utility>

#include "cuda/staged/kernel_common.cuh"
#include "cuda/staged/packed_kernel.h"
#include "cuda/staged/packed_lines.cuh"

namespace hoccl {
namespace {

using namespace staged_device;

// A thread multiplies 8 columns of a slab (16 bytes of a row of w) by a lane of rows: the
// CTA's 8 column groups x 32 row lanes. A warp's load is 4 rows x 128 contiguous bytes.
constexpr int kColsPerThread = 8;
constexpr int kColGroups = kGemvSlabCols / kColsPerThread;
constexpr int kRowLanes = kThreads / kColGroups;
constexpr int kWarps = kThreads / 32;
// Rows a thread loads at a time (x's 4 elements of them in one 8-byte load), and how many
// such loads it keeps in flight: 16 loads of 16 bytes, so a CTA alone keeps the SM's share
// of the memory busy.
constexpr int kRowsPerLoad = 4;
constexpr int kLoadsInFlight = 4;
constexpr int kStepRows = kRowLanes * kRowsPerLoad * kLoadsInFlight;
// A slab's row of 16-bit elements is this many lines (8 data bytes each).
constexpr int kLinesPerRow = kGemvSlabCols * 2 / 8;
static_assert(kRowLanes * kColGroups == kThreads && kRowLanes % 4 == 0,
              "a warp holds whole column groups of 4 row lanes (the shuffles below)");

// w is read once: past L1.
__device__ __forceinline__ uint4 LoadOnce(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Two 16-bit elements (the low one first) as floats, and back.
template <typename T>
__device__ __forceinline__ float2 Unpack(uint32_t v);
template <>
__device__ __forceinline__ float2 Unpack<__nv_bfloat16>(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 Unpack<__half>(uint32_t v) {
  __half2 h;
  *reinterpret_cast<uint32_t*>(&h) = v;
  return __half22float2(h);
}
template <typename T>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  const T a = FromFloat<T>(lo), b = FromFloat<T>(hi);
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&a)) |
         static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&b)) << 16;
}

// acc[m][c] = this thread's rows of x[m] . w[:, col + c] (float32).
template <typename T, int M>
__device__ __forceinline__ void MultiplySlab(const GemvOperands& g, size_t col,
                                             float (&acc)[M][kColsPerThread]) {
  const int lane = threadIdx.x / kColGroups;
  const T* x = static_cast<const T*>(g.x);
  const T* w = static_cast<const T*>(g.w) + col;
  const int k = g.k;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) acc[m][c] = 0.f;
  for (int base = 0; base < k; base += kStepRows) {
    uint4 wv[kLoadsInFlight][kRowsPerLoad];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int row0 = base + (u * kRowLanes + lane) * kRowsPerLoad;  // k % 4 == 0: all 4 in
#pragma unroll
      for (int j = 0; j < kRowsPerLoad; ++j)
        wv[u][j] =
            row0 < k ? LoadOnce(w + static_cast<size_t>(row0 + j) * g.n) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int row0 = base + (u * kRowLanes + lane) * kRowsPerLoad;
      if (row0 >= k) break;
      float xs[M][kRowsPerLoad];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint2 v =
            __ldg(reinterpret_cast<const uint2*>(x + static_cast<size_t>(m) * k + row0));
        const float2 a = Unpack<T>(v.x), b = Unpack<T>(v.y);
        xs[m][0] = a.x;
        xs[m][1] = a.y;
        xs[m][2] = b.x;
        xs[m][3] = b.y;
      }
#pragma unroll
      for (int j = 0; j < kRowsPerLoad; ++j) {
        const uint32_t words[4] = {wv[u][j].x, wv[u][j].y, wv[u][j].z, wv[u][j].w};
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const float2 wf = Unpack<T>(words[h]);
#pragma unroll
          for (int m = 0; m < M; ++m) {
            acc[m][2 * h] = fmaf(xs[m][j], wf.x, acc[m][2 * h]);
            acc[m][2 * h + 1] = fmaf(xs[m][j], wf.y, acc[m][2 * h + 1]);
          }
        }
      }
    }
  }
}

// Waits for line `line` of `sender`'s block in my slot and takes its data; false if the
// watchdog broke the group meanwhile. `offset`: the sender's offset - 1 from me.
__device__ bool TakeLine(const StagedKernelArgs& a, int set, int sender, int offset, size_t line,
                         uint32_t flag, uint2* data) {
  const char* at = PackedSlot(a.layout, a.rank, a.n, set, sender) + 16 * line;
  uint32_t seen = 0;
  StallClock clock;
  for (int spins = 0;; ++spins) {
    const uint4 v = LoadLine(at);
    if (LineArrived(v, flag, &seen)) {
      *data = make_uint2(v.x, v.z);
      return true;
    }
    if (spins % kSpinsPerBrokenCheck == kSpinsPerBrokenCheck - 1 &&
        !clock.Tick(a, offset, PackedFlagValue(seen), PackedFlagValue(flag)))
      return false;
  }
}

template <typename T, int M>
__global__ void __launch_bounds__(kThreads)
    GemvPsumKernel(const StagedKernelArgs a, const GemvOperands g) {
  const int n = a.n, r = a.rank;
  const uint32_t flag = PackedFlag(a.value);
  const int slabs = g.n / kGemvSlabCols;
  T* out = reinterpret_cast<T*>(a.out);
  __shared__ float partial[kWarps][M][kGemvSlabCols];
  __shared__ int call_set;
  if (threadIdx.x == 0) call_set = CallSet(a);
  __syncthreads();
  const int set = call_set;
  // The line of element (m, slab column q * 4) of the [M, N] block.
  auto line_of = [&](int slab, int m, int q) {
    return (static_cast<size_t>(m) * g.n + static_cast<size_t>(slab) * kGemvSlabCols) / 4 + q;
  };
  // 1. My slabs, each pushed to every peer (and kept in `out`) as soon as it is summed over
  //    the CTA: pushes never wait, so a slab's lines travel while the next one multiplies.
  for (int slab = blockIdx.x; slab < slabs; slab += gridDim.x) {
    float acc[M][kColsPerThread];
    const int group = threadIdx.x % kColGroups;
    MultiplySlab<T, M>(g, static_cast<size_t>(slab) * kGemvSlabCols + group * kColsPerThread, acc);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
        float v = acc[m][c];
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (lane < kColGroups) partial[warp][m][group * kColsPerThread + c] = v;
      }
    __syncthreads();
    for (int i = threadIdx.x; i < M * kLinesPerRow; i += kThreads) {
      const int m = i / kLinesPerRow, q = i % kLinesPerRow;
      float s[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[c] = partial[0][m][4 * q + c];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) s[c] += partial[w][m][4 * q + c];
      }
      const uint2 d = make_uint2(Pack<T>(s[0], s[1]), Pack<T>(s[2], s[3]));
      const size_t line = line_of(slab, m, q);
      for (int k = 1; k < n; ++k)
        StoreLine(PackedSlot(a.layout, (r + k) % n, n, set, r) + 16 * line, d, flag);
      *reinterpret_cast<uint2*>(out + 4 * line) = d;
    }
    __syncthreads();
  }
  // 2. My slabs' lines from every peer, added in rank order (float32, one rounding: the packed
  //    psum's order), my own from `out`; then the lines read are zeroed (packed_kernel.h).
  const int mine = (slabs - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;
  bool ok = true;
  for (int i = threadIdx.x; ok && i < mine * M * kLinesPerRow; i += kThreads) {
    const int slab = blockIdx.x + (i / (M * kLinesPerRow)) * gridDim.x;
    const int m = (i % (M * kLinesPerRow)) / kLinesPerRow, q = i % kLinesPerRow;
    const size_t line = line_of(slab, m, q);
    float sum[4];
    for (int s = 0; ok && s < n; ++s) {
      uint2 d;
      if (s == r)
        d = *reinterpret_cast<const uint2*>(out + 4 * line);
      else
        ok = TakeLine(a, set, s, (s - r + n) % n - 1, line, flag, &d);
      const float2 lo = Unpack<T>(d.x), hi = Unpack<T>(d.y);
      const float v[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
      for (int c = 0; c < 4; ++c) sum[c] = s ? sum[c] + v[c] : v[c];
    }
    if (!ok) break;
    *reinterpret_cast<uint2*>(out + 4 * line) =
        make_uint2(Pack<T>(sum[0], sum[1]), Pack<T>(sum[2], sum[3]));
    for (int s = 0; s < n; ++s)
      if (s != r) StoreLine(PackedSlot(a.layout, r, n, set, s) + 16 * line, make_uint2(0, 0), 0);
  }
  __syncthreads();
  FinishCall(a);
}

using Kernel = void (*)(const StagedKernelArgs, const GemvOperands);

template <typename T, int... Ms>
Kernel KernelFor(int m, std::integer_sequence<int, Ms...>) {
  Kernel k = nullptr;
  ((m == Ms + 1 ? (k = GemvPsumKernel<T, Ms + 1>, 0) : 0), ...);
  return k;
}

Kernel KernelFor(const GemvOperands& g) {
  const auto rows = std::make_integer_sequence<int, kGemvMaxRows>();
  return g.type == SumType::kBF16 ? KernelFor<__nv_bfloat16>(g.m, rows)
                                  : KernelFor<__half>(g.m, rows);
}

}  // namespace

const char* GemvPsumRefuses(const GemvOperands& g) {
  if (g.type != SumType::kBF16 && g.type != SumType::kF16) return "x and w are not bf16 or f16";
  if (g.m < 1 || g.m > kGemvMaxRows) return "x has more rows than a GEMV";
  if (g.k < 4 || g.k % 4) return "K is not a multiple of 4";
  if (g.n < kGemvSlabCols || g.n % kGemvSlabCols) return "N is not a multiple of 64";
  return nullptr;
}

cudaError_t LoadGemvPsumKernel() {
  const auto rows = std::make_integer_sequence<int, kGemvMaxRows>();
  for (int m = 1; m <= kGemvMaxRows; ++m) {
    cudaFuncAttributes attr;
    for (Kernel k : {KernelFor<__nv_bfloat16>(m, rows), KernelFor<__half>(m, rows)}) {
      cudaError_t e = cudaFuncGetAttributes(&attr, k);
      if (e != cudaSuccess) return e;
    }
  }
  return cudaSuccess;
}

cudaError_t LaunchGemvPsumKernel(const StagedKernelArgs& args, const GemvOperands& g, int device,
                                 cudaStream_t stream) {
  static thread_local int sms_of[64] = {};
  int sms = device >= 0 && device < 64 ? sms_of[device] : 0;
  if (!sms) {
    cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return e;
    if (device >= 0 && device < 64) sms_of[device] = sms;
  }
  const int slabs = g.n / kGemvSlabCols;
  const int most = sms / args.n > 0 ? sms / args.n : 1;
  const int per = (slabs + most - 1) / most;
  const int ctas = (slabs + per - 1) / per;
  KernelFor(g)<<<ctas, kThreads, 0, stream>>>(args, g);
  return cudaGetLastError();
}

}  // namespace hoccl
