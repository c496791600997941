#include "cpu/cpu_cross_process.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "cpu/cpu_executor.h"
#include "node_rendezvous.h"

namespace hoccl {
namespace {

// A staging segment: the owner's (written) or a peer's (read).
struct Mapping {
  uint64_t generation = 0;
  size_t bytes = 0;
  void* addr = nullptr;
};

// Payload words of an entry.
enum : int { kGeneration = 0, kCapacity = 1 };

std::mutex g_mu;
std::atomic<uint64_t> g_calls{0};
// (rendezvous, owner rank, entry index) -> the mapping of that entry's current staging.
std::map<std::tuple<const NodeRendezvous*, int, int>, Mapping>& Mine() {
  static auto* m = new std::map<std::tuple<const NodeRendezvous*, int, int>, Mapping>();
  return *m;
}
std::map<std::tuple<const NodeRendezvous*, int, int>, Mapping>& Peers() {
  static auto* m = new std::map<std::tuple<const NodeRendezvous*, int, int>, Mapping>();
  return *m;
}

std::string StagingName(const NodeRendezvous& rv, int rank, int index, uint64_t generation) {
  return rv.name() + "-r" + std::to_string(rank) + "-e" + std::to_string(index) + "-g" +
         std::to_string(generation);
}

// The last of the group's processes to map a staging segment unlinks its name (a process maps
// it once for all its ranks; the owner's process counts as one at creation).
void CountOpen(NodeRendezvous& rv, int owner, int index, const std::string& name) {
  if (rv.Opens(owner, index)->fetch_add(1) + 1 == rv.processes()) Unlink(name);
}

// My staging of entry `index`, at least `bytes` large: a new generation when it must grow
// (the entry is free, so no peer reads the old one).
std::string OwnStaging(NodeRendezvous& rv, int rank, int index, size_t bytes, Mapping** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  Mapping& m = Mine()[{&rv, rank, index}];
  if (m.addr && m.bytes >= bytes) {
    *out = &m;
    return "";
  }
  const size_t grown = std::max<size_t>({bytes, 2 * m.bytes, 4096});
  const uint64_t generation = m.generation + 1;
  void* addr = nullptr;
  const std::string name = StagingName(rv, rank, index, generation);
  std::string err = MapShared(name, grown, true, &addr);
  if (!err.empty()) return err;
  if (m.addr) {
    munmap(m.addr, m.bytes);
    // A peer process that never mapped the old generation never will: its name goes now.
    Unlink(StagingName(rv, rank, index, m.generation));
  }
  m = Mapping{generation, grown, addr};
  rv.Opens(rank, index)->store(1);
  *out = &m;
  return "";
}

// A peer's staging as its entry describes it, mapped once per generation (a peer of this
// process: its owner's mapping).
std::string PeerStaging(NodeRendezvous& rv, int peer, const PeerEntry& e, const void** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (rv.Local(peer)) {
    auto it = Mine().find({&rv, peer, e.index});
    if (it == Mine().end() || it->second.generation != e.payload[kGeneration])
      return "jax_hoccl internal error: no staging of rank " + std::to_string(peer) +
             " in its own process";
    *out = it->second.addr;
    return "";
  }
  Mapping& m = Peers()[{&rv, peer, e.index}];
  const uint64_t generation = e.payload[kGeneration];
  if (m.addr && m.generation == generation) {
    *out = m.addr;
    return "";
  }
  if (m.addr) munmap(m.addr, m.bytes);
  m = Mapping{};
  const std::string name = StagingName(rv, peer, e.index, generation);
  void* addr = nullptr;
  std::string err = MapShared(name, e.payload[kCapacity], false, &addr);
  if (!err.empty()) return err;
  m = Mapping{generation, static_cast<size_t>(e.payload[kCapacity]), addr};
  CountOpen(rv, peer, e.index, name);
  *out = addr;
  return "";
}

}  // namespace

std::string RunCpuAcrossProcesses(const OpSpec& spec, const std::vector<int64_t>& device_ids,
                                  uint64_t instruction, const std::string& what, const void* input,
                                  void* output, const std::string& op_name) {
  const char* op = op_name.c_str();
  const int n = spec.group_size, rank = spec.rank;
  NodeRendezvous* rv = nullptr;
  std::string err = NodeRendezvous::Get(device_ids, op, &rv);
  if (!err.empty()) return err;
  const CallKey key{instruction, rv->NextCount(rank, instruction)};

  int my_index = -1;
  err = rv->Publish(
      rank, key, what,
      [&](int index, uint64_t* payload) {
        Mapping* m = nullptr;
        std::string e = OwnStaging(*rv, rank, index, spec.bytes, &m);
        if (!e.empty()) return e;
        if (spec.bytes) std::memcpy(m->addr, input, spec.bytes);
        payload[kGeneration] = m->generation;
        payload[kCapacity] = m->bytes;
        return std::string();
      },
      &my_index, op);
  if (!err.empty()) return err;

  // Every peer's entry: the ready handshake (and the check that it is the same call).
  std::vector<const void*> inputs(n, nullptr);
  std::vector<PeerEntry> entries(n);
  inputs[rank] = input;
  for (int k = 1; k < n && err.empty(); ++k) {
    const int peer = (rank + k) % n;
    err = rv->Find(rank, peer, key, what, &entries[peer], op);
    if (err.empty()) err = PeerStaging(*rv, peer, entries[peer], &inputs[peer]);
  }
  if (err.empty()) {
    RunPlanOnHost(spec, inputs, output);
    g_calls.fetch_add(1);
  }
  // The done handshake: the owners may reuse their entries (and staging).
  for (int p = 0; p < n; ++p)
    if (p != rank && entries[p].index >= 0) rv->Release(p, entries[p].index);
  return err;
}

size_t LiveStagingMappings() {
  std::lock_guard<std::mutex> lock(g_mu);
  return Mine().size() + Peers().size();
}

uint64_t RendezvousCalls() { return g_calls.load(); }

}  // namespace hoccl
