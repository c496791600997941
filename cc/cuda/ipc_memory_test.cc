// Two-process test of ipc_memory.h on one GPU (plain checks, no gtest). The owner (this
// program) allocates with cudaMalloc and with AllocExportable, starts its fd server and execs
// itself as the importer, which maps both ranges and checks their contents, the caches, the
// refusals and that nothing leaks (file descriptors, mappings). Exit status 0 = all passed
// (or no GPU: SKIPPED). Built by CMake's ipc_memory_test target, or by hand:
//   g++ -std=c++17 -Icc -I<cuda>/include cc/cuda/ipc_memory.cc cc/cuda/driver_api.cc
//   cc/cuda/ipc_memory_test.cc
//       -L<cuda>/lib64 -lcudart_static -ldl -lpthread -lrt
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/ipc_memory.h"

using namespace hoccl;

namespace {

const char* g_who = "owner";
int g_failures = 0;

void Check(bool ok, const std::string& what) {
  std::printf("[%s] %s %s\n", g_who, ok ? "PASS" : "FAIL", what.c_str());
  std::fflush(stdout);
  if (!ok) ++g_failures;
}

void Info(const std::string& what) {
  std::printf("[%s] info %s\n", g_who, what.c_str());
  std::fflush(stdout);
}

bool Ok(const std::string& err, const std::string& what) {
  Check(err.empty(), what + (err.empty() ? "" : ": " + err));
  return err.empty();
}

int CountFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

double Micros(std::chrono::steady_clock::time_point t0, int n) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
         n;
}

std::string Num(double x) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f", x);
  return b;
}

constexpr size_t kABytes = 8 << 20;          // cudaMalloc
constexpr size_t kBBytes = (3 << 20) + 100;  // AllocExportable (rounds up)
constexpr size_t kOffA = (1 << 20) + 4;      // offsets of the described ranges
constexpr size_t kOffB = 2 << 20;
constexpr size_t kCheckBytes = 1 << 20;  // bytes copied back and compared
constexpr size_t kWriteOff = 3 << 20;    // where the importer writes into B
constexpr int kWriteWords = 16;

uint32_t PatternA(size_t i) { return 0xA0000000u ^ static_cast<uint32_t>(i * 2654435761u); }
uint32_t PatternB(size_t i) { return 0xB0000000u + static_cast<uint32_t>(i); }

