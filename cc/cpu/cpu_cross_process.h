// The CPU engine for a group whose ranks live in several processes of one node: each rank
// copies its input into staging of its own in POSIX shared memory (one segment per ring entry
// of the node rendezvous, grown on demand), publishes it, and runs its own plan (plan.h)
// reading the peers' staging; the ready handshake is finding a peer's entry, the done
// handshake releasing it. The staging names are unlinked once every peer has mapped them.
#ifndef JAX_HOCCL_CPU_CROSS_PROCESS_H_
#define JAX_HOCCL_CPU_CROSS_PROCESS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "plan.h"

namespace hoccl {

// Runs spec.rank's part of the collective; blocks until done (call it off XLA's threads).
// `instruction` identifies the calling instruction the same way in every process (it pairs
// the ranks' calls with the n-th call of it); `what` describes the call for mismatch errors;
// `op` is the user's op for messages.
std::string RunCpuAcrossProcesses(const OpSpec& spec, const std::vector<int64_t>& device_ids,
                                  uint64_t instruction, const std::string& what, const void* input,
                                  void* output, const std::string& op);

// Shared-memory segments this process maps (staging and rendezvous), for leak tests.
size_t LiveStagingMappings();
// Calls this process ran on this path (tests and the benchmark: which path ran).
uint64_t RendezvousCalls();

}  // namespace hoccl

#endif  // JAX_HOCCL_CPU_CROSS_PROCESS_H_
