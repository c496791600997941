// How fast a number of CTAs read a matrix from HBM, by how wide a block of each row a CTA reads
// (the rest of its share split over rows): 64 MiB, a [4096, 8192] bf16 weight, read by 64 or 128
// CTAs of 256 threads, each thread keeping U 16-byte loads in flight; then two such reads at
// once on two streams, as two ranks sharing a GPU run their GEMVs. What a GEMV kernel of a
// given grid can draw before any arithmetic (docs/design.md, "Decode: the GEMV inside the
// psum's exchange").
//
//   nvcc -std=c++17 -arch=sm_90a -O3 benchmarks/probe_read_bandwidth.cu -o
//   /tmp/probe_read_bandwidth /tmp/probe_read_bandwidth
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr int kThreads = 256;
constexpr int kRows = 4096, kRowBytes = 8192 * 2;

// CTA b reads `width` bytes of each row in its share of the rows (`split` shares).
template <int U>
__global__ void __launch_bounds__(kThreads)
    Read(const char* w, int width, int split, unsigned* sink) {
  const int blocks = kRowBytes / width;
  const int block = blockIdx.x % blocks, share = blockIdx.x / blocks;
  const int rows = kRows / split, first = share * rows;
  const int per_row = width / 16, rows_per_pass = kThreads / per_row;
  const char* base = w + static_cast<size_t>(block) * width + (threadIdx.x % per_row) * 16;
  unsigned acc = 0;
  for (int r = first + threadIdx.x / per_row; r < first + rows; r += rows_per_pass * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int row = r + u * rows_per_pass;
      v[u] = make_uint4(0, 0, 0, 0);
      if (row < first + rows)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                     : "l"(base + static_cast<size_t>(row) * kRowBytes));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

void Launch(int u, int grid, cudaStream_t s, const char* w, int width, int split, unsigned* sink) {
  if (u == 4) Read<4><<<grid, kThreads, 0, s>>>(w, width, split, sink);
  if (u == 8) Read<8><<<grid, kThreads, 0, s>>>(w, width, split, sink);
  if (u == 16) Read<16><<<grid, kThreads, 0, s>>>(w, width, split, sink);
}

}  // namespace

int main() {
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  char* w[2];
  unsigned* sink;
  for (char*& m : w) {
    cudaMalloc(&m, bytes);
    cudaMemset(m, 1, bytes);
  }
  cudaMalloc(&sink, sizeof(unsigned));
  cudaStream_t s[2];
  for (cudaStream_t& st : s) cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaEvent_t begin, end, other;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  cudaEventCreate(&other);
  const int reps = 20;
  for (int streams : {1, 2}) {
    for (int target : {64, 128}) {
      for (int width = 128; width <= 4096; width *= 2) {
        const int blocks = kRowBytes / width, split = target / blocks > 0 ? target / blocks : 1;
        const int grid = blocks * split;
        for (int u : {4, 8, 16}) {
          auto run = [&] {
            for (int k = 0; k < streams; ++k) Launch(u, grid, s[k], w[k], width, split, sink);
          };
          for (int i = 0; i < 3; ++i) run();
          cudaDeviceSynchronize();
          cudaEventRecord(begin, s[0]);
          cudaStreamWaitEvent(s[1], begin);
          for (int i = 0; i < reps; ++i) run();
          cudaEventRecord(other, s[1]);
          cudaStreamWaitEvent(s[0], other);
          cudaEventRecord(end, s[0]);
          cudaEventSynchronize(end);
          float ms = 0;
          cudaEventElapsedTime(&ms, begin, end);
          const double us = ms * 1e3 / reps;
          printf(
              "streams %d grid %4d each, width %5d B, split %3d, U %2d: %7.2f us  %5.2f TB/s  %s\n",
              streams, grid, width, split, u, us, streams * bytes / us / 1e6,
              cudaGetErrorString(cudaGetLastError()));
        }
      }
    }
  }
  return 0;
}
