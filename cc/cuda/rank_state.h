// A rank's one-time state in a group of the CUDA engine, per (communicator, rank), set up at
// its first call and never per call: how it reaches its peers (the transport, chosen once:
// peers in this process or in others), its flag arrays and its staging (cuda/staged/), all in
// one allocation that every peer maps during the setup.
#ifndef JAX_HOCCL_RANK_STATE_H_
#define JAX_HOCCL_RANK_STATE_H_

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "communicator.h"
#include "cuda/staged/exchange_kernel.h"
#include "cuda/transport/peer_transport.h"
#include "job.h"
#include "node_rendezvous.h"
#include "plan.h"

namespace hoccl {

// Which streams run collectives concurrently, each with its own flags (cuda_executor.h says
// why): lane 0 for XLA's stream, 1.. for the async starts' streams.
constexpr int kMaxAsyncLanes = 4;
constexpr int kLanes = 1 + kMaxAsyncLanes;

// The staged path's bookkeeping of one lane (cuda/staged/staged_exchange.h).
struct StagedLaneState {
  // Calls a lane may run ahead of the GPU: beyond it a call waits for the GPU to catch up.
  static constexpr int kNamed = 1024;
  uint64_t calls = 0;                 // staged calls enqueued so far; parity = calls % 2
  std::atomic<uint64_t> enqueued{0};  // the same, for the watchdog's thread
  OpLabel names[kNamed] = {};         // the user's op of call c at c % kNamed (messages)
  uint64_t values[kNamed] = {};       // its flag value (op and size: mismatches show)
};

struct RankState {
  std::mutex mu;  // setup only: calls of one rank come from its device's handler thread
  std::atomic<bool> ready{false};
  std::string setup_error;  // a failed setup is final
  int device = -1;
  std::unique_ptr<PeerTransport> transport;
  // The group's node rendezvous where it spans processes (a rank that gives up records it
  // there, and every rank's next call sees it), else null.
  NodeRendezvous* node = nullptr;
  // The zero-copy path's flags (cuda_executor.h), mine and every rank's by rank.
  uint64_t* flags = nullptr;
  std::vector<uint64_t*> peer_flags;
  // Every rank's allocation (by rank; [rank] is mine): flags, then the staged path's region
  // (cuda/staged/staged_layout.h) at the same offset in each.
  std::vector<char*> peer_base;
  // The staged region of every rank as the exchange kernel reads it (groups it serves).
  StagedKernelLayout kernel_layout = {};
  StagedLaneState staged[kLanes];
  bool watched = false;  // registered with the staged path's watchdog
  // Mapped host memory the GPU writes each lane's staged progress to (the watchdog reads it),
  // and the rest of what the GPU and the watchdog tell each other; with its device address.
  volatile uint64_t* progress = nullptr;
  CUdeviceptr progress_device = 0;
  StagedHostWords* host_words = nullptr;
  StagedHostWords* host_words_device = nullptr;
  // The user's ops of captured calls, by the tag their kernels carry (watchdog messages).
  static constexpr int kCapturedNames = 256;
  OpLabel captured_names[kCapturedNames] = {};
  uint64_t captured_tags = 0;
};

// Bytes of the zero-copy path's flag arrays at the start of every rank's allocation.
size_t ZeroCopyFlagBytes(int group_size);

// The state of spec.rank in `comm`, set up at the first call (which meets every peer once to
// map their allocations), and its device, made current for this thread; and whether `stream`
// (XLA's) is being recorded into a CUDA graph. `label` names the caller in errors. `device`
// stays -1 where the device could not be found.
std::string RankStateOn(Communicator& comm, const OpSpec& spec, cudaStream_t stream,
                        const OpLabel& label, RankState** out, int* device, bool* capturing);

}  // namespace hoccl

#endif  // JAX_HOCCL_RANK_STATE_H_
