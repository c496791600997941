#include "cuda/ipc_memory.h"

// No iostreams in this file: see the note in communicator.cc.

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>

#include "cuda/driver_api.h"

namespace hoccl {

namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(IpcRange::legacy), "legacy handle size");

std::string Hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof(b), "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

std::string Errno(const char* what) {
  return std::string(what) + " failed: " + std::strerror(errno);
}

std::string CudaError(const char* call, cudaError_t e) {
  cudaGetLastError();  // IPC errors are not sticky; do not leave them for XLA's next check
  return std::string(call) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

// Makes `device` current on this thread while alive; the caller's device comes back after.
struct DeviceGuard {
  int prev = -1;
  cudaError_t status = cudaSuccess;
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    if (prev != device) status = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev >= 0) cudaSetDevice(prev);
  }
};

// ---------------------------------------------------------------- state

// An allocation of mine that DescribeRange has seen, by base.
struct OwnAlloc {
  uint64_t size = 0;
  int32_t kind = kIpcVmmFd;
  uint64_t handle_id = 0;
  int device = 0;
  // VMM: a reference we hold, so that the handle's value cannot be reused by a later
  // allocation while this entry exists (its value is the allocation's identity).
  CUmemGenericAllocationHandle handle = 0;
  // Legacy: CUDA's allocation id, never reused within a process.
  unsigned long long buffer_id = 0;
  cudaIpcMemHandle_t legacy;
};

struct PeerKey {
  std::string socket;
  uint64_t base, handle_id;
  int device;
  bool operator<(const PeerKey& o) const {
    return std::tie(socket, base, handle_id, device) <
           std::tie(o.socket, o.base, o.handle_id, o.device);
  }
};

struct PeerMapping {
  int32_t kind;
  int device;
  CUdeviceptr va;  // start of the whole allocation here
  size_t size;
};

// Three locks so that the fd server (own_mu, pids_mu) never waits on an importer that holds
// peers_mu while it waits on another process's server: two processes mapping each other must
// not deadlock. Never destroyed: the detached server thread may run during exit.
struct State {
  std::mutex own_mu;
  std::map<uint64_t, OwnAlloc> own;
  uint64_t next_handle_id = 1;
  std::string server_name;  // abstract name, without the leading '\0'

  std::mutex pids_mu;
  std::set<int> allowed_pids;

  std::mutex peers_mu;
  std::map<PeerKey, PeerMapping> peers;
};

State& St() {
  static State* s = new State();
  return *s;
}

bool PidAllowed(int pid) {
  std::lock_guard<std::mutex> lock(St().pids_mu);
  return St().allowed_pids.count(pid) > 0;
}

// ---------------------------------------------------------------- sockets

std::string StripNul(const std::string& name) {
  return (!name.empty() && name[0] == '\0') ? name.substr(1) : name;
}

std::string Shown(const std::string& name) {  // abstract names print as "@name"
  std::string s = "@";
  for (char c : name) s += (c >= 32 && c < 127) ? c : '?';
  return s;
}

std::string MakeAddress(const std::string& name, sockaddr_un* a, socklen_t* len) {
  std::memset(a, 0, sizeof(*a));
  a->sun_family = AF_UNIX;
  if (name.empty() || name.size() > sizeof(a->sun_path) - 1)
    return "bad abstract socket name " + Shown(name) + " (1 to " +
           std::to_string(sizeof(a->sun_path) - 1) + " bytes)";
  std::memcpy(a->sun_path + 1, name.data(), name.size());  // sun_path[0] = '\0': abstract
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return "";
}

