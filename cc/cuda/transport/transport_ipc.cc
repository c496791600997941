#include "cuda/transport/transport_ipc.h"

#include <unistd.h>

#include <cstring>
#include <mutex>

#include "cuda/ipc_memory.h"
#include "job.h"

namespace hoccl {
namespace {

// Payload words: the IpcRange, then the owner's pid (which names its fd server).
constexpr int kPidWord = (sizeof(IpcRange) + 7) / 8;
static_assert(kPidWord < kPayloadWords, "an IpcRange and a pid fit in a payload");

std::string ServerName(const std::string& secret, int pid) {
  return "jax_hoccl-" + secret.substr(0, 32) + "-" + std::to_string(pid);
}

// This process's fd server, started once; only the job's processes on this node are served.
std::string StartServer(std::string* name) {
  static std::mutex mu;
  static std::string started, error;
  std::lock_guard<std::mutex> lock(mu);
  if (started.empty() && error.empty()) {
    const JobInfo job = Job();
    std::vector<int> pids;
    for (int pid : job.process_pids)
      if (pid > 0) pids.push_back(pid);
    AllowPeerPids(pids);
    started = ServerName(job.secret, getpid());
    error = StartFdServer(started);
  }
  *name = started;
  return error;
}

}  // namespace

std::string IpcTransport::Make(const Communicator& comm, int device, const char* op,
                               std::unique_ptr<PeerTransport>* out) {
  std::string server;
  std::string err = StartServer(&server);
  if (!err.empty()) return err;
  NodeRendezvous* rv = nullptr;
  err = NodeRendezvous::Get(comm.device_ids(), op, &rv);
  if (!err.empty()) return err;
  *out = std::make_unique<IpcTransport>(*rv, device);
  return "";
}

std::string IpcTransport::AllocFlags(size_t bytes, void** flags) {
  return AllocExportable(bytes, device_, flags);
}

std::string IpcTransport::Meet(int rank, CallKey key, const std::string& what, const void* mine,
                               size_t bytes, const std::vector<int>& wanted,
                               std::vector<const void*>* out, const char* op) {
  const int n = rv_.size();
  IpcRange range;
  std::string err = mine ? DescribeRange(mine, &range, bytes) : "";
  if (!err.empty()) return err;
  int index = -1;
  err = rv_.Publish(
      rank, key, what,
      [&](int, uint64_t* payload) {
        std::memcpy(payload, &range, sizeof range);
        payload[kPidWord] = static_cast<uint64_t>(getpid());
        return std::string();
      },
      &index, op);
  if (!err.empty()) return err;
  found_.assign(n, PeerEntry{});
  for (int k = 1; k < n && err.empty(); ++k) {
    const int peer = (rank + k) % n;
    err = rv_.Find(rank, peer, key, what, &found_[peer], op);
    if (!err.empty() || !out || !wanted[peer]) continue;
    IpcRange theirs;
    std::memcpy(&theirs, found_[peer].payload, sizeof theirs);
    const int pid = static_cast<int>(found_[peer].payload[kPidWord]);
    err = MapPeerRange(ServerName(rv_.secret(), pid), theirs, device_, &(*out)[peer]);
  }
  return err;
}

std::string IpcTransport::ExchangeFlags(int rank, uint64_t* my_flags, std::vector<uint64_t*>* all,
                                        const char* op) {
  const int n = rv_.size();
  std::vector<const void*> mapped(n, nullptr);
  mapped[rank] = my_flags;
  std::string err = Meet(rank, {kSetupKey, 1}, std::string("flag arrays of ") + op, my_flags, 0,
                         std::vector<int>(n, 1), &mapped, op);
  Release(0, rank);
  if (!err.empty()) return err;
  // Everyone has mapped everyone's flags once every peer got here.
  err = Meet(rank, {kSetupKey, 2}, "flag arrays mapped", nullptr, 0, {}, nullptr, op);
  Release(0, rank);
  if (!err.empty()) return err;
  all->resize(n);
  for (int q = 0; q < n; ++q)
    (*all)[q] = const_cast<uint64_t*>(static_cast<const uint64_t*>(mapped[q]));
  return "";
}

std::string IpcTransport::ExchangeBuffers(uint64_t seq, int rank, const void* input,
                                          void* /*output: pulls need only inputs*/,
                                          const std::vector<int>& peers,
                                          std::vector<const void*>* inputs, const char* op,
                                          const std::string& what) {
  std::vector<int> wanted(rv_.size(), 0);
  for (int p : peers) wanted[p] = 1;
  // Every peer finds every call (readers release each entry), involved in its copies or not.
  return Meet(rank, {0, seq}, what, input, 0, wanted, inputs, op);
}

void IpcTransport::Release(uint64_t /*seq*/, int rank) {
  for (int p = 0; p < static_cast<int>(found_.size()); ++p)
    if (p != rank && found_[p].index >= 0) rv_.Release(p, found_[p].index);
  found_.clear();
}

}  // namespace hoccl
