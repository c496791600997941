#include "driver_api.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

namespace hoccl {

namespace {

// The ABI version we ask the driver for: the CUDA 12.0 signatures (the "_v2" stream memory
// operations, which every CUDA 12/13 driver provides).
constexpr unsigned int kDriverAbiVersion = 12000;

const char* QueryResultName(cudaDriverEntryPointQueryResult r) {
  switch (r) {
    case cudaDriverEntryPointSuccess: return "found";
    case cudaDriverEntryPointSymbolNotFound: return "symbol not found";
    case cudaDriverEntryPointVersionNotSufficent: return "driver version not sufficient";
  }
  return "unknown";
}

template <typename Fn>
std::string Resolve(const char* name, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, kDriverAbiVersion, cudaEnableDefault, &status);
  if (err != cudaSuccess) {
    cudaGetLastError();  // do not leave a sticky-looking error for the next runtime call
    return std::string("cudaGetDriverEntryPointByVersion(") + name + ") failed: " +
           cudaGetErrorName(err) + ": " + cudaGetErrorString(err) +
           " (is an NVIDIA driver for CUDA >= 12 installed?)";
  }
  if (status != cudaDriverEntryPointSuccess || fn == nullptr) {
    return std::string("CUDA driver entry point ") + name + " unavailable: " +
           QueryResultName(status);
  }
  *out = reinterpret_cast<Fn>(fn);
  return "";
}

}  // namespace

std::string DriverApi::Describe(const char* call, CUresult result) const {
  std::string o = std::string(call) + " failed: CUresult " + std::to_string(static_cast<int>(result));
  const char* text = nullptr;
  if (get_error_string && get_error_string(result, &text) == CUDA_SUCCESS && text)
    o += std::string(": ") + text;
  return o;
}

const DriverApi& GetDriverApi() {
  static DriverApi* api = [] {
    auto* a = new DriverApi();
    std::string err = Resolve("cuStreamWriteValue64", &a->write_value64);
    if (err.empty()) err = Resolve("cuStreamWaitValue64", &a->wait_value64);
    if (!err.empty()) {
      a->write_value64 = nullptr;
      a->wait_value64 = nullptr;
      a->error = "the CUDA executor needs stream memory operations: " + err;
    }
    if (!Resolve("cuStreamBatchMemOp", &a->batch_mem_op).empty()) a->batch_mem_op = nullptr;
    if (!Resolve("cuGetErrorString", &a->get_error_string).empty()) a->get_error_string = nullptr;
    return a;
  }();
  return *api;
}

}  // namespace hoccl
