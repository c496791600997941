// The staged path's watchdog: with no host rendezvous, a peer that never comes leaves a stream
// waiting on the GPU for a flag. One host thread per process watches every staged lane's
// progress (the GPU writes each call's number to mapped host memory after its waits). A lane
// with calls outstanding and no progress gets its flags read: a peer's flag naming another
// call is a mismatch, reported at once; JAX_HOCCL_TIMEOUT_S without progress is a missing
// peer. Either way the watchdog writes on stderr the op the user called, the rank and the
// peers, breaks the group (every later call in it fails with that message) and writes the
// awaited flags itself, so the stream goes on (with that call's result invalid) and the
// process can exit.
#ifndef JAX_HOCCL_STAGED_WATCHDOG_H_
#define JAX_HOCCL_STAGED_WATCHDOG_H_

#include <cstdint>
#include <tuple>
#include <vector>

#include "communicator.h"
#include "cuda/rank_state.h"

namespace hoccl {

// Watches rank `rank`'s staged lanes in `comm` from now on (once per rank state).
void WatchStaged(Communicator* comm, RankState* st, int rank);

// (rank, lane, calls enqueued, calls the GPU got past) of every watched lane used so far
// (tests: after a block_until_ready the two are equal).
std::vector<std::tuple<int, int, uint64_t, uint64_t>> StagedLanes();

}  // namespace hoccl

#endif  // JAX_HOCCL_STAGED_WATCHDOG_H_