void SetTimeouts(int fd, int seconds) {
  timeval tv{seconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

struct Fd {  // closes on scope exit
  int fd;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

constexpr uint32_t kWireMagic = 0x31466348;  // "HcF1": wire format version 1

struct FdRequest {
  uint32_t magic;
  uint32_t reserved;
  uint64_t base;
  uint64_t handle_id;
};

struct FdReply {
  uint32_t magic;
  int32_t ok;
  uint64_t size;  // of the allocation the fd is for
  char error[240];
};

bool SendAll(int s, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = send(s, c, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool RecvAll(int s, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t k = recv(s, c, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Sends `n` bytes, with `fd` attached by SCM_RIGHTS when >= 0.
bool SendWithFd(int s, const void* p, size_t n, int fd) {
  if (fd < 0) return SendAll(s, p, n);
  iovec iov{const_cast<void*>(p), n};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  ssize_t k;
  do k = sendmsg(s, &msg, MSG_NOSIGNAL);
  while (k < 0 && errno == EINTR);
  if (k <= 0) return false;
  return SendAll(s, static_cast<const char*>(p) + k, n - static_cast<size_t>(k));
}

// Receives exactly `n` bytes; *fd gets the first descriptor passed along (extra ones are
// closed, so a confused peer cannot make us leak).
std::string RecvWithFd(int s, void* p, size_t n, int* fd) {
  *fd = -1;
  char* c = static_cast<char*>(p);
  while (n > 0) {
    iovec iov{c, n};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t k = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
    if (k < 0 && errno == EINTR) continue;
    for (cmsghdr* h = CMSG_FIRSTHDR(&msg); k >= 0 && h; h = CMSG_NXTHDR(&msg, h)) {
      if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
        if (*fd < 0)
          *fd = f;
        else
          close(f);
      }
    }
    if (k < 0) return Errno("recvmsg");
    if (k == 0) return "connection closed before the whole reply arrived";
    if (msg.msg_flags & MSG_CTRUNC) return "descriptor truncated in transit";
    c += k;
    n -= static_cast<size_t>(k);
  }
  return "";
}

// ---------------------------------------------------------------- fd server

// Exports my VMM allocation (base, handle_id) as a new POSIX fd, for the caller to send.
std::string ExportFd(uint64_t base, uint64_t handle_id, int* fd, uint64_t* size) {
  const DriverApi& api = GetDriverApi();
  std::lock_guard<std::mutex> lock(St().own_mu);
  auto it = St().own.find(base);
  if (it == St().own.end() || it->second.handle_id != handle_id || it->second.kind != kIpcVmmFd)
    return "no exportable allocation at " + Hex(base) + " with handle_id " +
           std::to_string(handle_id) + " here (never described, or freed and replaced since)";
  DeviceGuard guard(it->second.device);
  if (guard.status != cudaSuccess) return CudaError("cudaSetDevice", guard.status);
  CUresult r = api.mem_export_to_shareable_handle(fd, it->second.handle,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) return api.Describe("cuMemExportToShareableHandle", r);
  *size = it->second.size;
  return "";
}

void ServeOne(int conn) {
  SetTimeouts(conn, 5);  // a stuck client must not stall the server for long
  FdReply reply{};
  reply.magic = kWireMagic;
  int fd = -1;
  std::string err = [&]() -> std::string {
    FdRequest q{};
    if (!RecvAll(conn, &q, sizeof(q))) return "incomplete request";
    if (q.magic != kWireMagic) return "bad request (another jax_hoccl version?)";
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
      return Errno("getsockopt(SO_PEERCRED)");
    if (cred.uid != getuid())
      return "refused: uid " + std::to_string(cred.uid) + " is not this process's uid";
    if (!PidAllowed(cred.pid))
      return "refused: pid " + std::to_string(cred.pid) +
             " is not one of this job's processes (AllowPeerPids)";
    return ExportFd(q.base, q.handle_id, &fd, &reply.size);
  }();
  reply.ok = err.empty() ? 1 : 0;
  std::snprintf(reply.error, sizeof(reply.error), "%s", err.c_str());
  SendWithFd(conn, &reply, sizeof(reply), fd);  // a client gone away is its own problem
  if (fd >= 0) close(fd);                       // the receiver has its own copy now
}

void ServeLoop(int listen_fd) {
  for (;;) {
    int conn = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) {
      if (errno != EINTR && errno != ECONNABORTED) usleep(10000);  // e.g. EMFILE: retry later
      continue;
    }
    ServeOne(conn);
    close(conn);
  }
}

// Asks peer server `name` for the fd of allocation (r.base, r.handle_id).
std::string RequestFd(const std::string& name, const IpcRange& r, int* fd, uint64_t* size) {
  sockaddr_un addr;
  socklen_t addr_len = 0;
  std::string err = MakeAddress(name, &addr, &addr_len);
  if (!err.empty()) return err;
  Fd s{socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  if (s.fd < 0) return Errno("socket");
  SetTimeouts(s.fd, 30);
  if (connect(s.fd, reinterpret_cast<sockaddr*>(&addr), addr_len) != 0)
    return Errno("connect") + " (is the peer process up, with its fd server started?)";
  // Anyone can bind an abstract name first: only trust a server of this job.
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(s.fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return Errno("getsockopt(SO_PEERCRED)");
  if (cred.uid != getuid() || !PidAllowed(cred.pid))
    return "not trusted: the server is pid " + std::to_string(cred.pid) + " uid " +
           std::to_string(cred.uid) + ", not an allowed process of this job (AllowPeerPids)";
  FdRequest q{kWireMagic, 0, r.base, r.handle_id};
  if (!SendAll(s.fd, &q, sizeof(q))) return Errno("send");
  FdReply reply{};
  err = RecvWithFd(s.fd, &reply, sizeof(reply), fd);
  if (err.empty() && reply.magic != kWireMagic) err = "bad reply (another jax_hoccl version?)";
  if (err.empty() && !reply.ok)
    err = std::string(reply.error, strnlen(reply.error, sizeof(reply.error)));
  if (err.empty() && *fd < 0) err = "reply carried no descriptor";
  if (!err.empty()) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
    return err;
  }
  *size = reply.size;
  return "";
}

// ---------------------------------------------------------------- importing

std::string ImportVmm(const std::string& name, const IpcRange& r, int device, CUdeviceptr* va) {
  const DriverApi& api = GetDriverApi();
  int fd = -1;
  uint64_t size = 0;
  std::string err = RequestFd(name, r, &fd, &size);
  if (!err.empty()) return err;
  if (size != r.size) {
    close(fd);
    return "the server's allocation has " + std::to_string(size) + " bytes, the range says " +
           std::to_string(r.size);
  }
  DeviceGuard guard(device);
  if (guard.status != cudaSuccess) {
    close(fd);
    return CudaError("cudaSetDevice", guard.status);
  }
  CUmemGenericAllocationHandle h = 0;
  CUresult res =
      api.mem_import_from_shareable_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);  // the imported handle holds the allocation now
  if (res != CUDA_SUCCESS) return api.Describe("cuMemImportFromShareableHandle", res);
  res = api.mem_address_reserve(va, size, 0, 0, 0);
  if (res != CUDA_SUCCESS) {
    api.mem_release(h);
    return api.Describe("cuMemAddressReserve", res);
  }
  res = api.mem_map(*va, size, 0, h, 0);
  api.mem_release(h);  // the mapping keeps the memory alive until cuMemUnmap
  if (res != CUDA_SUCCESS) {
    api.mem_address_free(*va, size);
    return api.Describe("cuMemMap", res);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  res = api.mem_set_access(*va, size, &access, 1);
  if (res != CUDA_SUCCESS) {
    api.mem_unmap(*va, size);
    api.mem_address_free(*va, size);
    return api.Describe("cuMemSetAccess", res);
  }
  return "";
}

std::string OpenLegacy(const IpcRange& r, int device, CUdeviceptr* va) {
  DeviceGuard guard(device);
  if (guard.status != cudaSuccess) return CudaError("cudaSetDevice", guard.status);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, r.legacy, sizeof(h));
  void* p = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess)
    return CudaError("cudaIpcOpenMemHandle", e) +
           " (a handle of this same process cannot be opened: give MapPeerRange its own "
           "socket name for its own ranges)";
  *va = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
  return "";
}

}  // namespace

// ---------------------------------------------------------------- API

std::string DescribeRange(const void* ptr, IpcRange* out, size_t bytes) {
  const DriverApi& api = GetDriverApi();
  if (!api.vmm_error.empty()) return api.vmm_error;
  const CUdeviceptr p = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr));
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult r = api.mem_get_address_range(&base, &size, p);
  if (r != CUDA_SUCCESS)
    return api.Describe("cuMemGetAddressRange", r) + " for " + Hex(p) +
           " (not device memory of this process?)";
  if (bytes > size || p - base > size - bytes)
    return "range [" + Hex(p) + ", +" + std::to_string(bytes) +
           ") does not lie in one "
           "allocation (the one at " +
           Hex(base) + " has " + std::to_string(size) + " bytes)";

  // One query for the rest; each value gets 8 zeroed bytes, of which the driver writes 1 to 8.
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                 CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  unsigned long long v[3] = {};
  void* data[3] = {&v[0], &v[1], &v[2]};
  r = api.pointer_get_attributes(3, attrs, data, p);
  if (r != CUDA_SUCCESS) return api.Describe("cuPointerGetAttributes", r) + " for " + Hex(p);
  const bool legacy = v[1] != 0;

  CUmemGenericAllocationHandle h = 0;
  if (!legacy) {
    r = api.mem_retain_allocation_handle(&h, const_cast<void*>(ptr));
    if (r != CUDA_SUCCESS)
      return api.Describe("cuMemRetainAllocationHandle", r) + ": memory at " + Hex(p) +
             " is neither cudaMalloc memory nor a VMM allocation (cudaMallocAsync pools "
             "cannot be shared this way)";
  }
  State& s = St();
  std::lock_guard<std::mutex> lock(s.own_mu);
  auto it = s.own.find(base);
  const bool hit = it != s.own.end() && it->second.size == size &&
                   it->second.kind == (legacy ? kIpcLegacy : kIpcVmmFd) &&
                   (legacy ? it->second.buffer_id == v[0] : it->second.handle == h);
  if (hit && !legacy) api.mem_release(h);  // the entry holds its own reference
  if (!hit) {
    OwnAlloc a;
    a.size = size;
    a.kind = legacy ? kIpcLegacy : kIpcVmmFd;
    if (legacy) {
      a.device = static_cast<int>(v[2]);
      a.buffer_id = v[0];
      DeviceGuard guard(a.device);
      cudaError_t e = cudaIpcGetMemHandle(&a.legacy, reinterpret_cast<void*>(base));
      if (e != cudaSuccess) return CudaError("cudaIpcGetMemHandle", e) + " for " + Hex(base);
    } else {
      CUmemAllocationProp prop{};
      r = api.mem_get_allocation_properties_from_handle(&prop, h);
      const bool fd_ok = prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      if (r != CUDA_SUCCESS || !fd_ok) {
        api.mem_release(h);
        return r != CUDA_SUCCESS ? api.Describe("cuMemGetAllocationPropertiesFromHandle", r)
                                 : "the VMM allocation at " + Hex(base) +
                                       " was not created exportable as a "
                                       "POSIX fd (requested handle types " +
                                       Hex(prop.requestedHandleTypes) + ")";
      }
      a.device = prop.location.id;
      a.handle = h;
    }
    if (it != s.own.end()) {  // a new allocation took this base: drop the old one
      if (it->second.kind == kIpcVmmFd) api.mem_release(it->second.handle);
      s.own.erase(it);
    }
    a.handle_id = s.next_handle_id++;
    it = s.own.emplace(base, a).first;
  }
  const OwnAlloc& a = it->second;
  *out = IpcRange();
  out->base = base;
  out->size = a.size;
  out->offset = p - base;
  out->handle_id = a.handle_id;
  out->kind = a.kind;
  if (legacy) std::memcpy(out->legacy, &a.legacy, sizeof(out->legacy));
  return "";
}

std::string StartFdServer(const std::string& socket_name) {
  const std::string name = StripNul(socket_name);
  sockaddr_un addr;
  socklen_t addr_len = 0;
  std::string err = MakeAddress(name, &addr, &addr_len);
  if (!err.empty()) return "jax_hoccl fd server: " + err;
  State& s = St();
  std::lock_guard<std::mutex> lock(s.own_mu);
  if (!s.server_name.empty()) {
    if (s.server_name == name) return "";
    return "jax_hoccl fd server: already serving " + Shown(s.server_name) + ", cannot serve " +
           Shown(name) + " too";
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "jax_hoccl fd server: " + Errno("socket");
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), addr_len) != 0 || listen(fd, 128) != 0) {
    const bool in_use = errno == EADDRINUSE;
    err = "jax_hoccl fd server: " + Errno("bind/listen") + " on " + Shown(name) +
          (in_use ? " (another process uses this name)" : "");
    close(fd);
    return err;
  }
  try {
    std::thread(ServeLoop, fd).detach();  // lives until exit, as the listening socket does
  } catch (const std::system_error& e) {
    close(fd);
    return std::string("jax_hoccl fd server: cannot start its thread: ") + e.what();
  }
  s.server_name = name;
  return "";
}

