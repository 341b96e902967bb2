// The f32 kernels' row conversions (cpu/storage_rows-inl.h) on every SIMD target this
// CPU runs: widening bf16/f16 rows and rounding f32 rows to bf16/f16 must give, bit for
// bit, what the scalar conversions of tensor/convert.hpp give (the float64 reference's
// inputs and the tests' expectations are built with those).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "cpu/attention_forward.hpp"
#include "cpu/storage_rows.hpp"
#include "tensor/convert.hpp"

namespace attn::testing {
namespace {

float FloatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Every kind of f32 a gradient or an output can hold: zeros, subnormals, values whose
// dropped half is just under, at (with an even and an odd kept half) and just over a
// tie, the largest finite values (which round to ±∞ in bf16), ±∞, quiet and signalling
// NaNs with payloads; then random bit patterns (which include all of those again).
std::vector<float> Specials(std::mt19937_64& rng) {
  std::vector<uint32_t> bits = {0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007fffff, 0x00008000,
                                0x00018000, 0x3f807fff, 0x3f808000, 0x3f818000, 0x3f808001, 0xbf808000,
                                0xbf818000, 0x3f800000, 0x477fe000, 0x477ff000, 0x7f7fffff, 0xff7fffff,
                                0x7f7f8000, 0x7f7f7fff, 0x7f800000, 0xff800000, 0x7f800001, 0x7fbfffff,
                                0x7fc00000, 0xffc00001, 0xffffffff, 0x7f808000, 0x33000000, 0x387fc000};
  for (int i = 0; i < 4000; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  std::vector<float> values;
  for (const uint32_t b : bits) values.push_back(FloatOf(b));
  return values;
}

TEST(StorageRows, RoundingToBf16AndF16MatchesTheScalarConversionsOnEveryTarget) {
  auto rng = make_rng(77);
  const std::vector<float> src = Specials(rng);
  const int n = static_cast<int>(src.size());
  for (const int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    SCOPED_TRACE(detail::attention_forward_target());
    for (const DType dt : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(dtype_name(dt));
      // From several starting columns and lengths, so that every vector tail is taken;
      // the elements around the row must stay untouched.
      for (const int first : {0, 1, 5}) {
        for (const int width : {n - first, 1, 7, 17, 33}) {
          std::vector<uint16_t> dst(n + 16, 0xABCD);
          detail::store_row_f32_cpu(dt, dst.data(), first + 3, src.data() + first, width);
          for (int i = 0; i < n + 16; ++i) {
            const int at = i - 3 - first;
            const uint16_t want = at >= 0 && at < width
                                      ? (dt == DType::bf16 ? detail::f32_to_bf16(src[first + at])
                                                           : detail::f32_to_f16(src[first + at]))
                                      : uint16_t{0xABCD};
            ASSERT_EQ(dst[i], want) << "element " << i << ", f32 bits 0x" << std::hex
                                    << (at >= 0 && at < width ? BitsOf(src[first + at]) : 0u);
          }
        }
      }
    }
  }
  detail::force_simd_target(0);
}

TEST(StorageRows, WideningBf16AndF16MatchesTheScalarConversionsOnEveryTarget) {
  std::vector<uint16_t> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  for (const int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    SCOPED_TRACE(detail::attention_forward_target());
    for (const DType dt : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(dtype_name(dt));
      std::vector<float> got(all.size() - 1);
      detail::load_row_f32_cpu(dt, all.data(), 1, static_cast<int>(got.size()), got.data());
      for (size_t i = 0; i < got.size(); ++i) {
        const uint16_t h = all[i + 1];
        const float want = dt == DType::bf16 ? detail::bf16_to_f32(h) : detail::f16_to_f32(h);
        if (want != want) {
          // A NaN stays a NaN (F16C's widening quiets a signalling one; the scalar
          // conversion keeps its bits): both are NaN to every later operation.
          ASSERT_NE(got[i], got[i]) << "code 0x" << std::hex << h;
        } else {
          ASSERT_EQ(BitsOf(got[i]), BitsOf(want)) << "code 0x" << std::hex << h;
        }
      }
    }
  }
  detail::force_simd_target(0);
}

}  // namespace
}  // namespace attn::testing
