// Unit test of the scheduler (plan.h), without gtest: runs every rank's plan in a small
// simulator under several interleavings and checks
//   * the result of each collective (all_gather incl. peers_only, all_to_all, ppermute
//     incl. zero-fill),
//   * the handshakes: a peer's input is read only between WaitReady and SignalDone, every
//     wait is eventually satisfied (no deadlock), an input is released (WaitDone) only
//     after every reader signalled done, and each signal is sent exactly once,
//   * bounds, chunking (a copy count of chunks per peer, byte-exact sizes) and channels,
//   * the rotated peer order and ValidateSpec / OutputBytes.
// Exit status 0 on success, 1 with messages on stderr otherwise.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "plan.h"

namespace {

int g_failures = 0;

#define CHECK(cond, ...)                                                            \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      ++g_failures;                                                                 \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                            \
      std::fprintf(stderr, "\n");                                                   \
      if (g_failures > 50) std::exit(1);                                            \
    }                                                                               \
  } while (0)

using hoccl::MakePlan;
using hoccl::OpKind;
using hoccl::OpSpec;
using hoccl::PlanOptions;
using hoccl::Step;
using hoccl::StepKind;

uint8_t InputByte(int rank, size_t i) { return static_cast<uint8_t>(rank * 37 + i * 11 + 1); }

std::string Describe(const OpSpec& s, const PlanOptions& o) {
  std::string d = std::string(hoccl::OpName(s.op)) + " n=" + std::to_string(s.group_size) +
                  " bytes=" + std::to_string(s.bytes) + " chunks=" + std::to_string(o.chunks) +
                  " channels=" + std::to_string(o.channels);
  if (s.peers_only) d += " peers_only";
  if (s.in_place) d += " in_place";
  if (s.skip_own) d += " skip_own";
  if (s.op == OpKind::kPermute) {
    d += " dst=[";
    for (int x : s.permute_dst) d += std::to_string(x) + ",";
    d += "]";
  }
  return d;
}

// The expected output of rank `me`.
std::vector<uint8_t> Expected(const OpSpec& s, int me) {
  const int n = s.group_size;
  // Into the source's slot: slots nobody sends to keep the simulator's fill byte (0xAB).
  std::vector<uint8_t> out(hoccl::OutputBytes(s), s.at_source_slot ? 0xAB : 0);
  switch (s.op) {
    case OpKind::kAllGather:
      if (s.peers_only) {
        // Block k holds rank (me + 1 + k) % n's input; no own block.
        for (int k = 0; k + 1 < n; ++k)
          for (size_t i = 0; i < s.bytes; ++i)
            out[k * s.bytes + i] = InputByte((me + 1 + k) % n, i);
      } else {
        for (int src = 0; src < n; ++src)
          for (size_t i = 0; i < s.bytes; ++i) out[src * s.bytes + i] = InputByte(src, i);
      }
      break;
    case OpKind::kAllToAll: {
      size_t b = s.bytes / n;
      for (int src = 0; src < n; ++src)
        for (size_t i = 0; i < b; ++i) out[src * b + i] = InputByte(src, me * b + i);
      break;
    }
    case OpKind::kPermute:
      for (int src = 0; src < n; ++src)
        if (s.permute_dst[src] == me)
          for (size_t i = 0; i < s.bytes; ++i)
            out[(s.at_source_slot ? src * s.bytes : 0) + i] = InputByte(src, i);
      break;
  }
  if (s.skip_own) {  // my own slot is never written: it keeps the simulator's fill byte
    const size_t b = s.op == OpKind::kAllToAll ? s.bytes / n : s.bytes;
    for (size_t i = 0; i < b; ++i) out[me * b + i] = 0xAB;
  }
  return out;
}

// Tiny deterministic PRNG for the random interleavings.
struct Lcg {
  uint64_t x;
  uint32_t Next() {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(x >> 33);
  }
};