void AllowPeerPids(const std::vector<int>& pids) {
  std::lock_guard<std::mutex> lock(St().pids_mu);
  St().allowed_pids = std::set<int>(pids.begin(), pids.end());
}

std::string MapPeerRange(const std::string& peer_socket, const IpcRange& r, int device,
                         const void** local_ptr) {
  const std::string name = StripNul(peer_socket);
  auto fail = [&](const std::string& err) {  // built only on failure: hits stay cheap
    return "jax_hoccl: mapping the allocation " + Hex(r.base) + " (" + std::to_string(r.size) +
           " bytes, handle_id " + std::to_string(r.handle_id) + ") of peer " + Shown(name) + ": " +
           err;
  };
  if (r.offset >= r.size) return fail("offset " + std::to_string(r.offset) + " out of range");
  if (r.kind != kIpcVmmFd && r.kind != kIpcLegacy)
    return fail("unknown kind " + std::to_string(r.kind));
  State& s = St();
  {
    std::lock_guard<std::mutex> lock(s.own_mu);
    if (!s.server_name.empty() && name == s.server_name) {  // my own range
      *local_ptr = reinterpret_cast<const void*>(static_cast<uintptr_t>(r.base + r.offset));
      return "";
    }
  }
  const DriverApi& api = GetDriverApi();
  if (!api.vmm_error.empty()) return fail(api.vmm_error);
  std::lock_guard<std::mutex> lock(s.peers_mu);
  const PeerKey key{name, r.base, r.handle_id, device};
  auto it = s.peers.find(key);
  if (it == s.peers.end()) {
    CUdeviceptr va = 0;
    std::string err =
        r.kind == kIpcLegacy ? OpenLegacy(r, device, &va) : ImportVmm(name, r, device, &va);
    if (!err.empty()) return fail(err);
    it = s.peers.emplace(key, PeerMapping{r.kind, device, va, static_cast<size_t>(r.size)}).first;
  }
  *local_ptr = reinterpret_cast<const void*>(static_cast<uintptr_t>(it->second.va + r.offset));
  return "";
}

