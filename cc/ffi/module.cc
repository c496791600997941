// The one Python extension module, jax_hoccl._hoccl: FFI handler capsules for jax.ffi
// registration, plus the scheduler and communicator introspection the tests use.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <tuple>

#include "communicator.h"
#include "cpu/cpu_cross_process.h"
#include "cpu/cpu_staged.h"
#include "cpu/staged_lane.h"
#include "job.h"
#include "node_rendezvous.h"
#ifdef JAX_HOCCL_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/ipc_memory.h"
#include "cuda/staged/staged_exchange.h"
#include "cuda/staged/watchdog.h"
#endif
#include "ffi/handlers.h"
#include "host_profile.h"
#include "plan.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// A CPU handler with per-instruction state: its instantiate and execute stages.
template <typename T>
nb::dict CpuStaged(T* execute) {
  nb::dict stages;
  stages["instantiate"] = Capsule(hoccl::kInstantiateCpuCall);
  stages["execute"] = Capsule(execute);
  return stages;
}

// The state type the CPU handlers use; XLA needs it registered before those handlers.
nb::dict CpuCallType() {
  static XLA_FFI_TypeInfo info = xla::ffi::MakeTypeInfo<hoccl::CpuCall>();
  nb::dict d;
  d["type_id"] = nb::capsule(reinterpret_cast<void*>(&hoccl::CpuCall::id));
  d["type_info"] = nb::capsule(reinterpret_cast<void*>(&info));
  return d;
}

// The CUDA handler `fn`, or none in a build without the CUDA engine.
#ifdef JAX_HOCCL_WITH_CUDA
#define HOCCL_CUDA(fn) Capsule(hoccl::fn)
#else
#define HOCCL_CUDA(fn) nb::none()
#endif

nb::dict Registrations() {
  nb::dict d;
  auto add = [&](const char* name, nb::object cpu, nb::object cuda) {
    nb::dict per_platform;
    if (!cpu.is_none()) per_platform["cpu"] = cpu;
    if (!cuda.is_none()) per_platform["CUDA"] = cuda;
    d[name] = per_platform;
  };
  add("hoccl_all_gather", CpuStaged(hoccl::kAllGatherCpu), HOCCL_CUDA(kAllGatherCuda));
  add("hoccl_all_to_all", CpuStaged(hoccl::kAllToAllCpu), HOCCL_CUDA(kAllToAllCuda));
  add("hoccl_ppermute", CpuStaged(hoccl::kPermuteCpu), HOCCL_CUDA(kPermuteCuda));
  // The same for blocks the staged path takes: on CUDA command-buffer compatible.
  add("hoccl_all_gather_staged", CpuStaged(hoccl::kAllGatherCpu), HOCCL_CUDA(kAllGatherStagedCuda));
  add("hoccl_all_to_all_staged", CpuStaged(hoccl::kAllToAllCpu), HOCCL_CUDA(kAllToAllStagedCuda));
  add("hoccl_ppermute_staged", CpuStaged(hoccl::kPermuteCpu), HOCCL_CUDA(kPermuteStagedCuda));
  // CUDA only: psum and psum_scatter of staged blocks, summed by the exchange kernel.
  add("hoccl_psum_staged", nb::none(), HOCCL_CUDA(kPsumStagedCuda));
  add("hoccl_psum_scatter_staged", nb::none(), HOCCL_CUDA(kPsumScatterStagedCuda));
  // CUDA only: matmul_psum's GEMV, multiplied inside the staged psum's packed exchange.
  add("hoccl_matmul_psum_staged", nb::none(), HOCCL_CUDA(kMatmulPsumStagedCuda));
  // CUDA only: one kernel copying x to out, the floor bench --processes sets the staged calls
  // beside.
  add("hoccl_one_kernel_call", nb::none(), HOCCL_CUDA(kOneKernelCallCuda));
  // Async pairs.
  add("hoccl_all_gather_start", CpuStaged(hoccl::kAllGatherStartCpu),
      HOCCL_CUDA(kAllGatherStartCuda));
  add("hoccl_into_start", CpuStaged(hoccl::kIntoStartCpu), HOCCL_CUDA(kIntoStartCuda));
  add("hoccl_all_to_all_start", CpuStaged(hoccl::kAllToAllStartCpu),
      HOCCL_CUDA(kAllToAllStartCuda));
  add("hoccl_ppermute_start", CpuStaged(hoccl::kPermuteStartCpu), HOCCL_CUDA(kPermuteStartCuda));
  add("hoccl_done", Capsule(hoccl::kDoneCpu), HOCCL_CUDA(kDoneCuda));
  // CUDA only: its consumer is the flagged GEMM (Hopper GPUs)
  add("hoccl_announced_gather_start", nb::none(), HOCCL_CUDA(kAnnouncedGatherStartCuda));
  add("hoccl_gemm_ring_start", nb::none(), HOCCL_CUDA(kGemmRingStartCuda));
  add("hoccl_after", Capsule(hoccl::kOrderAfter), HOCCL_CUDA(kOrderAfter));
  // GEMM on row ranges (fused ops); on CPU the lowering is XLA's own dot instead.
  add("hoccl_rows_matmul", nb::none(), HOCCL_CUDA(kRowsMatmulCuda));
  return d;
}

