// The in-process transport of the CUDA engine (one process driving all local GPUs): the
// per-device handler threads meet in the communicator's host rendezvous (communicator.h),
// which swaps this call's XLA buffer addresses; peers then copy straight between them.
#ifndef JAX_HOCCL_TRANSPORT_DIRECT_H_
#define JAX_HOCCL_TRANSPORT_DIRECT_H_

#include <string>
#include <vector>

#include "communicator.h"
#include "cuda/transport/peer_transport.h"

namespace hoccl {

class DirectTransport : public PeerTransport {
 public:
  // spin_us: how long to spin for a peer before sleeping (cuda/rank_state.cc, kDefaultSpinMicros).
  DirectTransport(Communicator& comm, long long spin_us) : comm_(comm), spin_us_(spin_us) {}
  std::string AllocFlags(size_t bytes, void** flags) override;
  std::string ExchangeFlags(int rank, uint64_t* my_flags, std::vector<uint64_t*>* all,
                            const char* op) override;
  std::string ExchangeBuffers(uint64_t seq, int rank, const void* input, void* output,
                              const std::vector<int>& peers, std::vector<const void*>* inputs,
                              const char* op, const std::string& what) override;
  void Release(uint64_t seq, int rank) override;

 private:
  Communicator& comm_;
  const long long spin_us_;
};

}  // namespace hoccl

#endif  // JAX_HOCCL_TRANSPORT_DIRECT_H_
