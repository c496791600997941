// The staged one-hop path of the CPU engine across processes (docs/design.md, "The staged
// one-hop path"): below the crossover (a per-peer block of at most JAX_HOCCL_STAGED_BYTES,
// default 1 MiB; 0 turns the path off) a call needs no rendezvous. Each rank copies its blocks
// into its peers' slots of the instruction's lane (staged_lane.h), raises their flags, waits
// for its own, then copies out; calls alternate between two sets of slots and flags. Larger
// calls keep the per-call rendezvous (cpu_cross_process.h).
#ifndef JAX_HOCCL_CPU_CPU_STAGED_H_
#define JAX_HOCCL_CPU_CPU_STAGED_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "plan.h"

namespace hoccl {

// Runs spec.rank's part of the collective on the staged path, or returns false (and does
// nothing) when this call is not for it. `done(error)` is then called once: on this thread
// when the peers' flags are there at once or within a moment, else on a pool thread
// (RunDetached), which waits for them. The arguments are cpu_cross_process.h's.
bool RunCpuStaged(const OpSpec& spec, const std::vector<int64_t>& device_ids, uint64_t instruction,
                  const std::string& what, const void* input, void* output, const std::string& op,
                  std::function<void(const std::string&)> done);

// Calls this process ran on the staged path (tests and the benchmark: which path ran).
uint64_t StagedCalls();

}  // namespace hoccl

#endif  // JAX_HOCCL_CPU_CPU_STAGED_H_
