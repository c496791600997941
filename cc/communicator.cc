#include "communicator.h"

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <thread>

namespace hoccl {

static void StartWatchdog();

// Runs the peers' completions (ArriveAsync) on reusable threads. A completion may block (XLA
// continues that device's program in it, and XLA's own collectives wait for every device),
// so no task ever waits for a free thread: a new one starts whenever the queue outgrows the
// idle workers. The pool grows to the most completions ever in flight at once.
class CompletionPool {
 public:
  void Run(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    if (queue_.size() > static_cast<size_t>(idle_)) {
      std::thread([this] { Work(); }).detach();
    } else {
      cv_.notify_one();
    }
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      while (queue_.empty()) {
        ++idle_;
        cv_.wait(lock);
        --idle_;
      }
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  int idle_ = 0;
};

static CompletionPool& Completions() {
  static CompletionPool* pool = new CompletionPool();  // lives for the process
  return *pool;
}

void RunDetached(std::function<void()> task) { Completions().Run(std::move(task)); }

// Read once, at the first collective (the Python side checked its format at the first
// lowering: src/jax_hoccl/_src/environment.py).
double TimeoutSeconds() {
  static const double seconds = [] {
    const char* v = std::getenv("JAX_HOCCL_TIMEOUT_S");
    double t = (v && *v) ? std::atof(v) : 0.0;
    return t > 0 ? t : 300.0;
  }();
  return seconds;
}

// Messages are built with std::string + snprintf, not iostreams: iostreams need the locale
// machinery of libstdc++, which crashed (null facet) inside XLA's handler threads on the GPU
// machine when the extension carried its own static libstdc++ next to the process's shared one.
static std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

Communicator::Communicator(std::string key, std::vector<int64_t> device_ids)
    : key_(std::move(key)), device_ids_(std::move(device_ids)), next_seq_(device_ids_.size(), 0) {}

uint64_t Communicator::NextSeqAt(int rank, int64_t site) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t count = next_at_site_[{site, rank}]++;
  return (static_cast<uint64_t>(site) << 32) | (count & 0xffffffffu);
}

uint64_t Communicator::NextSeq(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return next_seq_[rank]++;
}

Communicator::Slot& Communicator::SlotFor(uint64_t seq) {
  auto it = slots_.find(seq);
  if (it != slots_.end()) return it->second;
  const int n = size();
  Slot& s = slots_[seq];
  s.inputs.assign(n, nullptr);
  s.arrived.assign(n, 0);
  return s;
}

void Communicator::Arrive(uint64_t seq, int rank, const void* input) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = SlotFor(seq);
    s.inputs[rank] = input;
    s.arrived[rank] = 1;
  }
  cv_.notify_all();
}

std::string Communicator::Describe(int rank) const {
  return "rank " + std::to_string(rank) + " (device " + std::to_string(device_ids_[rank]) + ")";
}

std::string Communicator::Fail(const std::string& msg) {
  if (broken_.empty()) broken_ = msg;
  cv_.notify_all();
  return msg;
}

void Communicator::Break(const std::string& msg) {
  std::lock_guard<std::mutex> lock(mu_);
  Fail(msg);
}

std::string Communicator::Broken() {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

static std::chrono::microseconds Timeout() {
  return std::chrono::microseconds(static_cast<int64_t>(TimeoutSeconds() * 1e6));
}

static std::chrono::steady_clock::time_point Deadline() {
  return std::chrono::steady_clock::now() + Timeout();
}

// The CPU engine's keys are (site << 32 | n-th call of it), the CUDA engine's plain sequence
// numbers: say which call that was in words a user can relate to.
static std::string CallNumber(uint64_t seq) {
  if (seq >> 32)
    return "call #" + std::to_string((seq & 0xffffffffu) + 1) + " of call site " +
           std::to_string(seq >> 32);
  return "collective call #" + std::to_string(seq + 1) + " of this group";
}

std::string Communicator::MissingPeers(const char* op, int rank, uint64_t seq,
                                       const std::vector<char>& arrived) const {
  std::string o = std::string("jax_hoccl ") + op + ": " + Describe(rank) + " of group [" + key_ +
                  "] timed out after " + Seconds(TimeoutSeconds()) +
                  " s (JAX_HOCCL_TIMEOUT_S) at " + CallNumber(seq) +
                  " waiting for missing peer(s):";
  for (int p = 0; p < size(); ++p)
    if (!arrived[p]) o += " " + Describe(p) + ";";
  return o +
         " every peer must call the same collectives in the same order. This communicator"
         " is now unusable; restart the process.";
}

std::string Communicator::WaitArrived(uint64_t seq, int rank, int peer, const char* op) {
  std::unique_lock<std::mutex> lock(mu_);
  auto deadline = Deadline();
  Slot* s = &SlotFor(seq);
  while (!s->arrived[peer]) {
    if (!broken_.empty()) return broken_;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !s->arrived[peer]) {
      return Fail(MissingPeers(op, rank, seq, s->arrived));
    }
    s = &SlotFor(seq);
  }
  return "";
}

bool Communicator::HasArrived(uint64_t seq, int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  return SlotFor(seq).arrived[peer] != 0;
}

const void* Communicator::Input(uint64_t seq, int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  return SlotFor(seq).inputs[peer];
}

