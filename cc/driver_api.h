// The few CUDA driver functions the executor needs (stream memory operations), resolved at
// run time through the runtime's cudaGetDriverEntryPointByVersion. Nothing links against
// libcuda, so the extension builds and imports on machines without a driver; a missing
// entry point only turns into an error when a GPU collective actually runs.
#ifndef JAX_HOCCL_DRIVER_API_H_
#define JAX_HOCCL_DRIVER_API_H_

#include <cuda.h>  // types and enums only; no cu* symbol is referenced directly

#include <string>

namespace hoccl {

struct DriverApi {
  using WriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  using WaitValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*,
                                    unsigned int);
  using GetErrorStringFn = CUresult (*)(CUresult, const char**);

  WriteValue64Fn write_value64 = nullptr;  // required
  WaitValue64Fn wait_value64 = nullptr;    // required
  BatchMemOpFn batch_mem_op = nullptr;     // optional: single ops are used without it
  GetErrorStringFn get_error_string = nullptr;  // optional: for messages

  // "" when the required entry points resolved, else why not (no driver, too old, ...).
  std::string error;

  // "cuStreamWriteValue64 failed: CUDA_ERROR_...: text" for a failed driver call.
  std::string Describe(const char* call, CUresult result) const;
};

// Resolved once per process (thread-safe); never null.
const DriverApi& GetDriverApi();

}  // namespace hoccl

#endif  // JAX_HOCCL_DRIVER_API_H_
