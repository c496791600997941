// The staged one-hop path of the CUDA engine (docs/design.md, "The staged path"): a block of
// at most StagedSlotBytes() moves through slots in the receiver's memory that every peer
// mapped once (cuda/rank_state.h), so a call needs no host rendezvous: it enqueues its pushes
// into the peers' slots, one batch of flag operations (raise every peer's ready flag, wait for
// and reset mine) and its copies out of its own slots, on the call's stream, and returns.
// Every call of a parity enqueues the same device work with the same flag values. A host
// watchdog (watchdog.h) reports and releases waits on a peer that never comes.
#ifndef JAX_HOCCL_STAGED_EXCHANGE_H_
#define JAX_HOCCL_STAGED_EXCHANGE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "communicator.h"
#include "cuda/cuda_executor.h"
#include "cuda/rank_state.h"
#include "cuda/staged/gemv_psum_kernel.h"
#include "plan.h"

namespace hoccl {

// Whether `spec` goes the staged path: a plain all_gather, all_to_all or permute (skip_own
// allowed) of two or more ranks whose block fits a slot. The same on every rank of a call.
bool StagedEligible(const OpSpec& spec);

// The ready flag's value for `spec`: nonzero, and naming the op and the block's size, so a
// peer at another call shows as a mismatch instead of a silent exchange of wrong bytes.
uint64_t StagedFlagValue(const OpSpec& spec);
// "all_gather of 4096 bytes" for a value StagedFlagValue made.
std::string DescribeStagedFlag(uint64_t value);

// Whether a group of n ranks takes the exchange kernel (exchange_kernel.h) rather than copy
// calls and stream memory operations: yes up to kKernelMaxRanks, unless
// JAX_HOCCL_STAGED_KERNEL=0 (the benchmarks' comparison). The same on every rank: set it for
// the whole job. The kernel's waits end through mapped host memory, so the watchdog ends them
// without a CUDA call (which a handler thread waiting behind the very wait could hold up):
// async starts (lanes 1..kMaxAsyncLanes) are staged only where the kernel serves.
bool StagedKernelServes(int n);

// How many staged calls ran under stream capture (recorded into a CUDA graph) so far.
uint64_t StagedCapturedCalls();
// How many staged calls' handlers enqueued the packed exchange (packed_kernel.h) so far.
uint64_t StagedPackedCalls();

// Enqueues spec.rank's part on `stream` (lane `lane`; `captured`: the stream is being recorded
// into a CUDA graph); `label` is the user's op for messages. With `gemv` (a summed all_gather:
// matmul_psum's GEMV), `input` is unused: the block is gemv's product, multiplied inside the
// packed exchange (gemv_psum_kernel.h), which the block must take.
ExecStatus RunStaged(Communicator& comm, RankState& st, const OpSpec& spec, cudaStream_t stream,
                     bool captured, const void* input, void* output, int lane, const OpLabel& label,
                     const GemvOperands* gemv = nullptr);

}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_EXCHANGE_H_
