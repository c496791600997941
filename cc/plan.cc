#include "plan.h"

#include <algorithm>

namespace hoccl {

const char* OpName(OpKind op) {
  switch (op) {
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kPermute: return "ppermute";
  }
  return "unknown";
}

std::string ValidateSpec(const OpSpec& spec) {
  const int n = spec.group_size;
  if (n < 1) return "group size must be >= 1";
  if (spec.rank < 0 || spec.rank >= n) return "rank out of range";
  if (spec.op == OpKind::kAllToAll && spec.bytes % n != 0)
    return "all_to_all input bytes must divide by the group size";
  if (spec.peers_only && spec.op != OpKind::kAllGather)
    return "peers_only applies to all_gather only";
  if (spec.at_source_slot && spec.op != OpKind::kPermute)
    return "at_source_slot applies to ppermute only";
  if (spec.in_place && (spec.op != OpKind::kAllGather || spec.peers_only))
    return "in_place applies to a full all_gather only";
  if (spec.skip_own && (spec.op == OpKind::kPermute || spec.peers_only || spec.in_place))
    return "skip_own applies to a full all_gather or an all_to_all only";
  if (spec.sum != SumType::kNone &&
      (spec.op == OpKind::kPermute || spec.peers_only || spec.in_place || spec.at_source_slot))
    return "a summed exchange is a full all_gather or an all_to_all";
  if (spec.op == OpKind::kPermute) {
    if (static_cast<int>(spec.permute_dst.size()) != n)
      return "permutation must have one entry per rank";
    std::vector<int> seen(n, 0);
    for (int d : spec.permute_dst) {
      if (d < -1 || d >= n) return "permutation destination out of range";
      if (d >= 0 && seen[d]++) return "permutation sends two buffers to one rank";
    }
  }
  return "";
}

size_t OutputBytes(const OpSpec& spec) {
  if (spec.sum != SumType::kNone)  // one block
    return spec.op == OpKind::kAllToAll ? spec.bytes / spec.group_size : spec.bytes;
  if (spec.at_source_slot) return spec.bytes * spec.group_size;
  if (spec.op != OpKind::kAllGather) return spec.bytes;
  return spec.bytes * (spec.peers_only ? spec.group_size - 1 : spec.group_size);
}

namespace {

// The source block of `src` that lands in `dst`'s output: (src offset, dst offset, bytes).
struct Block { size_t src_offset, dst_offset, bytes; };

Block BlockFor(const OpSpec& s, int src, int dst) {
  switch (s.op) {
    case OpKind::kAllGather: {
      if (!s.peers_only) return {0, src * s.bytes, s.bytes};
      size_t slot = (src - dst - 1 + 2 * s.group_size) % s.group_size;  // src = dst + 1 + slot
      return {0, slot * s.bytes, s.bytes};
    }
    case OpKind::kAllToAll: {
      size_t b = s.bytes / s.group_size;
      return {dst * b, src * b, b};
    }
    case OpKind::kPermute: return {0, s.at_source_slot ? src * s.bytes : 0, s.bytes};
  }
  return {0, 0, 0};
}

// Does `dst` read from `src`?
bool Reads(const OpSpec& s, int dst, int src) {
  if (s.op == OpKind::kPermute) return s.permute_dst[src] == dst;
  if ((s.peers_only || s.in_place || s.skip_own) && src == dst) return false;
  return true;
}

}  // namespace

std::vector<Step> MakePlan(const OpSpec& spec, const PlanOptions& options) {
  const int n = spec.group_size, r = spec.rank;
  const int chunks = std::max(1, options.chunks);
  const int channels = std::max(1, options.channels);
  std::vector<Step> steps;
  int copy_index = 0;
  auto add_copies = [&](int src) {
    Block b = BlockFor(spec, src, r);
    // Split into `chunks` nearly equal pieces; sizes need not divide.
    size_t base = b.bytes / chunks, extra = b.bytes % chunks, off = 0;
    for (int c = 0; c < chunks; ++c) {
      size_t len = base + (static_cast<size_t>(c) < extra ? 1 : 0);
      if (len == 0) continue;
      steps.push_back({StepKind::kCopy, src, copy_index++ % channels, b.src_offset + off,
                       b.dst_offset + off, len});
      off += len;
    }
  };

  // 1. Tell every reader of my input that it is ready (rotated order).
  for (int k = 1; k < n; ++k) {
    int p = (r + n - k) % n;  // the rank that reads from me at round k
    if (Reads(spec, p, r)) steps.push_back({StepKind::kSignalReady, p, 0, 0, 0, 0});
  }
  // 2. My own block needs no handshake.
  bool receives = false;
  if (Reads(spec, r, r)) {
    add_copies(r);
    receives = true;
  }
  // 3. Pull from peers: at round k I read from (r + k) % n, so no two ranks read one peer.
  for (int k = 1; k < n; ++k) {
    int p = (r + k) % n;
    if (!Reads(spec, r, p)) continue;
    receives = true;
    steps.push_back({StepKind::kWaitReady, p, 0, 0, 0, 0});
    add_copies(p);
    steps.push_back({StepKind::kSignalDone, p, 0, 0, 0, 0});
  }
  // 4. A ppermute destination nobody sends to gets zeros (jax.lax semantics).
  if (spec.op == OpKind::kPermute && !receives && !spec.at_source_slot && spec.bytes > 0)
    steps.push_back({StepKind::kZero, r, 0, 0, 0, spec.bytes});
  // 5. My input may be released only when every reader is done with it.
  for (int k = 1; k < n; ++k) {
    int p = (r + n - k) % n;
    if (Reads(spec, p, r)) steps.push_back({StepKind::kWaitDone, p, 0, 0, 0, 0});
  }
  return steps;
}

}  // namespace hoccl
