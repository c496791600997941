// Host time spent inside jax_hoccl's handlers, by phase, counted only when JAX_HOCCL_PROFILE
// is set (read once). It answers "is a chain of small collectives bound by the host (API
// calls, rendezvous) or by the GPU?"; read it from Python with _hoccl.host_profile().
#ifndef JAX_HOCCL_HOST_PROFILE_H_
#define JAX_HOCCL_HOST_PROFILE_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace hoccl {

bool HostProfileEnabled();
// `phase` must be a string literal (kept by address).
void HostProfileAdd(const char* phase, int64_t nanoseconds);
// (phase, calls, total nanoseconds), sorted by phase; `reset` clears the counters.
std::vector<std::tuple<std::string, long long, long long>> HostProfileSnapshot(bool reset);

// Adds the time from construction to destruction to `phase`.
class HostTimer {
 public:
  explicit HostTimer(const char* phase)
      : phase_(HostProfileEnabled() ? phase : nullptr),
        start_(phase_ ? std::chrono::steady_clock::now()
                      : std::chrono::steady_clock::time_point()) {}
  ~HostTimer() {
    if (phase_)
      HostProfileAdd(phase_, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now() - start_)
                                 .count());
  }
  HostTimer(const HostTimer&) = delete;
  HostTimer& operator=(const HostTimer&) = delete;

 private:
  const char* phase_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace hoccl

#endif  // JAX_HOCCL_HOST_PROFILE_H_