std::string AllocExportable(size_t bytes, int device, void** ptr) {
  const DriverApi& api = GetDriverApi();
  const std::string what = "jax_hoccl: exportable allocation of " + std::to_string(bytes) +
                           " bytes on device " + std::to_string(device) + ": ";
  if (!api.vmm_error.empty()) return what + api.vmm_error;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t gran = 0;
  CUresult r = api.mem_get_allocation_granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) return what + api.Describe("cuMemGetAllocationGranularity", r);
  const size_t size = (std::max<size_t>(bytes, 1) + gran - 1) / gran * gran;
  DeviceGuard guard(device);
  if (guard.status != cudaSuccess) return what + CudaError("cudaSetDevice", guard.status);
  CUmemGenericAllocationHandle h = 0;
  r = api.mem_create(&h, size, &prop, 0);
  if (r != CUDA_SUCCESS) return what + api.Describe("cuMemCreate", r);
  CUdeviceptr va = 0;
  r = api.mem_address_reserve(&va, size, gran, 0, 0);
  if (r != CUDA_SUCCESS) {
    api.mem_release(h);
    return what + api.Describe("cuMemAddressReserve", r);
  }
  r = api.mem_map(va, size, 0, h, 0);
  api.mem_release(h);  // the mapping keeps it; DescribeRange gets the handle from the address
  if (r != CUDA_SUCCESS) {
    api.mem_address_free(va, size);
    return what + api.Describe("cuMemMap", r);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = api.mem_set_access(va, size, &access, 1);
  std::string err;
  if (r != CUDA_SUCCESS) err = api.Describe("cuMemSetAccess", r);
  if (err.empty()) {
    void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(va));
    cudaError_t e = cudaMemset(p, 0, size);  // legacy stream: done before the synchronize
    if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
    if (e != cudaSuccess) err = CudaError("cudaMemset", e);
  }
  if (!err.empty()) {
    api.mem_unmap(va, size);
    api.mem_address_free(va, size);
    return what + err;
  }
  *ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(va));
  return "";
}

void UnmapAllPeers() {
  const DriverApi& api = GetDriverApi();
  State& s = St();
  std::lock_guard<std::mutex> lock(s.peers_mu);
  for (const auto& kv : s.peers) {
    const PeerMapping& m = kv.second;
    DeviceGuard guard(m.device);
    if (m.kind == kIpcLegacy) {
      cudaIpcCloseMemHandle(reinterpret_cast<void*>(static_cast<uintptr_t>(m.va)));
    } else {
      api.mem_unmap(m.va, m.size);
      api.mem_address_free(m.va, m.size);
    }
  }
  s.peers.clear();
}

size_t LivePeerMappings() {
  std::lock_guard<std::mutex> lock(St().peers_mu);
  return St().peers.size();
}

}  // namespace hoccl
