// TensorView and Tensor: shapes, strides, contiguity, alignment, errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <locale>
#include <string>

#include "attn/error.hpp"
#include "attn/tensor.hpp"

namespace attn {
namespace {

TEST(TensorView, ContiguousStridesAreRowMajor) {
  float buf[2 * 3 * 4 * 5];
  const TensorView t(buf, DType::f32, {2, 3, 4, 5});
  EXPECT_EQ(t.rank(), 4);
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{60, 20, 5, 1}));
  EXPECT_EQ(t.numel(), 120);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "f32[2, 3, 4, 5]");
}

TEST(TensorView, StridedViewOfBhsdAsBshd) {
  float buf[2 * 3 * 4 * 5];
  // Storage [B=2, H=4, L=3, d=5] seen as [B, L, H, d].
  const TensorView t(buf, DType::f32, {2, 3, 4, 5}, {60, 5, 15, 1});
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.stride(2), 15);
  EXPECT_NE(t.describe().find("strides"), std::string::npos);
}

// Descriptions (and so every error message) must not depend on the global locale: one
// that groups digits gave "f32[1,000,000]" through std::ostream.
TEST(TensorView, DescriptionIgnoresTheGlobalLocale) {
  struct Grouping : std::numpunct<char> {
    char do_thousands_sep() const override { return ','; }
    std::string do_grouping() const override { return "\3"; }
  };
  const std::locale saved = std::locale::global(std::locale(std::locale::classic(), new Grouping));
  float x = 0;
  const std::string text = TensorView(&x, DType::f32, {1000000, 2}, {3, 1000000}).describe();
  std::locale::global(saved);
  EXPECT_EQ(text, "f32[1000000, 2] strides [3, 1000000]");
}

TEST(TensorView, DefaultIsEmptyAndBadShapesThrow) {
  EXPECT_TRUE(TensorView().empty());
  float x = 0;
  EXPECT_THROW((void)TensorView(&x, DType::f32, {2, -1}), Error);
  EXPECT_THROW((void)TensorView(&x, DType::f32, {2, 3}, {1}), Error);
  EXPECT_THROW((void)TensorView(&x, DType::f32, {1, 1, 1, 1, 1, 1, 1, 1, 1}), Error);
}

TEST(Tensor, IsAlignedOwningAndViewable) {
  for (int64_t n : {1, 3, 17, 1000}) {
    Tensor t(DType::f32, {n, 3});
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
    EXPECT_EQ(t.numel(), n * 3);
    const TensorView v = t;
    EXPECT_EQ(v.size(0), n);
    EXPECT_EQ(v.data(), t.data());
    t.data_as<float>()[n * 3 - 1] = 1.5f;  // the whole extent is writable
  }
  EXPECT_THROW((void)Tensor(DType::f32, {-2}), Error);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_STREQ(dtype_name(DType::boolean), "bool");
}

// Large tensors sit on 2 MiB boundaries, so whole huge pages can back them; smaller
// ones keep the 64-byte alignment without the 2 MiB rounding.
TEST(Tensor, LargeTensorsAreHugePageAligned) {
  for (int64_t n : {int64_t{2} << 20, (int64_t{5} << 20) + 3}) {  // 8 MiB and ~20 MiB of f32
    Tensor t(DType::f32, {n});
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % (uintptr_t{2} << 20), 0u) << n;
    t.data_as<float>()[0] = 1.0f;
    t.data_as<float>()[n - 1] = 2.0f;  // the whole extent is writable
    EXPECT_EQ(t.data_as<float>()[n - 1], 2.0f);
  }
  Tensor small(DType::bf16, {1000, 3});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % 64, 0u);
}

}  // namespace
}  // namespace attn
