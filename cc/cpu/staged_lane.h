// The memory of one lane of the staged one-hop path across processes (cpu_staged.h): on CPU a
// lane is one custom-call instruction, the same in every process. For every rank q of the
// group, one POSIX shared-memory segment holds q's receive slots S_q[parity][sender] (C bytes
// each, C the lane's block bytes) and ready flags R_q[parity][sender]. q's process creates it
// at the lane's first call (mode 0600, named from the group's rendezvous name, which carries
// the job's secret, the instruction and q); every other process of the group maps it by name
// once, and the last one to map it unlinks the name. The mappings live as long as the process:
// a lane is an instruction of a compiled program, so there are as many as the programs have.
#ifndef JAX_HOCCL_CPU_STAGED_LANE_H_
#define JAX_HOCCL_CPU_STAGED_LANE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "node_rendezvous.h"
#include "plan.h"

namespace hoccl {

constexpr size_t kStagedWhatBytes = 200;

// The flag R_q[p][s], written by sender s, read and reset by q, and what s's call was (so a
// call that pairs with another collective is an error, not a silent wrong result).
struct alignas(64) StagedFlag {
  std::atomic<uint32_t> ready;  // 1: S_q[p][s] holds s's block of this call
  std::atomic<uint32_t> call;   // a hash of s's call description
  char what[kStagedWhatBytes];  // s's call description, rewritten when `call` changes
};

// Where one rank's blocks of a call go (from its plan, plan.h): my input's block for each
// destination, each sender's block in my output, and my own copy and zero fills.
struct StagedRoutes {
  struct Block {
    size_t src_offset = 0, dst_offset = 0, bytes = 0;  // bytes == 0: no data
  };
  OpSpec spec;              // what they were made for
  std::vector<Block> push;  // [d]: my input + src_offset -> S_d[p][me]
  std::vector<Block> pull;  // [s]: S_me[p][s] -> my output + dst_offset
  std::vector<Step> local;  // kCopy from my own input, kZero
};
StagedRoutes MakeStagedRoutes(const OpSpec& spec);
bool SameSpec(const OpSpec& a, const OpSpec& b);

// A rank's calls of one lane: they run one at a time, in the order of their counts.
struct StagedRank {
  std::mutex mu;                  // taking a call's count and ticket
  uint64_t tickets = 0;           // staged calls started (under mu)
  std::atomic<uint64_t> done{0};  // staged calls finished
  StagedRoutes routes;            // of the last call (used only by the running call)
};

class StagedLane {
 public:
  // The lane if this process has finished setting it up, else null; never waits.
  static StagedLane* Find(const std::vector<int64_t>& device_ids, uint64_t instruction);
  // The lane, set up at its first call: this process's ranks' segments created, every peer's
  // mapped (waiting within JAX_HOCCL_TIMEOUT_S for those that do not exist yet). `capacity`
  // (bytes per slot) and `what` come from the first call; a peer's segment made for another
  // capacity is a mismatch error naming its call.
  static std::string Get(NodeRendezvous& rv, const std::vector<int64_t>& device_ids,
                         uint64_t instruction, size_t capacity, int rank, const std::string& what,
                         const char* op, StagedLane** out);

  NodeRendezvous& rv() const { return *rv_; }
  size_t capacity() const { return capacity_; }
  int size() const { return n_; }
  char* Slot(int owner, int parity, int sender) const;
  StagedFlag& Flag(int owner, int parity, int sender) const;
  StagedRank& Rank(int rank) { return *ranks_[rank]; }
  // After a failure: unlinks every rank's name (a peer that never came leaves nothing behind).
  void UnlinkAll() const;

  StagedLane(NodeRendezvous* rv, std::string name, int n, size_t capacity);

 private:
  std::string SetUp(const std::vector<int64_t>& device_ids, int rank, const std::string& what,
                    const char* op);
  std::string SegmentName(int rank) const;

  NodeRendezvous* const rv_;
  const std::string name_;  // prefix of the segments' names
  const int n_;
  const size_t capacity_, stride_, bytes_;
  std::mutex setup_mu_;
  std::atomic<bool> ready_{false};
  std::vector<char*> segments_;  // [q]: rank q's segment in this process
  std::vector<std::unique_ptr<StagedRank>> ranks_;
};

// A staged rank's wait for its peers: NodeRendezvous::Wait over `ready`, which may shrink
// `missing` to the peers still missing (the error names those). A wait that outlasts a moment
// publishes `call` in the node rendezvous (under a key no call looks for), so that a peer's
// timeout says which call this rank is in.
std::string StagedWait(NodeRendezvous& rv, int rank, std::vector<int>& missing, const char* op,
                       const std::string& call, const std::string& waiting_for,
                       const std::function<bool()>& ready);

// Segments of staged lanes this process maps (tests: they stay flat over many calls).
size_t LiveStagedMappings();

}  // namespace hoccl

#endif  // JAX_HOCCL_CPU_STAGED_LANE_H_
