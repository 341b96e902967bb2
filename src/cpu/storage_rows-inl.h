// Rows of q, k, v and out in their storage dtype, read and written as f32 by the
// f32 kernels: bf16/f16 inputs are widened row by row where the kernel packs or loads
// them (exactly: every bf16/f16 value is an f32 value), and output rows are rounded
// once on the way out (nearest even, as the tensor conversions round). No f32 copy of
// a whole tensor is made. Included once per Highway target.

#if defined(ATTN_CPU_STORAGE_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_STORAGE_ROWS_INL_H_
#undef ATTN_CPU_STORAGE_ROWS_INL_H_
#else
#define ATTN_CPU_STORAGE_ROWS_INL_H_
#endif

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <cstdint>

#include "attn/tensor.hpp"
#include "cpu/tile_kernels-inl.h"  // DF, VF, kLanes
#include "tensor/convert.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

/// kLanes f16 values at p as f32, exactly, ±∞ and NaN included: F16C's vcvtph2ps
/// where the target has it; elsewhere Highway's emulation, which reads the codes with
/// an all-ones exponent as finite values (±∞ as ±65536: storage_rows_test), with
/// those codes' lanes replaced by ±∞ and NaN built from their bits.
HWY_INLINE VF LoadF16AsF32(DF df, const uint16_t* HWY_RESTRICT p) {
  const hn::Rebind<hwy::float16_t, DF> dh;
  const auto f = hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  return f;
#else
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint16_t, DF> d16;
  const auto w = hn::PromoteTo(du, hn::LoadU(d16, p));
  const auto exp = hn::Set(du, 0x7c00u);
  const auto special = hn::Eq(hn::And(w, exp), exp);
  const auto bits = hn::Or(hn::ShiftLeft<16>(hn::And(w, hn::Set(du, 0x8000u))),
                           hn::Or(hn::Set(du, 0x7f800000u), hn::ShiftLeft<13>(hn::And(w, hn::Set(du, 0x3ffu)))));
  return hn::IfThenElse(hn::RebindMask(df, special), hn::BitCast(df, bits), f);
#endif
}

/// `width` elements at element `offset` of `base` (a problem's q/k/v pointer, which
/// points at storage of dtype dt: f32, bf16 or f16) as f32: f32 rows in place, bf16/f16
/// rows widened into buf (at least `width` floats). With `round_bf16` (f32 inputs under
/// Precision::bf16) f32 rows are rounded to bf16 into buf instead: the values a
/// rounded copy of the tensor would hold, without the copy.
HWY_INLINE const float* RowF32(DType dt, const void* base, int64_t offset, int width, float* HWY_RESTRICT buf,
                               bool round_bf16 = false) {
  if (dt == DType::f32) {
    const float* row = static_cast<const float*>(base) + offset;
    if (!round_bf16) return row;
    round_f32_row_to_bf16(row, buf, width);
    return buf;
  }
  const DF df;
  const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
  int c = 0;
  if (dt == DType::bf16) {
    const hn::Rebind<hwy::bfloat16_t, DF> dh;
    for (; c + kLanes <= width; c += kLanes)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::bfloat16_t*>(src + c))), df, buf + c);
    for (; c < width; ++c) buf[c] = bf16_to_f32(src[c]);
  } else {
    for (; c + kLanes <= width; c += kLanes) hn::StoreU(LoadF16AsF32(df, src + c), df, buf + c);
    for (; c < width; ++c) buf[c] = f16_to_f32(src[c]);
  }
  return buf;
}

/// Writes `width` f32 values to element `offset` of `base` (storage of dtype dt),
/// rounding to bf16/f16 (nearest even) where dt asks: bf16 in vectors, bit for bit
/// f32_to_bf16 (the baseline build of store_f32_row's loop was 15% of a one-query
/// bf16 backward against 4k keys, perf on Zen 4); f16 on targets with F16C; else
/// store_f32_row, whose loops the compiler vectorises.
HWY_INLINE void StoreRowF32(DType dt, void* base, int64_t offset, const float* HWY_RESTRICT src, int width) {
#if HWY_TARGET != HWY_SCALAR
  if (dt == DType::bf16) {
    uint16_t* dst = static_cast<uint16_t*>(base) + offset;
    const DF df;
    const hn::RebindToSigned<DF> di;
    const hn::Rebind<uint16_t, DF> d16;
    int c = 0;
    for (; c + kLanes <= width; c += kLanes) {
      // f32_to_bf16: add 0x7fff plus the lowest kept bit, keep the top half; a NaN
      // keeps its top half with the quiet bit set. Logical shifts of the bits as
      // int32 (the sign bit shifted out or down to bit 15 of a non-negative value).
      const auto u = hn::BitCast(di, hn::LoadU(df, src + c));
      const auto top = hn::BitCast(di, hn::ShiftRight<16>(hn::BitCast(hn::RebindToUnsigned<DF>(), u)));
      const auto rounded = hn::BitCast(
          di, hn::ShiftRight<16>(hn::BitCast(hn::RebindToUnsigned<DF>(),
                                             hn::Add(u, hn::Add(hn::Set(di, 0x7fff), hn::And(top, hn::Set(di, 1)))))));
      const auto nan = hn::Gt(hn::And(u, hn::Set(di, 0x7fffffff)), hn::Set(di, 0x7f800000));
      const auto bits = hn::IfThenElse(nan, hn::Or(top, hn::Set(di, 0x0040)), rounded);
      hn::StoreU(hn::DemoteTo(d16, bits), d16, dst + c);  // 0 … 0xffff: exact
    }
    if (c < width) store_f32_row(dt, base, offset + c, src + c, width - c);
    return;
  }
#endif
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  if (dt == DType::f16) {
    // F16C's vcvtps2ph rounds to nearest even and quiets NaNs as f32_to_f16 does, bit
    // for bit. (Highway's emulation on older targets truncates, so they stay scalar.)
    uint16_t* dst = static_cast<uint16_t*>(base) + offset;
    const DF df;
    const hn::Rebind<hwy::float16_t, DF> dh;
    int c = 0;
    for (; c + kLanes <= width; c += kLanes)
      hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, src + c)), dh, reinterpret_cast<hwy::float16_t*>(dst + c));
    for (; c < width; ++c) dst[c] = f32_to_f16(src[c]);
    return;
  }
#endif
  store_f32_row(dt, base, offset, src, width);
}

/// Asks for rows [first, last) of one head of q, k or v (storage of dtype dt at
/// `base`; row j's `width` elements start at element at0 + j·row) to be brought
/// into the cache, one request per line. Packing reads a head's rows, 256 bytes
/// each at d = 64, H·d elements apart: a pattern the hardware prefetcher does not
/// follow, so the packing loops request the next head's rows while they pack this
/// head's.
HWY_INLINE void PrefetchRows(DType dt, const void* base, int64_t at0, int64_t row, int width, int first, int last) {
  const int64_t elem = static_cast<int64_t>(dtype_size(dt));
  const char* bytes = static_cast<const char*>(base);
  for (int j = first; j < last; ++j) {
    const char* r = bytes + (at0 + int64_t{j} * row) * elem;
    for (int64_t c = 0; c < width * elem; c += 64) hwy::Prefetch(r + c);
  }
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // ATTN_CPU_STORAGE_ROWS_INL_H_
