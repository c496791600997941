#include "node_rendezvous.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <thread>

#include "communicator.h"
#include "job.h"

namespace hoccl {

// ---------------------------------------------------------------- the shared segment

namespace {

constexpr uint64_t kMagic = 0x6a61786f63636c31ull;  // "jaxoccl1"
constexpr size_t kWhatBytes = 200;

// One published call. Written only by its owner, under a sequence lock: `version` is odd
// while the owner writes, so a reader that saw the same even version before and after its
// reads saw a whole entry. Free when no reader is left (readers_left == 0).
struct Entry {
  std::atomic<uint64_t> version;
  std::atomic<int32_t> readers_left;
  std::atomic<int32_t> opens;  // transports' counter (cpu_cross_process.cc: staging opens)
  uint64_t key_a, key_b;
  char what[kWhatBytes];
  uint64_t payload[kPayloadWords];
};

// Why the group broke, written once by the rank that gave up (state 1 while it writes).
constexpr size_t kReasonBytes = 4096;
struct Failure {
  std::atomic<int32_t> state;  // 0: usable, 1: being recorded, 2: recorded
  int32_t rank, pid;
  char reason[kReasonBytes];
};

struct Box {
  std::atomic<int32_t> pid;  // of the process holding this rank, 0 until attached
  Entry ring[kRingEntries];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "atomics in shared memory");

}  // namespace

struct NodeRendezvous::Segment {
  std::atomic<uint64_t> magic;
  std::atomic<int32_t> attached;
  int32_t n;
  Failure failure;
  Box box[1];  // n of them
  static size_t Bytes(int n) { return sizeof(Segment) + (n - 1) * sizeof(Box); }
};

// ---------------------------------------------------------------- shared memory names

namespace {

std::mutex g_names_mu;
std::set<std::string>& LinkedNames() {
  static auto* names = new std::set<std::string>();
  return *names;
}

void UnlinkAtExit() { UnlinkSharedMemory(); }

std::string Errno(const char* what, const std::string& name) {
  return std::string(what) + "(" + name + ") failed: " + std::strerror(errno);
}

}  // namespace

std::string MapShared(const std::string& name, size_t bytes, bool create, void** addr) {
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return Errno("shm_open", name);
  if (create) {
    {
      std::lock_guard<std::mutex> lock(g_names_mu);
      static bool registered = (std::atexit(UnlinkAtExit), true);
      (void)registered;
      LinkedNames().insert(name);
    }
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      std::string e = Errno("ftruncate", name);
      close(fd);
      Unlink(name);
      return e;
    }
  } else {
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
      close(fd);
      return "shared memory " + name + " is not yet sized";
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);  // the mapping keeps the memory
  if (p == MAP_FAILED) return Errno("mmap", name);
  *addr = p;
  return "";
}

void Unlink(const std::string& name) {
  shm_unlink(name.c_str());
  std::lock_guard<std::mutex> lock(g_names_mu);
  LinkedNames().erase(name);
}

std::vector<std::string> LinkedSharedMemory() {
  std::lock_guard<std::mutex> lock(g_names_mu);
  std::vector<std::string> linked;
  for (auto it = LinkedNames().begin(); it != LinkedNames().end();) {
    // Another process of the group may have unlinked it (the last to map it does).
    if (access(("/dev/shm" + *it).c_str(), F_OK) == 0) {
      linked.push_back(*it++);
    } else {
      it = LinkedNames().erase(it);
    }
  }
  return linked;
}

void UnlinkSharedMemory() {
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(g_names_mu);
    names.assign(LinkedNames().begin(), LinkedNames().end());
  }
  for (const std::string& name : names) Unlink(name);
}

// ---------------------------------------------------------------- attaching