// Runs all ranks' plans. order: 0 = round robin, 1 = reverse round robin, 2 = run one
// rank as far as it goes before the next, >= 3 = random with that seed.
void Simulate(OpSpec spec, const PlanOptions& opt, int order) {
  const int n = spec.group_size;
  const std::string what = Describe(spec, opt) + " order=" + std::to_string(order);
  std::vector<std::vector<Step>> plans(n);
  std::vector<std::vector<uint8_t>> in(n), out(n);
  for (int r = 0; r < n; ++r) {
    spec.rank = r;
    CHECK(hoccl::ValidateSpec(spec).empty(), "%s: valid spec rejected: %s", what.c_str(),
          hoccl::ValidateSpec(spec).c_str());
    plans[r] = MakePlan(spec, opt);
    in[r].resize(spec.bytes);
    for (size_t i = 0; i < spec.bytes; ++i) in[r][i] = InputByte(r, i);
    out[r].assign(hoccl::OutputBytes(spec), 0xAB);  // garbage: every byte must be written
    if (spec.in_place)  // except my own slot, which holds my input already
      for (size_t i = 0; i < spec.bytes; ++i) out[r][r * spec.bytes + i] = InputByte(r, i);
  }
  // ready[owner][reader], done[reader][owner]: signals sent (counts, must end at <= 1).
  std::vector<std::vector<int>> ready(n, std::vector<int>(n, 0)), done = ready;
  // reading[reader][owner]: reader passed WaitReady(owner) and has not yet SignalDone.
  std::vector<std::vector<int>> reading = ready, waited_ready = ready;
  std::vector<size_t> pc(n, 0);
  std::vector<int> released(n, 0);  // rank finished all WaitDone steps (input reusable)
  Lcg rng{static_cast<uint64_t>(order) * 7919u + 17u};

  // Executes one step of rank r if it can; returns whether it did.
  auto step = [&](int r) -> bool {
    if (pc[r] >= plans[r].size()) return false;
    const Step& s = plans[r][pc[r]];
    const bool peer_ok = s.peer >= 0 && s.peer < n;
    CHECK(peer_ok, "%s: rank %d step %zu has peer %d", what.c_str(), r, pc[r], s.peer);
    if (!peer_ok) {
      pc[r] = plans[r].size();
      return true;
    }
    switch (s.kind) {
      case StepKind::kSignalReady:
        CHECK(s.peer != r, "%s: rank %d signals ready to itself", what.c_str(), r);
        ++ready[r][s.peer];
        break;
      case StepKind::kWaitReady:
        if (ready[s.peer][r] == 0) return false;
        ++waited_ready[r][s.peer];
        reading[r][s.peer] = 1;
        break;
      case StepKind::kCopy: {
        CHECK(s.channel >= 0 && s.channel < std::max(1, opt.channels),
              "%s: rank %d copy on channel %d", what.c_str(), r, s.channel);
        CHECK(s.bytes > 0, "%s: rank %d empty copy", what.c_str(), r);
        CHECK(s.peer == r || reading[r][s.peer],
              "%s: rank %d reads rank %d's input outside WaitReady..SignalDone", what.c_str(), r,
              s.peer);
        CHECK(!released[s.peer] || s.peer == r,
              "%s: rank %d reads rank %d's input after it was released", what.c_str(), r, s.peer);
        const bool in_bounds =
            s.src_offset + s.bytes <= in[s.peer].size() && s.dst_offset + s.bytes <= out[r].size();
        CHECK(in_bounds, "%s: rank %d copy out of bounds (src %zu dst %zu bytes %zu)", what.c_str(),
              r, s.src_offset, s.dst_offset, s.bytes);
        if (in_bounds)
          for (size_t i = 0; i < s.bytes; ++i)
            out[r][s.dst_offset + i] = in[s.peer][s.src_offset + i];
        break;
      }
      case StepKind::kZero: {
        CHECK(s.peer == r, "%s: rank %d zero-fills for rank %d", what.c_str(), r, s.peer);
        const bool in_bounds = s.dst_offset + s.bytes <= out[r].size();
        CHECK(in_bounds, "%s: rank %d zero out of bounds", what.c_str(), r);
        if (in_bounds)
          for (size_t i = 0; i < s.bytes; ++i) out[r][s.dst_offset + i] = 0;
        break;
      }
      case StepKind::kSignalDone:
        CHECK(reading[r][s.peer], "%s: rank %d signals done to %d without reading", what.c_str(), r,
              s.peer);
        reading[r][s.peer] = 0;
        ++done[r][s.peer];
        break;
      case StepKind::kWaitDone: {
        if (done[s.peer][r] == 0) return false;
        // The last WaitDone releases the input.
        bool more = false;
        for (size_t k = pc[r] + 1; k < plans[r].size(); ++k)
          more |= plans[r][k].kind == StepKind::kWaitDone;
        if (!more) released[r] = 1;
        break;
      }
      default:
        CHECK(false, "%s: rank %d unknown step kind %d", what.c_str(), r, static_cast<int>(s.kind));
    }
    ++pc[r];
    return true;
  };

  for (;;) {
    bool progressed = false;
    if (order == 0 || order == 1) {
      for (int k = 0; k < n; ++k) progressed |= step(order == 0 ? k : n - 1 - k);
    } else if (order == 2) {
      for (int r = 0; r < n; ++r)
        while (step(r)) progressed = true;
    } else {
      // Try ranks in a random rotation until one moves.
      int start = static_cast<int>(rng.Next() % n);
      for (int k = 0; k < n && !progressed; ++k) progressed = step((start + k) % n);
    }
    if (!progressed) break;
  }

  for (int r = 0; r < n; ++r) {
    CHECK(pc[r] == plans[r].size(), "%s: deadlock: rank %d stuck at step %zu of %zu", what.c_str(),
          r, pc[r], plans[r].size());
    CHECK(out[r] == Expected(spec, r), "%s: wrong output on rank %d", what.c_str(), r);
    for (int p = 0; p < n; ++p) {
      CHECK(ready[r][p] <= 1 && done[r][p] <= 1, "%s: repeated signal %d->%d", what.c_str(), r, p);
      // Every ready signal is consumed by exactly one wait, and every reader says done.
      CHECK(ready[r][p] == waited_ready[p][r], "%s: ready %d->%d sent %d, waited %d", what.c_str(),
            r, p, ready[r][p], waited_ready[p][r]);
      CHECK(waited_ready[p][r] == done[p][r], "%s: rank %d read %d but done=%d", what.c_str(), p, r,
            done[p][r]);
      CHECK(!reading[r][p], "%s: rank %d never signalled done to %d", what.c_str(), r, p);
    }
  }
}

