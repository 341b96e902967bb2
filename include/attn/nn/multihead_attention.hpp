// Multi-head attention with PyTorch's nn.MultiheadAttention semantics and parameter
// names, on attn's fused kernels, plus what PyTorch lacks: grouped-query heads,
// RoPE, a sliding window and a KV cache for incremental decoding.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "attn/attention.hpp"
#include "attn/kvcache.hpp"
#include "attn/nn/layers.hpp"
#include "attn/nn/positional.hpp"

namespace attn::nn {

struct MultiheadAttentionConfig {
  int64_t embed_dim = 0;
  int64_t num_heads = 1;
  float dropout = 0.0f;       ///< on the attention probabilities, training mode only
  bool bias = true;           ///< in_proj_bias and out_proj.bias
  int64_t kdim = 0;           ///< key features; 0 = embed_dim
  int64_t vdim = 0;           ///< value features; 0 = embed_dim
  bool batch_first = false;   ///< [B, L, E] instead of PyTorch's default [L, B, E]
  // Beyond PyTorch:
  int64_t num_kv_heads = 0;   ///< grouped-query (GQA) / multi-query (1) heads; 0 = num_heads
  RopeStyle rope = RopeStyle::none;
  double rope_base = 10000.0;
  Window window;              ///< sliding window over positions (bottom-right aligned)
  uint64_t seed = 0;          ///< dropout stream
};

/// How a module's KV cache is stored (see attn/kvcache.hpp for the layouts).
struct KVCacheConfig {
  /// f32, bf16, f16, or i8 / f8e4m3 (quantized on append, one scale per token and head)
  DType dtype = DType::f32;
  int64_t page_size = 0;     ///< 0: contiguous [B, capacity, Hkv, hd]; ≥ 1: pages of this many positions
};

/// Keys and values of the positions decoded so far, per layer, in the storage
/// attn::attention_with_kvcache reads in place: k and v [B, capacity, Hkv, hd]
/// (contiguous) or [B·⌈capacity / page_size⌉, page_size, Hkv, hd] with block_table
/// int32 [B, ⌈capacity / page_size⌉] (paged); k_scale and v_scale f32 for i8 and
/// f8e4m3.
/// Positions [0, length) of every sequence are valid; seqlens (int32 [B]) holds
/// length for each sequence, as the kernel wants it.
struct KVCache {
  Tensor k, v;
  Tensor k_scale, v_scale;  ///< i8 and f8e4m3 caches only: [.., Hkv] beside k and v
  Tensor block_table;       ///< paged caches only
  Tensor seqlens;
  int64_t length = 0;
  int64_t batch = 0;
  int64_t capacity() const { return capacity_; }
  /// The storage as the kernel's view.
  attn::KVCache view() const;
  /// Sets length (and seqlens) after positions were appended.
  void set_length(int64_t n);

  int64_t capacity_ = 0;
};

/// Allocates an empty cache for `batch` sequences of up to `capacity` positions of
/// Hkv heads of hd features each.
KVCache allocate_kv_cache(int64_t batch, int64_t capacity, int64_t Hkv, int64_t hd, const KVCacheConfig& config);

/// The mask attn::attention_with_kvcache takes ([batch, 1, 1, K]) for a cached
/// call's key_padding_mask [batch, K] with K ≥ positions (PyTorch's convention:
/// boolean true = ignore that position, f32 added); an empty view for an empty
/// mask. A boolean mask is inverted into `storage` (attn: true = may attend); an f32
/// one is read in place. Throws attn::Error starting with `name` for a bad mask.
TensorView cached_padding_mask(const TensorView& key_padding_mask, int64_t batch, int64_t positions,
                               const std::string& name, Tensor& storage);

/// A cached call's two PyTorch-style masks as the one mask attn::attention_with_kvcache
/// takes: key_padding_mask [batch, K] as in cached_padding_mask, and attn_mask [rows, K]
/// or [batch·heads, rows, K] (row i = the call's query i, column j = position j;
/// boolean true = *not allowed*, or f32 added), K ≥ positions, the same K in both.
/// Without an attn_mask this is cached_padding_mask. With one, the two are combined
/// into `storage` as [B', H', rows, K] (B' = batch when either mask has a batch
/// dimension, H' = heads for a 3-D attn_mask): boolean (attn: true = may attend) when
/// neither is f32, else f32 with −∞ where a boolean removes. Throws attn::Error
/// starting with kpm_name or am_name for a bad mask.
TensorView cached_attention_mask(const TensorView& key_padding_mask, const std::string& kpm_name,
                                 const TensorView& attn_mask, const std::string& am_name, int64_t batch,
                                 int64_t heads, int64_t rows, int64_t positions, Tensor& storage);

struct MultiheadAttentionOutput {
  Tensor output;   ///< like query: [B, L, E] / [L, B, E] / unbatched [L, E]
  Tensor weights;  ///< when need_weights: [B, L, S] averaged over heads, or [B, H, L, S]
                   ///< (unbatched: [L, S] / [H, L, S]); after dropout, as PyTorch's
};

struct MultiheadAttentionGrads {
  Tensor dquery, dkey, dvalue;  ///< shaped like the inputs; for self-attention, add them
};

/// out_proj(softmax(q·kᵀ/√hd + masks)·v) over heads, q/k/v = in-projections of
/// query/key/value. Parameters (PyTorch's names):
///   in_proj_weight [E + 2·Hkv·hd, E] when kdim == vdim == E, else
///   q_proj_weight [E, E], k_proj_weight [Hkv·hd, kdim], v_proj_weight [Hkv·hd, vdim];
///   in_proj_bias [E + 2·Hkv·hd]; out_proj.weight [E, E], out_proj.bias [E].
/// With num_kv_heads == num_heads these are exactly PyTorch's shapes.
class MultiheadAttention : public Module {
 public:
  MultiheadAttention(const MultiheadAttentionConfig& config, Rng& rng);

