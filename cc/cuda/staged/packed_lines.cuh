// The packed exchange's lines (docs/design.md, "The packed exchange"), for every kernel that
// sends blocks so (packed_kernel.cu, gemv_psum_kernel.cu): a 16-byte line is two 8-byte words,
// each 4 bytes of data and the call's 32-bit flag, written by one store, so that a reader sees
// each word whole. Line l of a block carries its data bytes [8 l, 8 l + 8) and lies at byte
// 16 l of the sender's slot in the receiver's packed region.
#ifndef JAX_HOCCL_STAGED_PACKED_LINES_CUH_
#define JAX_HOCCL_STAGED_PACKED_LINES_CUH_

#include <cstdint>

#include "cuda/staged/exchange_kernel.h"

namespace hoccl {
namespace staged_device {

// The packed slot in `owner`'s region where `sender` writes, of slot set `set`.
__device__ __forceinline__ char* PackedSlot(const StagedKernelLayout& l, int owner, int n, int set,
                                            int sender) {
  return l.base[owner] + l.packed + (static_cast<size_t>(set) * n + sender) * l.packed_slot_bytes;
}

// One store per line: each 8-byte half (data, flag) lands whole, as a reader sees it.
__device__ __forceinline__ void StoreLine(char* line, uint2 d, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line), "r"(d.x), "r"(flag),
               "r"(d.y), "r"(flag)
               : "memory");
}

__device__ __forceinline__ uint4 LoadLine(const char* line) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(line)
               : "memory");
  return v;
}

// Whether a loaded line is the call's (both words carry `flag`); else, in `seen`, a flag of
// another call that one of its words holds (zero: not written yet), for the watchdog.
__device__ __forceinline__ bool LineArrived(const uint4& v, uint32_t flag, uint32_t* seen) {
  if (v.y == flag && v.w == flag) return true;
  if (v.y && v.y != flag)
    *seen = v.y;
  else if (v.w && v.w != flag)
    *seen = v.w;
  return false;
}

}  // namespace staged_device
}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_PACKED_LINES_CUH_
