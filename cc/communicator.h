// A communicator: the ranks of one group (device ids in rank order) and the host-side
// rendezvous they use to meet once per collective. Keyed by (platform, device ids), so
// every group of a mesh axis gets its own; each rank keeps its own sequence counter, and
// because every rank runs the same SPMD program the counters agree without talking.
//
// The rendezvous slot for (communicator, sequence) carries each rank's input address
// ("direct" mode: peers copy straight between XLA's buffers). The CUDA engine meets there
// with blocking waits (Arrive/WaitArrived); the CPU engine with ArriveAsync, which blocks no
// thread. A wait that exceeds the deadline breaks the communicator: its counters are then
// out of step, so every later call fails fast with the original reason.
#ifndef JAX_HOCCL_COMMUNICATOR_H_
#define JAX_HOCCL_COMMUNICATOR_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hoccl {

// Seconds a rank waits for its peers before failing; env JAX_HOCCL_TIMEOUT_S (default 300).
double TimeoutSeconds();

class Communicator {
 public:
  Communicator(std::string key, std::vector<int64_t> device_ids);

  int size() const { return static_cast<int>(device_ids_.size()); }
  const std::vector<int64_t>& device_ids() const { return device_ids_; }
  const std::string& key() const { return key_; }

  // The next sequence number of `rank` (0, 1, 2, ...). The CUDA engine uses these as flag
  // values: they grow monotonically per communicator, and every rank's GPU program issues the
  // collectives in one order (XLA:GPU runs its thunks in schedule order).
  uint64_t NextSeq(int rank);
  // The rendezvous key of `rank`'s next call from `site`: the CPU engine passes the key of
  // the calling instruction (handlers_cpu.cc). XLA:CPU may run independent ops concurrently
  // and in a different order on each device, so calls pair by (instruction, n-th call of it)
  // instead of by global order, as XLA's own CPU collectives key by op id.
  uint64_t NextSeqAt(int rank, int64_t site);

  // Publish my input for `seq`; marks me arrived (= ready for every reader). The CUDA
  // engine's host rendezvous (DirectTransport in cuda_executor.cc).
  void Arrive(uint64_t seq, int rank, const void* input);

  // Wait until `peer` has arrived at `seq`. On timeout returns an error naming the op, my
  // rank and every rank still missing, and breaks the communicator.
  std::string WaitArrived(uint64_t seq, int rank, int peer, const char* op);
  // Non-blocking: has `peer` arrived at `seq`? (lets a caller spin briefly before blocking)
  bool HasArrived(uint64_t seq, int peer);

  const void* Input(uint64_t seq, int peer);

  // Rank is finished with `seq`; the slot is freed when every rank has left.
  void Leave(uint64_t seq, int rank);

  // Error text if an earlier timeout broke this communicator, else "".
  std::string Broken();
  // Breaks it with `msg` (kept if it was already broken): a failure seen outside the
  // rendezvous (the staged path's watchdog, cuda/staged/watchdog.h).
  void Break(const std::string& msg);

  // The CPU engine's rendezvous, which blocks no thread: XLA:CPU runs every device's thunks
  // on one shared pool, and handlers that block waiting for peers can take all its threads
  // while the peers' matching calls wait for one (a deadlock seen once calls were paired per
  // instruction). Each rank deposits its buffers and a completion; the last to arrive calls
  // `run` on its own thread with every rank's buffers, then every completion with run's error
  // ("" on success). A watchdog thread fails a rendezvous still missing ranks after
  // JAX_HOCCL_TIMEOUT_S (the message names the op, each waiting rank and the missing ones)
  // and breaks the communicator; calls on a broken communicator complete with its error.
  using Completion = std::function<void(const std::string& error)>;
  using RunAll = std::function<std::string(const std::vector<const void*>& inputs,
                                           const std::vector<void*>& outputs)>;
  void ArriveAsync(uint64_t seq, int rank, const char* op, const void* input, void* output,
                   Completion done, const RunAll& run);
  void ExpireAsync();  // the watchdog's check

  // One-time setup exchange of one pointer per rank (e.g. the address of each rank's device
  // flag array): publish `value` for `rank` under `name`, then wait until every rank has
  // published under that name and fill `all` (indexed by rank). Times out like WaitArrived.
  std::string ExchangeSetup(const std::string& name, int rank, void* value, std::vector<void*>* all,
                            const char* op);

 private:
  friend size_t LiveSlotCount();
  struct Slot {
    std::vector<const void*> inputs;
    std::vector<char> arrived;
    int left = 0;
  };
  struct AsyncSlot {
    std::vector<const void*> inputs;
    std::vector<void*> outputs;
    std::vector<char> arrived;
    std::vector<Completion> done;
    int count = 0;
    std::string op;  // the user's op, for the timeout message
    std::chrono::steady_clock::time_point since;
  };
  Slot& SlotFor(uint64_t seq);               // requires mu_
  std::string Fail(const std::string& msg);  // requires mu_
  std::string Describe(int rank) const;
  // The timeout error of `rank` at `seq`, naming the op and every rank not in `arrived`.
  std::string MissingPeers(const char* op, int rank, uint64_t seq,
                           const std::vector<char>& arrived) const;

  const std::string key_;
  const std::vector<int64_t> device_ids_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> next_seq_;
  std::map<std::pair<int64_t, int>, uint64_t> next_at_site_;  // (site, rank) -> count
  std::map<uint64_t, Slot> slots_;
  std::map<uint64_t, AsyncSlot> async_slots_;
  struct SetupEntry {
    std::vector<void*> values;
    std::vector<char> published;
  };
  std::map<std::string, SetupEntry> setup_;
  std::string broken_;
};

// The process-wide communicator for (platform, device ids); created on first use.
Communicator& GetCommunicator(const std::string& platform, const std::vector<int64_t>& ids);

// Runs `task` on a pool thread that may block (a new thread when none is idle): the CPU
// engine's cross-process calls wait for peers there, not on XLA's threads.
void RunDetached(std::function<void()> task);

// Number of live rendezvous slots over all communicators (tests check nothing leaks).
size_t LiveSlotCount();

}  // namespace hoccl

#endif  // JAX_HOCCL_COMMUNICATOR_H_
