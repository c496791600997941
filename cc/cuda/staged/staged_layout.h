// Where the staged path's slots and flags lie in every rank's allocation (cuda/rank_state.h),
// at the same offsets in each, so a peer finds them from the base it mapped once. Per lane and
// parity (docs/design.md, "The staged path"): n ready flags (one per sender), then n slots of
// StagedSlotBytes() each (one per sender).
#ifndef JAX_HOCCL_STAGED_LAYOUT_H_
#define JAX_HOCCL_STAGED_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/rank_state.h"

namespace hoccl {

// The crossover: a block (what one rank sends one peer) of at most this many bytes goes the
// staged path; env JAX_HOCCL_STAGED_BYTES (0 = never), read once. Every slot holds this much.
constexpr long long kDefaultStagedBytes = 1 << 20;
inline size_t StagedSlotBytes() {
  static const size_t bytes = static_cast<size_t>(
      (EnvInt("JAX_HOCCL_STAGED_BYTES", kDefaultStagedBytes, 0) + 255) / 256 * 256);
  return bytes;
}

inline size_t StagedFlagBytes(int n) {
  return (static_cast<size_t>(kLanes) * 2 * n * sizeof(uint64_t) + 255) / 256 * 256;
}

// The staged region's bytes (0 when the staged path is off).
inline size_t StagedRegionBytes(int n) {
  const size_t slot = StagedSlotBytes();
  return slot ? StagedFlagBytes(n) + static_cast<size_t>(kLanes) * 2 * n * slot : 0;
}

// In the allocation at `base` of a group of n: the ready flag that `sender` raises for the
// owner, and the slot `sender` writes into, for (lane, parity).
inline uint64_t* StagedFlag(char* base, int n, int lane, int parity, int sender) {
  return reinterpret_cast<uint64_t*>(base + ZeroCopyFlagBytes(n)) + (lane * 2 + parity) * n +
         sender;
}
inline char* StagedSlot(char* base, int n, int lane, int parity, int sender) {
  return base + ZeroCopyFlagBytes(n) + StagedFlagBytes(n) +
         ((static_cast<size_t>(lane) * 2 + parity) * n + sender) * StagedSlotBytes();
}

}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_LAYOUT_H_
