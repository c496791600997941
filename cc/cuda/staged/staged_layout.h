// Where the staged path's slots and flags lie in every rank's allocation (cuda/rank_state.h),
// at the same offsets in each, so a peer finds them from the base it mapped once: per slot set
// (docs/design.md, "The staged path") n ready flags and n slots of StagedSlotBytes() each, one
// per sender.
#ifndef JAX_HOCCL_STAGED_LAYOUT_H_
#define JAX_HOCCL_STAGED_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/rank_state.h"
#include "cuda/staged/exchange_kernel.h"
#include "cuda/staged/packed_kernel.h"

namespace hoccl {

// The crossover: a block (what one rank sends one peer) of at most this many bytes goes the
// staged path; env JAX_HOCCL_STAGED_BYTES (0 = never), read once. Every slot holds this much.
constexpr long long kDefaultStagedBytes = 1 << 20;
inline size_t StagedSlotBytes() {
  static const size_t bytes = static_cast<size_t>(
      (EnvInt("JAX_HOCCL_STAGED_BYTES", kDefaultStagedBytes, 0) + 255) / 256 * 256);
  return bytes;
}

// The packed exchange's crossover (cuda/staged/packed_kernel.h): blocks of all_gather,
// all_to_all, psum and psum_scatter of at most this many bytes take it; env
// JAX_HOCCL_STAGED_PACKED_BYTES (0 = never), read once, at most the staged crossover. Its
// slots hold twice this (a flag beside every 4 bytes).
constexpr long long kDefaultPackedBytes = 128 << 10;
inline size_t PackedSlotBytes() {
  static const size_t bytes = [] {
    size_t b = static_cast<size_t>(
        (EnvInt("JAX_HOCCL_STAGED_PACKED_BYTES", kDefaultPackedBytes, 0) + 15) / 16 * 16);
    if (b > StagedSlotBytes()) b = StagedSlotBytes();
    return b < kPackedMaxBytes ? b : kPackedMaxBytes;
  }();
  return bytes;
}
inline size_t PackedRegionSlotBytes() { return (2 * PackedSlotBytes() + 255) / 256 * 256; }

// Slot sets: two parities per lane for calls enqueued by the host (docs/design.md), and two
// for the calls XLA captures into CUDA graphs (only XLA's stream, lane 0, is captured): the
// exchange kernel takes both by the parity of a count on the device, copy calls the first
// alone after an arrival exchange.
constexpr int kCapturedSet = 2 * kLanes;
constexpr int kSlotSets = kCapturedSet + 2;
inline int SlotSet(int lane, int parity) { return lane * 2 + parity; }

// Flags: kChunkFlags ready flags per sender and slot set, then as many arrival flags for the
// captured calls, then kLanes counters of finished CTAs and the count of captured calls.
inline size_t StagedFlagBytes(int n) {
  return (static_cast<size_t>(kSlotSets + 1) * n * kChunkFlags * sizeof(uint64_t) +
          (kLanes + 1) * sizeof(unsigned int) + 255) /
         256 * 256;
}

// The staged region's bytes (0 when the staged path is off).
inline size_t StagedRegionBytes(int n) {
  const size_t slot = StagedSlotBytes();
  return slot ? StagedFlagBytes(n) +
                    static_cast<size_t>(kSlotSets) * n * (slot + PackedRegionSlotBytes())
              : 0;
}

// In the allocation at `base` of a group of n: the ready flags (kChunkFlags) that `sender`
// raises for the owner, and the slot `sender` writes into, of slot set `set`.
inline uint64_t* StagedFlag(char* base, int n, int set, int sender) {
  return reinterpret_cast<uint64_t*>(base + ZeroCopyFlagBytes(n)) +
         (static_cast<size_t>(set) * n + sender) * kChunkFlags;
}
inline char* StagedSlot(char* base, int n, int set, int sender) {
  return base + ZeroCopyFlagBytes(n) + StagedFlagBytes(n) +
         (static_cast<size_t>(set) * n + sender) * StagedSlotBytes();
}
// The packed slot `sender` writes into, of slot set `set`.
inline char* PackedSlot(char* base, int n, int set, int sender) {
  return StagedSlot(base, n, kSlotSets, 0) +
         (static_cast<size_t>(set) * n + sender) * PackedRegionSlotBytes();
}
// The flag `sender` raises once it has arrived at a captured call (its earlier captured calls'
// copies out of its slots are done).
inline uint64_t* ArrivalFlag(char* base, int n, int sender) {
  return StagedFlag(base, n, kSlotSets, sender);
}
// The exchange kernel's count of finished CTAs of a lane (cuda/staged/exchange_kernel.h).
inline unsigned int* CtasDone(char* base, int n, int lane) {
  return reinterpret_cast<unsigned int*>(StagedFlag(base, n, kSlotSets + 1, 0)) + lane;
}
// The count of captured calls this rank's exchange kernels ran.
inline unsigned int* CapturedCount(char* base, int n) { return CtasDone(base, n, kLanes); }

// The same layout as the exchange kernel reads it, for the group whose allocations (by rank)
// are `bases` (at most kKernelMaxRanks of them).
inline StagedKernelLayout KernelLayout(const std::vector<char*>& bases) {
  const int n = static_cast<int>(bases.size());
  StagedKernelLayout l = {};
  for (int q = 0; q < n; ++q) l.base[q] = bases[q];
  char* b = bases[0];
  l.flags = reinterpret_cast<char*>(StagedFlag(b, n, 0, 0)) - b;
  l.slots = StagedSlot(b, n, 0, 0) - b;
  l.slot_bytes = StagedSlotBytes();
  l.packed = PackedSlot(b, n, 0, 0) - b;
  l.packed_slot_bytes = PackedRegionSlotBytes();
  l.captured_set = kCapturedSet;
  return l;
}

}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_LAYOUT_H_
