// MultiheadAttention: in-projections (CBLAS), RoPE, the fused attention kernels,
// out-projection; PyTorch's masks translated into one attn mask.
#include "attn/nn/multihead_attention.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#include "attn/error.hpp"
#include "nn/ops.hpp"

namespace attn::nn {

namespace {
std::string str(int64_t v) { return std::to_string(v); }

/// PyTorch's two masks, already checked, as the one mask attn's kernels take:
/// kpm [B, S] (or empty) and am [L, S] or [B·H, L, S] (or empty), boolean true = *not
/// allowed* or f32 added, into [B', H', L', S] (B' = B when either has a batch
/// dimension, H' = H for a 3-D am, L' = L with an am), boolean with attn's sense (true
/// = may attend) when neither is f32, else f32 with −∞ where a boolean removes.
Tensor combine_masks(const TensorView& kpm, const TensorView& am, int64_t B, int64_t H, int64_t L, int64_t S) {
  const bool am3d = !am.empty() && am.rank() == 3;
  const bool additive = (!kpm.empty() && kpm.dtype() == DType::f32) || (!am.empty() && am.dtype() == DType::f32);
  const int64_t Bm = (!kpm.empty() || am3d) ? B : 1, Hm = am3d ? H : 1, Lm = am.empty() ? 1 : L;
  Tensor mask(additive ? DType::f32 : DType::boolean, {Bm, Hm, Lm, S});
  for (int64_t b = 0; b < Bm; ++b)
    for (int64_t h = 0; h < Hm; ++h)
      for (int64_t i = 0; i < Lm; ++i)
        for (int64_t j = 0; j < S; ++j) {
          bool masked = false;  // PyTorch: true in a boolean mask = ignore / not allowed
          float add = 0.0f;
          if (!am.empty()) {
            const int64_t idx = am3d ? ((b * H + h) * L + i) * S + j : i * S + j;
            if (am.dtype() == DType::boolean) masked |= am.data_as<uint8_t>()[idx] != 0;
            else add += am.data_as<float>()[idx];
          }
          if (!kpm.empty()) {
            if (kpm.dtype() == DType::boolean) masked |= kpm.data_as<uint8_t>()[b * S + j] != 0;
            else add += kpm.data_as<float>()[b * S + j];
          }
          const int64_t o = ((b * Hm + h) * Lm + i) * S + j;
          if (additive) mask.data_as<float>()[o] = masked ? -std::numeric_limits<float>::infinity() : add;
          else mask.data_as<uint8_t>()[o] = masked ? 0 : 1;  // attn: true = may attend
        }
  return mask;
}
}  // namespace

MultiheadAttention::MultiheadAttention(const MultiheadAttentionConfig& config, Rng& rng)
    : out_proj(config.embed_dim > 0 ? config.embed_dim : 1, config.embed_dim > 0 ? config.embed_dim : 1, config.bias,
               rng),
      cfg_(config),
      E_(config.embed_dim),
      hd_(config.num_heads > 0 ? config.embed_dim / config.num_heads : 0),
      Hkv_(config.num_kv_heads > 0 ? config.num_kv_heads : config.num_heads),
      kdim_(config.kdim > 0 ? config.kdim : config.embed_dim),
      vdim_(config.vdim > 0 ? config.vdim : config.embed_dim),
      rope_(hd_ > 0 ? hd_ : 2, hd_ % 2 == 0 ? config.rope : RopeStyle::none, config.rope_base) {
  if (E_ < 1 || cfg_.num_heads < 1 || E_ % cfg_.num_heads != 0)
    throw Error("MultiheadAttention: embed_dim (" + str(E_) + ") must be a positive multiple of num_heads (" +
                str(cfg_.num_heads) + ")");
  if (Hkv_ < 1 || cfg_.num_heads % Hkv_ != 0)
    throw Error("MultiheadAttention: num_kv_heads (" + str(Hkv_) + ") must divide num_heads (" +
                str(cfg_.num_heads) + ")");
  if (!(cfg_.dropout >= 0.0f && cfg_.dropout < 1.0f))
    throw Error("MultiheadAttention: dropout must be in [0, 1), got " + std::to_string(cfg_.dropout));
  if (cfg_.rope != RopeStyle::none && hd_ % 2 != 0)
    throw Error("MultiheadAttention: RoPE needs an even head dimension, got " + str(hd_));
  const int64_t ekv = Hkv_ * hd_;
  if (kdim_ == E_ && vdim_ == E_) {
    in_proj_weight = &register_parameter("in_proj_weight", {E_ + 2 * ekv, E_});
    init_xavier_uniform(*in_proj_weight, rng);
  } else {
    q_proj_weight = &register_parameter("q_proj_weight", {E_, E_});
    k_proj_weight = &register_parameter("k_proj_weight", {ekv, kdim_});
    v_proj_weight = &register_parameter("v_proj_weight", {ekv, vdim_});
    for (Parameter* p : {q_proj_weight, k_proj_weight, v_proj_weight}) init_xavier_uniform(*p, rng);
  }
  if (cfg_.bias) in_proj_bias = &register_parameter("in_proj_bias", {E_ + 2 * ekv});  // zeros, as PyTorch
  register_module("out_proj", out_proj);
  if (out_proj.bias) init_constant(*out_proj.bias, 0.0f);
}

const float* MultiheadAttention::w_q() const {
  return in_proj_weight ? in_proj_weight->value.data() : q_proj_weight->value.data();
}
const float* MultiheadAttention::w_k() const {
  return in_proj_weight ? in_proj_weight->value.data() + E_ * E_ : k_proj_weight->value.data();
}
const float* MultiheadAttention::w_v() const {
  return in_proj_weight ? in_proj_weight->value.data() + (E_ + Hkv_ * hd_) * E_ : v_proj_weight->value.data();
}
float* MultiheadAttention::grad_w(int which) {
  if (in_proj_weight) return in_proj_weight->grad.data() + (which == 0 ? 0 : E_ + (which - 1) * Hkv_ * hd_) * E_;
  return (which == 0 ? q_proj_weight : which == 1 ? k_proj_weight : v_proj_weight)->grad.data();
}

// Rows (b, l) of a projection, in the input's order, seen as [B, L, H, hd].
TensorView MultiheadAttention::heads_view(const Tensor& rows, int64_t B, int64_t L, int64_t H) const {
  return heads_view(rows, B, L, H, cfg_.batch_first || shapes_.unbatched);
}

MultiheadAttention::Shapes MultiheadAttention::check_inputs(const TensorView& q, const TensorView& k,
                                                            const TensorView& v) const {
  expect_f32(q, -1, "MultiheadAttention: query");
  expect_f32(k, -1, "MultiheadAttention: key");
  expect_f32(v, -1, "MultiheadAttention: value");
  if ((q.rank() != 2 && q.rank() != 3) || k.rank() != q.rank() || v.rank() != q.rank())
    throw Error("MultiheadAttention: query, key and value must all be rank 3 (batched) or rank 2 (unbatched), got " +
                q.describe() + ", " + k.describe() + ", " + v.describe());
  Shapes s{};
  s.unbatched = q.rank() == 2;
  const bool bf = cfg_.batch_first || s.unbatched;
  auto batch = [&](const TensorView& t) { return s.unbatched ? 1 : t.size(bf ? 0 : 1); };
  auto len = [&](const TensorView& t) { return s.unbatched ? t.size(0) : t.size(bf ? 1 : 0); };
  s.B = batch(q);
  s.L = len(q);
  s.S = len(k);
  const int last = q.rank() - 1;
  if (q.size(last) != E_) throw Error("MultiheadAttention: query's last dimension must be embed_dim " + str(E_) + ", got " + q.describe());
  if (k.size(last) != kdim_) throw Error("MultiheadAttention: key's last dimension must be kdim " + str(kdim_) + ", got " + k.describe());
  if (v.size(last) != vdim_) throw Error("MultiheadAttention: value's last dimension must be vdim " + str(vdim_) + ", got " + v.describe());
  if (batch(k) != s.B || batch(v) != s.B)
    throw Error("MultiheadAttention: key and value must have query's batch size " + str(s.B) + ", got " +
                k.describe() + " and " + v.describe());
  if (len(v) != s.S)
    throw Error("MultiheadAttention: value must have key's sequence length " + str(s.S) + ", got " + v.describe());
  return s;
}

void MultiheadAttention::build_mask(const Shapes& s, const TensorView& kpm, const TensorView& am) {
  mask_ = Tensor();
  opt_.mask = TensorView();
  if (kpm.empty() && am.empty()) return;
  const int64_t H = cfg_.num_heads, B = s.B, L = s.L, S = s.S;
  auto expect_mask = [](const TensorView& m, const char* what) {
    if (m.dtype() != DType::boolean && m.dtype() != DType::f32)
      throw Error(std::string("MultiheadAttention: ") + what + " must be boolean or f32, got " + m.describe());
    if (!m.is_contiguous()) throw Error(std::string("MultiheadAttention: ") + what + " must be contiguous, got " + m.describe());
  };
  if (!kpm.empty()) {
    expect_mask(kpm, "key_padding_mask");
    const bool ok = s.unbatched ? (kpm.rank() == 1 && kpm.size(0) == S)
                                : (kpm.rank() == 2 && kpm.size(0) == B && kpm.size(1) == S);
    if (!ok)
      throw Error("MultiheadAttention: key_padding_mask must be " +
                  (s.unbatched ? "[" + str(S) + "]" : "[" + str(B) + ", " + str(S) + "]") + " ([batch, source length]), got " +
                  kpm.describe());
  }
  if (!am.empty()) {
    expect_mask(am, "attn_mask");
    const bool ok = (am.rank() == 2 && am.size(0) == L && am.size(1) == S) ||
                    (am.rank() == 3 && am.size(0) == B * H && am.size(1) == L && am.size(2) == S);
    if (!ok)
      throw Error("MultiheadAttention: attn_mask must be [" + str(L) + ", " + str(S) + "] or [" + str(B * H) + ", " +
                  str(L) + ", " + str(S) + "] ([batch·heads, target, source]), got " + am.describe());
  }
  mask_ = combine_masks(kpm, am, B, H, L, S);
  opt_.mask = mask_.view();
}

MultiheadAttentionOutput MultiheadAttention::forward(const TensorView& query, const TensorView& key,
                                                     const TensorView& value, const TensorView& key_padding_mask,
                                                     bool need_weights, const TensorView& attn_mask,
                                                     bool average_attn_weights, bool is_causal) {
  const Shapes s = check_inputs(query, key, value);
  opt_ = AttentionOptions();
  build_mask(s, key_padding_mask, attn_mask);
  shapes_ = s;
  const int64_t H = cfg_.num_heads, ekv = Hkv_ * hd_, nq = s.B * s.L, nk = s.B * s.S;
  query_ = clone(query);
  key_ = clone(key);
  value_ = clone(value);
  const float* bias = in_proj_bias ? in_proj_bias->value.data() : nullptr;
  q_ = Tensor(DType::f32, {nq, E_});
  k_ = Tensor(DType::f32, {nk, ekv});
  v_ = Tensor(DType::f32, {nk, ekv});
  ops::linear_forward(query_.data_as<float>(), nq, E_, w_q(), bias, E_, q_.data_as<float>());
  ops::linear_forward(key_.data_as<float>(), nk, kdim_, w_k(), bias ? bias + E_ : nullptr, ekv, k_.data_as<float>());
  ops::linear_forward(value_.data_as<float>(), nk, vdim_, w_v(), bias ? bias + E_ + ekv : nullptr, ekv,
                      v_.data_as<float>());
  const TensorView qv = heads_view(q_, s.B, s.L, H), kv = heads_view(k_, s.B, s.S, Hkv_),
                   vv = heads_view(v_, s.B, s.S, Hkv_);
  rope_.apply(qv, 0);
  rope_.apply(kv, 0);

  if (is_causal) opt_.causal = Causal::TopLeft;
  opt_.window = cfg_.window;
  if (training() && cfg_.dropout > 0.0f) {
    opt_.dropout_p = cfg_.dropout;
    opt_.seed = cfg_.seed;
    opt_.offset = calls_++;
  }
  attn_ = Tensor(DType::f32, {nq, E_});
  lse_ = Tensor(DType::f32, {s.B, H, s.L});
  Tensor probs;
  if (need_weights) probs = Tensor(DType::f32, {s.B, H, s.L, s.S});
  attention(qv, kv, vv, heads_view(attn_, s.B, s.L, H), opt_, lse_.view(), need_weights ? probs.view() : TensorView());
  have_forward_ = true;

  MultiheadAttentionOutput result;
  result.output = out_proj.forward(TensorView(attn_.data(), DType::f32, query.shape()));
  if (need_weights) {
    if (!average_attn_weights) {
      result.weights = std::move(probs);
      if (s.unbatched) result.weights = clone(TensorView(result.weights.data(), DType::f32, {H, s.L, s.S}));
    } else {
      result.weights = zeros(s.unbatched ? std::vector<int64_t>{s.L, s.S} : std::vector<int64_t>{s.B, s.L, s.S});
      float* w = result.weights.data_as<float>();
      const float* p = probs.data_as<float>();
      const int64_t plane = s.L * s.S;
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t e = 0; e < plane; ++e) w[b * plane + e] += p[(b * H + h) * plane + e] / float(H);
    }
  }
  return result;
}

