// What every FFI handler (CPU or CUDA, sync or start) shares: its binding, and what it does
// first: find this device's group and rank in the `group` attribute and build the op's spec,
// checking the output size.
#ifndef JAX_HOCCL_HANDLER_COMMON_H_
#define JAX_HOCCL_HANDLER_COMMON_H_

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "group.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace hoccl {

// The attributes every collective carries, passed as one dictionary attribute `group`
// (jax_hoccl/_src/axes.py, ffi_group_attrs): the device ids of every group, each in rank
// order (`size` of them), and the lowering's call site (axes.new_site).
struct Group {
  xla::ffi::Span<const int64_t> ids;
  int64_t size;
  int64_t site;
};

// The element type's name in a call's description (peers compare descriptions: ranks whose
// calls move as many bytes of other types would otherwise exchange them silently).
inline const char* TypeName(xla::ffi::DataType type) {
  using xla::ffi::DataType;
  switch (type) {
    case DataType::PRED: return "bool";
    case DataType::S8: return "int8";
    case DataType::S16: return "int16";
    case DataType::S32: return "int32";
    case DataType::S64: return "int64";
    case DataType::U8: return "uint8";
    case DataType::U16: return "uint16";
    case DataType::U32: return "uint32";
    case DataType::U64: return "uint64";
    case DataType::F16: return "float16";
    case DataType::F32: return "float32";
    case DataType::F64: return "float64";
    case DataType::BF16: return "bfloat16";
    case DataType::C64: return "complex64";
    case DataType::C128: return "complex128";
    case DataType::F8E5M2: return "float8_e5m2";
    case DataType::F8E4M3: return "float8_e4m3";
    case DataType::F8E4M3FN: return "float8_e4m3fn";
    case DataType::F8E4M3B11FNUZ: return "float8_e4m3b11fnuz";
    case DataType::F8E5M2FNUZ: return "float8_e5m2fnuz";
    case DataType::F8E4M3FNUZ: return "float8_e4m3fnuz";
    case DataType::F8E3M4: return "float8_e3m4";
    case DataType::F8E8M0FNU: return "float8_e8m0fnu";
    default: return "another XLA type";
  }
}

// An exchange's options beyond its op, group and buffers, passed whole from the handler to
// the spec (OpSpec in plan.h says what each does).
struct ExchangeOptions {
  xla::ffi::Span<const int64_t> permute_dst;  // permute only
  bool peers_only = false;
  bool at_source_slot = false;
  bool in_place = false;
  bool skip_own = false;
  SumType sum = SumType::kNone;
  const char* type = "";  // the element type's name (TypeName): errors and rendezvous name it
};
inline ExchangeOptions PermuteTo(xla::ffi::Span<const int64_t> permute_dst) {
  ExchangeOptions options;
  options.permute_dst = permute_dst;
  return options;
}
inline ExchangeOptions PeersOnly(int64_t peers_only) {
  ExchangeOptions options;
  options.peers_only = peers_only != 0;
  return options;
}
inline ExchangeOptions SkipOwn(int64_t skip_own) {
  ExchangeOptions options;
  options.skip_own = skip_own != 0;
  return options;
}

// A summed exchange of `x`'s elements (psum, psum_scatter on the staged path), or an error
// for a type the exchange kernel does not add (the lowering picks these targets only for
// these types: ffi_targets.py, lower_staged_sum).
inline xla::ffi::ErrorOr<ExchangeOptions> SumOf(xla::ffi::DataType type, const char* op) {
  ExchangeOptions options;
  switch (type) {
    case xla::ffi::DataType::F32: options.sum = SumType::kF32; break;
    case xla::ffi::DataType::BF16: options.sum = SumType::kBF16; break;
    case xla::ffi::DataType::F16: options.sum = SumType::kF16; break;
    default:
      return xla::ffi::Error::InvalidArgument(std::string("jax_hoccl ") + op +
                                              ": the staged sum adds float32, bfloat16 and "
                                              "float16 only");
  }
  return options;
}

// The op's spec for rank `rank` of `group`, checking the output size.
inline xla::ffi::Error MakeSpec(OpKind op, int rank, const Group& group, size_t in_bytes,
                                size_t out_bytes, const ExchangeOptions& options, OpSpec* spec) {
  *spec = OpSpec{op, static_cast<int>(group.size), rank, in_bytes, {}, options.peers_only};
  spec->permute_dst.assign(options.permute_dst.begin(), options.permute_dst.end());
  spec->at_source_slot = options.at_source_slot;
  spec->in_place = options.in_place;
  spec->skip_own = options.skip_own;
  spec->sum = options.sum;
  if (out_bytes != OutputBytes(*spec))
    return xla::ffi::Error::InvalidArgument(std::string("jax_hoccl ") + OpName(op) +
                                            ": output size does not match the input");
  return xla::ffi::Error::Success();
}

