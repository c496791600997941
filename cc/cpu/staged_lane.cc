#include "cpu/staged_lane.h"

#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <utility>

#include "job.h"

namespace hoccl {

// ---------------------------------------------------------------- routes

StagedRoutes MakeStagedRoutes(const OpSpec& spec) {
  const int n = spec.group_size, me = spec.rank;
  StagedRoutes r;
  r.spec = spec;
  r.push.assign(n, {});
  r.pull.assign(n, {});
  for (const Step& s : MakePlan(spec, PlanOptions{})) {
    if (s.kind == StepKind::kCopy && s.peer != me) {
      r.pull[s.peer] = {s.src_offset, s.dst_offset, s.bytes};
    } else if (s.kind == StepKind::kCopy || s.kind == StepKind::kZero) {
      r.local.push_back(s);
    }
  }
  // What each destination's plan reads from my input is what I push to it.
  for (int d = 0; d < n; ++d) {
    if (d == me) continue;
    OpSpec theirs = spec;
    theirs.rank = d;
    for (const Step& s : MakePlan(theirs, PlanOptions{}))
      if (s.kind == StepKind::kCopy && s.peer == me) r.push[d] = {s.src_offset, 0, s.bytes};
  }
  return r;
}

bool SameSpec(const OpSpec& a, const OpSpec& b) {
  return a.op == b.op && a.group_size == b.group_size && a.rank == b.rank && a.bytes == b.bytes &&
         a.permute_dst == b.permute_dst && a.peers_only == b.peers_only &&
         a.at_source_slot == b.at_source_slot && a.in_place == b.in_place &&
         a.skip_own == b.skip_own;
}

// ---------------------------------------------------------------- the segments

namespace {

constexpr uint64_t kLaneMagic = 0x6a686f63636c736cull;  // "jhocclsl"
// The key of a waiting rank's notice in the node rendezvous: no call's key (CPU calls use
// instruction keys, setup exchanges kSetupKey).
constexpr uint64_t kNoticeKey = kSetupKey - 1;
// How long a staged wait lasts before it publishes its notice.
constexpr auto kNoticeAfter = std::chrono::milliseconds(1);

struct alignas(64) LaneHeader {
  std::atomic<uint64_t> magic;  // set last by the creator
  std::atomic<int32_t> opens;   // processes that mapped the segment; the last unlinks it
  int32_t n;
  uint64_t capacity;
  char what[kStagedWhatBytes];  // the creator's first call
};

std::atomic<size_t> g_live_mappings{0};

size_t RoundUp(size_t bytes) { return (bytes + 63) / 64 * 64; }

std::string IdsText(const std::vector<int64_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

std::mutex g_lanes_mu;
using LaneKey = std::pair<std::vector<int64_t>, uint64_t>;  // (group, instruction)
std::map<LaneKey, std::unique_ptr<StagedLane>>& Lanes() {
  static auto* lanes = new std::map<LaneKey, std::unique_ptr<StagedLane>>();
  return *lanes;
}

}  // namespace

StagedLane::StagedLane(NodeRendezvous* rv, std::string name, int n, size_t capacity)
    : rv_(rv),
      name_(std::move(name)),
      n_(n),
      capacity_(capacity),
      stride_(RoundUp(capacity)),
      bytes_(sizeof(LaneHeader) + 2 * n * (sizeof(StagedFlag) + stride_)),
      segments_(n, nullptr) {
  for (int q = 0; q < n; ++q) ranks_.push_back(std::make_unique<StagedRank>());
}

std::string StagedLane::SegmentName(int rank) const { return name_ + "-r" + std::to_string(rank); }

StagedFlag& StagedLane::Flag(int owner, int parity, int sender) const {
  char* flags = segments_[owner] + sizeof(LaneHeader);
  return reinterpret_cast<StagedFlag*>(flags)[parity * n_ + sender];
}

char* StagedLane::Slot(int owner, int parity, int sender) const {
  char* slots = segments_[owner] + sizeof(LaneHeader) + 2 * n_ * sizeof(StagedFlag);
  return slots + (parity * n_ + sender) * stride_;
}

void StagedLane::UnlinkAll() const {
  for (int q = 0; q < n_; ++q) Unlink(SegmentName(q));
}

StagedLane* StagedLane::Find(const std::vector<int64_t>& device_ids, uint64_t instruction) {
  std::lock_guard<std::mutex> lock(g_lanes_mu);
  auto it = Lanes().find({device_ids, instruction});
  if (it == Lanes().end() || !it->second->ready_.load(std::memory_order_acquire)) return nullptr;
  return it->second.get();
}

std::string StagedLane::Get(NodeRendezvous& rv, const std::vector<int64_t>& device_ids,
                            uint64_t instruction, size_t capacity, int rank,
                            const std::string& what, const char* op, StagedLane** out) {
  StagedLane* lane = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_lanes_mu);
    auto& slot = Lanes()[{device_ids, instruction}];
    if (!slot) {
      char hex[17];
      std::snprintf(hex, sizeof hex, "%llx", static_cast<unsigned long long>(instruction));
      slot = std::make_unique<StagedLane>(&rv, rv.name() + "-s" + hex,
                                          static_cast<int>(device_ids.size()), capacity);
    }
    lane = slot.get();
  }
  // One setup per lane and process; other lanes set up meanwhile (a peer may set up another
  // lane first and only then this one).
  std::lock_guard<std::mutex> setup(lane->setup_mu_);
  if (!lane->ready_.load(std::memory_order_acquire)) {
    std::string err = lane->SetUp(device_ids, rank, what, op);
    if (!err.empty()) {
      lane->UnlinkAll();
      return rv.Fail(rank, op, err);
    }
    lane->ready_.store(true, std::memory_order_release);
  }
  if (capacity > lane->capacity_)  // another rank of this process came with a larger block
    return rv.Fail(rank, op,
                   std::string("jax_hoccl ") + op + ": mismatched collectives in group [" +
                       IdsText(device_ids) + "]: " + rv.DescribeRank(rank) + " called " + what +
                       ", larger than the same call of another rank of this process.");
  *out = lane;
  return "";
}