MultiheadAttentionGrads MultiheadAttention::backward(const TensorView& doutput) {
  if (!have_forward_) throw Error("MultiheadAttention.backward: backward called before forward");
  const Shapes& s = shapes_;
  const int64_t H = cfg_.num_heads, ekv = Hkv_ * hd_, nq = s.B * s.L, nk = s.B * s.S;
  Tensor dattn = out_proj.backward(doutput);  // checks doutput's shape
  Tensor dq = zeros({nq, E_}), dk = zeros({nk, ekv}), dv = zeros({nk, ekv});
  const TensorView dqv = heads_view(dq, s.B, s.L, H), dkv = heads_view(dk, s.B, s.S, Hkv_);
  attention_backward(heads_view(q_, s.B, s.L, H), heads_view(k_, s.B, s.S, Hkv_), heads_view(v_, s.B, s.S, Hkv_),
                     heads_view(attn_, s.B, s.L, H), lse_.view(), heads_view(dattn, s.B, s.L, H), dqv, dkv,
                     heads_view(dv, s.B, s.S, Hkv_), opt_);
  rope_.apply_backward(dqv, 0);  // forward: q ← R·q, so dq ← Rᵀ·dq
  rope_.apply_backward(dkv, 0);

  MultiheadAttentionGrads g;
  g.dquery = zeros(query_.shape());
  g.dkey = zeros(key_.shape());
  g.dvalue = zeros(value_.shape());
  float* db = in_proj_bias ? in_proj_bias->grad.data() : nullptr;
  ops::linear_backward(query_.data_as<float>(), dq.data_as<float>(), nq, E_, w_q(), E_, g.dquery.data_as<float>(),
                       grad_w(0), db);
  ops::linear_backward(key_.data_as<float>(), dk.data_as<float>(), nk, kdim_, w_k(), ekv, g.dkey.data_as<float>(),
                       grad_w(1), db ? db + E_ : nullptr);
  ops::linear_backward(value_.data_as<float>(), dv.data_as<float>(), nk, vdim_, w_v(), ekv,
                       g.dvalue.data_as<float>(), grad_w(2), db ? db + E_ + ekv : nullptr);
  return g;
}