using PyStep = std::tuple<int, int, int, size_t, size_t, size_t>;

// The steps one rank executes: (kind, peer, channel, src_offset, dst_offset, bytes).
std::vector<PyStep> Plan(int op, int group_size, int rank, size_t bytes,
                         std::vector<int> permute_dst, int chunks, int channels, bool peers_only) {
  hoccl::OpSpec spec{
      static_cast<hoccl::OpKind>(op), group_size, rank, bytes, permute_dst, peers_only};
  std::string err = hoccl::ValidateSpec(spec);
  if (!err.empty()) throw nb::value_error(err.c_str());
  std::vector<PyStep> out;
  for (const hoccl::Step& s : hoccl::MakePlan(spec, {chunks, channels}))
    out.emplace_back(static_cast<int>(s.kind), s.peer, s.channel, s.src_offset, s.dst_offset,
                     s.bytes);
  return out;
}

}  // namespace

NB_MODULE(_hoccl, m) {
  m.def("registrations", &Registrations);
  m.def("cpu_call_type", &CpuCallType);
  m.def("plan", &Plan, nb::arg("op"), nb::arg("group_size"), nb::arg("rank"), nb::arg("bytes"),
        nb::arg("permute_dst") = std::vector<int>{}, nb::arg("chunks") = 1, nb::arg("channels") = 1,
        nb::arg("peers_only") = false);
  m.def("live_slot_count", &hoccl::LiveSlotCount);
  m.def(
      "set_job",
      [](std::string secret, int process_index, std::vector<int64_t> device_process,
         std::vector<int> process_pids) {
        hoccl::SetJob(
            {std::move(secret), process_index, std::move(device_process), std::move(process_pids)});
      },
      nb::arg("secret"), nb::arg("process_index"), nb::arg("device_process"),
      nb::arg("process_pids"),
      "the jax.distributed job as src/jax_hoccl/_src/job.py found it (cc/job.h)");
  m.def("set_local_devices", &hoccl::SetLocalDevices, nb::arg("global_ids"),
        "global device id of each local CUDA ordinal (cc/job.h)");
  m.def("name_site", &hoccl::NameSite, nb::arg("site"), nb::arg("name"),
        "the user's op a lowering's call site runs, for error messages");
  m.def("linked_shared_memory", &hoccl::LinkedSharedMemory,
        "names of POSIX shared memory this process created and has not unlinked");
  m.def("live_staging_mappings", &hoccl::LiveStagingMappings);
  m.def("live_staged_mappings", &hoccl::LiveStagedMappings,
        "shared-memory segments of the CPU engine's staged lanes this process maps");
  m.def(
      "cpu_calls_by_path",
      [] {
        nb::dict d;
        d["staged"] = hoccl::StagedCalls();
        d["rendezvous"] = hoccl::RendezvousCalls();
        return d;
      },
      "calls across processes this process ran on each path of the CPU engine (cc/cpu/)");
  m.def("host_profile", &hoccl::HostProfileSnapshot, nb::arg("reset") = false,
        "(phase, calls, ns) of host time inside the handlers; set JAX_HOCCL_PROFILE=1 first");
#ifdef JAX_HOCCL_WITH_CUDA
  m.def("staged_captured_calls", &hoccl::StagedCapturedCalls,
        "staged calls recorded into CUDA graphs (their replays do not run the handler)");
  m.def("staged_packed_calls", &hoccl::StagedPackedCalls,
        "staged calls whose handler enqueued the packed exchange (cc/cuda/staged/packed_kernel.h)");
  m.def("staged_lanes", &hoccl::StagedLanes,
        "(rank, lane, calls enqueued, calls the GPU got past) of every staged lane used");
  m.def("live_peer_mappings", &hoccl::LivePeerMappings,
        "peer allocations of other processes mapped by this one (cc/ipc_memory.h)");
  m.def(
      "gpu_pci_bus_id",
      [](int ordinal) {
        char id[32] = {0};
        return cudaDeviceGetPCIBusId(id, sizeof(id), ordinal) == cudaSuccess ? std::string(id)
                                                                             : std::string();
      },
      nb::arg("ordinal"), "the PCI bus id of a CUDA ordinal: which physical GPU it is");
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
