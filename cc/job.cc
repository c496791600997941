#include "job.h"

#include <unistd.h>

#include <map>
#include <mutex>

namespace hoccl {
namespace {

std::mutex g_mu;
JobInfo& JobRef() {
  static auto* job = new JobInfo();
  return *job;
}
std::map<int64_t, std::string>& SiteNames() {
  static auto* names = new std::map<int64_t, std::string>();
  return *names;
}

}  // namespace

void SetJob(JobInfo info) {
  std::lock_guard<std::mutex> lock(g_mu);
  JobRef() = std::move(info);
}

JobInfo Job() {
  std::lock_guard<std::mutex> lock(g_mu);
  return JobRef();
}

int ProcessOfLocked(const JobInfo& j, int64_t device) {  // requires g_mu
  if (device < 0 || static_cast<size_t>(device) >= j.device_process.size()) return j.process_index;
  return static_cast<int>(j.device_process[device]);
}

int ProcessOf(int64_t device) {
  std::lock_guard<std::mutex> lock(g_mu);
  return ProcessOfLocked(JobRef(), device);
}

// Called on every collective: one lock, no copy of the job.
std::vector<int> LocalRanks(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(g_mu);
  const JobInfo& j = JobRef();
  std::vector<int> ranks;
  for (size_t r = 0; r < ids.size(); ++r)
    if (ProcessOfLocked(j, ids[r]) == j.process_index) ranks.push_back(static_cast<int>(r));
  return ranks;
}

bool AllLocal(const std::vector<int64_t>& ids) { return LocalRanks(ids).size() == ids.size(); }

std::vector<int64_t>& LocalDevices() {
  static auto* ids = new std::vector<int64_t>();
  return *ids;
}

void SetLocalDevices(std::vector<int64_t> global_ids) {
  std::lock_guard<std::mutex> lock(g_mu);
  LocalDevices() = std::move(global_ids);
}

int64_t GlobalDeviceId(int64_t local_ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto& ids = LocalDevices();
  if (local_ordinal < 0 || static_cast<size_t>(local_ordinal) >= ids.size() ||
      ids[local_ordinal] < 0)
    return local_ordinal;
  return ids[local_ordinal];
}

void NameSite(int64_t site, std::string name) {
  std::lock_guard<std::mutex> lock(g_mu);
  SiteNames()[site] = std::move(name);
}

std::string SiteName(int64_t site, const char* mover) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = SiteNames().find(site);
  if (it == SiteNames().end() || it->second == mover) return mover;
  return it->second + " (" + mover + ")";
}

}  // namespace hoccl
