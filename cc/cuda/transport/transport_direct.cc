#include "cuda/transport/transport_direct.h"

#include <cuda_runtime_api.h>

#include <chrono>

namespace hoccl {

std::string DirectTransport::ExchangeFlags(int rank, uint64_t* my_flags,
                                           std::vector<uint64_t*>* all, const char* op) {
  std::vector<void*> values;
  std::string err = comm_.ExchangeSetup("cuda_flags", rank, my_flags, &values, op);
  if (!err.empty()) return err;
  all->resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) (*all)[i] = static_cast<uint64_t*>(values[i]);
  return "";
}

std::string DirectTransport::ExchangeBuffers(
    uint64_t seq, int rank, const void* input, void* /*output: pulls need only inputs*/,
    const std::vector<int>& peers, std::vector<const void*>* inputs, const char* op,
    const std::string& /*what: one program, one process*/) {
  comm_.Arrive(seq, rank, input);
  // The peers' handler threads usually arrive within microseconds: spin a little before
  // sleeping on the condition variable (a futex wake-up costs tens of microseconds, which
  // would dominate a small collective).
  const long long spin_us = spin_us_;
  for (int p : peers) {
    if (spin_us > 0 && !comm_.HasArrived(seq, p)) {
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
      while (!comm_.HasArrived(seq, p) && std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
    }
    std::string err = comm_.WaitArrived(seq, rank, p, op);
    if (!err.empty()) return err;
    (*inputs)[p] = comm_.Input(seq, p);
  }
  return "";
}

void DirectTransport::Release(uint64_t seq, int rank) { comm_.Leave(seq, rank); }

std::string DirectTransport::AllocFlags(size_t bytes, void** flags) {
  cudaError_t e = cudaMalloc(flags, bytes);
  if (e != cudaSuccess)
    return std::string("cudaMalloc(flags) failed: ") + cudaGetErrorName(e) + ": " +
           cudaGetErrorString(e);
  return "";
}

}  // namespace hoccl