  /// query [B, L, E] ([L, B, E] unless batch_first; [L, E] unbatched), key [.., S, kdim],
  /// value [.., S, vdim]. Masks as PyTorch's:
  ///   key_padding_mask [B, S] (unbatched [S]): boolean, true = *ignore* that key; or f32, added.
  ///   attn_mask [L, S] or [B·H, L, S]: boolean, true = *not allowed*; or f32, added.
  ///   is_causal: key j is visible to query i iff j ≤ i (applied with attn_mask if both given).
  /// A query that sees no key outputs out_proj.bias (PyTorch gives NaN there).
  MultiheadAttentionOutput forward(const TensorView& query, const TensorView& key, const TensorView& value,
                                   const TensorView& key_padding_mask = {}, bool need_weights = true,
                                   const TensorView& attn_mask = {}, bool average_attn_weights = true,
                                   bool is_causal = false);

  /// Gradients of the last forward given d(loss)/d(output); adds into parameter grads.
  /// The returned weights are not differentiated (they are for inspection).
  MultiheadAttentionGrads backward(const TensorView& doutput);

  /// An empty cache for `batch` sequences of up to `capacity` positions.
  KVCache make_cache(int64_t batch, int64_t capacity, const KVCacheConfig& storage = {}) const;
  /// Incremental self-attention for decoding (inference: no backward, no dropout):
  /// x [B, T, E] (or [T, B, E]) holds the next T positions. Their keys and values
  /// (RoPE at their absolute positions) are appended to `cache` in place — rounded
  /// or quantized to its dtype — and they attend to every cached position with
  /// causal bottom-right alignment and the window, through
  /// attn::attention_with_kvcache: each step reads the cache once and re-packs
  /// nothing, so decoding N positions after a prompt of P reads O(N·(P + N)) cache
  /// rows. key_padding_mask [B, K], K ≥ cache.length + T, column j = position j (a
  /// padded batch's pad positions, e.g. left padding): boolean, true = *ignore* that
  /// position (as in forward()); or f32, added to the scores. A mask of the final
  /// length serves every step. attn_mask [T, K] or [B·H, T, K], K ≥ cache.length + T
  /// (and key_padding_mask's K when both are given): row i = this call's position
  /// cache.length + i, column j = position j; boolean, true = *not allowed*, or f32,
  /// added, on top of the causal order and the window (e.g. a tree of draft tokens in
  /// speculative decoding, each seeing only its ancestors). A query that sees no
  /// position outputs out_proj.bias. Returns [B, T, E] / [T, B, E].
  Tensor forward_cached(const TensorView& x, KVCache& cache, const TensorView& key_padding_mask = {},
                        const TensorView& attn_mask = {});

  /// Cross-attention for decoding, step 1: the keys and values of key [B, S, kdim]
  /// and value [B, S, vdim] (or [S, B, ·]; RoPE at positions 0 … S−1), projected once
  /// into a cache of length S.
  KVCache make_memory_cache(const TensorView& key, const TensorView& value, const KVCacheConfig& storage = {}) const;
  /// Cross-attention for decoding, step 2: x [B, T, E] (or [T, B, E]) attends to
  /// every position of `memory` but those key_padding_mask removes ([B, K], K ≥ S,
  /// as in forward_cached: the source sentences' padding) and attn_mask ([T, K] or
  /// [B·H, T, K], K ≥ S, as in forward_cached; row i = x's row i) remove; its queries
  /// rotate at positions `position` … position+T−1. Nothing is appended. Returns x's
  /// shape.
  Tensor forward_memory_cached(const TensorView& x, const KVCache& memory, int64_t position,
                               const TensorView& key_padding_mask = {}, const TensorView& attn_mask = {});

  const MultiheadAttentionConfig& config() const { return cfg_; }
  int64_t head_dim() const { return hd_; }

  Parameter* in_proj_weight = nullptr;  // kdim == vdim == embed_dim
  Parameter* q_proj_weight = nullptr;   // otherwise
  Parameter* k_proj_weight = nullptr;
  Parameter* v_proj_weight = nullptr;
  Parameter* in_proj_bias = nullptr;
  Linear out_proj;

 private:
  struct Shapes {
    int64_t B, L, S;
    bool unbatched;
  };
  Shapes check_inputs(const TensorView& q, const TensorView& k, const TensorView& v) const;
  void build_mask(const Shapes& s, const TensorView& key_padding_mask, const TensorView& attn_mask);
  const float* w_q() const;
  const float* w_k() const;
  const float* w_v() const;
  float* grad_w(int which);
  TensorView heads_view(const Tensor& rows, int64_t B, int64_t L, int64_t H) const;
  TensorView heads_view(const Tensor& rows, int64_t B, int64_t L, int64_t H, bool batch_major) const;
  Shapes cached_shapes(const TensorView& x, const char* what) const;
  Tensor attend_cached(const TensorView& x, const Shapes& s, const attn::KVCache& cache, const Tensor& seqlens,
                       int64_t position, bool append, const AttentionOptions& opt);

  MultiheadAttentionConfig cfg_;
  int64_t E_, hd_, Hkv_, kdim_, vdim_;
  RotaryEmbedding rope_;
  uint64_t calls_ = 0;

  // What backward needs from the last forward.
  Shapes shapes_{};
  Tensor query_, key_, value_;  // inputs as rows
  Tensor q_, k_, v_, attn_;     // projections (q, k after RoPE) and the heads' output, as rows
  Tensor lse_, mask_;
  AttentionOptions opt_;
  bool have_forward_ = false;
};

}  // namespace attn::nn
