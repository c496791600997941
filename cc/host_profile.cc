#include "host_profile.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace hoccl {
namespace {

struct Counters {
  std::mutex mu;
  std::map<const char*, std::pair<long long, long long>> by_phase;  // calls, ns
};

Counters& Global() {
  static Counters* c = new Counters();  // never destroyed: handlers may run at exit
  return *c;
}

}  // namespace

bool HostProfileEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JAX_HOCCL_PROFILE");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

void HostProfileAdd(const char* phase, int64_t nanoseconds) {
  Counters& c = Global();
  std::lock_guard<std::mutex> lock(c.mu);
  auto& e = c.by_phase[phase];
  e.first += 1;
  e.second += nanoseconds;
}

std::vector<std::tuple<std::string, long long, long long>> HostProfileSnapshot(bool reset) {
  Counters& c = Global();
  std::lock_guard<std::mutex> lock(c.mu);
  std::vector<std::tuple<std::string, long long, long long>> out;
  for (const auto& [phase, e] : c.by_phase) out.emplace_back(phase, e.first, e.second);
  std::sort(out.begin(), out.end());
  if (reset) c.by_phase.clear();
  return out;
}

}  // namespace hoccl
