// Argument checks shared by the public entry points (attention(), its backward,
// attention_with_kvcache()): each failure is an attn::Error "fn: <what>" naming the
// argument, what was expected and what was given.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "attn/error.hpp"
#include "attn/tensor.hpp"
#include "tensor/overlap.hpp"

namespace attn::detail {

// Builds "fn: <what>" messages.
class Checker {
 public:
  explicit Checker(const char* fn) : fn_(fn) {}

  // The device every tensor of the call must be on, and the argument that decided it
  // (by default the CPU, decided by the function itself: it runs on the CPU only).
  void set_device(const Device& device, const char* decided_by) {
    device_ = device;
    device_owner_ = decided_by;
  }
  const Device& device() const { return device_; }

  // A tensor (present or not) must be on the call's device.
  void on_device(const TensorView& t, const char* name) const {
    if (t.empty() || t.device().same_memory(device_)) return;
    if (device_owner_ == nullptr) {
      fail(std::string(name) + " is on " + t.device().describe() + ", but " + fn_ +
           " takes tensors in host memory (device cpu) only");
    }
    fail(std::string(name) + " is on " + t.device().describe() + " but " + device_owner_ + " is on " +
         device_.describe() + ": every tensor of one call must be on the same device");
  }
  // Small int32 metadata (cu_seqlens, key_lengths) may also stay in host memory when the
  // call runs on a device: it is read on the host either way.
  void metadata_on_device_or_host(const TensorView& t, const char* name) const {
    if (!t.empty() && t.device().is_cpu()) return;
    on_device(t, name);
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(std::string(fn_) + ": " + what);
  }
  // A check on every call's path: the message is a literal, or a callable that builds
  // it only on failure (building "got <shape>" strings eagerly cost a decode step of
  // a short cache ~5 µs, a tenth of its time).
  void require(bool ok, const char* what) const {
    if (!ok) fail(what);
  }
  template <class Message, std::enable_if_t<std::is_invocable_v<const Message&>, int> = 0>
  void require(bool ok, const Message& what) const {
    if (!ok) fail(std::string(what()));
  }

  // A tensor argument that must be present, of dtype `dt` and rank `rank`.
  void tensor(const TensorView& t, const char* name, DType dt, int rank,
              const char* layout) const {
    if (t.empty()) fail(std::string(name) + " is required, got none");
    on_device(t, name);
    if (t.dtype() != dt) {
      const bool lowp = dt == DType::bf16 || dt == DType::f16;
      fail(std::string(name) + " must have dtype " + dtype_name(dt) +
           (lowp || std::string(name) != "q" ? std::string(" (the dtype of q; mixed dtypes are an error)") : "") +
           ", got " + dtype_name(t.dtype()));
    }
    if (t.rank() != rank) {
      fail(std::string(name) + " must have rank " + std::to_string(rank) + " " + layout +
           ", got " + t.describe());
    }
    if (t.data() == nullptr && t.numel() > 0) {
      fail(std::string(name) + " has a null data pointer but " + std::to_string(t.numel()) +
           " elements");
    }
    nonnegative_strides(t, name);
  }

  // Negative strides are rejected everywhere (the kernels and the reference
  // address a view from its first element upwards).
  void nonnegative_strides(const TensorView& t, const char* name) const {
    for (int i = 0; i < t.rank(); ++i) {
      if (t.size(i) > 1 && t.stride(i) < 0) {
        fail(std::string(name) + " must have non-negative strides, got stride " +
             std::to_string(t.stride(i)) + " in dimension " + std::to_string(i) + " of " +
             t.describe());
      }
    }
  }

  // An output must not overlap itself, nor any of `others` (inputs or outputs)
  // except those `alias_ok` says it may equal exactly.
  void writable(const TensorView& t, const char* name) const {
    if (self_overlapping(t)) {
      fail(std::string(name) + " is an output, so its elements must not overlap each other " +
           "(no stride 0 on a dimension of size > 1), got " + t.describe());
    }
  }
  void disjoint(const TensorView& out, const char* out_name, const TensorView& other,
                const char* other_name, bool exact_alias_ok = false) const {
    if (out.empty() || other.empty()) return;
    if (exact_alias_ok && same_view(out, other)) return;
    if (views_overlap(out, other)) {
      fail(std::string(out_name) + " overlaps " + other_name +
           (exact_alias_ok ? " without being exactly the same view" : "") +
           ": an output must not share memory with an input or another output" +
           (exact_alias_ok ? " (out may alias q, k or v exactly)" : "") + "; got " + out_name +
           " " + out.describe() + " at " + std::to_string(reinterpret_cast<uintptr_t>(out.data())) +
           ", " + other_name + " " + other.describe() + " at " +
           std::to_string(reinterpret_cast<uintptr_t>(other.data())));
    }
  }

  // The last dimension must be contiguous (stride 1) unless it has one element.
  void last_contiguous(const TensorView& t, const char* name) const {
    const int r = t.rank() - 1;
    if (r >= 0 && t.size(r) > 1 && t.stride(r) != 1 && t.numel() > 0) {  // an empty view's strides mean nothing
      fail(std::string(name) + " must have a contiguous last dimension (stride 1), got " +
           t.describe());
    }
  }

  void dim_equals(const TensorView& t, const char* name, int dim, int64_t expected,
                  const char* meaning) const {
    if (t.size(dim) != expected) {
      fail(std::string(name) + ".shape[" + std::to_string(dim) + "] (" + meaning +
           ") must be " + std::to_string(expected) + ", got " + std::to_string(t.size(dim)) +
           " in " + t.describe());
    }
  }

 private:
  const char* fn_;
  Device device_;
  const char* device_owner_ = nullptr;
};

}  // namespace attn::detail
