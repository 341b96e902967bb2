// Sinusoidal and learned positions, RoPE, ALiBi slopes.
#include "attn/nn/positional.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attn/error.hpp"
#include "nn/ops.hpp"

namespace attn::nn {

Tensor sinusoidal_table(int64_t max_len, int64_t dim, double base) {
  if (max_len < 0 || dim < 1) throw Error("sinusoidal_table: need max_len ≥ 0 and dim ≥ 1");
  Tensor t(DType::f32, {max_len, dim});
  float* p = t.data_as<float>();
  for (int64_t pos = 0; pos < max_len; ++pos)
    for (int64_t c = 0; c < dim; ++c) {
      const double angle = double(pos) / std::pow(base, double(c - c % 2) / double(dim));
      p[pos * dim + c] = static_cast<float>(c % 2 == 0 ? std::sin(angle) : std::cos(angle));
    }
  return t;
}

namespace {
// x: [B, L, dim] or [L, B, dim]; calls f(row pointer, position) for every row.
template <class F>
void for_each_position(const TensorView& x, bool batch_first, int64_t offset, int64_t max_len, const char* what,
                       F&& f) {
  if (x.rank() != 3) throw Error(std::string(what) + ": expected a rank-3 tensor, got " + x.describe());
  const int64_t B = batch_first ? x.size(0) : x.size(1), L = batch_first ? x.size(1) : x.size(0);
  // offset > max_len − L rather than offset + L > max_len: no overflow near INT64_MAX.
  if (offset < 0 || offset > max_len - L)
    throw Error(std::string(what) + ": " + std::to_string(L) + " positions from " + std::to_string(offset) +
                " exceed max_len " + std::to_string(max_len) + " (offset must be in [0, max_len − L])");
  const int64_t dim = x.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) f((batch_first ? b * L + l : l * B + b) * dim, offset + l);
}
}  // namespace

SinusoidalPositionalEncoding::SinusoidalPositionalEncoding(int64_t dim, int64_t max_len, bool batch_first)
    : dim_(dim), max_len_(max_len), batch_first_(batch_first), table_(sinusoidal_table(max_len, dim)) {}

Tensor SinusoidalPositionalEncoding::forward(const TensorView& x, int64_t offset) {
  ops::expect_last_dim(x, dim_, "SinusoidalPositionalEncoding.forward: x");
  Tensor y = clone(x);
  float* out = y.data_as<float>();
  const float* pe = table_.data_as<float>();
  for_each_position(x, batch_first_, offset, max_len_, "SinusoidalPositionalEncoding.forward",
                    [&](int64_t row, int64_t pos) {
                      for (int64_t c = 0; c < dim_; ++c) out[row + c] += pe[pos * dim_ + c];
                    });
  return y;
}

Tensor SinusoidalPositionalEncoding::backward(const TensorView& dy) { return clone(dy); }

LearnedPositionalEmbedding::LearnedPositionalEmbedding(int64_t max_len, int64_t dim, Rng& rng, bool batch_first)
    : weight(register_parameter("weight", {max_len, dim})), max_len_(max_len), dim_(dim), batch_first_(batch_first) {
  init_normal(weight, 1.0f, rng);
}

Tensor LearnedPositionalEmbedding::forward(const TensorView& x, int64_t offset) {
  ops::expect_last_dim(x, dim_, "LearnedPositionalEmbedding.forward: x");
  Tensor y = clone(x);
  float* out = y.data_as<float>();
  for_each_position(x, batch_first_, offset, max_len_, "LearnedPositionalEmbedding.forward",
                    [&](int64_t row, int64_t pos) {
                      for (int64_t c = 0; c < dim_; ++c) out[row + c] += weight.value[pos * dim_ + c];
                    });
  offset_ = offset;
  return y;
}

Tensor LearnedPositionalEmbedding::backward(const TensorView& dy) {
  if (offset_ < 0) throw Error("LearnedPositionalEmbedding.backward: backward called before forward");
  ops::expect_last_dim(dy, dim_, "LearnedPositionalEmbedding.backward: dy");
  const float* g = dy.data_as<float>();
  for_each_position(dy, batch_first_, offset_, max_len_, "LearnedPositionalEmbedding.backward",
                    [&](int64_t row, int64_t pos) {
                      for (int64_t c = 0; c < dim_; ++c) weight.grad[pos * dim_ + c] += g[row + c];
                    });
  return clone(dy);
}

// ---- RoPE --------------------------------------------------------------------------

RotaryEmbedding::RotaryEmbedding(int64_t head_dim, RopeStyle style, double base, int64_t rotary_dim)
    : head_dim_(head_dim), rotary_dim_(rotary_dim < 0 ? head_dim : rotary_dim), style_(style), base_(base) {
  if (style == RopeStyle::none) rotary_dim_ = 0;
  if (rotary_dim_ % 2 != 0 || rotary_dim_ > head_dim)
    throw Error("RotaryEmbedding: rotary_dim must be even and ≤ head_dim (" + std::to_string(head_dim) + "), got " +
                std::to_string(rotary_dim_));
  if (!(base > 1.0)) throw Error("RotaryEmbedding: base must be > 1, got " + std::to_string(base));
  for (int64_t p = 0; p < rotary_dim_ / 2; ++p)
    inv_freq_.push_back(std::pow(base_, -2.0 * double(p) / double(rotary_dim_)));
}

