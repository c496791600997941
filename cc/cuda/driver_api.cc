#include "cuda/driver_api.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <type_traits>

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
    return std::string("cudaGetDriverEntryPointByVersion(") + name +
           ") failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err) +
           " (is an NVIDIA driver for CUDA >= 12 installed?)";
  }
  if (status != cudaDriverEntryPointSuccess || fn == nullptr) {
    return std::string("CUDA driver entry point ") + name +
           " unavailable: " + QueryResultName(status);
  }
  *out = reinterpret_cast<Fn>(fn);
  return "";
}

// Our pointer types must match cuda.h's declarations (decltype does not reference the
// symbols, so nothing links against libcuda). cuMemGetAddressRange is cuda.h's macro for _v2,
// the version kDriverAbiVersion resolves.
#define HOCCL_SAME_SIGNATURE(type, fn) \
  static_assert(std::is_same<DriverApi::type, decltype(&::fn)>::value, #fn " signature")
HOCCL_SAME_SIGNATURE(MemGetAddressRangeFn, cuMemGetAddressRange);
HOCCL_SAME_SIGNATURE(PointerGetAttributesFn, cuPointerGetAttributes);
HOCCL_SAME_SIGNATURE(MemRetainAllocationHandleFn, cuMemRetainAllocationHandle);
HOCCL_SAME_SIGNATURE(MemReleaseFn, cuMemRelease);
HOCCL_SAME_SIGNATURE(MemExportToShareableHandleFn, cuMemExportToShareableHandle);
HOCCL_SAME_SIGNATURE(MemImportFromShareableHandleFn, cuMemImportFromShareableHandle);
HOCCL_SAME_SIGNATURE(MemGetAllocationPropertiesFromHandleFn,
                     cuMemGetAllocationPropertiesFromHandle);
HOCCL_SAME_SIGNATURE(MemCreateFn, cuMemCreate);
HOCCL_SAME_SIGNATURE(MemGetAllocationGranularityFn, cuMemGetAllocationGranularity);
HOCCL_SAME_SIGNATURE(MemAddressReserveFn, cuMemAddressReserve);
HOCCL_SAME_SIGNATURE(MemAddressFreeFn, cuMemAddressFree);
HOCCL_SAME_SIGNATURE(MemMapFn, cuMemMap);
HOCCL_SAME_SIGNATURE(MemUnmapFn, cuMemUnmap);
HOCCL_SAME_SIGNATURE(MemSetAccessFn, cuMemSetAccess);
#undef HOCCL_SAME_SIGNATURE

}  // namespace

std::string DriverApi::Describe(const char* call, CUresult result) const {
  std::string o =
      std::string(call) + " failed: CUresult " + std::to_string(static_cast<int>(result));
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
    if (!Resolve("cuStreamWaitValue32", &a->wait_value32).empty()) a->wait_value32 = nullptr;
    if (!Resolve("cuGetErrorString", &a->get_error_string).empty()) a->get_error_string = nullptr;
    // All or nothing: a partial set would fail halfway through a mapping.
    const std::string vmm[] = {
        Resolve("cuMemGetAddressRange", &a->mem_get_address_range),
        Resolve("cuPointerGetAttributes", &a->pointer_get_attributes),
        Resolve("cuMemRetainAllocationHandle", &a->mem_retain_allocation_handle),
        Resolve("cuMemRelease", &a->mem_release),
        Resolve("cuMemExportToShareableHandle", &a->mem_export_to_shareable_handle),
        Resolve("cuMemImportFromShareableHandle", &a->mem_import_from_shareable_handle),
        Resolve("cuMemGetAllocationPropertiesFromHandle",
                &a->mem_get_allocation_properties_from_handle),
        Resolve("cuMemCreate", &a->mem_create),
        Resolve("cuMemGetAllocationGranularity", &a->mem_get_allocation_granularity),
        Resolve("cuMemAddressReserve", &a->mem_address_reserve),
        Resolve("cuMemAddressFree", &a->mem_address_free),
        Resolve("cuMemMap", &a->mem_map),
        Resolve("cuMemUnmap", &a->mem_unmap),
        Resolve("cuMemSetAccess", &a->mem_set_access),
    };
    for (const std::string& e : vmm) {
      if (!e.empty() && a->vmm_error.empty())
        a->vmm_error = "cross-process peer memory needs the CUDA virtual memory API: " + e;
    }
    return a;
  }();
  return *api;
}

}  // namespace hoccl
