// The FFI handler symbols the nanobind module exposes to Python (module.cc). One handler per
// mover and platform; all take (x) -> out with attributes groups, group_size, site
// [, permute_dst] (see jax_hoccl/_src/axes.py for what they mean).
#ifndef JAX_HOCCL_HANDLERS_H_
#define JAX_HOCCL_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

namespace hoccl {

extern "C" {
XLA_FFI_Error* kAllGatherCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteCpu(XLA_FFI_CallFrame* call_frame);
#ifdef JAX_HOCCL_WITH_CUDA
XLA_FFI_Error* kAllGatherCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteCuda(XLA_FFI_CallFrame* call_frame);
#endif
}

}  // namespace hoccl

#endif  // JAX_HOCCL_HANDLERS_H_
