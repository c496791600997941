// Cross-process peer memory for the CUDA engine (one process per GPU): an owner describes a
// range of its device memory (DescribeRange), ships the IpcRange to its peers by any host
// channel, and a peer maps it (MapPeerRange) once per allocation and copies from/to it.
//   VMM memory (XLA's pool, AllocExportable): the allocation's POSIX fd travels by SCM_RIGHTS
//     from the owner's fd server (StartFdServer, an abstract Unix socket) to the importer, who
//     imports, reserves, maps and grants its device access.
//   cudaMalloc memory: the legacy cudaIpcMemHandle travels inside the IpcRange itself.
// Only processes of the same uid whose pids the job allowed (AllowPeerPids) are served, and an
// importer only trusts a server whose pid is allowed. Errors are strings ("" = ok).
// The header needs no CUDA headers: an IpcRange is plain bytes that any host channel can carry.
#ifndef JAX_HOCCL_IPC_MEMORY_H_
#define JAX_HOCCL_IPC_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hoccl {

enum IpcKind : int32_t { kIpcVmmFd = 0, kIpcLegacy = 1 };

// Where a pointer of the owner lies: allocation [base, base + size), ptr = base + offset.
// (base, handle_id) names the allocation: handle_id is new whenever the owner sees a new
// allocation at a known base, so an importer's cached mapping of a freed one is never reused.
struct IpcRange {
  uint64_t base = 0;
  uint64_t size = 0;
  uint64_t offset = 0;
  uint64_t handle_id = 0;
  int32_t kind = kIpcVmmFd;
  int32_t reserved = 0;
  char legacy[64] = {};  // kIpcLegacy: the cudaIpcMemHandle_t of the allocation
};
static_assert(sizeof(IpcRange) == 104, "IpcRange travels as raw bytes");

// Owner side, per call (cached by allocation base; a hit costs a few driver queries, no
// export). bytes > 0 also checks that [ptr, ptr + bytes) lies in the one allocation.
// Caveat: for VMM memory the cache holds a reference on the allocation (that is what makes
// handle_id reliable), so a freed allocation's memory lives on until a new one takes its base.
std::string DescribeRange(const void* ptr, IpcRange* out, size_t bytes = 0);

// Starts this process's fd server (one detached thread) on the abstract Unix socket `name`
// (a leading '\0' is accepted and ignored; derive it from a secret job id and the pid, e.g.
// "jax_hoccl-<job>-<pid>"). Idempotent for the same name; a second name is an error.
std::string StartFdServer(const std::string& name);

// The pids of this job's processes (replaces the previous list): the fd server answers only
// them, and MapPeerRange only trusts a server run by one of them. Same uid is required too.
void AllowPeerPids(const std::vector<int>& pids);

// Importer side: the address in this process of the peer's range r (r.base + r.offset there),
// accessible from CUDA `device`. Maps the whole allocation on first use and caches it by
// (peer_socket, base, handle_id). A peer_socket equal to this process's own server name means
// the range is mine: the owner's pointer itself comes back, nothing is mapped.
std::string MapPeerRange(const std::string& peer_socket, const IpcRange& r, int device,
                         const void** local_ptr);

// `bytes` (rounded up to the allocation granularity) of zeroed device memory on `device`,
// created exportable as a POSIX fd (for flag arrays that peers map). Lives until exit.
std::string AllocExportable(size_t bytes, int device, void** ptr);

// Unmaps and releases every imported peer allocation (clean exit, tests).
void UnmapAllPeers();
// Number of imported peer allocations currently mapped.
size_t LivePeerMappings();

}  // namespace hoccl

#endif  // JAX_HOCCL_IPC_MEMORY_H_
