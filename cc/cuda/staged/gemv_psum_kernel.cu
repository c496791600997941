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
// A tile: the rows of a slab that the CTA multiplies at a time, each thread a run of 4
// consecutive rows (x's 4 elements of them in one 8-byte load). A thread copies its tile's
// 16-byte pieces of w into its own part of a ring of tiles in shared memory (cp.async),
// kStages - 1 tiles ahead of the one it multiplies, so the memory is kept busy while it
// computes; no thread reads another's pieces, so the ring needs no barrier. Two CTAs fit an
// SM (one alone cannot draw its share of the memory's bandwidth).
constexpr int kRun = 4;
constexpr int kRunsPerTile = 1;
constexpr int kPiecesPerTile = kRun * kRunsPerTile;
constexpr int kTileRows = kRowLanes * kPiecesPerTile;
constexpr int kStages = 4;
constexpr size_t kRingBytes = size_t{kStages} * kPiecesPerTile * kThreads * 16;
// A slab's row of 16-bit elements is this many lines (8 data bytes each).
constexpr int kLinesPerRow = kGemvSlabCols * 2 / 8;
static_assert(kRowLanes * kColGroups == kThreads && kRowLanes % 4 == 0,
              "a warp holds whole column groups of 4 row lanes (the shuffles below)");

// 16 bytes from global memory into shared memory, asynchronously (zeros where `bytes` is 0).
__device__ __forceinline__ void CopyPiece(uint4* dst, const void* src, int bytes) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void CommitPieces() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WaitPieces() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
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

// The rows of w a thread takes in tile `tile` of its slab: runs of kRun from this row.
__device__ __forceinline__ int RunRow(int tile, int run, int lane) {
  return tile * kTileRows + (run * kRowLanes + lane) * kRun;
}

