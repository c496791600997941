// The CPU executor: once every rank of a collective has arrived (Communicator::ArriveAsync),
// the last one runs each rank's plan with memcpy, reading peers' inputs straight from
// XLA's buffers. No thread waits for another (XLA:CPU shares one pool between devices).
#ifndef JAX_HOCCL_CPU_EXECUTOR_H_
#define JAX_HOCCL_CPU_EXECUTOR_H_

#include <string>
#include <vector>

#include "plan.h"

namespace hoccl {

// Runs spec.rank's plan with memcpy: its copies from inputs[peer] and its zero fills into
// `output`. The handshakes are the caller's (every input is in place before, and stays so
// until every rank is done). Shared with the cross-process engine (cpu_cross_process.h).
void RunPlanOnHost(const OpSpec& spec, const std::vector<const void*>& inputs, void* output);

// Runs the copies of `spec` (its rank field ignored) for every rank r, from inputs[*] into
// outputs[r]. Returns "" or an error message.
std::string RunAllRanks(const OpSpec& spec, const std::vector<const void*>& inputs,
                        const std::vector<void*>& outputs);

}  // namespace hoccl

#endif  // JAX_HOCCL_CPU_EXECUTOR_H_
