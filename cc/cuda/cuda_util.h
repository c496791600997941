// Small helpers every file of the CUDA engine uses: CUDA errors as strings, integer
// environment variables, and JAX_HOCCL_DEBUG's trace lines.
#ifndef JAX_HOCCL_CUDA_UTIL_H_
#define JAX_HOCCL_CUDA_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace hoccl {

inline std::string CudaError(const char* call, cudaError_t e) {
  return std::string(call) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

// An integer >= `min` from the environment, or `fallback` (environment.py rejects malformed
// values at the first lowering, before any handler runs).
inline long long EnvInt(const char* name, long long fallback, long long min = 1) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && x >= min) ? x : fallback;
}

inline bool DebugEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_HOCCL_DEBUG");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

}  // namespace hoccl

// Returns the error string of a failed CUDA runtime call from a function returning string.
#define HOCCL_CUDA_RETURN(call)                                              \
  do {                                                                       \
    cudaError_t hoccl_e_ = (call);                                           \
    if (hoccl_e_ != cudaSuccess) return ::hoccl::CudaError(#call, hoccl_e_); \
  } while (0)

#define HOCCL_TRACE(...)                                \
  do {                                                  \
    if (::hoccl::DebugEnabled()) {                      \
      std::fprintf(stderr, "[jax_hoccl] " __VA_ARGS__); \
      std::fflush(stderr);                              \
    }                                                   \
  } while (0)

#endif  // JAX_HOCCL_CUDA_UTIL_H_
