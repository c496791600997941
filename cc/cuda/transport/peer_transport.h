// How a rank of the CUDA engine reaches its peers' memory, one implementation per file:
// transport_direct.h (peers in this process: their addresses are ours) and transport_ipc.h
// (peers in other processes of the node: their allocations mapped once). The executor
// (cuda_executor.h) only ever sees this interface.
#ifndef JAX_HOCCL_PEER_TRANSPORT_H_
#define JAX_HOCCL_PEER_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hoccl {

class PeerTransport {
 public:
  virtual ~PeerTransport() = default;
  // One-time: device memory for my flag array that peers can reach (zeroed by the caller).
  virtual std::string AllocFlags(size_t bytes, void** flags) = 0;
  // Whether peers' memory needs cudaDeviceEnablePeerAccess (an IPC mapping grants its own).
  virtual bool NeedsPeerAccess() const { return true; }
  // One-time: publish my flag array, learn every rank's (indexed by rank, mine included).
  virtual std::string ExchangeFlags(int rank, uint64_t* my_flags, std::vector<uint64_t*>* all,
                                    const char* op) = 0;
  // Per call: publish my buffers for `seq`, wait until every rank in `peers` published, and
  // return their input addresses in (*inputs)[peer] (valid until Release). `what` describes
  // the call; peers that describe theirs differently are a mismatch error.
  virtual std::string ExchangeBuffers(uint64_t seq, int rank, const void* input, void* output,
                                      const std::vector<int>& peers,
                                      std::vector<const void*>* inputs, const char* op,
                                      const std::string& what) = 0;
  virtual void Release(uint64_t seq, int rank) = 0;
};

}  // namespace hoccl

#endif  // JAX_HOCCL_PEER_TRANSPORT_H_
