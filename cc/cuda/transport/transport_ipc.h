// The cross-process transport of the CUDA engine (one process per GPU, or any group whose
// ranks live in several processes of one node): the ranks meet in the node's shared-memory
// rendezvous (node_rendezvous.h), where each call publishes where its input lies (an
// IpcRange: which allocation, at which offset); a peer maps that allocation once through
// ipc_memory.h (XLA's pool is one VMM allocation: one fd, one mapping) and then copies straight
// from it. Flag arrays live in exportable memory that every peer maps during the one-time
// setup, which ends with a second meeting: no rank writes a flag before every peer has mapped.
#ifndef JAX_HOCCL_TRANSPORT_IPC_H_
#define JAX_HOCCL_TRANSPORT_IPC_H_

#include <memory>
#include <string>
#include <vector>

#include "communicator.h"
#include "cuda/transport/peer_transport.h"
#include "node_rendezvous.h"

namespace hoccl {

class IpcTransport : public PeerTransport {
 public:
  // Attaches to the group's rendezvous (ranks of this process: those of its devices).
  static std::string Make(const Communicator& comm, int device, const char* op,
                          std::unique_ptr<PeerTransport>* out);

  std::string AllocFlags(size_t bytes, void** flags) override;
  bool NeedsPeerAccess() const override { return false; }  // mappings carry their own access
  std::string ExchangeFlags(int rank, uint64_t* my_flags, std::vector<uint64_t*>* all,
                            const char* op) override;
  std::string ExchangeBuffers(uint64_t seq, int rank, const void* input, void* output,
                              const std::vector<int>& peers, std::vector<const void*>* inputs,
                              const char* op, const std::string& what) override;
  void Release(uint64_t seq, int rank) override;

  IpcTransport(NodeRendezvous& rv, int device) : rv_(rv), device_(device) {}

 private:
  // Publishes my range under `key` and maps every peer's (those in `wanted`) into `out`.
  std::string Meet(int rank, CallKey key, const std::string& what, const void* mine, size_t bytes,
                   const std::vector<int>& wanted, std::vector<const void*>* out, const char* op);

  NodeRendezvous& rv_;
  const int device_;
  std::vector<PeerEntry> found_;  // peers' entries of the call in progress, by rank
};

}  // namespace hoccl

#endif  // JAX_HOCCL_TRANSPORT_IPC_H_
