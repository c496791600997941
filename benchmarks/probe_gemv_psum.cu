// matmul_psum's GEMV kernel (cc/cuda/staged/gemv_psum_kernel.h) without JAX: two ranks in one
// process on one GPU, each on a stream of its own, their packed slots in device memory, calling
// the kernel back to back (slot sets alternating as the staged path's do); times a call of both
// ranks at once for decode's shapes (x [M, 4096] per rank, w [4096, 8192] bf16, M = 1 and 8),
// and checks that both ranks hold the same bits and the sum of their products. Waits that never
// end are broken after 10 s (the kernel's broken word), so a protocol bug fails
// instead of hanging.
//
//   XLA_FFI=$(python -c "import jax.ffi; print(jax.ffi.include_dir())")
//   nvcc -std=c++17 -arch=sm_90a -O3 -Icc -I$XLA_FFI benchmarks/probe_gemv_psum.cu \
//     cc/cuda/staged/gemv_psum_kernel.cu -o /tmp/probe_gemv_psum
//   /tmp/probe_gemv_psum
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/staged/exchange_kernel.h"
#include "cuda/staged/gemv_psum_kernel.h"

using namespace hoccl;

namespace {

constexpr int kRanks = 2, kK = 4096, kN = 8192, kCalls = 200;

// Small integers / 16: every product and sum below is exact in float32.
float Value(size_t i, unsigned seed) {
  unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return static_cast<int>(h % 9 - 4) / 16.0f;
}

std::vector<__nv_bfloat16> Host(size_t count, unsigned seed) {
  std::vector<__nv_bfloat16> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = __float2bfloat16(Value(i, seed));
  return v;
}

struct Rank {
  char* region;  // its packed slots: 2 sets x kRanks senders
  __nv_bfloat16 *x, *w, *out;
  unsigned* counters;      // ctas_done, then the captured count
  StagedHostWords* words;  // mapped host memory: the broken word, the stall reports
  StagedHostWords* words_device;
};

}  // namespace

int main() {
  cudaError_t e = LoadGemvPsumKernel();
  if (e != cudaSuccess) {
    printf("loading the kernel: %s\n", cudaGetErrorString(e));
    return 1;
  }
  cudaStream_t streams[kRanks];
  for (cudaStream_t& s : streams) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int failed = 0;
  for (int m : {1, 8}) {
    const size_t block = static_cast<size_t>(m) * kN * 2, slot = (2 * block + 255) / 256 * 256;
    Rank ranks[kRanks];
    std::vector<std::vector<__nv_bfloat16>> xs, ws;
    for (int r = 0; r < kRanks; ++r) {
      Rank& k = ranks[r];
      xs.push_back(Host(static_cast<size_t>(m) * kK, 11 + r));
      ws.push_back(Host(static_cast<size_t>(kK) * kN, 71 + r));
      cudaMalloc(&k.region, 2 * kRanks * slot);
      cudaMemset(k.region, 0, 2 * kRanks * slot);
      cudaMalloc(&k.x, xs[r].size() * 2);
      cudaMalloc(&k.w, ws[r].size() * 2);
      cudaMalloc(&k.out, block);
      cudaMemcpy(k.x, xs[r].data(), xs[r].size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(k.w, ws[r].data(), ws[r].size() * 2, cudaMemcpyHostToDevice);
      cudaMalloc(&k.counters, 2 * sizeof(unsigned));
      cudaMemset(k.counters, 0, 2 * sizeof(unsigned));
      cudaHostAlloc(&k.words, sizeof(StagedHostWords), cudaHostAllocMapped);
      memset(static_cast<void*>(k.words), 0, sizeof(StagedHostWords));
      cudaHostGetDevicePointer(&k.words_device, k.words, 0);
    }
    auto call = [&](int c) {
      for (int r = 0; r < kRanks; ++r) {
        StagedKernelArgs a = {};
        a.out = reinterpret_cast<char*>(ranks[r].out);
        a.block = block;
        a.value = kFlagMark | uint64_t{1} << kFlagOpShift | uint64_t{2} << kFlagSumShift | block;
        a.kind = StagedKind::kGather;
        a.n = kRanks;
        a.rank = r;
        a.set = c & 1;
        a.ctas_done = ranks[r].counters;
        a.captured_count = ranks[r].counters + 1;
        a.broken = &ranks[r].words_device->broken;
        a.host = ranks[r].words_device;
        for (int q = 0; q < kRanks; ++q) a.layout.base[q] = ranks[q].region;
        a.layout.packed_slot_bytes = slot;
        const GemvOperands g{ranks[r].x, ranks[r].w, m, kK, kN, SumType::kBF16};
        cudaError_t le = LaunchGemvPsumKernel(a, g, 0, streams[r]);
        if (le != cudaSuccess) printf("launch: %s\n", cudaGetErrorString(le));
      }
    };
    // A watchdog of our own: breaks every rank's waits if the calls take 10 s.
    std::atomic<bool> done{false};
    std::thread watchdog([&] {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!done && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (!done)
        for (Rank& k : ranks) k.words->broken = 1;
    });
    for (int c = 0; c < 10; ++c) call(c);
    cudaDeviceSynchronize();
    cudaEvent_t begin, end, other;
    cudaEventCreate(&begin);
    cudaEventCreate(&end);
    cudaEventCreate(&other);
    cudaEventRecord(begin, streams[0]);
    cudaStreamWaitEvent(streams[1], begin);
    for (int c = 10; c < 10 + kCalls; ++c) call(c);
    cudaEventRecord(other, streams[1]);
    cudaStreamWaitEvent(streams[0], other);
    cudaEventRecord(end, streams[0]);
    cudaEventSynchronize(end);
    done = true;
    watchdog.join();
    float ms = 0;
    cudaEventElapsedTime(&ms, begin, end);
    // Both ranks' results, against the exact sum of the two products (rounded once per rank's
    // product and once for the sum, as the kernel rounds).
    std::vector<std::vector<__nv_bfloat16>> outs(kRanks, std::vector<__nv_bfloat16>(block / 2));
    for (int r = 0; r < kRanks; ++r)
      cudaMemcpy(outs[r].data(), ranks[r].out, block, cudaMemcpyDeviceToHost);
    int differ = 0, wrong = 0;
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < kN; ++j) {
        float want = 0;
        for (int r = 0; r < kRanks; ++r) {
          double p = 0;
          for (int k = 0; k < kK; ++k)
            p += static_cast<double>(__bfloat162float(xs[r][static_cast<size_t>(i) * kK + k])) *
                 __bfloat162float(ws[r][static_cast<size_t>(k) * kN + j]);
          want += __bfloat162float(__float2bfloat16(static_cast<float>(p)));
        }
        const size_t at = static_cast<size_t>(i) * kN + j;
        const float got = __bfloat162float(outs[0][at]);
        differ += memcmp(&outs[0][at], &outs[1][at], 2) != 0;
        wrong += std::fabs(got - __bfloat162float(__float2bfloat16(want))) > 0;
      }
    failed += differ || wrong || ranks[0].words->broken;
    printf(
        "M %d: %7.2f us a call of both ranks at once; ranks differ at %d, wrong at %d of %d; "
        "%s%s\n",
        m, ms * 1e3 / kCalls, differ, wrong, m * kN, cudaGetErrorString(cudaGetLastError()),
        ranks[0].words->broken ? "; WAITS BROKEN AFTER 10 s" : "");
  }
  return failed ? 1 : 0;
}