std::string StagedLane::SetUp(const std::vector<int64_t>& device_ids, int rank,
                              const std::string& what, const char* op) {
  std::set<int> processes;
  for (int64_t id : device_ids) processes.insert(ProcessOf(id));
  const int users = static_cast<int>(processes.size());
  const std::vector<int> local = LocalRanks(device_ids);
  for (int q : local) {
    void* addr = nullptr;
    std::string err = MapShared(SegmentName(q), bytes_, true, &addr);
    if (!err.empty()) return std::string("jax_hoccl ") + op + ": " + err;
    ++g_live_mappings;
    auto* h = static_cast<LaneHeader*>(addr);  // zero-filled: every flag 0
    h->n = n_;
    h->capacity = capacity_;
    std::snprintf(h->what, kStagedWhatBytes, "%s", what.c_str());
    h->opens.store(1, std::memory_order_relaxed);
    h->magic.store(kLaneMagic, std::memory_order_release);
    segments_[q] = static_cast<char*>(addr);
  }
  std::vector<int> missing;
  for (int q = 0; q < n_; ++q)
    if (!segments_[q]) missing.push_back(q);
  std::string mismatch;
  std::string err = StagedWait(*rv_, rank, missing, op, what, "the staging of " + what, [&] {
    for (auto it = missing.begin(); it != missing.end();) {
      const std::string name = SegmentName(*it);
      void* addr = nullptr;
      // The header first: a segment made for another capacity has another size.
      if (!MapShared(name, sizeof(LaneHeader), false, &addr).empty()) {
        ++it;
        continue;
      }
      auto* h = static_cast<LaneHeader*>(addr);
      const bool made = h->magic.load(std::memory_order_acquire) == kLaneMagic;
      if (made && (h->capacity != capacity_ || h->n != n_)) {
        char theirs[kStagedWhatBytes];
        std::snprintf(theirs, sizeof theirs, "%s", h->what);
        mismatch = std::string("jax_hoccl ") + op + ": mismatched collectives in group [" +
                   IdsText(device_ids) + "]: " + rv_->DescribeRank(rank) + " called " + what +
                   ", but " + rv_->DescribeRank(*it) + " called " + theirs +
                   " at the same point. Every process must call the same collectives, with the "
                   "same shapes and dtypes, in the same order. This group is now unusable.";
      }
      munmap(addr, sizeof(LaneHeader));
      if (!mismatch.empty()) return true;
      if (!made || !MapShared(name, bytes_, false, &addr).empty()) {
        ++it;
        continue;
      }
      ++g_live_mappings;
      segments_[*it] = static_cast<char*>(addr);
      h = static_cast<LaneHeader*>(addr);
      if (h->opens.fetch_add(1, std::memory_order_acq_rel) + 1 == users) Unlink(name);
      it = missing.erase(it);
    }
    return missing.empty();
  });
  return mismatch.empty() ? err : mismatch;
}

// ---------------------------------------------------------------- waiting

std::string StagedWait(NodeRendezvous& rv, int rank, std::vector<int>& missing, const char* op,
                       const std::string& call, const std::string& waiting_for,
                       const std::function<bool()>& ready) {
  const auto notice_at = std::chrono::steady_clock::now() + kNoticeAfter;
  int notice = -1;
  bool noticed = false;
  // `missing` shrinks inside `ready`, so the timeout names only the peers still missing.
  std::string err = rv.Wait(rank, missing, op, waiting_for, [&] {
    if (ready()) return true;
    if (!noticed && std::chrono::steady_clock::now() > notice_at) {
      noticed = true;
      std::string e = rv.Publish(
          rank, CallKey{kNoticeKey, 0}, call, [](int, uint64_t*) { return std::string(); }, &notice,
          op);
      if (!e.empty()) notice = -1;
    }
    return false;
  });
  // Nobody reads a notice: its owner releases it for every peer. After a failure it stays, so
  // that the peers' own timeouts still say where this rank gave up.
  if (notice >= 0 && err.empty())
    for (int p = 1; p < rv.size(); ++p) rv.Release(rank, notice);
  return err;
}

size_t LiveStagedMappings() { return g_live_mappings.load(); }

}  // namespace hoccl
