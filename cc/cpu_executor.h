// The CPU executor: runs one rank's plan with memcpy, using the communicator's host
// rendezvous for the ready/done handshakes. Every device of an XLA:CPU launch runs its
// handler on its own thread, so blocking waits here are safe (DESIGN.md).
#ifndef JAX_HOCCL_CPU_EXECUTOR_H_
#define JAX_HOCCL_CPU_EXECUTOR_H_

#include <string>

#include "communicator.h"
#include "plan.h"

namespace hoccl {

// Executes `spec` for spec.rank on `comm`; `site` identifies the call site (see
// Communicator::NextSeqAt). Returns "" or an error message.
std::string RunOnCpu(Communicator& comm, const OpSpec& spec, int64_t site, const void* input,
                     void* output);

}  // namespace hoccl

#endif  // JAX_HOCCL_CPU_EXECUTOR_H_