void RotaryEmbedding::fill_rows(int64_t first, int64_t n, Table& t, int64_t at) const {
  const int64_t half = rotary_dim_ / 2;
  for (int64_t pos = first; pos < first + n; ++pos)
    for (int64_t p = 0; p < half; ++p) {
      const double angle = double(pos) * inv_freq_[p];
      t.cos[(at + pos - first) * half + p] = static_cast<float>(std::cos(angle));
      t.sin[(at + pos - first) * half + p] = static_cast<float>(std::sin(angle));
    }
}

std::shared_ptr<const RotaryEmbedding::Table> RotaryEmbedding::table_through(int64_t end) const {
  std::shared_ptr<const Table> have = std::atomic_load(&table_);
  if (have != nullptr && have->positions >= end) return have;
  // Grow by doubling (capped), keeping the rows made so far. Two threads may both
  // grow it; each publishes a complete table, and either is correct.
  const int64_t half = rotary_dim_ / 2, old = have != nullptr ? have->positions : 0;
  auto grown = std::make_shared<Table>();
  grown->positions = std::min(kCachedPositions, std::max(end, 2 * old));
  grown->cos.resize(static_cast<size_t>(grown->positions * half));
  grown->sin.resize(grown->cos.size());
  if (have != nullptr) {
    std::copy(have->cos.begin(), have->cos.end(), grown->cos.begin());
    std::copy(have->sin.begin(), have->sin.end(), grown->sin.begin());
  }
  fill_rows(old, grown->positions - old, *grown, old);
  std::atomic_store(&table_, std::shared_ptr<const Table>(grown));
  return grown;
}

void RotaryEmbedding::rotate(const TensorView& x, int64_t offset, float sign) const {
  if (rotary_dim_ == 0) return;
  if (x.dtype() != DType::f32 || x.rank() != 4 || x.size(3) != head_dim_ || x.stride(3) != 1)
    throw Error("RotaryEmbedding: expected an f32 view [B, L, H, " + std::to_string(head_dim_) +
                "] with a contiguous last dimension, got " + x.describe());
  if (offset < 0) throw Error("RotaryEmbedding: positions_offset must be ≥ 0");
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), half = rotary_dim_ / 2;
  if (L == 0) return;
  if (offset > INT64_MAX - L) throw Error("RotaryEmbedding: positions_offset + L overflows int64");
  // The rows of positions [offset, offset + L): from the shared table, or made for
  // this call where they lie past it (the same values either way).
  std::shared_ptr<const Table> shared;
  Table own;
  const float* cos_rows;
  const float* sin_rows;
  if (offset + L <= kCachedPositions) {
    shared = table_through(offset + L);
    cos_rows = shared->cos.data() + offset * half;
    sin_rows = shared->sin.data() + offset * half;
  } else {
    own.positions = L;
    own.cos.resize(static_cast<size_t>(L * half));
    own.sin.resize(own.cos.size());
    fill_rows(offset, L, own, 0);
    cos_rows = own.cos.data();
    sin_rows = own.sin.data();
  }
  float* base = x.data_as<float>();
  // The pair (a, b) of plane p becomes (a·cos − b·sin, a·sin + b·cos); sign = −1
  // rotates back (the transpose of a rotation is its inverse), which is the backward.
  const int64_t second = style_ == RopeStyle::half ? half : 1;
  const int64_t step = style_ == RopeStyle::half ? 1 : 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) {
      const float* c = cos_rows + l * half;
      const float* s = sin_rows + l * half;
      for (int64_t h = 0; h < H; ++h) {
        float* row = base + b * x.stride(0) + l * x.stride(1) + h * x.stride(2);
        for (int64_t p = 0; p < half; ++p) {
          float& a = row[p * step];
          float& bb = row[p * step + second];
          const float sn = sign * s[p];
          const float na = a * c[p] - bb * sn, nb = a * sn + bb * c[p];
          a = na;
          bb = nb;
        }
      }
    }
}

void RotaryEmbedding::apply(const TensorView& x, int64_t positions_offset) const { rotate(x, positions_offset, 1.0f); }
void RotaryEmbedding::apply_backward(const TensorView& dx, int64_t positions_offset) const {
  rotate(dx, positions_offset, -1.0f);
}

// ---- ALiBi -------------------------------------------------------------------------

std::vector<float> alibi_slopes(int64_t num_heads) {
  if (num_heads < 1) throw Error("alibi_slopes: num_heads must be ≥ 1, got " + std::to_string(num_heads));
  auto power_of_two = [](int64_t n) {
    std::vector<float> s(static_cast<size_t>(n));
    for (int64_t h = 0; h < n; ++h) s[h] = static_cast<float>(std::pow(2.0, -8.0 * double(h + 1) / double(n)));
    return s;
  };
  int64_t m = 1;
  while (m * 2 <= num_heads) m *= 2;
  std::vector<float> slopes = power_of_two(m);
  if (m == num_heads) return slopes;
  const std::vector<float> extra = power_of_two(2 * m);
  for (int64_t i = 0; static_cast<int64_t>(slopes.size()) < num_heads; i += 2) slopes.push_back(extra[i]);
  return slopes;
}

}  // namespace attn::nn
