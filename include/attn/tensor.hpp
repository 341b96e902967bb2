// Tensors: a non-owning strided view (TensorView) and an owning, 64-byte-aligned
// buffer (Tensor). Shapes and strides are in elements, outermost dimension first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace attn {

/// Element types. f32 is what the kernels compute with; boolean (one byte, 0 or 1)
/// is for masks; i32 for sequence offsets and lengths. bf16 and f16 are storage
/// types for the low-precision paths; i8 and f8e4m3 (OCP FP8 E4M3, "e4m3fn": bias 7,
/// finite to ±448, no infinities, NaN = S.1111.111) for quantized KV caches
/// (attn/kvcache.hpp).
enum class DType : uint8_t { f32, bf16, f16, boolean, i32, i8, f8e4m3 };

/// Size of one element in bytes.
size_t dtype_size(DType t);
/// "f32", "bf16", "f16", "bool", "i32", "i8", "f8e4m3".
const char* dtype_name(DType t);

/// Where a tensor's memory lives: host memory (the default) or one CUDA device, with
/// the CUDA stream (a cudaStream_t, here as void* so that this header needs no CUDA)
/// that work on it is ordered on; nullptr is the device's default stream. Every tensor
/// of one call must be on the same device; the call runs there, on q's stream
/// (attention() on a CUDA device needs a build with the CUDA backend, attn::cuda).
struct Device {
  enum class Type : uint8_t { cpu, cuda };
  Type type = Type::cpu;
  int index = 0;            // the CUDA device ordinal (0 for the CPU)
  void* stream = nullptr;   // cudaStream_t; nullptr = the default stream

  static Device cpu() { return {}; }
  static Device cuda(int index = 0, void* stream = nullptr) { return {Type::cuda, index, stream}; }
  bool is_cpu() const { return type == Type::cpu; }
  bool is_cuda() const { return type == Type::cuda; }
  /// Same memory space (type and index; the stream is not compared).
  bool same_memory(const Device& o) const { return type == o.type && index == o.index; }
  /// "cpu" or "cuda:0".
  std::string describe() const;
};

/// A view of memory someone else owns: data pointer, element type, shape and
/// strides (in elements). At most 8 dimensions.
///
///   TensorView(ptr, DType::f32, {B, L, H, d})            // contiguous, row-major
///   TensorView(ptr, DType::f32, {B, L, H, d}, strides)   // any strides, e.g. a BHSD
///                                                        // buffer seen as BSHD
/// A default-constructed view is "absent" (used for optional arguments). Views are on
/// the CPU unless placed on a device with on():
///   TensorView(dev_ptr, DType::bf16, {B, L, H, d}).on(Device::cuda(0, stream))
class TensorView {
 public:
  static constexpr int kMaxRank = 8;

  TensorView() = default;
  TensorView(const void* data, DType dtype, std::initializer_list<int64_t> shape);
  TensorView(const void* data, DType dtype, std::vector<int64_t> shape);
  TensorView(const void* data, DType dtype, std::vector<int64_t> shape,
             std::vector<int64_t> strides);

  /// True for a default-constructed view (no tensor given).
  bool empty() const { return rank_ < 0; }
  int rank() const { return rank_ < 0 ? 0 : rank_; }
  DType dtype() const { return dtype_; }
  int64_t size(int dim) const { return shape_[dim]; }
  int64_t stride(int dim) const { return strides_[dim]; }
  std::vector<int64_t> shape() const;
  std::vector<int64_t> strides() const;
  /// Number of elements (product of the shape; 1 for rank 0).
  int64_t numel() const;
  /// True when the strides are those of a packed row-major array.
  bool is_contiguous() const;

  void* data() const { return const_cast<void*>(data_); }
  template <class T>
  T* data_as() const { return static_cast<T*>(const_cast<void*>(data_)); }

  /// The device whose memory data() points into (Device::cpu() unless set with on()).
  const Device& device() const { return device_; }
  /// The same view, placed on `device` (data() must point into that device's memory).
  TensorView on(const Device& device) const {
    TensorView t = *this;
    t.device_ = device;
    return t;
  }

  /// "f32[2, 17, 8, 64]" (strides appended when not contiguous; " on cuda:0" for a
  /// device view), for messages.
  std::string describe() const;

 private:
  const void* data_ = nullptr;
  DType dtype_ = DType::f32;
  int rank_ = -1;
  int64_t shape_[kMaxRank] = {};
  int64_t strides_[kMaxRank] = {};
  Device device_;
};

/// Owning, contiguous, 64-byte-aligned storage. Converts to a TensorView.
/// Contents are uninitialised after construction (use fill / copies).
/// From 8 MiB on, storage is 2 MiB-aligned and, on Linux, advised as transparent huge
/// pages (madvise, as NumPy does for its large arrays): a paged KV cache read in a
/// scattered page order runs up to ~10% faster on them (docs/PERFORMANCE.md).
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::vector<int64_t> shape);

  TensorView view() const;
  operator TensorView() const { return view(); }  // NOLINT: views are cheap

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  void* data() { return buffer_.get(); }
  const void* data() const { return buffer_.get(); }
  template <class T>
  T* data_as() { return static_cast<T*>(data()); }
  template <class T>
  const T* data_as() const { return static_cast<const T*>(data()); }

 private:
  struct FreeAligned {
    void operator()(void* p) const;
  };
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::unique_ptr<void, FreeAligned> buffer_;
};

}  // namespace attn
