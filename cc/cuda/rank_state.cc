#include "cuda/rank_state.h"

#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "cuda/cuda_util.h"
#include "cuda/driver_api.h"
#include "cuda/staged/gemv_psum_kernel.h"
#include "cuda/staged/staged_layout.h"
#include "cuda/transport/transport_direct.h"
#include "cuda/transport/transport_ipc.h"
#include "job.h"

namespace hoccl {
namespace {

// Microseconds a handler spins on the host rendezvous before blocking on a condition variable;
// env JAX_HOCCL_SPIN_US overrides (0 = never spin).
constexpr long long kDefaultSpinMicros = 200;

RankState& RankStateFor(const Communicator* comm, int rank) {
  static std::mutex mu;
  static auto* all =
      new std::map<std::pair<const Communicator*, int>, std::unique_ptr<RankState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& s = (*all)[{comm, rank}];
  if (!s) s = std::make_unique<RankState>();
  return *s;
}

// Turns on peer access from `device` (current) to `peer`; XLA usually did already.
std::string EnablePeerAccess(int device, int peer) {
  static std::mutex mu;
  static auto* done = new std::set<std::pair<int, int>>();
  std::lock_guard<std::mutex> lock(mu);
  if (device == peer || done->count({device, peer})) return "";
  int can = 0;
  HOCCL_CUDA_RETURN(cudaDeviceCanAccessPeer(&can, device, peer));
  if (!can) {
    return "CUDA device " + std::to_string(device) + " cannot access device " +
           std::to_string(peer) +
           " as a peer (no NVLink/PCIe P2P); the copy-engine collectives need peer access";
  }
  cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // clear it
  } else if (e != cudaSuccess) {
    return CudaError("cudaDeviceEnablePeerAccess", e);
  }
  done->insert({device, peer});
  return "";
}

// The transport, chosen once: peers in this process, else the node's IPC transport.
std::string MakeTransport(Communicator& comm, int device, const char* op,
                          std::unique_ptr<PeerTransport>* out) {
  if (AllLocal(comm.device_ids())) {
    static const long long spin_us = EnvInt("JAX_HOCCL_SPIN_US", kDefaultSpinMicros, 0);
    *out = std::make_unique<DirectTransport>(comm, spin_us);
    return "";
  }
  return IpcTransport::Make(comm, device, op, out);
}

// Where the GPU reports each lane's staged progress, and the watchdog its verdict: mapped host
// memory. Where a stream memory operation cannot write it, the staged path stays off
// (progress null).
std::string AllocProgress(RankState& st, cudaStream_t stream) {
  static_assert(kLanes <= sizeof(StagedHostWords::progress) / sizeof(uint64_t), "lanes");
  void* host = nullptr;
  HOCCL_CUDA_RETURN(cudaHostAlloc(&host, sizeof(StagedHostWords), cudaHostAllocMapped));
  std::memset(host, 0, sizeof(StagedHostWords));
  void* dev = nullptr;
  HOCCL_CUDA_RETURN(cudaHostGetDevicePointer(&dev, host, 0));
  const CUdeviceptr progress = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(dev));
  const DriverApi& api = GetDriverApi();
  CUresult r = api.write_value64(reinterpret_cast<CUstream>(stream), progress, 0,
                                 CU_STREAM_WRITE_VALUE_DEFAULT);
  cudaError_t e = cudaStreamSynchronize(stream);
  if (r != CUDA_SUCCESS || e != cudaSuccess) {
    HOCCL_TRACE("staged path off: a stream memory operation cannot write mapped host memory\n");
    cudaGetLastError();
    return "";
  }
  st.host_words = static_cast<StagedHostWords*>(host);
  st.host_words_device = static_cast<StagedHostWords*>(dev);
  st.progress = st.host_words->progress;
  st.progress_device = progress;
  return "";
}

