// The rendezvous of a group whose ranks live in several processes of one node: one POSIX
// shared-memory segment per group (mode 0600, named from the job's secret, cc/job.h), in
// which every rank owns a ring of entries. A call publishes an entry {key, what, payload} and
// finds each peer's entry with the same key; a peer releases an entry when it is done with
// it, and the owner reuses it only once every peer has. No Python and no network per call.
//
// Guarantees, as in one process (communicator.h): a peer that does not come within
// JAX_HOCCL_TIMEOUT_S, or whose process exits, ends the wait with an error naming the op, the
// ranks, their processes and the missing peers; a peer that publishes the same key with a
// different `what` (another op, dtype, size or group at the same point) is an immediate error
// naming both calls. A failure breaks the group for every rank, in every process: the rank
// that gives up records who it is and why in the shared segment (Fail), and every rank's next
// call in the group (or its wait in progress) fails at once with that reason (Broken).
//
// The segment's name is unlinked as soon as every rank has attached (a killed process leaves
// nothing in /dev/shm after that); names this process created and that are still linked are
// unlinked at exit.
#ifndef JAX_HOCCL_NODE_RENDEZVOUS_H_
#define JAX_HOCCL_NODE_RENDEZVOUS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace hoccl {

// Entries per rank: independent calls in flight at once (XLA:CPU may run several).
constexpr int kRingEntries = 16;
// What a transport attaches to an entry (CPU: its staging segment; CUDA: buffer ranges).
constexpr int kPayloadWords = 32;

// Pairs the ranks' calls: (instruction, n-th call of it) on CPU, (0, sequence) on CUDA, where
// every rank issues its calls in one order; (kSetupKey, id) for one-time exchanges.
struct CallKey {
  uint64_t a = 0, b = 0;
  bool operator==(const CallKey& o) const { return a == o.a && b == o.b; }
};
constexpr uint64_t kSetupKey = ~uint64_t{0};

struct PeerEntry {
  int index = -1;  // in the owner's ring; pass to Release
  uint64_t payload[kPayloadWords] = {};
};

class NodeRendezvous {
 public:
  // The rendezvous of the group `device_ids` (global ids in rank order), attached once per
  // process for the ranks this process holds (cc/job.h). `op` names the caller in errors.
  static std::string Get(const std::vector<int64_t>& device_ids, const char* op,
                         NodeRendezvous** out);

  int size() const { return n_; }
  int processes() const { return processes_; }           // distinct processes holding the ranks
  bool Local(int rank) const;                            // whether this process holds `rank`
  const std::string& name() const { return name_; }      // the segment's (unlinked) name
  const std::string& secret() const { return secret_; }  // the job's (cc/job.h)

  // Publishes `rank`'s entry for `key`; waits for a free ring entry if all are in use. `fill`
  // runs first with the entry's index: it prepares what the entry points to (e.g. copies the
  // input into that entry's staging) and writes the payload; its error aborts the publish.
  using Fill = std::function<std::string(int index, uint64_t* payload)>;
  std::string Publish(int rank, CallKey key, const std::string& what, const Fill& fill, int* index,
                      const char* op);
  // Waits for `peer`'s entry for `key`, checks its `what` equals mine, returns its payload.
  std::string Find(int rank, int peer, CallKey key, const std::string& what, PeerEntry* out,
                   const char* op);
  // I am done with `peer`'s entry `index` (its owner may reuse it and what it points to).
  void Release(int peer, int index);
  // Waits until every peer released my entry `index` (a setup barrier: all have used it).
  std::string WaitReleased(int rank, int index, const char* op);
  // For a transport that waits on memory of its own (cpu/staged_lane.h): this class's wait for
  // `ready` (the timeout, a peer's exit and the broken group end it, with this class's
  // messages naming `peers`), and a rank's description.
  std::string Wait(int rank, const std::vector<int>& peers, const char* op,
                   const std::string& waiting_for, const std::function<bool()>& ready);
  std::string DescribeRank(int rank) const { return Describe(rank); }

  // Declares the group unusable for every rank: records `rank`'s `reason` in the shared
  // segment (the first reason recorded wins) and, when JAX_HOCCL_FAILURE_LOG names a file (the
  // launcher's), appends "pid<TAB>reason" to it. Returns the error for this call `op`: the
  // reason, or the first one if another rank gave up before.
  std::string Fail(int rank, const char* op, const std::string& reason);
  // "" while the group is usable; else the error for this process's call `op`: the reason
  // itself where this process gave up, else naming the rank that gave up and its reason.
  std::string Broken(const char* op);
  // Whether a rank gave up on the group (Broken's cheap test, for calls on the fast path).
  bool Failed() const;
  // The number of my entries still published and not yet released by every peer.
  int LiveEntries(int rank);
  // The n-th call of CPU instruction `key` by `rank` (0, 1, ...).
  uint64_t NextCount(int rank, uint64_t key);
  // A counter in `owner`'s entry `index` for its transport (cpu_cross_process.cc: staging opens).
  std::atomic<int32_t>* Opens(int owner, int index);

  struct Segment;
  NodeRendezvous(std::string name, std::string secret, int n, std::vector<int64_t> device_ids,
                 Segment* seg)
      : name_(std::move(name)),
        secret_(std::move(secret)),
        n_(n),
        device_ids_(std::move(device_ids)),
        seg_(seg) {
    Count();
  }

 private:
  std::string Describe(int rank) const;
  std::string PublishedBy(int peer) const;
  void Count();  // processes_, local_
  // Waits until `ready` is true; "" or the timeout / peer-exit error (naming `waiting_for`).
  template <typename Pred>
  std::string WaitFor(int rank, const std::vector<int>& peers, const char* op,
                      const std::string& waiting_for, Pred ready);

  const std::string name_;
  const std::string secret_;
  const int n_;
  const std::vector<int64_t> device_ids_;
  Segment* seg_;
  int processes_ = 0;
  std::vector<bool> local_;
  std::mutex publish_mu_;  // one publisher at a time (ranks of this process share the lock)
  std::mutex mu_;          // counts_
  std::map<std::pair<int, uint64_t>, uint64_t> counts_;
};

// Whether process `pid` is gone, or a zombie its parent has not reaped yet.
bool PeerProcessExited(int pid);

// Names of shared memory this process created and has not yet unlinked (tests: nothing is
// left behind); unlinks them all.
std::vector<std::string> LinkedSharedMemory();
void UnlinkSharedMemory();

// Creates (O_EXCL, mode 0600) or opens the POSIX shared memory `name` of `bytes` and maps it.
// The creator's name is remembered for UnlinkSharedMemory until unlinked with Unlink().
std::string MapShared(const std::string& name, size_t bytes, bool create, void** addr);
void Unlink(const std::string& name);

}  // namespace hoccl

#endif  // JAX_HOCCL_NODE_RENDEZVOUS_H_