void Fill(void* dev, size_t bytes, uint32_t (*pattern)(size_t)) {
  std::vector<uint32_t> h(bytes / 4);
  for (size_t i = 0; i < h.size(); ++i) h[i] = pattern(i);
  Check(cudaMemcpy(dev, h.data(), h.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess,
        "fill " + std::to_string(bytes) + " bytes");
}

// Copies kCheckBytes from `dev` (= word `first` of the pattern) and compares.
bool Matches(const void* dev, size_t first, uint32_t (*pattern)(size_t)) {
  std::vector<uint32_t> h(kCheckBytes / 4);
  if (cudaMemcpy(h.data(), dev, kCheckBytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  for (size_t i = 0; i < h.size(); ++i)
    if (h[i] != pattern(first + i)) return false;
  return true;
}

struct Message {  // owner -> importer, through a pipe
  int owner_pid;
  char socket[64];
  IpcRange a, b;  // cudaMalloc (legacy) and AllocExportable (VMM) ranges
};

// ---------------------------------------------------------------- importer

int Importer(int pipe_fd) {
  g_who = "importer";
  alarm(120);
  Message m;
  size_t got = 0;
  while (got < sizeof(m)) {
    ssize_t k = read(pipe_fd, reinterpret_cast<char*>(&m) + got, sizeof(m) - got);
    if (k <= 0) return 2;
    got += static_cast<size_t>(k);
  }
  const std::string sock = m.socket;

  // A process the owner did not allow (forked before this process touches CUDA) is refused.
  pid_t stranger = fork();
  if (stranger == 0) {
    g_who = "stranger";
    AllowPeerPids({m.owner_pid});
    const void* p = nullptr;
    std::string err = MapPeerRange(sock, m.b, 0, &p);
    Info("MapPeerRange said: " + err);
    _exit(err.find("refused: pid") != std::string::npos ? 0 : 1);
  }
  int status = 0;
  waitpid(stranger, &status, 0);
  Check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "a pid the owner did not allow is refused");

  // A server whose pid I did not allow is not trusted.
  AllowPeerPids({});
  const void* pa = nullptr;
  const void* pb = nullptr;
  std::string err = MapPeerRange(sock, m.b, 0, &pb);
  Check(err.find("not trusted") != std::string::npos, "a server pid I did not allow: " + err);
  AllowPeerPids({m.owner_pid});

  Check(cudaSetDevice(0) == cudaSuccess, "cudaSetDevice(0)");
  auto t0 = std::chrono::steady_clock::now();
  if (!Ok(MapPeerRange(sock, m.a, 0, &pa), "map the cudaMalloc range (legacy IPC)")) return 1;
  Info("legacy open took " + Num(Micros(t0, 1)) + " us");
  t0 = std::chrono::steady_clock::now();
  if (!Ok(MapPeerRange(sock, m.b, 0, &pb), "map the AllocExportable range (fd server)")) return 1;
  Info("fd request + import + map took " + Num(Micros(t0, 1)) + " us");
  Check(Matches(pa, kOffA / 4, PatternA), "cudaMemcpy from the mapped cudaMalloc range");
  Check(Matches(pb, kOffB / 4, PatternB), "cudaMemcpy from the mapped VMM range");
  Check(LivePeerMappings() == 2, "2 live mappings");

  // Writes through the mapping land in the owner's memory (the owner checks after I exit).
  std::vector<uint32_t> w(kWriteWords);
  for (int i = 0; i < kWriteWords; ++i) w[i] = 0xC0FFEE00u + i;
  Check(cudaMemcpy(static_cast<char*>(const_cast<void*>(pb)) - kOffB + kWriteOff, w.data(),
                   w.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess,
        "write into the mapped VMM range");

  // Caches: same pointers, no new mapping; another offset in the same allocation too.
  const void* pa2 = nullptr;
  const void* pb2 = nullptr;
  Ok(MapPeerRange(sock, m.a, 0, &pa2), "map the cudaMalloc range again");
  Ok(MapPeerRange(sock, m.b, 0, &pb2), "map the VMM range again");
  IpcRange b0 = m.b;
  b0.offset = 0;
  const void* pb0 = nullptr;
  Ok(MapPeerRange(sock, b0, 0, &pb0), "map offset 0 of the VMM allocation");
  Check(pa2 == pa && pb2 == pb, "second MapPeerRange returns the same pointers");
  Check(static_cast<const char*>(pb0) == static_cast<const char*>(pb) - kOffB,
        "another offset of a mapped allocation reuses its mapping");
  Check(LivePeerMappings() == 2, "still 2 live mappings");

  IpcRange bogus = m.b;
  bogus.handle_id += 1000;
  err = MapPeerRange(sock, bogus, 0, &pb0);
  Check(err.find("no exportable allocation") != std::string::npos,
        "an unknown handle_id is refused by the owner: " + err);

  // 1000 x (DescribeRange of my own memory + cached MapPeerRange): no fd, no mapping leaks.
  void* mine = nullptr;
  Ok(AllocExportable(4096, 0, &mine), "AllocExportable in the importer");
  int fds = CountFds();
  bool same = true;
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; ++i) {
    IpcRange r;
    same &= DescribeRange(mine, &r).empty();
    same &= MapPeerRange(sock, m.a, 0, &pa2).empty() && pa2 == pa;
    same &= MapPeerRange(sock, m.b, 0, &pb2).empty() && pb2 == pb;
  }
  Info("DescribeRange + 2 cached MapPeerRange: " + Num(Micros(t0, 1000)) + " us per iteration");
  Check(same && CountFds() == fds && LivePeerMappings() == 2,
        "1000 x DescribeRange + MapPeerRange: same results, fds " + std::to_string(fds) + " -> " +
            std::to_string(CountFds()) + ", mappings " + std::to_string(LivePeerMappings()));

  // 50 x unmap everything + map again (each VMM map asks the fd server): nothing leaks.
  fds = CountFds();
  bool ok = true;
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 50 && ok; ++i) {
    UnmapAllPeers();
    ok &= LivePeerMappings() == 0;
    err = MapPeerRange(sock, m.a, 0, &pa);
    if (err.empty()) err = MapPeerRange(sock, m.b, 0, &pb);
    if (!err.empty()) Check(false, "remap " + std::to_string(i) + ": " + err);
    ok &= err.empty();
  }
  Info("unmap all + remap both: " + Num(Micros(t0, 50)) + " us per round");
  Check(ok && Matches(pa, kOffA / 4, PatternA) && Matches(pb, kOffB / 4, PatternB),
        "50 x UnmapAllPeers + remap: data still right");
  Check(CountFds() == fds && LivePeerMappings() == 2,
        "50 x remap: fds " + std::to_string(fds) + " -> " + std::to_string(CountFds()));
  UnmapAllPeers();
  Check(LivePeerMappings() == 0, "UnmapAllPeers leaves no mapping");
  return g_failures == 0 ? 0 : 1;
}

// ---------------------------------------------------------------- owner

// A VMM allocation replaced at the same address must get a new handle_id.
void RemapSameAddress() {
  const DriverApi& api = GetDriverApi();
  void* c = nullptr;
  if (!Ok(AllocExportable(1, 0, &c), "AllocExportable(1)")) return;
  IpcRange r1, r2;
  Ok(DescribeRange(c, &r1), "DescribeRange of a fresh exportable allocation");
  const CUdeviceptr va = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(c));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle h = 0;
  bool ok = api.mem_unmap(va, r1.size) == CUDA_SUCCESS &&
            api.mem_create(&h, r1.size, &prop, 0) == CUDA_SUCCESS &&
            api.mem_map(va, r1.size, 0, h, 0) == CUDA_SUCCESS &&
            api.mem_release(h) == CUDA_SUCCESS &&
            api.mem_set_access(va, r1.size, &access, 1) == CUDA_SUCCESS;
  Check(ok, "replace the physical memory behind the same address");
  Ok(DescribeRange(c, &r2), "DescribeRange after the replacement");
  Check(r2.base == r1.base && r2.handle_id != r1.handle_id,
        "new VMM allocation at the same base: handle_id " + std::to_string(r1.handle_id) + " -> " +
            std::to_string(r2.handle_id));
}

