#include "cpu_executor.h"

#include <cstring>

namespace hoccl {

std::string RunAllRanks(const OpSpec& spec, const std::vector<const void*>& inputs,
                        const std::vector<void*>& outputs) {
  for (int r = 0; r < spec.group_size; ++r) {
    OpSpec mine = spec;
    mine.rank = r;
    char* out = static_cast<char*>(outputs[r]);
    // Ready and done handshakes are moot here: every input is in place and nobody leaves
    // before all copies are done.
    for (const Step& s : MakePlan(mine, PlanOptions{})) {
      if (s.kind == StepKind::kCopy) {
        std::memcpy(out + s.dst_offset, static_cast<const char*>(inputs[s.peer]) + s.src_offset,
                    s.bytes);
      } else if (s.kind == StepKind::kZero) {
        std::memset(out + s.dst_offset, 0, s.bytes);
      }
    }
  }
  return "";
}

}  // namespace hoccl
