// The FFI handler symbols the nanobind module exposes to Python (module.cc), one per op and
// platform. Movers take (x) -> out with attributes group (groups, group_size, site: Group in
// ffi/handler_common.h)[, permute_dst]. Async pairs: `<op>_start` takes the same, stream, and
// peers_only for all_gather and returns (out, token): it enqueues the copies and returns at
// once, out still being filled; `done` makes XLA's stream wait for them, its outputs aliasing
// its inputs (jax_hoccl/_src/ops/async_collectives.py). `into_start` writes an all_gather's
// result, or a ppermute's into the sender's slot, into rows [offset, ...) of a larger buffer,
// donated or new: fused ops assemble outputs with it. `after` passes arrays through (aliased)
// so that XLA's compute on them depends on a start's token.
#ifndef JAX_HOCCL_HANDLERS_H_
#define JAX_HOCCL_HANDLERS_H_

#include <cstdint>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace hoccl {

// The CPU handlers' per-instruction state (cpu/handlers_cpu.cc): `key` names the custom-call
// instruction, the same on every device of the executable.
struct CpuCall {
  static xla::ffi::TypeId id;
  int64_t key = 0;
  int64_t site = 0;        // the lowering's call site (axes.new_site)
  uint64_t cross_key = 0;  // names the instruction alike in every process (cpu/handlers_cpu.cc)
};

extern "C" {
XLA_FFI_Error* kAllGatherCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllGatherStartCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kIntoStartCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllStartCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteStartCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kDoneCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kOrderAfter(XLA_FFI_CallFrame* call_frame);  // CPU and CUDA: a no-op
XLA_FFI_Error* kInstantiateCpuCall(XLA_FFI_CallFrame* call_frame);
#ifdef JAX_HOCCL_WITH_CUDA
XLA_FFI_Error* kAllGatherCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteCuda(XLA_FFI_CallFrame* call_frame);
// the same, command-buffer compatible: the lowering's targets for staged blocks
XLA_FFI_Error* kAllGatherStagedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllStagedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteStagedCuda(XLA_FFI_CallFrame* call_frame);
// psum / psum_scatter of staged blocks, summed inside the exchange
XLA_FFI_Error* kPsumStagedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPsumScatterStagedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllGatherStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kIntoStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllToAllStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPermuteStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kDoneCuda(XLA_FFI_CallFrame* call_frame);
// the fused ops' (cuda/fused/)
XLA_FFI_Error* kAnnouncedGatherStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kGemmRingStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kRowsMatmulCuda(XLA_FFI_CallFrame* call_frame);
// matmul_psum's GEMV and its staged psum, one kernel (command-buffer compatible)
XLA_FFI_Error* kMatmulPsumStagedCuda(XLA_FFI_CallFrame* call_frame);
// one kernel copying x to out: the cost of any one-kernel custom call (cuda/one_kernel_call.cu)
XLA_FFI_Error* kOneKernelCallCuda(XLA_FFI_CallFrame* call_frame);
#endif
}

}  // namespace hoccl

#endif  // JAX_HOCCL_HANDLERS_H_