// Static properties of one rank's plan.
void CheckPlanShape(OpSpec spec, const PlanOptions& opt) {
  const int n = spec.group_size;
  const std::string what = Describe(spec, opt);
  for (int r = 0; r < n; ++r) {
    spec.rank = r;
    std::vector<Step> plan = MakePlan(spec, opt);
    // Peers are pulled from in rotated order r+1, r+2, ...
    int last_offset = 0;
    size_t copied = 0, zeroed = 0;
    std::vector<int> copies_per_peer(n, 0);
    for (const Step& s : plan) {
      if (s.kind == StepKind::kWaitReady) {
        int offset = (s.peer - r + n) % n;
        CHECK(offset > last_offset, "%s: rank %d pulls peer %d out of rotated order", what.c_str(),
              r, s.peer);
        last_offset = offset;
      }
      if (s.kind == StepKind::kCopy) {
        copied += s.bytes;
        ++copies_per_peer[s.peer];
      }
      if (s.kind == StepKind::kZero) zeroed += s.bytes;
    }
    CHECK(!(spec.peers_only || spec.in_place || spec.skip_own) || copies_per_peer[r] == 0,
          "%s: peers_only/in_place/skip_own rank %d copies itself", what.c_str(), r);
    CHECK(spec.op == OpKind::kPermute || zeroed == 0, "%s: rank %d zero-fills", what.c_str(), r);
    // Into the source's slot: only the slot of a sender is written, nothing zero-filled.
    size_t senders = 0;
    for (int p = 0; p < n; ++p) senders += spec.op == OpKind::kPermute && spec.permute_dst[p] == r;
    const size_t writes =
        spec.at_source_slot
            ? senders * spec.bytes
            : hoccl::OutputBytes(spec) -
                  (spec.in_place || spec.skip_own
                       ? (spec.op == OpKind::kAllToAll ? spec.bytes / n : spec.bytes)
                       : 0);
    CHECK(!spec.at_source_slot || zeroed == 0, "%s: rank %d zero-fills", what.c_str(), r);
    CHECK(copied + zeroed == writes, "%s: rank %d writes %zu of %zu bytes", what.c_str(), r,
          copied + zeroed, writes);
    const size_t block = spec.op == OpKind::kAllToAll ? spec.bytes / n : spec.bytes;
    const size_t want = std::min<size_t>(block, static_cast<size_t>(std::max(1, opt.chunks)));
    for (int p = 0; p < n; ++p)
      CHECK(copies_per_peer[p] == 0 || static_cast<size_t>(copies_per_peer[p]) == want,
            "%s: rank %d makes %d copies from %d, want %zu", what.c_str(), r, copies_per_peer[p], p,
            want);
  }
}

