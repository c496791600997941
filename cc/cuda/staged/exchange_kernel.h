// The staged path's exchange as one kernel (docs/design.md, "The staged path"): a call's
// pushes into the peers' slots, its ready flags, its waits and its copies out, in one launch
// instead of a copy call, a batch of stream memory operations and another copy call. The host
// enqueue is what a small collective costs; one launch is the least of it. Each of the
// kernel's CTAs moves one chunk of every block and has its own flag per sender, so no CTA
// waits for another of its grid (no co-residency is assumed: they may run one by one).
#ifndef JAX_HOCCL_STAGED_EXCHANGE_KERNEL_H_
#define JAX_HOCCL_STAGED_EXCHANGE_KERNEL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace hoccl {

// Groups the kernel serves (a larger group takes the copy-call exchange).
constexpr int kKernelMaxRanks = 16;
// CTAs per call at most, and the flags each sender has per slot set (one per CTA).
constexpr int kChunkFlags = 32;
// Bytes a CTA moves of each block at least (smaller blocks use fewer CTAs).
constexpr size_t kChunkBytes = 32 << 10;

// A staged call's flag value (staged_exchange.h: StagedFlagValue), constant per op and size:
// bit 63 set, bits 48-55 the op + 1, bits 56-57 the type a sum adds in (SumType, plan.h: psum,
// psum_scatter; 0 for the movers), bits 0-47 the block's bytes. The packed exchange's 32-bit
// flag (packed_kernel.h) repacks the same fields.
constexpr uint64_t kFlagMark = uint64_t{1} << 63;
constexpr int kFlagOpShift = 48;
constexpr int kFlagSumShift = 56;
constexpr uint64_t kFlagSizeMask = (uint64_t{1} << kFlagOpShift) - 1;

// Host memory the GPU writes and reads (mapped, one per rank state; cuda/rank_state.h).
struct StagedHostWords {
  volatile uint64_t progress[8];  // per lane: the calls the GPU got past (non-captured calls)
  // A kernel waiting more than a second reports here every ~100 ms (captured calls have no
  // host-side count to watch): a beat counter, the sender it waits on and what its flag holds.
  volatile uint64_t stall_beats;
  volatile uint64_t stall_seen;
  volatile uint64_t stall_expected;
  volatile int32_t stall_sender;
  volatile int32_t stall_tag;  // the call's entry in the captured calls' names
  // The broken word: the watchdog ends the kernels' waits with it, without a CUDA call
  // (staged_exchange.h, StagedKernelServes).
  volatile uint32_t broken;
};

// Where every rank's staged region lies (cuda/staged/staged_layout.h computes the same): a
// slot set's flags at flags + (set * n + sender) * kChunkFlags words, its slots at
// slots + (set * n + sender) * slot_bytes, its packed slots (packed_kernel.h) at
// packed + (set * n + sender) * packed_slot_bytes, from each rank's base.
struct StagedKernelLayout {
  char* base[kKernelMaxRanks];  // every rank's allocation, by rank
  size_t flags, slots, slot_bytes;
  size_t packed, packed_slot_bytes;
  int captured_set;  // the captured calls' first slot set (of two)
};

enum class StagedKind : int { kGather, kAllToAll, kPermute };

// One call; small, as a launch's cost grows with its parameters.
struct StagedKernelArgs {
  const char* in;
  char* out;
  size_t block;    // bytes a rank sends each peer
  size_t chunk;    // bytes of each block that one CTA moves (a multiple of 16)
  uint64_t value;  // the ready flag's value (op and size)
  StagedKind kind;
  int n, rank, set;
  int skip_own;     // gather/all_to_all: my own block is not copied
  int sum;          // gather/all_to_all: a SumType (plan.h): every rank's block for me, my own
                    // from `in`, added in rank order into `out` (one block); 0: copied out
  int permute_dst;  // permute: where mine goes (-1: nowhere), and who sends to me
  int permute_src;  // (-1: nobody; my output is zero-filled)
  int captured;     // a captured call: its slot set by the parity of captured_count
  int lane;         // progress[lane] gets progress_value (if non-zero)
  int tag;          // a captured call's entry in the names of captured calls
  uint64_t progress_value;
  unsigned int* ctas_done;  // device counter of this lane: the last CTA reports progress
  // A captured call's slot set is captured_set + (*captured_count & 1); its last CTA counts it.
  unsigned int* captured_count;
  // The word the watchdog sets when it gives up on the group: waits end at once (the results
  // are not valid): StagedHostWords::broken.
  volatile unsigned int* broken;
  StagedHostWords* host;  // its device address
  StagedKernelLayout layout;
};

// The number of CTAs for a block of `block` bytes, and in `chunk` the bytes each moves: at
// least `least` (a multiple of `granule`), more once that would take over kChunkFlags CTAs.
// The exchange kernel's CTA needs its own flags; and where ranks share a GPU, every CTA of
// theirs must be able to be resident at once (a CTA waits for its peers' CTA of its index).
inline int SplitAmongCtas(size_t block, size_t least, size_t granule, size_t* chunk) {
  size_t per = (block + kChunkFlags - 1) / kChunkFlags;
  if (per < least) per = least;
  per = (per + granule - 1) / granule * granule;
  *chunk = per;
  const size_t ctas = (block + per - 1) / per;
  return ctas ? static_cast<int>(ctas) : 1;
}
// The exchange kernel's: kChunkBytes at least, in 16-byte words.
inline int ExchangeCtas(size_t block, size_t* chunk) {
  return SplitAmongCtas(block, kChunkBytes, 16, chunk);
}

// Loads the kernel into the current context (before any stream capture needs it).
cudaError_t LoadExchangeKernel();

// Launches the exchange on `stream`.
cudaError_t LaunchExchangeKernel(const StagedKernelArgs& args, int ctas, cudaStream_t stream);

}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_EXCHANGE_KERNEL_H_
