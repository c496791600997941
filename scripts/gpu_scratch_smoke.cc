// Scratch: the CUDA executor without XLA. Two host threads (one per GPU) run RunOnCuda with
// the real communicator on their own streams; checks bytes and times chains of ops.
//   g++ -std=c++17 -O2 -g -Icc -I/usr/local/cuda/include scripts/gpu_scratch_smoke.cc
//     cc/cuda_executor.cc cc/driver_api.cc cc/plan.cc cc/communicator.cc
//     -L/usr/local/cuda/lib64 -lcudart_static -ldl -lrt -lpthread -o /tmp/smoke
#include <cuda_runtime_api.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "communicator.h"
#include "cuda_executor.h"
#include "plan.h"

using namespace hoccl;

static void OnSegv(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "SIGNAL %d, backtrace:\n", sig);
  backtrace_symbols_fd(frames, n, 2);
  _exit(128 + sig);
}

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      _exit(2);                                                                        \
    }                                                                                  \
  } while (0)

static unsigned char Pattern(int rank, size_t i) { return (unsigned char)(i * 7 + rank * 13 + 1); }

int main(int argc, char** argv) {
  signal(SIGSEGV, OnSegv);
  signal(SIGABRT, OnSegv);
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  const int n = ndev >= 2 ? 2 : ndev;
  printf("smoke: %d devices, using %d\n", ndev, n);
  std::vector<int64_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(i);
  Communicator& comm = GetCommunicator("cuda-smoke", ids);
  int failures = 0;
  const size_t sizes[] = {4000, (3u << 20) + 14, 64u << 20};
  for (size_t bytes : sizes) {
    for (int opi = 0; opi < 3; ++opi) {
      OpKind op = static_cast<OpKind>(opi);
      size_t in_bytes = op == OpKind::kAllToAll ? bytes / n * n : bytes;
      std::vector<void*> in(n), out(n);
      std::vector<cudaStream_t> st(n);
      OpSpec base{op, n, 0, in_bytes, {}};
      if (op == OpKind::kPermute) for (int r = 0; r < n; ++r) base.permute_dst.push_back((r + 1) % n);
      size_t out_bytes = OutputBytes(base);
      for (int r = 0; r < n; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaMalloc(&in[r], in_bytes));
        CK(cudaMalloc(&out[r], out_bytes));
        CK(cudaMemset(out[r], 0xEE, out_bytes));
        std::vector<unsigned char> h(in_bytes);
        for (size_t i = 0; i < in_bytes; ++i) h[i] = Pattern(r, i);
        CK(cudaMemcpy(in[r], h.data(), in_bytes, cudaMemcpyHostToDevice));
        CK(cudaStreamCreateWithFlags(&st[r], cudaStreamNonBlocking));
      }
      const int iters = bytes > (16u << 20) ? 20 : 200;
      std::vector<double> secs(n);
      std::vector<std::string> errs(n);
      auto body = [&](int r) {
        CK(cudaSetDevice(r));
        OpSpec spec = base;
        spec.rank = r;
        auto one = [&]() {
          ExecStatus s = RunOnCuda(comm, spec, st[r], in[r], out[r]);
          if (!s.ok()) errs[r] = s.message;
          return s.ok();
        };
        if (!one()) return;
        CK(cudaStreamSynchronize(st[r]));
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventRecord(e0, st[r]));
        for (int i = 0; i < iters; ++i)
          if (!one()) return;
        CK(cudaEventRecord(e1, st[r]));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        secs[r] = ms * 1e-3 / iters;
      };
      std::vector<std::thread> th;
      for (int r = 0; r < n; ++r) th.emplace_back(body, r);
      for (auto& t : th) t.join();
      bool ok = true;
      for (int r = 0; r < n; ++r) {
        if (!errs[r].empty()) { printf("  error rank %d: %s\n", r, errs[r].c_str()); ok = false; continue; }
        CK(cudaSetDevice(r));
        std::vector<unsigned char> h(out_bytes);
        CK(cudaMemcpy(h.data(), out[r], out_bytes, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < out_bytes && ok; ++i) {
          unsigned char want;
          if (op == OpKind::kAllGather) want = Pattern(i / in_bytes, i % in_bytes);
          else if (op == OpKind::kPermute) want = Pattern((r + n - 1) % n, i);
          else { size_t b = in_bytes / n; int src = i / b; want = Pattern(src, r * b + i % b); }
          if (h[i] != want) { printf("  MISMATCH rank %d byte %zu: %d != %d\n", r, i, h[i], want); ok = false; }
        }
      }
      failures += !ok;
      double t = secs[0] > secs[n - 1] ? secs[0] : secs[n - 1];
      printf("smoke %-10s %10zu B/rank  %s  %9.1f us/op  %7.1f GB/s (input bytes / time)\n", OpName(op),
             in_bytes, ok ? "OK  " : "FAIL", t * 1e6, in_bytes / t / 1e9);
      fflush(stdout);
      for (int r = 0; r < n; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaFree(in[r]));
        CK(cudaFree(out[r]));
        CK(cudaStreamDestroy(st[r]));
      }
    }
  }
  printf("smoke: %s, live slots %zu\n", failures ? "FAILED" : "all OK", LiveSlotCount());
  return failures ? 1 : 0;
}