// `device`'s group and rank in the table (an error naming `op` where it is not there).
inline xla::ffi::Error FindGroupOf(OpKind op, const Group& group, int64_t device,
                                   GroupPosition* pos) {
  std::string err = FindGroup(group.ids.begin(), group.ids.size(), group.size, device, pos);
  if (!err.empty())
    return xla::ffi::Error::InvalidArgument(std::string("jax_hoccl ") + OpName(op) + ": " + err);
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error DecodeOp(OpKind op, int64_t device, size_t in_bytes, size_t out_bytes,
                                const Group& group, const ExchangeOptions& options, OpSpec* spec,
                                std::vector<int64_t>* group_ids) {
  GroupPosition pos;
  xla::ffi::Error found = FindGroupOf(op, group, device, &pos);
  if (!found.success()) return found;
  xla::ffi::Error made = MakeSpec(op, pos.rank, group, in_bytes, out_bytes, options, spec);
  if (!made.success()) return made;
  *group_ids = std::move(pos.device_ids);
  return xla::ffi::Error::Success();
}

// The input peers read: `in`, or for an all_gather in place (plan.h) my slot of the output.
inline const void* InputFor(const OpSpec& spec, const void* in, void* out) {
  return spec.in_place ? static_cast<const char*>(out) + spec.rank * spec.bytes : in;
}

// A start's outputs: (out, token[, x]). Output 1 is an ordering token nobody reads; output 2,
// when the lowering asks for it, aliases the input x (async_collectives.py: compute on it is
// ordered after the start). Only `out` is written.
inline xla::ffi::ErrorOr<xla::ffi::Result<xla::ffi::AnyBuffer>> StartOutput(
    xla::ffi::RemainingRets rets) {
  auto out = rets.get<xla::ffi::AnyBuffer>(0);
  if (out.has_error()) return out.error();
  return *out;
}

// into_start's operands and the rows [offset, offset + n * block) of `out` it writes
// (all_gather: every rank's slot; ppermute: the sender's slot), checked against out's size.
// Operands (x[, dst]); or, for an all_gather in place (in_place_bytes = the block's bytes > 0),
// only the buffer: my block is already in my slot, which is also the input peers read
// (its address needs my rank: InputFor).
struct IntoRows {
  const void* x = nullptr;
  size_t x_bytes = 0;
  void* dst = nullptr;
  size_t bytes = 0;
  bool in_place = false;
};
inline xla::ffi::ErrorOr<IntoRows> DecodeInto(xla::ffi::RemainingArgs args, xla::ffi::AnyBuffer out,
                                              const Group& group, int64_t offset,
                                              int64_t in_place_bytes) {
  IntoRows rows;
  rows.in_place = in_place_bytes > 0;
  if (rows.in_place) {
    rows.x_bytes = static_cast<size_t>(in_place_bytes);
  } else {
    auto x = args.get<xla::ffi::AnyBuffer>(0);
    if (x.has_error()) return x.error();
    rows.x = x->untyped_data();
    rows.x_bytes = x->size_bytes();
  }
  rows.bytes = rows.x_bytes * static_cast<size_t>(group.size);
  if (offset < 0 || static_cast<size_t>(offset) + rows.bytes > out.size_bytes())
    return xla::ffi::Error::InvalidArgument("jax_hoccl into_start: rows out of the buffer");
  rows.dst = static_cast<char*>(out.untyped_data()) + offset;
  return rows;
}

// The bindings, one per (sync | start), after the platform's context (`context()`: a
// Binding cannot be moved into a function, only made in it): the input `In` (a buffer, or
// RemainingArgs), the outputs and the group; a start's outputs are RemainingRets (StartOutput) and
// it runs on async stream `stream`. An op appends its own attributes (.Attr), which follow these in
// its handler's parameters.
template <typename In, typename Binding>
auto BindInput(Binding binding) {
  if constexpr (std::is_same_v<In, xla::ffi::RemainingArgs>) {
    return std::move(binding).RemainingArgs();
  } else {
    return std::move(binding).template Arg<In>();
  }
}
template <typename In, typename MakeContext>
auto SyncBinding(MakeContext context) {
  return BindInput<In>(context()).template Ret<xla::ffi::AnyBuffer>().template Attr<Group>("group");
}
template <typename In, typename MakeContext>
auto StartBinding(MakeContext context) {
  return BindInput<In>(context())
      .RemainingRets()
      .template Attr<Group>("group")
      .template Attr<int64_t>("stream");
}

}  // namespace hoccl

// The members must be all of the dictionary's: the lowering passes exactly these.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    hoccl::Group, ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("groups"),
    ::xla::ffi::StructMember<int64_t>("group_size"), ::xla::ffi::StructMember<int64_t>("site"));

#endif  // JAX_HOCCL_HANDLER_COMMON_H_