// acc[m][c] += x[m] . w[:, col + c] over this thread's rows of the tile whose pieces are `ring`
// (k % 4 == 0: a run is all in or all out).
template <typename T, int M>
__device__ __forceinline__ void MultiplyTile(const GemvOperands& g, int tile, const uint4* ring,
                                             float (&acc)[M][kColsPerThread]) {
  const int lane = threadIdx.x / kColGroups;
  const T* x = static_cast<const T*>(g.x);
#pragma unroll
  for (int run = 0; run < kRunsPerTile; ++run) {
    const int row0 = RunRow(tile, run, lane);
    if (row0 >= g.k) break;
    float xs[M][kRun];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint2 v =
          __ldg(reinterpret_cast<const uint2*>(x + static_cast<size_t>(m) * g.k + row0));
      const float2 a = Unpack<T>(v.x), b = Unpack<T>(v.y);
      xs[m][0] = a.x;
      xs[m][1] = a.y;
      xs[m][2] = b.x;
      xs[m][3] = b.y;
    }
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      const uint4 p = ring[(run * kRun + j) * kThreads];
      const uint32_t words[4] = {p.x, p.y, p.z, p.w};
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

// One CTA per slab of kGemvSlabCols columns: it multiplies its slab, then pushes it to every
// peer (and keeps it in `out`). Pushes never wait. Only the last `summers` CTAs to finish their
// slab wait: for every peer's lines, which they add to the whole block. So at most `summers`
// CTAs of a rank hold SMs while they wait, and every other CTA, of every rank, still finds one
// (forward progress: LaunchGemvPsumKernel keeps the ranks' summers to half the SMs).
template <typename T, int M>
__global__ void __launch_bounds__(kThreads, 2)
    GemvPsumKernel(const StagedKernelArgs a, const GemvOperands g, int summers) {
  const int n = a.n, r = a.rank, slab = blockIdx.x;
  const uint32_t flag = PackedFlag(a.value);
  T* out = reinterpret_cast<T*>(a.out);
  __shared__ float partial[kWarps][M][kGemvSlabCols];
  __shared__ int call_set;
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) call_set = CallSet(a);
  // 1. My slab, tile by tile through the ring.
  extern __shared__ uint4 ring[];  // [kStages][kPiecesPerTile][kThreads]
  const int group = threadIdx.x % kColGroups, lane = threadIdx.x / kColGroups;
  const T* w = static_cast<const T*>(g.w) + static_cast<size_t>(slab) * kGemvSlabCols +
               group * kColsPerThread;
  const int tiles = (g.k + kTileRows - 1) / kTileRows;
  auto slot_of = [&](int t) {
    return ring + static_cast<size_t>(t % kStages) * kPiecesPerTile * kThreads + threadIdx.x;
  };
  auto fetch = [&](int t) {  // tile t's pieces into its ring slot (an empty group past the end)
    if (t < tiles) {
#pragma unroll
      for (int run = 0; run < kRunsPerTile; ++run) {
        const int row0 = RunRow(t, run, lane);
#pragma unroll
        for (int j = 0; j < kRun; ++j)
          CopyPiece(slot_of(t) + (run * kRun + j) * kThreads,
                    row0 < g.k ? w + static_cast<size_t>(row0 + j) * g.n : g.w,
                    row0 < g.k ? 16 : 0);
      }
    }
    CommitPieces();
  };
  for (int t = 0; t < kStages - 1; ++t) fetch(t);
  float acc[M][kColsPerThread] = {};
  for (int t = 0; t < tiles; ++t) {
    fetch(t + kStages - 1);
    WaitPieces<kStages - 1>();  // tile t's pieces are in
    MultiplyTile<T, M>(g, t, slot_of(t), acc);
  }
  // 2. The slab summed over the CTA, rounded, pushed as lines to every peer and kept in `out`.
  const int warp_lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) {
      float v = acc[m][c];
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (warp_lane < kColGroups) partial[warp][m][group * kColsPerThread + c] = v;
    }
  __syncthreads();
  const int set = call_set;
  // The line of element (m, column 4 q of the slab) of the [M, N] block.
  auto line_of = [&](int m, int q) {
    return (static_cast<size_t>(m) * g.n + static_cast<size_t>(slab) * kGemvSlabCols) / 4 + q;
  };
  for (int i = threadIdx.x; i < M * kLinesPerRow; i += kThreads) {
    const int m = i / kLinesPerRow, q = i % kLinesPerRow;
    float s[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[c] = partial[0][m][4 * q + c];
#pragma unroll
      for (int v = 1; v < kWarps; ++v) s[c] += partial[v][m][4 * q + c];
    }
    const uint2 d = make_uint2(Pack<T>(s[0], s[1]), Pack<T>(s[2], s[3]));
    const size_t line = line_of(m, q);
    for (int k = 1; k < n; ++k)
      StoreLine(PackedSlot(a.layout, (r + k) % n, n, set, r) + 16 * line, d, flag);
    *reinterpret_cast<uint2*>(out + 4 * line) = d;
  }
  // 3. A ticket on the lane's CTA count: the last `summers` to take one wait until every CTA of
  //    the grid took its own (its slab is in `out` then: its fence came before), then for every
  //    peer's lines, and add them in rank order (float32, one rounding: the packed psum's
  //    order), my own partial from `out`; they zero the lines they read (packed_kernel.h) and
  //    count themselves again, and the last of them reports the call done. Only they wait, and
  //    the CTAs they wait for never do.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    ticket = atomicAdd(a.ctas_done, 1u);
  }
  __syncthreads();
  const int first = static_cast<int>(gridDim.x) - summers;
  if (static_cast<int>(ticket) < first) return;
  // The rest of my grid never waits, so this wait ends; it still gives way to the watchdog
  // (whatever broke the group, the counter is left as a call that ends leaves it).
  __shared__ bool grid_in;
  if (threadIdx.x == 0) {
    bool in = true;
    for (int spins = 1; *reinterpret_cast<volatile unsigned*>(a.ctas_done) < gridDim.x; ++spins) {
      __nanosleep(100);
      if (spins % kSpinsPerBrokenCheck == 0 && *a.broken) {
        in = false;
        break;
      }
    }
    __threadfence();
    grid_in = in;
  }
  __syncthreads();
  const size_t lines = static_cast<size_t>(M) * g.n / 4;
  bool ok = grid_in;
  for (size_t line = (ticket - first) * static_cast<size_t>(kThreads) + threadIdx.x;
       ok && line < lines; line += static_cast<size_t>(summers) * kThreads) {
    float sum[4];
    for (int s = 0; ok && s < n; ++s) {
      uint2 d;
      if (s == r)
        d = __ldcg(reinterpret_cast<const uint2*>(out + 4 * line));
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
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(a.ctas_done, 1u) == gridDim.x + summers - 1) {
      *a.ctas_done = 0;
      ReportCallDone(a);
    }
  }
}

using Kernel = void (*)(const StagedKernelArgs, const GemvOperands, int);

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
      if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(kRingBytes));
      // Shared memory before L1, so that two CTAs (their rings) fit an SM.
      if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
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
  // Waiting CTAs: where the n ranks share a GPU, theirs together hold half its SMs at most,
  // a quarter of its places for CTAs (two an SM); so even four times n ranks on one GPU (other
  // groups') leave their GEMVs' other CTAs places to run.
  const int slabs = g.n / kGemvSlabCols;
  int summers = sms / (2 * args.n);
  if (summers < 1) summers = 1;
  if (summers > slabs) summers = slabs;
  KernelFor(g)<<<slabs, kThreads, kRingBytes, stream>>>(args, g, summers);
  return cudaGetLastError();
}

}  // namespace hoccl
