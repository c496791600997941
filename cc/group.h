// Decoding what the Python lowering passes every handler: the group table of the mesh axis
// (device ids, one row per group, row-major, `group_size` per row) and finding this device's
// group and rank in it. XLA's FFI gives a handler its device id but no partition id.
#ifndef JAX_HOCCL_GROUP_H_
#define JAX_HOCCL_GROUP_H_

#include <cstdint>
#include <string>
#include <vector>

namespace hoccl {

struct GroupPosition {
  std::vector<int64_t> device_ids;  // my group, in rank order
  int rank = -1;
};

// Empty error string on success.
inline std::string FindGroup(const int64_t* table, size_t table_len, int64_t group_size,
                             int64_t device, GroupPosition* out) {
  if (group_size <= 0 || table_len % group_size != 0)
    return "malformed group table (length " + std::to_string(table_len) + ", group size " +
           std::to_string(group_size) + ")";
  for (size_t i = 0; i < table_len; ++i) {
    if (table[i] != device) continue;
    size_t row = i / group_size;
    out->device_ids.assign(table + row * group_size, table + (row + 1) * group_size);
    out->rank = static_cast<int>(i % group_size);
    return "";
  }
  return "device " + std::to_string(device) + " is not in the collective's group table";
}

}  // namespace hoccl

#endif  // JAX_HOCCL_GROUP_H_