attn::KVCache KVCache::view() const {
  attn::KVCache c;
  c.k = k.view();
  c.v = v.view();
  if (!k_scale.shape().empty()) c.k_scale = k_scale.view(), c.v_scale = v_scale.view();
  if (!block_table.shape().empty()) c.block_table = block_table.view();
  return c;
}

void KVCache::set_length(int64_t n) {
  length = n;
  int32_t* lens = seqlens.data_as<int32_t>();
  for (int64_t b = 0; b < batch; ++b) lens[b] = static_cast<int32_t>(n);
}

KVCache allocate_kv_cache(int64_t batch, int64_t capacity, int64_t Hkv, int64_t hd, const KVCacheConfig& config) {
  if (batch < 1 || capacity < 1)
    throw Error("make_cache: batch and capacity must be ≥ 1, got " + str(batch) + " and " + str(capacity));
  if (capacity > INT32_MAX) throw Error("make_cache: capacity must fit in int32, got " + str(capacity));
  const DType dt = config.dtype;
  if (dt != DType::f32 && dt != DType::bf16 && dt != DType::f16 && dt != DType::i8 && dt != DType::f8e4m3)
    throw Error(std::string("make_cache: storage dtype must be f32, bf16, f16, i8 or f8e4m3, got ") + dtype_name(dt));
  if (config.page_size < 0) throw Error("make_cache: page_size must be 0 (contiguous) or ≥ 1, got " + str(config.page_size));
  KVCache c;
  c.batch = batch;
  c.capacity_ = capacity;
  std::vector<int64_t> rows{batch, capacity};  // the leading two dimensions of k, v and the scales
  if (config.page_size > 0) {
    const int64_t pages = (capacity + config.page_size - 1) / config.page_size;
    rows = {batch * pages, config.page_size};
    c.block_table = Tensor(DType::i32, {batch, pages});
    // Sequence b owns pages b, b + batch, b + 2·batch, …: interleaved rather than
    // adjacent, so the kernel's page-table walk is what the tests exercise.
    int32_t* table = c.block_table.data_as<int32_t>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < pages; ++i) table[b * pages + i] = static_cast<int32_t>(i * batch + b);
  }
  c.k = Tensor(dt, {rows[0], rows[1], Hkv, hd});
  c.v = Tensor(dt, {rows[0], rows[1], Hkv, hd});
  if (dt == DType::i8 || dt == DType::f8e4m3) {
    c.k_scale = Tensor(DType::f32, {rows[0], rows[1], Hkv});
    c.v_scale = Tensor(DType::f32, {rows[0], rows[1], Hkv});
  }
  c.seqlens = Tensor(DType::i32, {batch});
  c.set_length(0);
  return c;
}

