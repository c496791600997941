#include "cpu_executor.h"

#include <cstring>

namespace hoccl {

std::string RunOnCpu(Communicator& comm, const OpSpec& spec, int64_t site, const void* input,
                     void* output) {
  std::string err = comm.Broken();
  if (!err.empty()) return err;
  err = ValidateSpec(spec);
  if (!err.empty()) return std::string("jax_hoccl ") + OpName(spec.op) + ": " + err;
  const int r = spec.rank;
  const char* op = OpName(spec.op);
  const uint64_t seq = comm.NextSeqAt(r, site);
  // Arriving publishes my buffers and is the "ready" signal to every reader at once.
  comm.Arrive(seq, r, input, output);
  char* out = static_cast<char*>(output);
  for (const Step& s : MakePlan(spec, PlanOptions{})) {
    switch (s.kind) {
      case StepKind::kSignalReady: break;  // covered by Arrive
      case StepKind::kWaitReady: err = comm.WaitArrived(seq, r, s.peer, op); break;
      case StepKind::kCopy: {
        const char* src = static_cast<const char*>(s.peer == r ? input : comm.Input(seq, s.peer));
        std::memcpy(out + s.dst_offset, src + s.src_offset, s.bytes);
        break;
      }
      case StepKind::kZero: std::memset(out + s.dst_offset, 0, s.bytes); break;
      case StepKind::kSignalDone: comm.SignalDone(seq, r, s.peer); break;
      case StepKind::kWaitDone: err = comm.WaitDone(seq, r, s.peer, op); break;
    }
    if (!err.empty()) return err;
  }
  comm.Leave(seq, r);
  return "";
}

}  // namespace hoccl
