// TensorView and Tensor: shapes, strides and aligned storage.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>

#include "attn/error.hpp"
#include "attn/tensor.hpp"
#include "tensor/storage.hpp"
#include "tensor/view_util.hpp"

namespace attn {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::boolean: return 1;
    case DType::i32: return 4;
    case DType::i8: return 1;
    case DType::f8e4m3: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::boolean: return "bool";
    case DType::i32: return "i32";
    case DType::i8: return "i8";
    case DType::f8e4m3: return "f8e4m3";
  }
  return "?";
}

namespace detail {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace detail

namespace {

using detail::shape_string;

// The number of elements, or an attn::Error when it (or its size in bytes of
// `elem` each) does not fit in int64: a wrapped product would allocate or
// address far less than the shape says.
int64_t checked_numel(const char* who, const std::vector<int64_t>& shape, size_t elem) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s == 0) return 0;
  }
  for (int64_t s : shape) {
    if (s < 0 || __builtin_mul_overflow(n, s, &n)) {
      throw Error(std::string(who) + ": shape " + shape_string(shape) +
                  " is too large (its element count overflows int64)");
    }
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(elem), &bytes)) {
    throw Error(std::string(who) + ": shape " + shape_string(shape) +
                " is too large (its size in bytes overflows int64)");
  }
  return n;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    s[i] = acc;
    if (__builtin_mul_overflow(acc, std::max<int64_t>(shape[i], 1), &acc)) acc = INT64_MAX;
  }
  return s;
}

}  // namespace

TensorView::TensorView(const void* data, DType dtype, std::initializer_list<int64_t> shape)
    : TensorView(data, dtype, std::vector<int64_t>(shape)) {}

TensorView::TensorView(const void* data, DType dtype, std::vector<int64_t> shape)
    : TensorView(data, dtype, shape, contiguous_strides(shape)) {}

TensorView::TensorView(const void* data, DType dtype, std::vector<int64_t> shape,
                       std::vector<int64_t> strides)
    : data_(data), dtype_(dtype) {
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    throw Error("TensorView: rank must be at most 8, got " + std::to_string(shape.size()));
  }
  if (shape.size() != strides.size()) {
    throw Error("TensorView: shape and strides must have the same length, got " +
                std::to_string(shape.size()) + " and " + std::to_string(strides.size()));
  }
  rank_ = static_cast<int>(shape.size());
  for (int i = 0; i < rank_; ++i) {
    if (shape[i] < 0) {
      throw Error("TensorView: shape[" + std::to_string(i) + "] must be >= 0, got " +
                  std::to_string(shape[i]));
    }
    shape_[i] = shape[i];
    strides_[i] = strides[i];
  }
  checked_numel("TensorView", shape, dtype_size(dtype));
  // The last element's offset, |Σ (size − 1)·stride| in bytes, must fit as well.
  int64_t reach = 0, term = 0;
  for (int i = 0; i < rank_; ++i) {
    if (shape_[i] == 0) return;
    const int64_t stride = strides_[i] < 0 ? -strides_[i] : strides_[i];
    if (__builtin_mul_overflow(shape_[i] - 1, stride, &term) ||
        __builtin_mul_overflow(term, static_cast<int64_t>(dtype_size(dtype)), &term) ||
        __builtin_add_overflow(reach, term, &reach)) {
      throw Error("TensorView: shape " + shape_string(shape) +
                  " with these strides reaches beyond int64 bytes");
    }
  }
}

std::vector<int64_t> TensorView::shape() const { return {shape_, shape_ + rank()}; }
std::vector<int64_t> TensorView::strides() const { return {strides_, strides_ + rank()}; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank(); ++i) n *= shape_[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t acc = 1;
  for (int i = rank(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != acc) return false;
    acc *= shape_[i];
  }
  return true;
}

std::string TensorView::describe() const {
  if (empty()) return "(none)";
  // Plain strings, not iostreams: see number_text.hpp.
  std::string text = std::string(dtype_name(dtype_)) + "[";
  for (int i = 0; i < rank_; ++i) text += (i ? ", " : "") + std::to_string(shape_[i]);
  text += "]";
  if (!is_contiguous()) {
    text += " strides [";
    for (int i = 0; i < rank_; ++i) text += (i ? ", " : "") + std::to_string(strides_[i]);
    text += "]";
  }
  if (!device_.is_cpu()) text += " on " + device_.describe();
  return text;
}

std::string Device::describe() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

void Tensor::FreeAligned::operator()(void* p) const { std::free(p); }

Tensor::Tensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (shape_[i] < 0) {
      throw Error("Tensor: shape[" + std::to_string(i) + "] must be >= 0, got " +
                  std::to_string(shape_[i]));
    }
  }
  const size_t bytes = static_cast<size_t>(checked_numel("Tensor", shape_, dtype_size(dtype_))) *
                       dtype_size(dtype_);
  if (bytes > (size_t{1} << 62)) {
    throw Error("Tensor: shape " + shape_string(shape_) + " is too large (" +
                std::to_string(bytes) + " bytes)");
  }
  void* p = detail::allocate_storage(bytes);
  if (p == nullptr) throw std::bad_alloc();
  buffer_.reset(p);
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

TensorView Tensor::view() const { return TensorView(buffer_.get(), dtype_, shape_); }

}  // namespace attn