KVCache MultiheadAttention::make_cache(int64_t batch, int64_t capacity, const KVCacheConfig& storage) const {
  return allocate_kv_cache(batch, capacity, Hkv_, hd_, storage);
}

TensorView MultiheadAttention::heads_view(const Tensor& rows, int64_t B, int64_t L, int64_t H, bool batch_major) const {
  const int64_t w = H * hd_;
  return TensorView(rows.data(), DType::f32, {B, L, H, hd_}, {batch_major ? L * w : w, batch_major ? w : B * w, hd_, 1});
}

MultiheadAttention::Shapes MultiheadAttention::cached_shapes(const TensorView& x, const char* what) const {
  const std::string name = std::string("MultiheadAttention.") + what + ": x";
  expect_f32(x, 3, name.c_str());
  if (x.size(2) != E_) throw Error(name + "'s last dimension must be " + str(E_) + ", got " + x.describe());
  Shapes s{};
  s.B = cfg_.batch_first ? x.size(0) : x.size(1);
  s.L = cfg_.batch_first ? x.size(1) : x.size(0);
  return s;
}

Tensor MultiheadAttention::attend_cached(const TensorView& x, const Shapes& s, const attn::KVCache& cache,
                                         const Tensor& seqlens, int64_t position, bool append,
                                         const AttentionOptions& opt) {
  const int64_t H = cfg_.num_heads, ekv = Hkv_ * hd_, n = s.B * s.L;
  const bool bm = cfg_.batch_first;
  const float* bias = in_proj_bias ? in_proj_bias->value.data() : nullptr;
  Tensor q(DType::f32, {n, E_}), out(DType::f32, {n, E_}), k, v;
  ops::linear_forward(x.data_as<float>(), n, E_, w_q(), bias, E_, q.data_as<float>());
  const TensorView qv = heads_view(q, s.B, s.L, H, bm);
  rope_.apply(qv, position);
  KVCacheOptions kv;
  if (append) {
    k = Tensor(DType::f32, {n, ekv});
    v = Tensor(DType::f32, {n, ekv});
    ops::linear_forward(x.data_as<float>(), n, E_, w_k(), bias ? bias + E_ : nullptr, ekv, k.data_as<float>());
    ops::linear_forward(x.data_as<float>(), n, E_, w_v(), bias ? bias + E_ + ekv : nullptr, ekv, v.data_as<float>());
    kv.k_new = heads_view(k, s.B, s.L, Hkv_, bm);
    kv.v_new = heads_view(v, s.B, s.L, Hkv_, bm);
    rope_.apply(kv.k_new, position);
  }
  attention_with_kvcache(qv, cache, seqlens.view(), heads_view(out, s.B, s.L, H, bm), opt, kv);
  Tensor y(DType::f32, x.shape());
  ops::linear_forward(out.data_as<float>(), n, E_, out_proj.weight.value.data(),
                      out_proj.bias ? out_proj.bias->value.data() : nullptr, E_, y.data_as<float>());
  return y;
}