std::string Communicator::ExchangeSetup(const std::string& name, int rank, void* value,
                                        std::vector<void*>* all, const char* op) {
  std::unique_lock<std::mutex> lock(mu_);
  const int n = size();
  SetupEntry& e = setup_[name];  // std::map: references stay valid while others insert
  if (e.values.empty()) {
    e.values.assign(n, nullptr);
    e.published.assign(n, 0);
  }
  e.values[rank] = value;
  e.published[rank] = 1;
  cv_.notify_all();
  auto deadline = Deadline();
  auto missing = [&] {
    for (int p = 0; p < n; ++p)
      if (!e.published[p]) return true;
    return false;
  };
  while (missing()) {
    if (!broken_.empty()) return broken_;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && missing()) {
      std::string o = std::string("jax_hoccl ") + op + ": " + Describe(rank) + " of group [" +
                      key_ + "] timed out after " + Seconds(TimeoutSeconds()) +
                      " s (JAX_HOCCL_TIMEOUT_S) in the one-time setup (" + name +
                      ") waiting for missing peer(s):";
      for (int p = 0; p < n; ++p)
        if (!e.published[p]) o += " " + Describe(p) + ";";
      o += " every peer must call the same collectives in the same order. This communicator"
           " is now unusable; restart the process.";
      return Fail(o);
    }
  }
  *all = e.values;
  return "";
}

void Communicator::Leave(uint64_t seq, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(seq);
  if (it == slots_.end()) return;
  if (++it->second.left == size()) slots_.erase(it);
}

void Communicator::ArriveAsync(uint64_t seq, int rank, const char* op, const void* input,
                               void* output, Completion done, const RunAll& run) {
  StartWatchdog();
  AsyncSlot ready;
  std::string broken;
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) {
      broken = broken_;
    } else {
      const int n = size();
      auto [it, fresh] = async_slots_.try_emplace(seq);
      AsyncSlot& s = it->second;
      if (fresh) {
        s.inputs.assign(n, nullptr);
        s.outputs.assign(n, nullptr);
        s.arrived.assign(n, 0);
        s.done.resize(n);
        s.op = op;
        s.since = std::chrono::steady_clock::now();
      }
      s.inputs[rank] = input;
      s.outputs[rank] = output;
      s.arrived[rank] = 1;
      s.done[rank] = std::move(done);
      if (++s.count == n) {
        ready = std::move(s);
        async_slots_.erase(it);
        last = true;
      }
    }
  }
  // Outside the lock: completions may run XLA's next thunks on this thread, which may arrive
  // here again.
  if (!broken.empty()) {
    done(broken);
    return;
  }
  if (!last) return;
  const std::string err = run(ready.inputs, ready.outputs);
  // XLA:CPU continues a device's program inside its completion: each peer's runs on the
  // completion pool, never queued behind another (two devices' continuations on one thread
  // deadlock as soon as one blocks, e.g. in XLA's own collectives), mine here.
  for (int r = 0; r < size(); ++r)
    if (r != rank) Completions().Run([c = std::move(ready.done[r]), err] { c(err); });
  ready.done[rank](err);
}

void Communicator::ExpireAsync() {
  std::vector<std::pair<Completion, std::string>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    const auto timeout = Timeout();
    for (auto it = async_slots_.begin(); it != async_slots_.end();) {
      AsyncSlot& s = it->second;
      if (broken_.empty() && now - s.since < timeout) {
        ++it;
        continue;
      }
      for (int r = 0; r < size(); ++r) {
        if (!s.arrived[r]) continue;
        std::string msg = broken_;
        if (msg.empty() || now - s.since >= timeout) {
          msg = MissingPeers(s.op.c_str(), r, it->first, s.arrived);
          if (broken_.empty()) broken_ = msg;
        }
        failed.emplace_back(std::move(s.done[r]), msg);
      }
      it = async_slots_.erase(it);
    }
  }
  cv_.notify_all();
  for (auto& [done, msg] : failed)
    Completions().Run([c = std::move(done), m = std::move(msg)] { c(m); });
}

static std::mutex g_registry_mu;
static std::map<std::string, std::unique_ptr<Communicator>>& Registry() {
  static auto* r = new std::map<std::string, std::unique_ptr<Communicator>>();
  return *r;
}

Communicator& GetCommunicator(const std::string& platform, const std::vector<int64_t>& ids) {
  std::string ids_text;
  for (size_t i = 0; i < ids.size(); ++i) ids_text += (i ? "," : "") + std::to_string(ids[i]);
  std::string key = platform + ":" + ids_text;
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto& slot = Registry()[key];
  if (!slot) slot = std::make_unique<Communicator>(ids_text, ids);
  return *slot;
}

size_t LiveSlotCount() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  size_t total = 0;
  for (auto& [key, comm] : Registry()) {
    std::lock_guard<std::mutex> l(comm->mu_);
    total += comm->slots_.size() + comm->async_slots_.size();
  }
  return total;
}

// One thread for the process, started by the first async rendezvous: every 50 ms it lets
// each communicator fail the rendezvous that waited too long.
static void StartWatchdog() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::thread([] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        std::vector<Communicator*> comms;
        {
          std::lock_guard<std::mutex> lock(g_registry_mu);
          for (auto& [key, comm] : Registry()) comms.push_back(comm.get());
        }
        for (Communicator* c : comms) c->ExpireAsync();  // communicators live for the process
      }
    }).detach();
  });
}

}  // namespace hoccl
