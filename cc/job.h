// The job this process belongs to (jax.distributed), as far as the engines need it: a secret
// id shared by the job's processes only (names of shared memory and sockets derive from it,
// so nothing outside the job can guess them), this process's index, and which process owns
// each global device id and its pid. Set once from Python (src/jax_hoccl/_src/job.py) before
// the first collective whose group spans processes; without it every device is this
// process's own (one process driving all local devices).
#ifndef JAX_HOCCL_JOB_H_
#define JAX_HOCCL_JOB_H_

#include <cstdint>
#include <string>
#include <vector>

namespace hoccl {

struct JobInfo {
  std::string secret;  // hex, from the job's key-value store
  int process_index = 0;
  std::vector<int64_t> device_process;  // device id -> process index (-1: unknown)
  std::vector<int> process_pids;        // process index -> pid (same node only; else 0)
};

void SetJob(JobInfo info);
// A copy of the job (empty secret when no job was set).
JobInfo Job();
// The ranks (indices into `ids`) whose devices belong to this process.
std::vector<int> LocalRanks(const std::vector<int64_t>& ids);
// Whether every device of `ids` belongs to this process.
bool AllLocal(const std::vector<int64_t>& ids);
// The process that owns `device` (this one when no job was set).
int ProcessOf(int64_t device);

// XLA:GPU gives a handler its local device ordinal, which is not the global device id once
// several processes share the job (each process's first GPU is ordinal 0). Set from Python at
// registration: global id of each local ordinal (identity when unset).
void SetLocalDevices(std::vector<int64_t> global_ids);
int64_t GlobalDeviceId(int64_t local_ordinal);

// Names the user's op in errors: the lowering registers `site` -> "psum" (the mover a site
// runs, e.g. all_gather, may differ from what the user called).
void NameSite(int64_t site, std::string name);
std::string SiteName(int64_t site, const char* mover);

// The user's op a call serves, named (SiteName) only where a message needs it: a call that
// goes well never builds the string.
struct OpLabel {
  int64_t site = -1;
  const char* mover = "";  // a string literal (OpName)
  const char* type = "";   // the element type's name, "" where none is named (a literal)
  std::string Name() const { return SiteName(site, mover); }
};

// A site shared by alternative instructions: the n-th collective of each branch of one
// lax.cond / lax.switch, of which each rank may run another (src/jax_hoccl/_src/branches.py).
// The CPU engine pairs every instruction of a shared site as one (handlers_cpu.cc). The
// program marks it in the site itself (axes.lowered_site), so a process that only runs a
// program lowered elsewhere (a deserialized jax.export) pairs them too.
constexpr int64_t kSharedSite = int64_t{1} << 42;
inline bool SiteShared(int64_t site) { return site > 0 && (site & kSharedSite) != 0; }

}  // namespace hoccl

#endif  // JAX_HOCCL_JOB_H_