namespace {

void check_cache_heads(const KVCache& cache, int64_t B, int64_t Hkv, int64_t hd, const char* what) {
  const std::string name = std::string("MultiheadAttention.") + what + ": cache";
  if (cache.capacity() == 0 || cache.k.shape().size() != 4 || cache.seqlens.shape().empty())
    throw Error(name + " must come from make_cache or make_memory_cache");
  if (cache.batch != B)
    throw Error(name + " holds " + str(cache.batch) + " sequences, x has " + str(B));
  if (cache.k.shape()[2] != Hkv || cache.k.shape()[3] != hd)
    throw Error(name + " has " + str(cache.k.shape()[2]) + " heads of " + str(cache.k.shape()[3]) +
                " features, this module " + str(Hkv) + " of " + str(hd));
}

}  // namespace

TensorView cached_padding_mask(const TensorView& kpm, int64_t batch, int64_t positions, const std::string& name,
                               Tensor& storage) {
  if (kpm.empty()) return {};
  if (kpm.dtype() != DType::boolean && kpm.dtype() != DType::f32)
    throw Error(name + " must be boolean or f32, got " + kpm.describe());
  if (kpm.rank() != 2 || kpm.size(0) != batch || kpm.size(1) < positions)
    throw Error(name + " must be [" + str(batch) + ", K] with K ≥ " + str(positions) +
                " ([batch, positions], every position this call attends to), got " + kpm.describe());
  if (!kpm.is_contiguous()) throw Error(name + " must be contiguous, got " + kpm.describe());
  const int64_t K = kpm.size(1);
  if (kpm.dtype() == DType::f32) return TensorView(kpm.data(), DType::f32, {batch, 1, 1, K});
  storage = Tensor(DType::boolean, {batch, 1, 1, K});
  const uint8_t* from = kpm.data_as<uint8_t>();
  uint8_t* to = storage.data_as<uint8_t>();
  for (int64_t n = 0; n < batch * K; ++n) to[n] = from[n] == 0;  // attn: true = may attend
  return storage.view();
}

