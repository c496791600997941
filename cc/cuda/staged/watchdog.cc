#include "cuda/staged/watchdog.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/staged/staged_exchange.h"
#include "cuda/staged/staged_layout.h"
#include "job.h"
#include "node_rendezvous.h"

namespace hoccl {
namespace {

using Clock = std::chrono::steady_clock;

// How often the thread looks, and how long a lane may stand still before its flags are read
// (a peer at another call is reported then, not after the timeout).
constexpr auto kPoll = std::chrono::milliseconds(10);
constexpr auto kCheckFlags = std::chrono::seconds(1);

struct LaneWatch {
  uint64_t last = 0;
  Clock::time_point since = Clock::now();
  Clock::time_point checked;
};

struct Watched {
  Communicator* comm;
  RankState* st;
  int rank;
  LaneWatch lanes[kLanes];
  bool fired = false;
  // Stall reports of captured calls' kernels (CheckStall).
  uint64_t stall_beats = 0;
  bool stalled = false;
  Clock::time_point stall_last, stall_since;
};

std::mutex g_mu;
std::vector<std::unique_ptr<Watched>>& All() {
  static auto* all = new std::vector<std::unique_ptr<Watched>>();
  return *all;
}

// The watchdog's own stream on `device` (reads and writes flags beside the stuck stream).
cudaStream_t StreamFor(int device) {
  static std::map<int, cudaStream_t> streams;
  cudaStream_t& s = streams[device];
  if (!s && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) s = nullptr;
  return s;
}

// Whether this group's waits are the exchange kernel's, judged from its stall reports and
// ended through the mapped broken word, with no CUDA call (staged_exchange.h).
bool HostVerdicts(const Watched& w) { return StagedKernelServes(w.comm->size()); }

// Each peer's ready flag of a lane's slot set, as one value: one naming another call if any of
// its CTAs' flags does, else `expected` if any is raised, else 0.
std::string ReadFlags(const Watched& w, int lane, int parity, uint64_t expected,
                      std::vector<uint64_t>* flags) {
  const int n = w.comm->size();
  std::vector<uint64_t> all(static_cast<size_t>(n) * kChunkFlags, 0);
  flags->assign(n, 0);
  HOCCL_CUDA_RETURN(cudaSetDevice(w.st->device));
  cudaStream_t s = StreamFor(w.st->device);
  if (!s) return "no watchdog stream";
  HOCCL_CUDA_RETURN(
      cudaMemcpyAsync(all.data(), StagedFlag(w.st->peer_base[w.rank], n, SlotSet(lane, parity), 0),
                      all.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
  HOCCL_CUDA_RETURN(cudaStreamSynchronize(s));
  for (int q = 0; q < n; ++q)
    for (int c = 0; c < kChunkFlags; ++c) {
      const uint64_t v = all[static_cast<size_t>(q) * kChunkFlags + c];
      if (v && v != expected) (*flags)[q] = v;
      if (v == expected && !(*flags)[q]) (*flags)[q] = v;
    }
  HOCCL_TRACE("watchdog: rank %d lane %d read its flags\n", w.rank, lane);
  return "";
}

// Every exchange kernel's wait of this rank ends (exchange_kernel.h: the broken word).
void SetBroken(const Watched& w) { w.st->host_words->broken = 1; }

// Ends the stuck waits myself: the exchange kernels see the broken word and stop waiting; the
// stream memory operations' waits see every peer's flag of the stuck call raised. Either way
// that call and the calls behind it pass one by one (the group is broken, so no new call is
// enqueued).
void Release(const Watched& w, int lane, uint64_t call) {
  if (HostVerdicts(w)) {  // every kernel, running or queued, ends its waits by itself
    SetBroken(w);
    return;
  }
  const int n = w.comm->size();
  const int parity = static_cast<int>(call & 1);
  std::vector<uint64_t> values(kChunkFlags,
                               w.st->staged[lane].values[call % StagedLaneState::kNamed]);
  if (cudaSetDevice(w.st->device) != cudaSuccess) return;
  cudaStream_t s = StreamFor(w.st->device);
  if (!s) return;
  for (int q = 0; q < n; ++q)
    if (q != w.rank)
      cudaMemcpyAsync(StagedFlag(w.st->peer_base[w.rank], n, SlotSet(lane, parity), q),
                      values.data(), values.size() * sizeof(uint64_t), cudaMemcpyHostToDevice, s);
  cudaStreamSynchronize(s);
  HOCCL_TRACE("watchdog: rank %d lane %d released call %llu\n", w.rank, lane,
              static_cast<unsigned long long>(call));
}

// The pid of the process that holds rank q's device, when another process of this node does.
int PeerPid(const Communicator& comm, int q) {
  const JobInfo job = Job();
  const int process = ProcessOf(comm.device_ids()[q]);
  if (process == job.process_index || process < 0 ||
      process >= static_cast<int>(job.process_pids.size()))
    return 0;
  return job.process_pids[process];
}

bool Exited(int pid) { return PeerProcessExited(pid); }

std::string Who(const Communicator& comm, const std::vector<int>& ranks) {
  std::string out;
  for (int q : ranks) {
    out += (out.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) + " (device " +
           std::to_string(comm.device_ids()[q]);
    if (const int pid = PeerPid(comm, q))
      out += ", process " + std::to_string(ProcessOf(comm.device_ids()[q])) + " pid " +
             std::to_string(pid) + (Exited(pid) ? ", which has exited" : "");
    out += ")";
  }
  return out;
}

void Fire(Watched& w, int lane, const OpLabel& label, const std::string& why) {
  const std::string name = label.Name();
  const std::string msg =
      "jax_hoccl " + name + " (rank " + std::to_string(w.rank) + " of " +
      std::to_string(w.comm->size()) + ", CUDA device " + std::to_string(w.st->device) +
      ", staged path, lane " + std::to_string(lane) + "): " + why +
      ". The watchdog released the wait on the GPU (that call's result is not valid); every "
      "later jax_hoccl call in this group fails with this error.";
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  w.comm->Break(msg);
  if (w.st->node) w.st->node->Fail(w.rank, name.c_str(), msg);
  w.fired = true;
}

void Fire(Watched& w, int lane, uint64_t call, const std::string& why) {
  Fire(w, lane, w.st->staged[lane].names[call % StagedLaneState::kNamed], why);
}

// The verdict on a kernel's wait from its stall reports (StagedHostWords: the sender it waits
// on, what that flag holds), or "" while there is none yet. `reported`: a kernel reported
// lately (else only the timeout can be judged); `where` is "" or " inside a CUDA graph".
std::string StallVerdict(const Watched& w, bool reported, double seconds, const char* where) {
  const StagedHostWords& h = *w.st->host_words;
  const int q = (w.rank + 1 + h.stall_sender) % w.comm->size();
  const uint64_t seen = h.stall_seen, expected = h.stall_expected;
  if (reported && seen && seen != expected)
    return std::string("mismatched collectives") + where + ": " + Who(*w.comm, {q}) + " is in " +
           DescribeStagedFlag(seen) + " at the same point, this rank in " +
           DescribeStagedFlag(expected);
  if (reported && Exited(PeerPid(*w.comm, q)))
    return std::string("lost its peer(s) while waiting on the GPU") + where + ": the process of " +
           Who(*w.comm, {q}) + " exited";
  if (seconds >= TimeoutSeconds())
    return "timed out after " + std::to_string(static_cast<int>(TimeoutSeconds())) +
           " s (JAX_HOCCL_TIMEOUT_S) waiting on the GPU" + where + " for " +
           (reported ? Who(*w.comm, {q}) : std::string("its peers")) +
           " to reach this call; every peer must call the same collectives in the same order";
  return "";
}

// A lane's stuck call judged from the kernels' stall reports (HostVerdicts).
void JudgeFromReports(Watched& w, int lane, uint64_t call, double seconds) {
  const std::string why = StallVerdict(w, w.stalled, seconds, "");
  if (why.empty()) return;
  Fire(w, lane, call, why);
  SetBroken(w);
}

void Check(Watched& w, int lane, Clock::time_point now) {
  LaneWatch& lw = w.lanes[lane];
  const uint64_t enqueued = w.st->staged[lane].enqueued.load(std::memory_order_acquire);
  const uint64_t done = w.st->progress[lane];
  if (done >= enqueued || done != lw.last) {
    lw.last = done;
    lw.since = now;
    return;
  }
  if (w.fired) {  // keep releasing what is still queued behind
    Release(w, lane, done);
    return;
  }
  const auto stuck = now - lw.since;
  const uint64_t expected = w.st->staged[lane].values[done % StagedLaneState::kNamed];
  const double seconds = std::chrono::duration<double>(stuck).count();
  if (stuck >= kCheckFlags && now - lw.checked >= kCheckFlags) {
    lw.checked = now;
    HOCCL_TRACE("watchdog: rank %d lane %d stands at call %llu of %llu for %.1f s\n", w.rank, lane,
                static_cast<unsigned long long>(done), static_cast<unsigned long long>(enqueued),
                seconds);
    if (HostVerdicts(w)) {
      JudgeFromReports(w, lane, done, seconds);
      return;
    }
    std::vector<uint64_t> flags;
    if (ReadFlags(w, lane, static_cast<int>(done & 1), expected, &flags).empty()) {
      for (int q = 0; q < w.comm->size(); ++q) {
        if (q == w.rank || flags[q] == 0 || flags[q] == expected) continue;
        Fire(w, lane, done,
             "mismatched collectives: " + Who(*w.comm, {q}) + " is in " +
                 DescribeStagedFlag(flags[q]) + " at the same point, this rank in " +
                 DescribeStagedFlag(expected));
        Release(w, lane, done);
        return;
      }
      std::vector<int> missing, exited;
      for (int q = 0; q < w.comm->size(); ++q) {
        if (q == w.rank || flags[q] != 0) continue;
        missing.push_back(q);
        if (Exited(PeerPid(*w.comm, q))) exited.push_back(q);
      }
      if (!exited.empty()) {
        Fire(w, lane, done,
             "lost its peer(s) while waiting on the GPU: the process of " + Who(*w.comm, exited) +
                 " exited");
        Release(w, lane, done);
      } else if (seconds >= TimeoutSeconds()) {
        Fire(w, lane, done,
             "timed out after " + std::to_string(static_cast<int>(TimeoutSeconds())) +
                 " s (JAX_HOCCL_TIMEOUT_S) waiting on the GPU for " +
                 (missing.empty() ? std::string("its peers") : Who(*w.comm, missing)) +
                 " to reach this call; every peer must call the same collectives in the same "
                 "order");
        Release(w, lane, done);
      }
    }
  }
}

// A captured call's exchange kernel reports its waits of more than a second itself (a replayed
// graph leaves no host-side count to watch): the same verdicts, from what it reports.
void CheckStall(Watched& w, Clock::time_point now) {
  StagedHostWords& h = *w.st->host_words;
  const uint64_t beats = h.stall_beats;
  if (beats == w.stall_beats) {
    if (now - w.stall_last > 5 * kPoll + std::chrono::milliseconds(100)) w.stalled = false;
    return;
  }
  w.stall_beats = beats;
  w.stall_last = now;
  if (!w.stalled) {
    w.stalled = true;
    w.stall_since = now - kCheckFlags;  // the kernel waited a second before its first report
  }
  const int tag = h.stall_tag;
  if (w.fired || tag < 0 || tag >= RankState::kCapturedNames) return;
  const double seconds = std::chrono::duration<double>(now - w.stall_since).count();
  const std::string why = StallVerdict(w, true, seconds, " inside a CUDA graph");
  if (why.empty()) return;
  Fire(w, 0, w.st->captured_names[tag], why);
  SetBroken(w);
}

void Loop() {
  for (;;) {
    std::this_thread::sleep_for(kPoll);
    std::lock_guard<std::mutex> lock(g_mu);
    const Clock::time_point now = Clock::now();
    for (auto& w : All())
      if (w->st->progress) {
        for (int lane = 0; lane < kLanes; ++lane) Check(*w, lane, now);
        CheckStall(*w, now);
      }
  }
}

}  // namespace

void WatchStaged(Communicator* comm, RankState* st, int rank) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (All().empty()) std::thread(Loop).detach();
  auto w = std::make_unique<Watched>();
  w->comm = comm;
  w->st = st;
  w->rank = rank;
  All().push_back(std::move(w));
}

}  // namespace hoccl

namespace hoccl {

std::vector<std::tuple<int, int, uint64_t, uint64_t>> StagedLanes() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::tuple<int, int, uint64_t, uint64_t>> out;
  for (auto& w : All())
    for (int lane = 0; lane < kLanes; ++lane) {
      const uint64_t enqueued = w->st->staged[lane].enqueued.load(std::memory_order_acquire);
      if (enqueued && w->st->progress)
        out.emplace_back(w->rank, lane, enqueued, w->st->progress[lane]);
    }
  return out;
}

}  // namespace hoccl
