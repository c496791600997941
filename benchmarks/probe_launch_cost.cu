// Host time of one kernel launch, by the kernel's parameter size and the API: the runtime's
// <<<>>> against the driver's cuLaunchKernel (resolved through the runtime, no libcuda link).
// An empty kernel, launched back to back on one stream and timed on the host: what a staged
// call's launch costs before any of jax_hoccl's own work. Run it alone, then as several
// clients of one MPS daemon at once.
//
//   nvcc -std=c++17 -arch=sm_90a -O2 benchmarks/probe_launch_cost.cu -o /tmp/probe_launch_cost
//   /tmp/probe_launch_cost [launches]
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

using Clock = std::chrono::steady_clock;
using LaunchFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void**, void**);

template <int Bytes>
struct Params {
  char bytes[Bytes];
};

// Reads its parameters so they are passed; never prints (no thread has index 999).
template <int Bytes>
__global__ void Empty(Params<Bytes> p) {
  if (p.bytes[0] == 123 && threadIdx.x == 999) printf("x");
}

double UsPerLaunch(Clock::time_point t0, Clock::time_point t1, int launches) {
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / launches;
}

template <int Bytes>
void Measure(cudaStream_t s, LaunchFn driver_launch, int launches, int ctas) {
  Params<Bytes> p = {};
  for (int i = 0; i < 200; ++i) Empty<Bytes><<<ctas, 128, 0, s>>>(p);  // warm
  cudaStreamSynchronize(s);
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < launches; ++i) Empty<Bytes><<<ctas, 128, 0, s>>>(p);
  const Clock::time_point t1 = Clock::now();
  cudaStreamSynchronize(s);
  const Clock::time_point t2 = Clock::now();
  cudaFunction_t f;
  cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(Empty<Bytes>));
  void* args[] = {&p};
  for (int i = 0; i < launches; ++i)
    driver_launch(reinterpret_cast<CUfunction>(f), ctas, 1, 1, 128, 1, 1, 0,
                  reinterpret_cast<CUstream>(s), args, nullptr);
  const Clock::time_point t3 = Clock::now();
  cudaStreamSynchronize(s);
  const Clock::time_point t4 = Clock::now();
  std::printf(
      "params %5d B ctas %3d: runtime %.2f us/launch (%.2f with drain), driver %.2f us/launch "
      "(%.2f)\n",
      Bytes, ctas, UsPerLaunch(t0, t1, launches), UsPerLaunch(t0, t2, launches),
      UsPerLaunch(t2, t3, launches), UsPerLaunch(t2, t4, launches));
}

}  // namespace

int main(int argc, char** argv) {
  const int launches = argc > 1 ? std::atoi(argv[1]) : 2000;
  cudaSetDevice(0);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuLaunchKernel", &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "cuLaunchKernel not found\n");
    return 1;
  }
  const LaunchFn driver_launch = reinterpret_cast<LaunchFn>(fn);
  for (int round = 0; round < 2; ++round) {
    Measure<16>(s, driver_launch, launches, 1);
    Measure<128>(s, driver_launch, launches, 1);
    Measure<304>(s, driver_launch, launches, 1);  // the exchange kernel's parameters
    Measure<304>(s, driver_launch, launches, 32);
    Measure<1024>(s, driver_launch, launches, 1);
    Measure<4000>(s, driver_launch, launches, 1);
  }
  return 0;
}
