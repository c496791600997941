// Consecutive stream memory operations on one stream (flag writes and waits that the GPU's
// front end executes, no kernel): one cuStreamWriteValue64 / cuStreamWaitValue64 each, or
// all as one cuStreamBatchMemOp where the driver has it (one host call for the lot).
#ifndef JAX_HOCCL_STREAM_MEM_OPS_H_
#define JAX_HOCCL_STREAM_MEM_OPS_H_

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/driver_api.h"

namespace hoccl {

class MemOps {
 public:
  MemOps(const DriverApi& api, cudaStream_t stream) : api_(api), stream_(stream) {}

  // Writes `value` to `addr` once the stream's earlier work is done (and visible).
  void Write(uint64_t* addr, uint64_t value);
  // Same, to an address given as a device pointer (mapped host memory).
  void WriteDevice(CUdeviceptr addr, uint64_t value);
  // Waits until *addr >= value (monotone flags) or, with equal = true, *addr == value.
  void Wait(uint64_t* addr, uint64_t value, bool equal = false);
  bool empty() const { return ops_.empty(); }

  // Enqueues what was collected; "" or the driver's error.
  std::string Flush();

 private:
  const DriverApi& api_;
  cudaStream_t stream_;
  std::vector<CUstreamBatchMemOpParams> ops_;
};

}  // namespace hoccl

#endif  // JAX_HOCCL_STREAM_MEM_OPS_H_
