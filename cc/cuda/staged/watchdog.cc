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

std::string ReadFlags(const Watched& w, int lane, int parity, std::vector<uint64_t>* flags) {
  const int n = w.comm->size();
  flags->assign(n, 0);
  HOCCL_CUDA_RETURN(cudaSetDevice(w.st->device));
  cudaStream_t s = StreamFor(w.st->device);
  if (!s) return "no watchdog stream";
  HOCCL_CUDA_RETURN(cudaMemcpyAsync(
      flags->data(), StagedFlag(w.st->peer_base[w.rank], n, SlotSet(lane, parity), 0),
      n * sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
  HOCCL_CUDA_RETURN(cudaStreamSynchronize(s));
  HOCCL_TRACE("watchdog: rank %d lane %d read its flags\n", w.rank, lane);
  return "";
}

// Raises every peer's flag of the stuck call myself: its wait passes, and so will the calls
// behind it, one by one (the group is broken, so no new call is enqueued).
void Release(const Watched& w, int lane, uint64_t call) {
  const int n = w.comm->size();
  const int parity = static_cast<int>(call & 1);
  std::vector<uint64_t> values(n, w.st->staged[lane].values[call % StagedLaneState::kNamed]);
  if (cudaSetDevice(w.st->device) != cudaSuccess) return;
  cudaStream_t s = StreamFor(w.st->device);
  if (!s) return;
  uint64_t* mine = StagedFlag(w.st->peer_base[w.rank], n, SlotSet(lane, parity), 0);
  for (int q = 0; q < n; ++q)
    if (q != w.rank)
      cudaMemcpyAsync(mine + q, &values[q], sizeof(uint64_t), cudaMemcpyHostToDevice, s);
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

void Fire(Watched& w, int lane, uint64_t call, const std::string& why) {
  const StagedLaneState& sl = w.st->staged[lane];
  const std::string msg =
      std::string("jax_hoccl ") + sl.names[call % StagedLaneState::kNamed] + " (rank " +
      std::to_string(w.rank) + " of " + std::to_string(w.comm->size()) + ", CUDA device " +
      std::to_string(w.st->device) + ", staged path, lane " + std::to_string(lane) + "): " + why +
      ". The watchdog released the wait on the GPU (that call's result is not valid); every "
      "later jax_hoccl call in this group fails with this error.";
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  w.comm->Break(msg);
  if (w.st->node) w.st->node->Fail(w.rank, sl.names[call % StagedLaneState::kNamed], msg);
  w.fired = true;
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
    std::vector<uint64_t> flags;
    if (ReadFlags(w, lane, static_cast<int>(done & 1), &flags).empty()) {
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

void Loop() {
  for (;;) {
    std::this_thread::sleep_for(kPoll);
    std::lock_guard<std::mutex> lock(g_mu);
    const Clock::time_point now = Clock::now();
    for (auto& w : All())
      if (w->st->progress)
        for (int lane = 0; lane < kLanes; ++lane) Check(*w, lane, now);
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