TensorView cached_attention_mask(const TensorView& kpm, const std::string& kpm_name, const TensorView& am,
                                 const std::string& am_name, int64_t batch, int64_t heads, int64_t rows,
                                 int64_t positions, Tensor& storage) {
  Tensor padding;
  const TensorView kpm_view = cached_padding_mask(kpm, batch, positions, kpm_name, padding);
  if (am.empty()) {
    storage = std::move(padding);
    return kpm_view;
  }
  if (am.dtype() != DType::boolean && am.dtype() != DType::f32)
    throw Error(am_name + " must be boolean or f32, got " + am.describe());
  const bool ok = (am.rank() == 2 && am.size(0) == rows) || (am.rank() == 3 && am.size(0) == batch * heads && am.size(1) == rows);
  const int64_t K = am.rank() >= 2 ? am.size(am.rank() - 1) : 0;
  if (!ok || K < positions)
    throw Error(am_name + " must be [" + str(rows) + ", K] or [" + str(batch * heads) + ", " + str(rows) +
                ", K] with K ≥ " + str(positions) + " ([batch·heads, this call's positions, every position it attends to]), got " +
                am.describe());
  if (!am.is_contiguous()) throw Error(am_name + " must be contiguous, got " + am.describe());
  if (!kpm.empty() && kpm.size(1) != K)
    throw Error(am_name + " and " + kpm_name + " must have as many columns (positions), got " + am.describe() +
                " and " + kpm.describe());
  storage = combine_masks(kpm, am, batch, heads, rows, K);
  return storage.view();
}