int Owner() {
  alarm(180);
  Check(cudaSetDevice(0) == cudaSuccess, "cudaSetDevice(0)");
  void* a = nullptr;
  void* b = nullptr;
  Check(cudaMalloc(&a, kABytes) == cudaSuccess, "cudaMalloc");
  if (!Ok(AllocExportable(kBBytes, 0, &b), "AllocExportable")) return 1;
  {
    std::vector<uint32_t> h(kBBytes / 4, 1);
    cudaMemcpy(h.data(), b, h.size() * 4, cudaMemcpyDeviceToHost);
    bool zero = true;
    for (uint32_t x : h) zero &= x == 0;
    Check(zero, "AllocExportable memory is zeroed");
  }
  Fill(a, kABytes, PatternA);
  Fill(b, kBBytes, PatternB);

  IpcRange ra, rb, r;
  Ok(DescribeRange(static_cast<char*>(a) + kOffA, &ra, kCheckBytes), "DescribeRange(cudaMalloc)");
  Ok(DescribeRange(static_cast<char*>(b) + kOffB, &rb, kCheckBytes), "DescribeRange(exportable)");
  Check(ra.kind == kIpcLegacy && ra.base == reinterpret_cast<uintptr_t>(a) && ra.offset == kOffA &&
            ra.size >= kABytes,
        "cudaMalloc range: legacy kind, size " + std::to_string(ra.size));
  Check(rb.kind == kIpcVmmFd && rb.base == reinterpret_cast<uintptr_t>(b) && rb.offset == kOffB &&
            rb.size >= kBBytes,
        "exportable range: VMM kind, size " + std::to_string(rb.size));
  std::string err = DescribeRange(static_cast<char*>(b) + rb.size - 8, &r, 16);
  Check(!err.empty(), "a range past the allocation's end is an error: " + err);
  int on_stack = 0;
  err = DescribeRange(&on_stack, &r);
  Check(!err.empty(), "host memory is an error: " + err);

  {  // What DescribeRange's VMM cache relies on: a retain returns the allocation's one handle.
    const DriverApi& api = GetDriverApi();
    CUmemGenericAllocationHandle h1 = 0, h2 = 0;
    api.mem_retain_allocation_handle(&h1, b);
    api.mem_retain_allocation_handle(&h2, static_cast<char*>(b) + kOffB);
    api.mem_release(h1);
    api.mem_release(h2);
    Info("two retains of the exportable allocation: " + std::to_string(h1) + ", " +
         std::to_string(h2) + " (the cache holds " + std::to_string(rb.handle_id) + "'s)");
    CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID;
    unsigned long long ida = 0, idb = 0;
    void* da = &ida;
    void* db = &idb;
    CUresult ra_ = api.pointer_get_attributes(1, &attr, &da, reinterpret_cast<uintptr_t>(a));
    CUresult rb_ = api.pointer_get_attributes(1, &attr, &db, reinterpret_cast<uintptr_t>(b));
    Info("MEMORY_BLOCK_ID: cudaMalloc " + std::to_string(ida) + " (CUresult " +
         std::to_string(ra_) + "), exportable " + std::to_string(idb) + " (CUresult " +
         std::to_string(rb_) + ")");
  }
  int fds = CountFds();
  bool same = true;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; ++i) {
    same &= DescribeRange(static_cast<char*>(a) + kOffA, &r).empty() && r.handle_id == ra.handle_id;
    same &= DescribeRange(static_cast<char*>(b) + kOffB, &r).empty() && r.handle_id == rb.handle_id;
  }
  Info("DescribeRange (cache hit): " + Num(Micros(t0, 2000)) + " us per call");
  Check(same && CountFds() == fds, "2000 x DescribeRange: same handle_id, fds " +
                                       std::to_string(fds) + " -> " + std::to_string(CountFds()));

  const std::string sock = "jax_hoccl_test-" + std::to_string(getpid());
  if (!Ok(StartFdServer(sock), "StartFdServer(@" + sock + ")")) return 1;
  Ok(StartFdServer(std::string(1, '\0') + sock), "StartFdServer again, same name");
  Check(!StartFdServer(sock + "-other").empty(), "StartFdServer with another name is an error");
  const void* own = nullptr;
  Ok(MapPeerRange(sock, rb, 0, &own), "MapPeerRange of my own range");
  Check(own == static_cast<char*>(b) + kOffB && LivePeerMappings() == 0,
        "my own range comes back as the pointer itself, nothing mapped");

  fds = CountFds();
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return 1;
  pid_t child = fork();
  if (child == 0) {  // exec at once: the CUDA state of this process must not be used here
    close(pipe_fds[1]);
    std::string arg = std::to_string(pipe_fds[0]);
    execl("/proc/self/exe", "ipc_memory_test", "--importer", arg.c_str(), (char*)nullptr);
    _exit(127);
  }
  close(pipe_fds[0]);
  AllowPeerPids({child});
  Message m{};
  m.owner_pid = getpid();
  std::snprintf(m.socket, sizeof(m.socket), "%s", sock.c_str());
  m.a = ra;
  m.b = rb;
  Check(write(pipe_fds[1], &m, sizeof(m)) == static_cast<ssize_t>(sizeof(m)), "send the ranges");
  close(pipe_fds[1]);
  int status = 0;
  waitpid(child, &status, 0);
  Check(WIFEXITED(status) && WEXITSTATUS(status) == 0,
        "importer passed (status " + std::to_string(status) + ")");
  Check(CountFds() == fds, "the fd server left no fd open: " + std::to_string(fds) + " -> " +
                               std::to_string(CountFds()));

  std::vector<uint32_t> w(kWriteWords);
  cudaMemcpy(w.data(), static_cast<char*>(b) + kWriteOff, w.size() * 4, cudaMemcpyDeviceToHost);
  bool written = true;
  for (int i = 0; i < kWriteWords; ++i) written &= w[i] == 0xC0FFEE00u + i;
  Check(written, "the importer's write reached my memory");

  RemapSameAddress();

  // Informational: does cudaMalloc put a new allocation at the freed base? Then it must get a
  // new handle_id too.
  cudaFree(a);
  void* a2 = nullptr;
  cudaMalloc(&a2, kABytes);
  Ok(DescribeRange(a2, &r), "DescribeRange of a new cudaMalloc allocation");
  if (a2 == a)
    Check(r.handle_id != ra.handle_id, "new cudaMalloc allocation at the same base: handle_id " +
                                           std::to_string(ra.handle_id) + " -> " +
                                           std::to_string(r.handle_id));
  else
    Info("the new cudaMalloc allocation lies elsewhere; same-base case not exercised");

  std::printf("%s: %d failure(s)\n", g_failures == 0 ? "ALL PASSED" : "FAILED", g_failures);
  return g_failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc == 3 && std::strcmp(argv[1], "--importer") == 0) return Importer(std::atoi(argv[2]));
  int devices = 0;  // built in CI without a GPU: nothing to run there
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 0;
  }
  return Owner();
}
