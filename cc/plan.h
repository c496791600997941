// The collective scheduler: turns (op, group size, rank, bytes, options) into the ordered
// list of steps one rank executes. Pure C++: no CUDA, no XLA, so it is unit-tested by a
// simulator (tests/test_plan_simulator.py) and shared by the CPU and CUDA executors.
//
// Model: every rank owns one input and one output buffer. The plan is *pull*-based: a rank
// only ever writes its own output, reading peers' inputs. Two handshakes guard each peer pair
//   ready(owner -> reader): "my input holds this op's data and may be read"
//   done (reader -> owner): "I finished reading your input; you may reuse it"
// so no byte is read before it is ready and no input is released while a peer still reads it.
#ifndef JAX_HOCCL_PLAN_H_
#define JAX_HOCCL_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hoccl {

enum class OpKind : int { kAllGather = 0, kAllToAll = 1, kPermute = 2 };

const char* OpName(OpKind op);

// The element type a summed exchange adds in (OpSpec::sum), float32 accumulation throughout.
enum class SumType : int { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

enum class StepKind : int {
  kSignalReady = 0,  // tell `peer` that my input is ready for it to read
  kWaitReady = 1,    // wait until `peer` said its input is ready
  kCopy = 2,         // copy `bytes` from peer's input + src_offset to my output + dst_offset
  kZero = 3,         // fill my output + dst_offset with `bytes` zeros (ppermute non-receivers)
  kSignalDone = 4,   // tell `peer` I finished reading its input
  kWaitDone = 5,     // wait until `peer` said it finished reading my input
};

struct Step {
  StepKind kind;
  int peer;     // the other rank (== own rank for a local copy)
  int channel;  // which stream / engine carries a copy (0 for non-copies)
  size_t src_offset;
  size_t dst_offset;
  size_t bytes;
};

struct PlanOptions {
  // Split each peer's block into this many copies (a pipeline the executor may spread over
  // channels). 1 = one direct copy per peer.
  int chunks = 1;
  // Number of channels (streams/engines) copies are spread over, round-robin.
  int channels = 1;
};

struct OpSpec {
  OpKind op;
  int group_size;
  int rank;
  // all_gather: bytes of the input (one rank's shard); all_to_all: bytes of the whole input
  // (group_size equal blocks); permute: bytes of the input.
  size_t bytes;
  // permute only: dst[src] = destination rank of src's buffer, or -1 (size group_size).
  std::vector<int> permute_dst;
  // all_gather only: gather just the peers' blocks, rotated: output block k holds rank
  // (rank + 1 + k) % n's input, n - 1 blocks. Fused ops use it to multiply their own block
  // while the peers' blocks are still in flight.
  bool peers_only = false;
  // permute only: the output has group_size slots of `bytes` and the received buffer lands in
  // the sender's slot; other slots are not written (a destination nobody sends to keeps its
  // bytes). One round of an all_to_all split by shift: the fused ops' pipelines (into_start).
  bool at_source_slot = false;
  // all_gather only: my input already is my slot (rank * bytes) of the output, so nothing is
  // copied for it; every peer's block lands in its own slot. matmul_psum's GEMMs write their
  // summed pieces straight into the gather buffer, which is then gathered in place.
  bool in_place = false;
  // all_gather / all_to_all: my own block is not copied into my slot of the output (which
  // stays unwritten); the caller takes it from its input. psum and psum_scatter sum it from
  // there: the local copy's cudaMemcpyAsync alone cost ~6 us of host time per op on H200.
  bool skip_own = false;
  // all_gather / all_to_all on the staged path only: every rank's block for me (my own from
  // my input) summed in rank order into one block of this type, in float32 and rounded once,
  // inside the exchange: psum's and psum_scatter's sum without a kernel of XLA's after it
  // (cuda/staged/exchange_kernel.h). The output is one block.
  SumType sum = SumType::kNone;
};

// Validates the spec; returns an empty string or a message saying what is wrong.
std::string ValidateSpec(const OpSpec& spec);

// The steps `spec.rank` executes, in order. Peers are visited in rotated order
// (rank+1, rank+2, ...) so at any moment each rank reads from a different peer.
std::vector<Step> MakePlan(const OpSpec& spec, const PlanOptions& options);

// Output bytes of one rank for this spec.
size_t OutputBytes(const OpSpec& spec);

}  // namespace hoccl

#endif  // JAX_HOCCL_PLAN_H_
