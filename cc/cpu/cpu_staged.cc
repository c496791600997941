#include "cpu/cpu_staged.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "communicator.h"
#include "cpu/staged_lane.h"
#include "node_rendezvous.h"

namespace hoccl {
namespace {

// Read once; environment.py checked it is an integer >= 0.
size_t StagedBytes() {
  static const size_t bytes = [] {
    const char* v = std::getenv("JAX_HOCCL_STAGED_BYTES");
    return (v && *v) ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : size_t{1} << 20;
  }();
  return bytes;
}

// The bytes one rank sends one peer (plan.cc's blocks).
size_t BlockBytes(const OpSpec& spec) {
  return spec.op == OpKind::kAllToAll ? spec.bytes / spec.group_size : spec.bytes;
}

// Waits for peers' flags on this thread this long before a pool thread takes the wait over:
// peers running in step arrive within microseconds, and a pool thread costs a wake-up.
constexpr auto kInlineWait = std::chrono::microseconds(100);

std::atomic<uint64_t> g_staged_calls{0};

uint32_t Hash(const std::string& s) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 16777619u;
  return h | 1;  // never 0, the value of a flag no call has written
}

// One call of a lane by one rank, from its count to its completion.
struct Call {
  OpSpec spec;
  uint64_t instruction;
  uint32_t hash;
  std::string what, op;
  const void* input;
  void* output;
  std::function<void(const std::string&)> done;
  StagedLane* lane = nullptr;
  int rank = spec.rank, parity = 0;
  uint64_t ticket = 0;
  std::vector<int> missing;  // peers whose flags have not come
  std::string mismatch;

  StagedRank& me() const { return lane->Rank(rank); }

  // The call's count (so its parity) and its turn among this rank's calls of the lane.
  void TakeTurn() {
    StagedRank& r = me();
    std::lock_guard<std::mutex> lock(r.mu);
    parity = static_cast<int>(lane->rv().NextCount(rank, instruction) & 1);
    ticket = r.tickets++;
  }
  bool MyTurn() const { return me().done.load(std::memory_order_acquire) == ticket; }

  // In its turn: the routes of this spec (made again only when it changed), steps 1 and 2.
  void Begin() {
    StagedRank& r = me();
    if (r.routes.push.empty() || !SameSpec(r.routes.spec, spec)) r.routes = MakeStagedRoutes(spec);
    PushAndSignal();
  }

  // Steps 1 and 2 of the protocol: my blocks into my peers' slots, then every peer's flag.
  void PushAndSignal() {
    StagedRank& r = me();
    const int n = lane->size();
    const char* in = static_cast<const char*>(input);
    for (int k = 1; k < n; ++k) {
      const int d = (rank + k) % n;
      const StagedRoutes::Block& b = r.routes.push[d];
      if (b.bytes) std::memcpy(lane->Slot(d, parity, rank), in + b.src_offset, b.bytes);
    }
    for (int k = 1; k < n; ++k) {
      StagedFlag& f = lane->Flag((rank + k) % n, parity, rank);
      if (f.call.load(std::memory_order_relaxed) != hash) {
        std::snprintf(f.what, kStagedWhatBytes, "%s", what.c_str());
        f.call.store(hash, std::memory_order_relaxed);
      }
      f.ready.store(1, std::memory_order_release);
    }
    missing.clear();
    for (int k = 1; k < n; ++k) missing.push_back((rank + k) % n);
  }

  // Step 3, without waiting: takes (and resets) the flags that came; true when all have.
  bool TakeFlags() {
    for (auto it = missing.begin(); it != missing.end();) {
      StagedFlag& f = lane->Flag(rank, parity, *it);
      if (f.ready.load(std::memory_order_acquire) != 1) {
        ++it;
        continue;
      }
      if (f.call.load(std::memory_order_relaxed) != hash && mismatch.empty()) {
        char theirs[kStagedWhatBytes];
        std::snprintf(theirs, sizeof theirs, "%s", f.what);
        mismatch = "jax_hoccl " + op +
                   ": mismatched collectives: " + lane->rv().DescribeRank(rank) + " called " +
                   what + ", but " + lane->rv().DescribeRank(*it) + " called " + theirs +
                   " at the same point. Every process must call the same collectives, with the "
                   "same shapes and dtypes, in the same order. This group is now unusable.";
      }
      f.ready.store(0, std::memory_order_relaxed);  // before my next flag write (release)
      it = missing.erase(it);
    }
    return missing.empty();
  }

