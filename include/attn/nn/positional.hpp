// Positional information: the sinusoidal table of "Attention Is All You Need",
// learned absolute positions, rotary embeddings (RoPE, both pairings) and ALiBi
// slopes for any number of heads.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attn/nn/module.hpp"
#include "attn/tensor.hpp"

namespace attn::nn {

/// The sinusoidal table [max_len, dim]:
///   PE[pos, 2i] = sin(pos / base^(2i/dim)),  PE[pos, 2i+1] = cos(pos / base^(2i/dim)),
/// base 10000 in the paper. Odd `dim` ends with a sine column. Computed in double.
Tensor sinusoidal_table(int64_t max_len, int64_t dim, double base = 10000.0);

/// Adds the sinusoidal table to x: [B, L, dim] (batch_first) or [L, B, dim], positions
/// offset, offset+1, …; no parameters, so backward passes the gradient through.
class SinusoidalPositionalEncoding : public Module {
 public:
  SinusoidalPositionalEncoding(int64_t dim, int64_t max_len = 4096, bool batch_first = true);
  Tensor forward(const TensorView& x, int64_t offset = 0);
  Tensor backward(const TensorView& dy);

 private:
  int64_t dim_, max_len_;
  bool batch_first_;
  Tensor table_;
};

/// Learned absolute positions: weight [max_len, dim] ~ N(0, 1) added to x laid out as
/// in SinusoidalPositionalEncoding.
class LearnedPositionalEmbedding : public Module {
 public:
  LearnedPositionalEmbedding(int64_t max_len, int64_t dim, Rng& rng, bool batch_first = true);
  Tensor forward(const TensorView& x, int64_t offset = 0);
  Tensor backward(const TensorView& dy);

  Parameter& weight;

 private:
  int64_t max_len_, dim_;
  bool batch_first_;
  int64_t offset_ = -1, batch_ = 0, len_ = 0;
};

/// How RoPE pairs a head's dimensions into rotated planes.
enum class RopeStyle {
  none,
  interleaved,  ///< (0,1), (2,3), …: RoFormer and GPT-J
  half,         ///< (i, i + rotary_dim/2): GPT-NeoX and Llama ("rotate_half")
};

/// Rotary position embedding (Su et al. 2021). Plane p of a head of position `pos` is
/// rotated by angle pos·base^(−2p/rotary_dim); only the first `rotary_dim` dimensions
/// (even, ≤ head_dim) rotate, the rest pass through. Rotations preserve norms and make
/// q_m·k_n depend on m − n only. Angles are computed in double; the cos/sin rows of
/// positions below kCachedPositions are cached (shared, immutable once made, so apply
/// may run on one object from several threads at once), and rows past them are made
/// per call for that call's positions only: decoding at position 10⁶ costs the rows
/// it rotates, not a table of every position before it.
class RotaryEmbedding {
 public:
  RotaryEmbedding(int64_t head_dim, RopeStyle style, double base = 10000.0, int64_t rotary_dim = -1);

  /// Rotates x in place: a view [B, L, H, head_dim] (any strides, last dimension
  /// contiguous) whose row l has position positions_offset + l.
  void apply(const TensorView& x, int64_t positions_offset) const;
  /// The backward of apply: rotates a gradient by the opposite angles, in place.
  void apply_backward(const TensorView& dx, int64_t positions_offset) const;

  RopeStyle style() const { return style_; }
  int64_t rotary_dim() const { return rotary_dim_; }

  /// Positions whose cos/sin rows are cached (at rotary_dim 128: 16 MiB when full).
  static constexpr int64_t kCachedPositions = 32768;

 private:
  struct Table {  // cos and sin of positions [0, positions): [positions, rotary_dim/2]
    int64_t positions = 0;
    std::vector<float> cos, sin;
  };
  void rotate(const TensorView& x, int64_t offset, float sign) const;
  /// A table holding at least positions [0, end) (end ≤ kCachedPositions).
  std::shared_ptr<const Table> table_through(int64_t end) const;
  /// The cos/sin rows of positions [first, first + n) into t's rows [at, at + n).
  void fill_rows(int64_t first, int64_t n, Table& t, int64_t at) const;

  int64_t head_dim_, rotary_dim_;
  RopeStyle style_;
  double base_;
  std::vector<double> inv_freq_;  // base^(−2p/rotary_dim), per plane p
  // Replaced, never changed in place (std::atomic_load/atomic_store): a reader keeps
  // the table it loaded for as long as it rotates with it.
  mutable std::shared_ptr<const Table> table_;
};

/// ALiBi slopes for `num_heads` heads (Press et al. 2022): for a power of two n,
/// slope_h = 2^(−8(h+1)/n); otherwise the slopes of the nearest lower power of two m,
/// followed by every other slope of 2m until there are n (the paper's recipe).
std::vector<float> alibi_slopes(int64_t num_heads);

}  // namespace attn::nn