void RunAll(const OpSpec& spec) {
  for (int chunks : {1, 2, 3, 7}) {
    for (int channels : {1, 2, 4}) {
      PlanOptions opt;
      opt.chunks = chunks;
      opt.channels = channels;
      CheckPlanShape(spec, opt);
      for (int order = 0; order < 8; ++order) Simulate(spec, opt, order);
    }
  }
}

void TestValidate() {
  auto err = [](OpKind op, int n, int rank, size_t bytes, std::vector<int> dst) {
    OpSpec s{op, n, rank, bytes, dst};
    return hoccl::ValidateSpec(s);
  };
  CHECK(!err(OpKind::kAllGather, 0, 0, 4, {}).empty(), "group size 0 accepted");
  CHECK(!err(OpKind::kAllGather, 2, 2, 4, {}).empty(), "rank == group size accepted");
  CHECK(!err(OpKind::kAllGather, 2, -1, 4, {}).empty(), "negative rank accepted");
  CHECK(err(OpKind::kAllGather, 3, 1, 5, {}).empty(), "all_gather rejected");
  CHECK(!err(OpKind::kAllToAll, 3, 0, 10, {}).empty(), "indivisible all_to_all accepted");
  CHECK(err(OpKind::kAllToAll, 3, 0, 12, {}).empty(), "all_to_all rejected");
  CHECK(!err(OpKind::kPermute, 3, 0, 4, {1, 2}).empty(), "short permutation accepted");
  CHECK(!err(OpKind::kPermute, 3, 0, 4, {1, 1, 0}).empty(), "duplicate destination accepted");
  CHECK(!err(OpKind::kPermute, 3, 0, 4, {1, 3, 0}).empty(), "destination 3 of 3 accepted");
  CHECK(!err(OpKind::kPermute, 3, 0, 4, {1, -2, 0}).empty(), "destination -2 accepted");
  CHECK(err(OpKind::kPermute, 3, 0, 4, {1, -1, 0}).empty(), "partial permutation rejected");
  CHECK(err(OpKind::kPermute, 3, 0, 4, {-1, -1, -1}).empty(), "empty permutation rejected");
  OpSpec po{OpKind::kAllToAll, 2, 0, 4, {}};
  po.peers_only = true;
  CHECK(!hoccl::ValidateSpec(po).empty(), "peers_only all_to_all accepted");
  po.op = OpKind::kAllGather;
  CHECK(hoccl::ValidateSpec(po).empty(), "peers_only all_gather rejected");

  OpSpec ag{OpKind::kAllGather, 4, 0, 6, {}};
  CHECK(hoccl::OutputBytes(ag) == 24, "all_gather output bytes");
  ag.peers_only = true;
  CHECK(hoccl::OutputBytes(ag) == 18, "peers_only all_gather output bytes");
  OpSpec a2a{OpKind::kAllToAll, 4, 0, 8, {}};
  CHECK(hoccl::OutputBytes(a2a) == 8, "all_to_all output bytes");
  OpSpec perm{OpKind::kPermute, 4, 0, 8, {1, 2, 3, 0}};
  CHECK(hoccl::OutputBytes(perm) == 8, "ppermute output bytes");
  perm.at_source_slot = true;
  CHECK(hoccl::OutputBytes(perm) == 32, "ppermute into the source's slot: output bytes");
  CHECK(hoccl::ValidateSpec(perm).empty(), "ppermute into the source's slot rejected");
  a2a.at_source_slot = true;
  CHECK(!hoccl::ValidateSpec(a2a).empty(), "at_source_slot all_to_all accepted");
  OpSpec in_place{OpKind::kAllGather, 4, 0, 6, {}};
  in_place.in_place = true;
  CHECK(hoccl::ValidateSpec(in_place).empty() && hoccl::OutputBytes(in_place) == 24,
        "in-place all_gather");
  in_place.peers_only = true;
  CHECK(!hoccl::ValidateSpec(in_place).empty(), "in-place peers_only all_gather accepted");
  perm.in_place = true;
  CHECK(!hoccl::ValidateSpec(perm).empty(), "in-place ppermute accepted");
  OpSpec skip{OpKind::kAllToAll, 4, 0, 8, {}};
  skip.skip_own = true;
  CHECK(hoccl::ValidateSpec(skip).empty() && hoccl::OutputBytes(skip) == 8,
        "all_to_all without the own block");
  skip.op = OpKind::kAllGather;
  CHECK(hoccl::ValidateSpec(skip).empty(), "all_gather without the own block rejected");
  skip.peers_only = true;
  CHECK(!hoccl::ValidateSpec(skip).empty(), "skip_own peers_only all_gather accepted");
  OpSpec skip_perm{OpKind::kPermute, 4, 0, 8, {1, 2, 3, 0}};
  skip_perm.skip_own = true;
  CHECK(!hoccl::ValidateSpec(skip_perm).empty(), "skip_own ppermute accepted");
  // A summed exchange (the staged psum / psum_scatter): one block out, full movers only.
  OpSpec summed{OpKind::kAllGather, 4, 1, 64, {}};
  summed.sum = hoccl::SumType::kBF16;
  CHECK(hoccl::ValidateSpec(summed).empty() && hoccl::OutputBytes(summed) == 64, "summed gather");
  summed.op = OpKind::kAllToAll;
  CHECK(hoccl::ValidateSpec(summed).empty() && hoccl::OutputBytes(summed) == 16,
        "summed all_to_all");
  summed.op = OpKind::kAllGather;
  summed.peers_only = true;
  CHECK(!hoccl::ValidateSpec(summed).empty(), "summed peers_only all_gather accepted");
  OpSpec summed_perm{OpKind::kPermute, 4, 0, 8, {1, 2, 3, 0}};
  summed_perm.sum = hoccl::SumType::kF32;
  CHECK(!hoccl::ValidateSpec(summed_perm).empty(), "summed ppermute accepted");
  CHECK(std::string(hoccl::OpName(OpKind::kAllToAll)) == "all_to_all", "op name");
}