  // Step 4: my peers' blocks out of my slots, then my own block and zero fills.
  void CopyOut() {
    StagedRank& r = me();
    const int n = lane->size();
    char* out = static_cast<char*>(output);
    for (int k = 1; k < n; ++k) {
      const int s = (rank + k) % n;
      const StagedRoutes::Block& b = r.routes.pull[s];
      if (b.bytes) std::memcpy(out + b.dst_offset, lane->Slot(rank, parity, s), b.bytes);
    }
    const char* in = static_cast<const char*>(input);
    for (const Step& s : r.routes.local) {
      if (s.kind == StepKind::kCopy) {
        std::memcpy(out + s.dst_offset, in + s.src_offset, s.bytes);
      } else {
        std::memset(out + s.dst_offset, 0, s.bytes);
      }
    }
  }

  void Finish(std::string err) {
    if (err.empty() && !mismatch.empty()) err = lane->rv().Fail(rank, op.c_str(), mismatch);
    if (err.empty()) {
      CopyOut();
      ++g_staged_calls;
    } else {
      lane->UnlinkAll();  // the group is broken: no peer is to open them any more
    }
    me().done.store(ticket + 1, std::memory_order_release);
    done(err);
  }

  // The rest of the call on a pool thread: the turn of this call, then steps 1-4.
  void RunWaiting(bool pushed) {
    NodeRendezvous& rv = lane->rv();
    std::vector<int> self;
    // My previous call of this lane ends within its own timeout, or breaks the group.
    std::string err =
        rv.Wait(rank, self, op.c_str(), "the previous " + what, [&] { return MyTurn(); });
    if (err.empty()) err = rv.Broken(op.c_str());
    if (err.empty() && !pushed) Begin();
    if (err.empty())
      err = StagedWait(rv, rank, missing, op.c_str(), what, what, [&] { return TakeFlags(); });
    Finish(err);
  }
};

}  // namespace

bool RunCpuStaged(const OpSpec& spec, const std::vector<int64_t>& device_ids, uint64_t instruction,
                  const std::string& what, const void* input, void* output, const std::string& op,
                  std::function<void(const std::string&)> done) {
  const size_t block = BlockBytes(spec);
  if (StagedBytes() == 0 || block > StagedBytes()) return false;
  StagedLane* lane = StagedLane::Find(device_ids, instruction);
  // A site shared by a cond's branches (job.h) is one lane: its first call sized the slots, and
  // a larger call later takes the rendezvous (on every rank alike: they make the same call).
  if (lane && block > lane->capacity()) return false;
  auto call = std::make_shared<Call>(
      Call{spec, instruction, Hash(what), what, op, input, output, std::move(done)});
  if (!lane) {  // the lane's first call in this process: set it up on a pool thread
    RunDetached([call, device_ids, block] {
      NodeRendezvous* rv = nullptr;
      const char* op = call->op.c_str();
      std::string err = NodeRendezvous::Get(device_ids, op, &rv);
      if (err.empty())
        err = StagedLane::Get(*rv, device_ids, call->instruction, block, call->rank, call->what, op,
                              &call->lane);
      if (!err.empty()) return call->done(err);
      call->TakeTurn();
      call->RunWaiting(false);
    });
    return true;
  }
  call->lane = lane;
  std::string err = lane->rv().Broken(call->op.c_str());
  if (!err.empty()) {
    call->done(err);
    return true;
  }
  call->TakeTurn();
  if (!call->MyTurn()) {  // my previous call of this lane still runs (another execution)
    RunDetached([call] { call->RunWaiting(false); });
    return true;
  }
  call->Begin();
  const auto give_up = std::chrono::steady_clock::now() + kInlineWait;
  while (!call->TakeFlags()) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (std::chrono::steady_clock::now() > give_up) {
      RunDetached([call] { call->RunWaiting(true); });
      return true;
    }
  }
  call->Finish("");
  return true;
}

uint64_t StagedCalls() { return g_staged_calls.load(); }

}  // namespace hoccl
