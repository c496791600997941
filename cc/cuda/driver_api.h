// The few CUDA driver functions the executor needs (stream memory operations, and virtual
// memory management for cross-process peer memory), resolved at
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
  using WaitValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*,
                                    unsigned int);
  using GetErrorStringFn = CUresult (*)(CUresult, const char**);

  // Virtual memory management and pointer queries, for mapping peers' memory across
  // processes (ipc_memory.cc). Optional as a group: vmm_error says why they are unusable.
  using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  using PointerGetAttributesFn = CUresult (*)(unsigned int, CUpointer_attribute*, void**,
                                              CUdeviceptr);
  using MemRetainAllocationHandleFn = CUresult (*)(CUmemGenericAllocationHandle*, void*);
  using MemReleaseFn = CUresult (*)(CUmemGenericAllocationHandle);
  using MemExportToShareableHandleFn = CUresult (*)(void*, CUmemGenericAllocationHandle,
                                                    CUmemAllocationHandleType, unsigned long long);
  using MemImportFromShareableHandleFn = CUresult (*)(CUmemGenericAllocationHandle*, void*,
                                                      CUmemAllocationHandleType);
  using MemGetAllocationPropertiesFromHandleFn = CUresult (*)(CUmemAllocationProp*,
                                                              CUmemGenericAllocationHandle);
  using MemCreateFn = CUresult (*)(CUmemGenericAllocationHandle*, size_t,
                                   const CUmemAllocationProp*, unsigned long long);
  using MemGetAllocationGranularityFn = CUresult (*)(size_t*, const CUmemAllocationProp*,
                                                     CUmemAllocationGranularity_flags);
  using MemAddressReserveFn = CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                           unsigned long long);
  using MemAddressFreeFn = CUresult (*)(CUdeviceptr, size_t);
  using MemMapFn = CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                unsigned long long);
  using MemUnmapFn = CUresult (*)(CUdeviceptr, size_t);
  using MemSetAccessFn = CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);

  WriteValue64Fn write_value64 = nullptr;       // required
  WaitValue64Fn wait_value64 = nullptr;         // required
  BatchMemOpFn batch_mem_op = nullptr;          // optional: single ops are used without it
  WaitValue32Fn wait_value32 = nullptr;         // optional: for the flagged GEMM's int32 flags
  GetErrorStringFn get_error_string = nullptr;  // optional: for messages

  MemGetAddressRangeFn mem_get_address_range = nullptr;
  PointerGetAttributesFn pointer_get_attributes = nullptr;
  MemRetainAllocationHandleFn mem_retain_allocation_handle = nullptr;
  MemReleaseFn mem_release = nullptr;
  MemExportToShareableHandleFn mem_export_to_shareable_handle = nullptr;
  MemImportFromShareableHandleFn mem_import_from_shareable_handle = nullptr;
  MemGetAllocationPropertiesFromHandleFn mem_get_allocation_properties_from_handle = nullptr;
  MemCreateFn mem_create = nullptr;
  MemGetAllocationGranularityFn mem_get_allocation_granularity = nullptr;
  MemAddressReserveFn mem_address_reserve = nullptr;
  MemAddressFreeFn mem_address_free = nullptr;
  MemMapFn mem_map = nullptr;
  MemUnmapFn mem_unmap = nullptr;
  MemSetAccessFn mem_set_access = nullptr;

  // "" when the required entry points resolved, else why not (no driver, too old, ...).
  std::string error;
  // "" when every VMM / pointer-query entry point above resolved, else the first that did not.
  std::string vmm_error;

  // "cuStreamWriteValue64 failed: CUDA_ERROR_...: text" for a failed driver call.
  std::string Describe(const char* call, CUresult result) const;
};

// Resolved once per process (thread-safe); never null.
const DriverApi& GetDriverApi();

}  // namespace hoccl

#endif  // JAX_HOCCL_DRIVER_API_H_
