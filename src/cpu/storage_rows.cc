// storage_rows-inl.h's row conversions behind Highway's runtime dispatch (see
// storage_rows.hpp).
#include "cpu/storage_rows.hpp"

#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/storage_rows.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "cpu/tile_kernels-inl.h"
#include "cpu/storage_rows-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

void LoadRow(DType dt, const void* base, int64_t offset, int width, float* dst) {
  const float* row = RowF32(dt, base, offset, width, dst);
  if (row != dst) std::memcpy(dst, row, sizeof(float) * width);
}

void StoreRow(DType dt, void* base, int64_t offset, const float* src, int width) {
  StoreRowF32(dt, base, offset, src, width);
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

HWY_EXPORT(LoadRow);
HWY_EXPORT(StoreRow);

void load_row_f32_cpu(DType dt, const void* base, int64_t offset, int width, float* dst) {
  HWY_DYNAMIC_DISPATCH(LoadRow)(dt, base, offset, width, dst);
}

void store_row_f32_cpu(DType dt, void* base, int64_t offset, const float* src, int width) {
  HWY_DYNAMIC_DISPATCH(StoreRow)(dt, base, offset, src, width);
}

}  // namespace attn::detail
#endif  // HWY_ONCE
