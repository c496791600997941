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
};

struct StagedCopy {
  char* dst;
  const char* src;
};

struct StagedKernelArgs {
  size_t block;    // bytes of every copy
  size_t chunk;    // bytes of each copy that one CTA moves (a multiple of 16)
  uint64_t value;  // the ready flag's value (op and size)
  int pushes, peers, pulls;
  StagedCopy push[kKernelMaxRanks];  // my block into each peer's slot, and my own
  // For each peer, in the same order: the ready flags (kChunkFlags each) I raise in the peer,
  // and mine that it raises; for a captured call also the arrival flags, raised and awaited
  // before any push (null otherwise).
  uint64_t* raise[kKernelMaxRanks];
  uint64_t* wait[kKernelMaxRanks];
  uint64_t* arrive_raise[kKernelMaxRanks];
  uint64_t* arrive_wait[kKernelMaxRanks];
  StagedCopy pull[kKernelMaxRanks];  // out of my slots
  char* zero_fill;                   // a permute's output nobody sends to, or null
  unsigned int* ctas_done;           // device counter: the last CTA reports progress
  // Device memory the watchdog sets when it gives up on the group: waits end at once (the
  // results are not valid). In device memory, not mapped host memory: every CTA reads it.
  volatile unsigned int* broken;
  int lane;  // progress[lane] gets progress_value (if non-zero)
  uint64_t progress_value;
  int tag;
  StagedHostWords* host;  // its device address
};

// The number of CTAs (and the chunk) for a block of `block` bytes.
int ExchangeCtas(size_t block, size_t* chunk);

// Loads the kernel into the current context (before any stream capture needs it).
cudaError_t LoadExchangeKernel();

// Launches the exchange on `stream`.
cudaError_t LaunchExchangeKernel(const StagedKernelArgs& args, int ctas, cudaStream_t stream);

}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_EXCHANGE_KERNEL_H_