namespace {

std::string GroupHash(const std::vector<int64_t>& ids) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the ids
  for (int64_t id : ids) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(id >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string IdsText(const std::vector<int64_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

std::chrono::steady_clock::duration TimeoutDuration() {
  return std::chrono::microseconds(static_cast<int64_t>(TimeoutSeconds() * 1e6));
}

// Spins briefly, then yields, then sleeps: peers usually arrive within microseconds, and a
// long wait should not burn a core.
void Backoff(int iteration) {
  if (iteration < 2000) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else if (iteration < 4000) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Gone, or a zombie its parent has not reaped yet (a launcher may wait on another child).
bool ProcessExited(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64], buf[256];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  size_t len = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[len] = '\0';
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) S ..."
  return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

}  // namespace

bool PeerProcessExited(int pid) { return ProcessExited(pid); }

std::string NodeRendezvous::Get(const std::vector<int64_t>& device_ids, const char* op,
                                NodeRendezvous** out) {
  static std::mutex mu;
  static auto* all = new std::map<std::vector<int64_t>, std::unique_ptr<NodeRendezvous>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*all)[device_ids];
  if (slot) {
    *out = slot.get();
    return slot->Broken(op);
  }
  const JobInfo job = Job();
  if (job.secret.empty())
    return std::string("jax_hoccl ") + op + ": the group [" + IdsText(device_ids) +
           "] spans processes, but this process joined no job (jax.distributed)";
  const int n = static_cast<int>(device_ids.size());
  const std::vector<int> local_ranks = LocalRanks(device_ids);
  const std::string name = "/jax_hoccl-" + job.secret.substr(0, 32) + "-" + GroupHash(device_ids);
  const size_t bytes = Segment::Bytes(n);
  const bool creator = !local_ranks.empty() && local_ranks.front() == 0;
  void* addr = nullptr;
  std::string err;
  const auto deadline = std::chrono::steady_clock::now() + TimeoutDuration();
  if (creator) {
    err = MapShared(name, bytes, true, &addr);
    if (err.empty()) {
      auto* seg = static_cast<Segment*>(addr);  // zero-filled by ftruncate
      seg->n = n;
      seg->magic.store(kMagic, std::memory_order_release);
    }
  } else {
    // Rank 0's process creates it; wait for it (the whole timeout: processes start unevenly).
    for (int i = 0;; ++i) {
      err = MapShared(name, bytes, false, &addr);
      if (err.empty() &&
          static_cast<Segment*>(addr)->magic.load(std::memory_order_acquire) == kMagic)
        break;
      if (err.empty()) munmap(addr, bytes);
      if (std::chrono::steady_clock::now() > deadline) {
        const int owner = ProcessOf(device_ids[0]);
        err = "jax_hoccl " + std::string(op) + ": timed out after " +
              std::to_string(static_cast<int>(TimeoutSeconds())) +
              " s (JAX_HOCCL_TIMEOUT_S) waiting for process " + std::to_string(owner) +
              " (rank 0, device " + std::to_string(device_ids[0]) + ") to set up group [" +
              IdsText(device_ids) + "]";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(i < 100 ? 1 : 10));
    }
  }
  if (!err.empty()) return err;
  auto* seg = static_cast<Segment*>(addr);
  for (int r : local_ranks) seg->box[r].pid.store(getpid(), std::memory_order_release);
  // The last rank to attach unlinks the name: from then on only mappings hold the segment.
  if (seg->attached.fetch_add(static_cast<int32_t>(local_ranks.size())) +
          static_cast<int32_t>(local_ranks.size()) ==
      n) {
    Unlink(name);
  }
  slot = std::make_unique<NodeRendezvous>(name, job.secret, n, device_ids, seg);
  *out = slot.get();
  return "";
}

void NodeRendezvous::Count() {
  std::set<int> procs;
  for (int64_t id : device_ids_) procs.insert(ProcessOf(id));
  processes_ = static_cast<int>(procs.size());
  local_.assign(n_, false);
  for (int r : LocalRanks(device_ids_)) local_[r] = true;
}

bool NodeRendezvous::Local(int rank) const { return local_[rank]; }

// ---------------------------------------------------------------- calls

std::string NodeRendezvous::Describe(int rank) const {
  const int pid = seg_->box[rank].pid.load(std::memory_order_acquire);
  return "rank " + std::to_string(rank) + " (device " + std::to_string(device_ids_[rank]) +
         ", process " + std::to_string(ProcessOf(device_ids_[rank])) +
         (pid ? ", pid " + std::to_string(pid) : std::string()) + ")";
}

constexpr char kInNoCall[] = " (in no jax_hoccl call)";

// What `peer` has published and its peers have not all taken yet: the calls it is in.
std::string NodeRendezvous::PublishedBy(int peer) const {
  std::string calls;
  for (int i = 0; i < kRingEntries; ++i) {
    Entry& e = seg_->box[peer].ring[i];
    const uint64_t v = e.version.load(std::memory_order_acquire);
    if (v % 2 || e.readers_left.load(std::memory_order_acquire) == 0) continue;
    char seen[kWhatBytes];
    std::memcpy(seen, e.what, kWhatBytes);
    seen[kWhatBytes - 1] = '\0';
    if (e.version.load(std::memory_order_acquire) == v)
      calls += (calls.empty() ? "" : ", ") + std::string(seen);
  }
  return calls.empty() ? std::string(kInNoCall) : " (which is in " + calls + ")";
}

namespace {

// A line for the launcher (python -m jax_hoccl.launch), which ends the job on it: the file it
// watches, if it exists (never created here).
void ReportFailure(const std::string& reason) {
  const char* path = std::getenv("JAX_HOCCL_FAILURE_LOG");
  if (!path || !*path) return;
  const int fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return;
  std::string line = std::to_string(getpid()) + "\t" + reason;
  for (char& c : line)
    if (c == '\n') c = ' ';
  line += '\n';
  ssize_t written = write(fd, line.data(), line.size());  // one write: lines do not interleave
  (void)written;
  close(fd);
}

}  // namespace

std::string NodeRendezvous::Fail(int rank, const char* op, const std::string& reason) {
  Failure& f = seg_->failure;
  int32_t usable = 0;
  if (!f.state.compare_exchange_strong(usable, 1, std::memory_order_acq_rel)) {
    return Broken(op);  // another rank gave up first: its reason
  }
  f.rank = rank;
  f.pid = getpid();
  std::snprintf(f.reason, kReasonBytes, "%s", reason.c_str());
  f.state.store(2, std::memory_order_release);
  ReportFailure(reason);
  return reason;
}

bool NodeRendezvous::Failed() const {
  return seg_->failure.state.load(std::memory_order_acquire) != 0;
}

std::string NodeRendezvous::Broken(const char* op) {
  const Failure& f = seg_->failure;
  int32_t state = f.state.load(std::memory_order_acquire);
  if (state == 0) return "";
  // Being recorded: a few microseconds (unless the recording process was killed meanwhile).
  for (int i = 0; state == 1 && i < 100000; ++i) {
    std::this_thread::yield();
    state = f.state.load(std::memory_order_acquire);
  }
  const std::string prefix =
      std::string("jax_hoccl ") + op + ": group [" + IdsText(device_ids_) + "] is unusable: ";
  if (state != 2) return prefix + "a rank gave up on it; restart the job.";
  char reason[kReasonBytes];
  std::memcpy(reason, f.reason, kReasonBytes);
  reason[kReasonBytes - 1] = '\0';
  if (f.pid == getpid()) return reason;
  return prefix + Describe(f.rank) + " gave up on it: " + reason;
}

uint64_t NodeRendezvous::NextCount(int rank, uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_[{rank, key}]++;
}

template <typename Pred>
std::string NodeRendezvous::WaitFor(int rank, const std::vector<int>& peers, const char* op,
                                    const std::string& waiting_for, Pred ready) {
  if (ready()) return "";
  const auto start = std::chrono::steady_clock::now();
  const auto timeout = TimeoutDuration();
  for (int i = 0;; ++i) {
    if (ready()) return "";
    Backoff(i);
    if (i % 256 != 255) continue;
    std::string broken = Broken(op);
    if (!broken.empty()) return broken;
    const bool late = std::chrono::steady_clock::now() - start > timeout;
    std::string exited;
    for (int p : peers)
      if (ProcessExited(seg_->box[p].pid.load(std::memory_order_acquire)))
        exited += " " + Describe(p) + ";";
    if (!late && exited.empty()) continue;
    if (ready()) return "";
    std::string msg = std::string("jax_hoccl ") + op + ": " + Describe(rank) + " of group [" +
                      IdsText(device_ids_) + "] ";
    if (!exited.empty()) {
      msg += "lost its peer(s) while waiting for " + waiting_for + ": the process of" + exited +
             " exited.";
    } else {
      msg += "timed out after " + std::to_string(static_cast<int>(TimeoutSeconds())) +
             " s (JAX_HOCCL_TIMEOUT_S) waiting for " + waiting_for + " from peer(s):";
      bool idle = false;
      for (int p : peers) {
        const std::string calls = PublishedBy(p);
        idle = idle || calls == kInNoCall;
        msg += " " + Describe(p) + calls + ";";
      }
      msg += " every process must call the same collectives in the same order.";
      // A peer outside jax_hoccl may be stuck in XLA's compile, which jax_hoccl cannot see.
      if (idle)
        msg +=
            " A peer in no jax_hoccl call may be waiting in XLA's compile of another "
            "program: on GPU, sharded autotuning waits for every process "
            "(--xla_gpu_shard_autotuning=false ends that wait).";
    }
    return Fail(rank, op, msg + " This group is now unusable; restart the job.");
  }
}

std::string NodeRendezvous::Publish(int rank, CallKey key, const std::string& what,
                                    const Fill& fill, int* index, const char* op) {
  std::string broken = Broken(op);
  if (!broken.empty()) return broken;
  Box& box = seg_->box[rank];
  std::vector<int> peers;
  for (int p = 0; p < n_; ++p)
    if (p != rank) peers.push_back(p);
  // The lowest free entry, so a steady program reuses the same few (and their staging).
  std::lock_guard<std::mutex> publishing(publish_mu_);
  int free_index = -1;
  std::string err =
      WaitFor(rank, peers, op, "a free entry (peers still reading " + what + ")", [&] {
        for (int i = 0; i < kRingEntries; ++i)
          if (box.ring[i].readers_left.load(std::memory_order_acquire) == 0) {
            free_index = i;
            return true;
          }
        return false;
      });
  if (!err.empty()) return err;
  Entry& e = box.ring[free_index];
  uint64_t payload[kPayloadWords] = {};
  err = fill(free_index, payload);
  if (!err.empty()) return err;
  e.version.fetch_add(1, std::memory_order_acq_rel);  // odd: writing
  std::atomic_thread_fence(std::memory_order_release);
  e.key_a = key.a;
  e.key_b = key.b;
  std::snprintf(e.what, kWhatBytes, "%s", what.c_str());
  std::memcpy(e.payload, payload, sizeof(e.payload));
  e.readers_left.store(n_ - 1, std::memory_order_relaxed);
  e.version.fetch_add(1, std::memory_order_release);  // even: published
  *index = free_index;
  return "";
}

std::string NodeRendezvous::Find(int rank, int peer, CallKey key, const std::string& what,
                                 PeerEntry* out, const char* op) {
  std::string broken = Broken(op);
  if (!broken.empty()) return broken;
  Box& box = seg_->box[peer];
  std::string mismatch;
  std::string err = WaitFor(rank, {peer}, op, what, [&] {
    for (int i = 0; i < kRingEntries; ++i) {
      Entry& e = box.ring[i];
      const uint64_t v1 = e.version.load(std::memory_order_acquire);
      if (v1 % 2 || e.readers_left.load(std::memory_order_acquire) == 0) continue;
      if (e.key_a != key.a || e.key_b != key.b) continue;
      char seen[kWhatBytes];
      std::memcpy(seen, e.what, kWhatBytes);
      std::memcpy(out->payload, e.payload, sizeof(out->payload));
      std::atomic_thread_fence(std::memory_order_acquire);
      if (e.version.load(std::memory_order_relaxed) != v1) continue;  // rewritten meanwhile
      seen[kWhatBytes - 1] = '\0';
      if (what != seen) mismatch = seen;
      out->index = i;
      return true;
    }
    return false;
  });
  if (!err.empty()) return err;
  if (!mismatch.empty()) {
    Release(peer, out->index);
    return Fail(rank, op,
                std::string("jax_hoccl ") + op + ": mismatched collectives in group [" +
                    IdsText(device_ids_) + "]: " + Describe(rank) + " called " + what + ", but " +
                    Describe(peer) + " called " + mismatch +
                    " at the same point. Every process must call the same collectives, with the "
                    "same shapes and dtypes, in the same order. This group is now unusable.");
  }
  return "";
}

void NodeRendezvous::Release(int peer, int index) {
  seg_->box[peer].ring[index].readers_left.fetch_sub(1, std::memory_order_acq_rel);
}

std::string NodeRendezvous::WaitReleased(int rank, int index, const char* op) {
  std::string broken = Broken(op);
  if (!broken.empty()) return broken;
  std::vector<int> peers;
  for (int p = 0; p < n_; ++p)
    if (p != rank) peers.push_back(p);
  Entry& e = seg_->box[rank].ring[index];
  return WaitFor(rank, peers, op, "every peer to finish its one-time setup",
                 [&] { return e.readers_left.load(std::memory_order_acquire) == 0; });
}

std::string NodeRendezvous::Wait(int rank, const std::vector<int>& peers, const char* op,
                                 const std::string& waiting_for,
                                 const std::function<bool()>& ready) {
  return WaitFor(rank, peers, op, waiting_for, ready);
}

std::atomic<int32_t>* NodeRendezvous::Opens(int owner, int index) {
  return &seg_->box[owner].ring[index].opens;
}

int NodeRendezvous::LiveEntries(int rank) {
  int live = 0;
  for (int i = 0; i < kRingEntries; ++i)
    live += seg_->box[rank].ring[i].readers_left.load(std::memory_order_acquire) != 0;
  return live;
}

}  // namespace hoccl
