// FFI handler symbols of the async pairs: `<op>_start` enqueues the copies and returns at
// once (outputs: the destination, still being filled, and an alias of the input that keeps
// it alive), `done` makes XLA's stream wait for them (outputs alias its inputs). See
// jax_hoccl/_src/ops/async_collectives.py.
#ifndef JAX_HOCCL_HANDLERS_ASYNC_H_
#define JAX_HOCCL_HANDLERS_ASYNC_H_

#include "xla/ffi/api/c_api.h"

namespace hoccl {

extern "C" {
XLA_FFI_Error* kAllGatherStartCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllStartCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteStartCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kDoneCpu(XLA_FFI_CallFrame* call_frame);
#ifdef JAX_HOCCL_WITH_CUDA
XLA_FFI_Error* kAllGatherStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kDoneCuda(XLA_FFI_CallFrame* call_frame);
#endif
}

}  // namespace hoccl

#endif  // JAX_HOCCL_HANDLERS_ASYNC_H_