void TestCollectives() {
  for (int n = 1; n <= 8; ++n) {
    for (size_t bytes : {size_t{1}, size_t{5}, size_t{16}, size_t{33}}) {
      RunAll(OpSpec{OpKind::kAllGather, n, 0, bytes, {}});
      OpSpec peers{OpKind::kAllGather, n, 0, bytes, {}};
      peers.peers_only = true;
      RunAll(peers);
      OpSpec in_place{OpKind::kAllGather, n, 0, bytes, {}};
      in_place.in_place = true;  // my block already in my slot of the output
      RunAll(in_place);
      RunAll(OpSpec{OpKind::kAllToAll, n, 0, bytes * n, {}});
      for (OpKind op : {OpKind::kAllGather, OpKind::kAllToAll}) {
        OpSpec skip{op, n, 0, op == OpKind::kAllToAll ? bytes * n : bytes, {}};
        skip.skip_own = true;  // my slot left unwritten (psum / psum_scatter read my input)
        RunAll(skip);
      }
    }
    // ppermute: shifts, the reverse, the identity, partial and empty permutations.
    std::vector<std::vector<int>> perms;
    for (int shift = 0; shift < n; ++shift) {
      std::vector<int> d(n);
      for (int i = 0; i < n; ++i) d[i] = (i + shift) % n;
      perms.push_back(d);
    }
    std::vector<int> rev(n), partial(n, -1), none(n, -1);
    for (int i = 0; i < n; ++i) rev[i] = n - 1 - i;
    for (int i = 0; i + 1 < n; i += 2) partial[i] = i + 1;  // odd ranks receive, evens zero
    perms.push_back(rev);
    perms.push_back(partial);
    perms.push_back(none);
    for (const auto& d : perms)
      for (size_t bytes : {size_t{1}, size_t{7}, size_t{32}}) {
        OpSpec s{OpKind::kPermute, n, 0, bytes, d};
        RunAll(s);
        s.at_source_slot = true;  // the received buffer in the sender's slot, nothing else
        RunAll(s);
      }
  }
}

}  // namespace

int main() {
  TestValidate();
  TestCollectives();
  if (g_failures) {
    std::fprintf(stderr, "plan_test: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("plan_test: all checks passed\n");
  return 0;
}
