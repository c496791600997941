// The packed exchange (docs/design.md, "The packed exchange"): the staged path's exchange for
// small blocks of all_gather, all_to_all, psum and psum_scatter, with every 8-byte word of a
// slot carrying 4 bytes of data and a 4-byte flag, written by one store. A receiver waits on
// the words themselves: no fence behind the pushes, no separate flag hop, no barrier between
// pushing and reading, and the copy out (or the sum) is the wait. A receiver zeroes the words
// it read, so a word holds a flag only from the one call that wrote it: the flag is the same
// at every call of an op and size (capture-safe) and no stale word can pass for a new one.
#ifndef JAX_HOCCL_STAGED_PACKED_KERNEL_H_
#define JAX_HOCCL_STAGED_PACKED_KERNEL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/staged/exchange_kernel.h"

namespace hoccl {

// Data bytes a CTA moves of each block at a time (a multiple of 16): 4 lines per thread.
constexpr size_t kPackedChunkBytes = 8 << 10;
// Blocks this large at most fit the packed slots (the slot holds twice the block).
constexpr size_t kPackedMaxBytes = size_t{1} << 23;

// The 32-bit flag of a call from its StagedFlagValue (exchange_kernel.h: kFlagMark): the
// op (bits 25-30), the sum's type (bits 23-24) and the block's size (under 8 MiB), nonzero;
// and back, for the watchdog's messages.
__host__ __device__ constexpr uint32_t PackedFlag(uint64_t value) {
  return 0x80000000u | static_cast<uint32_t>((value >> kFlagOpShift) & 0x3f) << 25 |
         static_cast<uint32_t>((value >> kFlagSumShift) & 3) << 23 |
         static_cast<uint32_t>(value & 0x7fffff);
}
__host__ __device__ constexpr uint64_t PackedFlagValue(uint32_t flag) {
  return flag ? kFlagMark | static_cast<uint64_t>((flag >> 25) & 0x3f) << kFlagOpShift |
                    static_cast<uint64_t>((flag >> 23) & 3) << kFlagSumShift | (flag & 0x7fffff)
              : 0;
}
// A value of every field round-trips: the watchdog names the same call either way.
static_assert(PackedFlagValue(PackedFlag(kFlagMark | uint64_t{3} << kFlagOpShift |
                                         uint64_t{3} << kFlagSumShift | 0x7fff10)) ==
                  (kFlagMark | uint64_t{3} << kFlagOpShift | uint64_t{3} << kFlagSumShift |
                   0x7fff10),
              "PackedFlag keeps the op, the sum's type and the size");
// Sums in two types of one size are two flags.
static_assert(PackedFlag(kFlagMark | uint64_t{2} << kFlagSumShift | 64) !=
                  PackedFlag(kFlagMark | uint64_t{3} << kFlagSumShift | 64),
              "PackedFlag tells a bfloat16 sum from a float16 one");

// Whether a call of this kind and block size takes the packed exchange, where the packed
// slots hold `packed_bytes` of data (0: the path is off). Not a permute: a slot is reused two
// calls on only because at the call between, every peer was heard from (so it had read it),
// and a permute hears from one peer at most.
inline bool PackedServes(StagedKind kind, size_t block, size_t packed_bytes) {
  return kind != StagedKind::kPermute && block && block <= packed_bytes;
}

// The packed exchange's CTAs: kPackedChunkBytes at least, in whole passes of it.
inline int PackedCtas(size_t block, size_t* chunk) {
  return SplitAmongCtas(block, kPackedChunkBytes, kPackedChunkBytes, chunk);
}

// Loads the kernel into the current context (before any stream capture needs it).
cudaError_t LoadPackedKernel();

// Launches the packed exchange on `stream` (args.chunk from PackedCtas).
cudaError_t LaunchPackedKernel(const StagedKernelArgs& args, int ctas, cudaStream_t stream);

}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_PACKED_KERNEL_H_
