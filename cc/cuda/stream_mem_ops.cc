#include "cuda/stream_mem_ops.h"

#include <algorithm>
#include <cstring>

#include "host_profile.h"

namespace hoccl {
namespace {

CUdeviceptr DevPtr(const uint64_t* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
}

}  // namespace

void MemOps::Write(uint64_t* addr, uint64_t value) { WriteDevice(DevPtr(addr), value); }

void MemOps::WriteDevice(CUdeviceptr addr, uint64_t value) {
  CUstreamBatchMemOpParams p;
  std::memset(&p, 0, sizeof(p));
  p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  p.writeValue.address = addr;
  p.writeValue.value64 = value;
  p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;  // fenced after earlier work
  ops_.push_back(p);
}

void MemOps::Wait(uint64_t* addr, uint64_t value, bool equal) {
  CUstreamBatchMemOpParams p;
  std::memset(&p, 0, sizeof(p));
  p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  p.waitValue.address = DevPtr(addr);
  p.waitValue.value64 = value;
  p.waitValue.flags = equal ? CU_STREAM_WAIT_VALUE_EQ : CU_STREAM_WAIT_VALUE_GEQ;
  ops_.push_back(p);
}

std::string MemOps::Flush() {
  if (ops_.empty()) return "";
  HostTimer timer("api: stream memops");
  std::string err;
  CUstream s = reinterpret_cast<CUstream>(stream_);
  if (ops_.size() > 1 && api_.batch_mem_op) {
    constexpr size_t kMaxBatch = 256;  // cuStreamBatchMemOp's limit per call
    for (size_t i = 0; i < ops_.size() && err.empty(); i += kMaxBatch) {
      unsigned count = static_cast<unsigned>(std::min(kMaxBatch, ops_.size() - i));
      CUresult r = api_.batch_mem_op(s, count, ops_.data() + i, 0);
      if (r != CUDA_SUCCESS) err = api_.Describe("cuStreamBatchMemOp", r);
    }
  } else {
    for (const CUstreamBatchMemOpParams& p : ops_) {
      CUresult r;
      if (p.operation == CU_STREAM_MEM_OP_WRITE_VALUE_64) {
        r = api_.write_value64(s, p.writeValue.address, p.writeValue.value64, p.writeValue.flags);
        if (r != CUDA_SUCCESS) {
          err = api_.Describe("cuStreamWriteValue64", r);
          break;
        }
      } else {
        r = api_.wait_value64(s, p.waitValue.address, p.waitValue.value64, p.waitValue.flags);
        if (r != CUDA_SUCCESS) {
          err = api_.Describe("cuStreamWaitValue64", r);
          break;
        }
      }
    }
  }
  ops_.clear();
  return err;
}

}  // namespace hoccl