std::string SetupRank(RankState& st, Communicator& comm, const OpSpec& spec, int device,
                      cudaStream_t stream, const char* op) {
  const int n = spec.group_size;
  std::string err = MakeTransport(comm, device, op, &st.transport);
  if (!err.empty()) return err;
  PeerTransport& transport = *st.transport;
  // Allocate and zero my flags (and staging) before anyone can learn their address.
  const size_t bytes = ZeroCopyFlagBytes(n) + StagedRegionBytes(n);
  void* p = nullptr;
  err = transport.AllocFlags(bytes, &p);
  if (err.empty()) {
    cudaError_t e = cudaMemsetAsync(p, 0, bytes, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) err = CudaError("cudaMemsetAsync/cudaStreamSynchronize(flags)", e);
  }
  if (err.empty() && StagedRegionBytes(n)) err = AllocProgress(st, stream);
  if (err.empty() && StagedRegionBytes(n)) {
    cudaError_t e = LoadExchangeKernel();
    if (e == cudaSuccess) e = LoadPackedKernel();
    if (e == cudaSuccess) e = LoadGemvPsumKernel();
    if (e != cudaSuccess) err = CudaError("loading the staged exchange kernels", e);
  }
  // Publish even on failure (as null) so peers fail fast instead of timing out.
  std::vector<uint64_t*> all;
  std::string xerr = transport.ExchangeFlags(
      spec.rank, err.empty() ? static_cast<uint64_t*>(p) : nullptr, &all, op);
  if (!err.empty()) return err;
  if (!xerr.empty()) return xerr;
  for (int q = 0; q < n; ++q) {
    if (!all[q]) {
      return "rank " + std::to_string(q) +
             " of the group failed its one-time setup (see its error)";
    }
    if (q == spec.rank || !transport.NeedsPeerAccess()) continue;
    cudaPointerAttributes attr;
    HOCCL_CUDA_RETURN(cudaPointerGetAttributes(&attr, all[q]));
    err = EnablePeerAccess(device, attr.device);
    if (!err.empty()) return err;
  }
  if (!AllLocal(comm.device_ids())) {
    err = NodeRendezvous::Get(comm.device_ids(), op, &st.node);
    if (!err.empty()) return err;
  }
  st.device = device;
  st.flags = static_cast<uint64_t*>(p);
  st.peer_base.resize(n);
  for (int q = 0; q < n; ++q) st.peer_base[q] = reinterpret_cast<char*>(all[q]);
  st.peer_flags = std::move(all);
  if (n <= kKernelMaxRanks && StagedRegionBytes(n)) st.kernel_layout = KernelLayout(st.peer_base);
  return "";
}

}  // namespace

size_t ZeroCopyFlagBytes(int group_size) {
  return (kLanes * 2 * static_cast<size_t>(group_size) * sizeof(uint64_t) + 255) / 256 * 256;
}

namespace {

// `device` made this thread's current device.
std::string MakeCurrent(int device) {
  int current = -1;
  HOCCL_CUDA_RETURN(cudaGetDevice(&current));
  if (current != device) HOCCL_CUDA_RETURN(cudaSetDevice(device));
  return "";
}

// The stream's device (made current for this thread) at a rank's first call.
std::string StreamDevice(cudaStream_t stream, bool capturing, int* device) {
#if CUDART_VERSION >= 12080
  // Under stream capture (XLA recording a CUDA graph) cudaStreamGetDevice is refused; the
  // handler's thread is then already on its device.
  if (capturing) {
    HOCCL_CUDA_RETURN(cudaGetDevice(device));
    return "";
  }
  HOCCL_CUDA_RETURN(cudaStreamGetDevice(stream, device));
  return MakeCurrent(*device);
#else
  (void)stream;
  (void)capturing;
  HOCCL_CUDA_RETURN(cudaGetDevice(device));
#endif
  return "";
}

}  // namespace

std::string RankStateOn(Communicator& comm, const OpSpec& spec, cudaStream_t stream,
                        const OpLabel& label, RankState** out, int* device, bool* capturing) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  HOCCL_CUDA_RETURN(cudaStreamIsCapturing(stream, &capture));
  *capturing = capture != cudaStreamCaptureStatusNone;
  RankState& st = RankStateFor(&comm, spec.rank);
  if (st.ready.load(std::memory_order_acquire)) {
    // A rank of a group is one device: the one its first call found.
    *device = st.device;
    *out = &st;
    return *capturing ? "" : MakeCurrent(st.device);  // (captured: as StreamDevice)
  }
  std::string err = StreamDevice(stream, *capturing, device);
  if (!err.empty()) return err;
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.ready.load() && st.setup_error.empty()) {
    const std::string op = label.Name();
    err = SetupRank(st, comm, spec, *device, stream, op.c_str());
    if (err.empty())
      st.ready.store(true, std::memory_order_release);
    else
      st.setup_error = err;
    HOCCL_TRACE("%s rank %d: setup flags %p -> '%s'\n", op.c_str(), spec.rank,
                static_cast<void*>(st.flags), err.c_str());
  }
  if (!st.ready.load()) return st.setup_error;
  *out = &st;
  return "";
}

}  // namespace hoccl
