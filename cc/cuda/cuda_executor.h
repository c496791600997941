// The CUDA executor: runs one rank's plan (plan.h) on the GPU with no kernel of ours.
//   data  : cudaMemcpyAsync pulls from the peer's XLA input into my XLA output (UVA peer
//           pointers, copy engines), cudaMemsetAsync for ppermute ranks nobody sends to;
//   sync  : stream memory operations (cuStreamWriteValue64 / cuStreamWaitValue64, batched with
//           cuStreamBatchMemOp when available) on a small per-(communicator, rank) flag array;
//   order : everything is enqueued on XLA's stream, or forked from it onto per-device side
//           streams and joined back before the handler returns.
//
// Peers' memory comes through a PeerTransport (peer_transport.h): in one process the
// per-device handlers swap this call's buffer addresses in the host rendezvous
// (transport_direct.h); across processes of a node they map each other's allocations
// (transport_ipc.h). Blocks up to the crossover go the staged path instead (cuda/staged/:
// copied through slots every peer mapped once, no host rendezvous); this file is the
// zero-copy path of larger ones.
//
// Flags of rank r (uint64, n = group size, on r's device), values are call sequence + 1 and
// only ever grow, so nothing is reset. One row of 2n flags per lane (see kLanes):
//   flags[2n*lane + p]      ready_from[p]: owner p's input for this call may be read (by p)
//   flags[2n*lane + n + p]  done_from[p] : reader p finished reading my input (written by p)
#ifndef JAX_HOCCL_CUDA_EXECUTOR_H_
#define JAX_HOCCL_CUDA_EXECUTOR_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "communicator.h"
#include "cuda/rank_state.h"
#include "cuda/transport/peer_transport.h"
#include "job.h"
#include "plan.h"

namespace hoccl {

struct GemvOperands;  // cuda/staged/gemv_psum_kernel.h

// A per-peer block of at least this many bytes forks the copies onto side streams (copies of
// different channels then run on different copy engines); smaller ones run entirely on XLA's
// stream, avoiding the fork/join events. Env JAX_HOCCL_MULTISTREAM_MIN_BYTES overrides.
constexpr size_t kMultiStreamMinBytes = size_t{1} << 20;
// Side streams per device (H200: 3 async copy engines). Channel 0 runs on XLA's stream,
// channel c >= 1 on side stream (c - 1) % kMaxSideStreams.
constexpr int kMaxSideStreams = 3;
// Default number of channels for large messages (capped by the number of copies a rank does).
constexpr int kLargeMessageChannels = 3;

// A wait on a flag (value >= this call's) means "the peer's call of this sequence number, or
// a later one, got there"; that implies this call only if the peer runs the calls that share
// the flag in order, i.e. on one stream. So every stream that runs collectives concurrently
// has its own row of flags, a lane: lane 0 for the calls on XLA's stream, lanes 1.. for the
// async starts' streams. (With one row, a collective on XLA's stream between an async start
// and its done could raise a peer's "done" flag before the start's copies had finished
// reading, and XLA could reuse that buffer too early.) Every rank puts a call in the same lane.
// (kLanes: cuda/rank_state.h.)

enum class ErrorKind { kNone, kInvalidArgument, kDeadline, kInternal, kUnavailable };

struct ExecStatus {
  ErrorKind kind = ErrorKind::kNone;
  std::string message;
  bool ok() const { return kind == ErrorKind::kNone; }
  static ExecStatus Ok() { return {}; }
};

// Bytes of one peer's block (what one copy moves without chunking).
size_t BlockBytes(const OpSpec& spec);

// Chunks/channels for `spec` on the GPU: 1 chunk on 1 channel below kMultiStreamMinBytes,
// else 1 chunk per peer spread over kLargeMessageChannels channels; env JAX_HOCCL_CHUNKS and
// JAX_HOCCL_CHANNELS override either (read once, at the first collective).
PlanOptions ChooseCudaPlanOptions(const OpSpec& spec);

// Rows that a GEMM waits for in-kernel (fused/flagged_gemm.py, consumer side): after each copy
// into the output, flags[dst_offset / bytes] (uint64) is written 1 on the copying stream. The
// exchange then runs on one stream in chunks of `bytes` (one flag each), and its copies ask for
// the copy engines (cudaMemcpyBatchAsync's PreferOverlapWithCompute): a copy within one GPU may
// otherwise run as a kernel, which would wait for the SMs that the waiting GEMM holds.
struct Announce {
  uint64_t* flags = nullptr;
  size_t bytes = 0;
};

// Enqueues `spec` for spec.rank on `stream` (XLA's stream of the current device, lane 0, or
// an async start's stream, its lane). Returns once everything is enqueued; on the zero-copy
// path the host rendezvous with every involved peer has happened by then. `label` names the
// user's op in errors (e.g. "psum (all_gather)"). `gemv`: a summed all_gather whose block is
// the product of matmul_psum's GEMV, multiplied in the staged path's packed exchange
// (cuda/staged/gemv_psum_kernel.h); `input` is unused.
ExecStatus RunOnCuda(Communicator& comm, const OpSpec& spec, cudaStream_t stream, const void* input,
                     void* output, int lane, const OpLabel& label,
                     const Announce* announce = nullptr, const GemvOperands* gemv = nullptr);

}  // namespace hoccl

#endif  // JAX_HOCCL_CUDA_EXECUTOR_H_