Tensor MultiheadAttention::forward_cached(const TensorView& x, KVCache& cache, const TensorView& key_padding_mask,
                                          const TensorView& attn_mask) {
  if (kdim_ != E_ || vdim_ != E_)
    throw Error("MultiheadAttention.forward_cached: self-attention only (kdim and vdim must equal embed_dim)");
  const Shapes s = cached_shapes(x, "forward_cached");
  check_cache_heads(cache, s.B, Hkv_, hd_, "forward_cached");
  if (cache.length + s.L > cache.capacity())
    throw Error("MultiheadAttention.forward_cached: cache holds " + str(cache.length) + " of " +
                str(cache.capacity()) + " positions, no room for " + str(s.L) + " more");
  AttentionOptions opt;
  opt.causal = Causal::BottomRight;
  opt.window = cfg_.window;
  Tensor mask;
  opt.mask = cached_attention_mask(key_padding_mask, "MultiheadAttention.forward_cached: key_padding_mask", attn_mask,
                                   "MultiheadAttention.forward_cached: attn_mask", s.B, cfg_.num_heads, s.L,
                                   cache.length + s.L, mask);
  Tensor y = attend_cached(x, s, cache.view(), cache.seqlens, cache.length, /*append=*/true, opt);
  cache.set_length(cache.length + s.L);
  return y;
}

KVCache MultiheadAttention::make_memory_cache(const TensorView& key, const TensorView& value,
                                              const KVCacheConfig& storage) const {
  expect_f32(key, 3, "MultiheadAttention.make_memory_cache: key");
  expect_f32(value, 3, "MultiheadAttention.make_memory_cache: value");
  const bool bm = cfg_.batch_first;
  const int64_t B = bm ? key.size(0) : key.size(1), S = bm ? key.size(1) : key.size(0);
  if (key.size(2) != kdim_) throw Error("MultiheadAttention.make_memory_cache: key's last dimension must be " + str(kdim_) + ", got " + key.describe());
  if (value.size(2) != vdim_ || value.size(0) != key.size(0) || value.size(1) != key.size(1))
    throw Error("MultiheadAttention.make_memory_cache: value must be " + std::string(bm ? "[B, S, " : "[S, B, ") +
                str(vdim_) + "] with key's B and S, got " + value.describe());
  const int64_t ekv = Hkv_ * hd_, n = B * S;
  const float* bias = in_proj_bias ? in_proj_bias->value.data() : nullptr;
  Tensor k(DType::f32, {n, ekv}), v(DType::f32, {n, ekv});
  ops::linear_forward(key.data_as<float>(), n, kdim_, w_k(), bias ? bias + E_ : nullptr, ekv, k.data_as<float>());
  ops::linear_forward(value.data_as<float>(), n, vdim_, w_v(), bias ? bias + E_ + ekv : nullptr, ekv, v.data_as<float>());
  KVCacheOptions kv;
  kv.k_new = heads_view(k, B, S, Hkv_, bm);
  kv.v_new = heads_view(v, B, S, Hkv_, bm);
  rope_.apply(kv.k_new, 0);
  KVCache cache = allocate_kv_cache(B, S, Hkv_, hd_, storage);
  kvcache_append(cache.view(), cache.seqlens.view(), kv);
  cache.set_length(S);
  return cache;
}

Tensor MultiheadAttention::forward_memory_cached(const TensorView& x, const KVCache& memory, int64_t position,
                                                 const TensorView& key_padding_mask, const TensorView& attn_mask) {
  const Shapes s = cached_shapes(x, "forward_memory_cached");
  check_cache_heads(memory, s.B, Hkv_, hd_, "forward_memory_cached");
  if (position < 0) throw Error("MultiheadAttention.forward_memory_cached: position must be ≥ 0, got " + str(position));
  AttentionOptions opt;
  opt.causal = Causal::None;
  Tensor mask;
  opt.mask = cached_attention_mask(key_padding_mask, "MultiheadAttention.forward_memory_cached: key_padding_mask",
                                   attn_mask, "MultiheadAttention.forward_memory_cached: attn_mask", s.B,
                                   cfg_.num_heads, s.L, memory.length, mask);
  return attend_cached(x, s, memory.view(), memory.seqlens, position, /*append=*/false, opt);
}

}  // namespace attn::nn
