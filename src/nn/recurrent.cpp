// GRU and LSTM cells and layers. The input projections of a whole sequence are one
// matrix product; each time step adds h·W_hhᵀ and applies the gates pointwise.
// The backward collects every step's gate gradients and turns them into weight
// gradients with one product per weight at the end (llm.c style: no per-step
// outer products).
#include "attn/nn/recurrent.hpp"

#include <cmath>
#include <cstring>

#include "attn/error.hpp"
#include "nn/ops.hpp"

namespace attn::nn {

namespace {

using ops::sigmoid;

// ---- pointwise gate math, shared by the cells and the layers ------------------------

// GRU. gi = W_ih x + b_ih, gh = W_hh h + b_hh, both [B, 3H] in the order r, z, n.
void gru_pointwise(const float* gi, const float* gh, const float* h, int64_t B, int64_t H, float* r, float* z,
                   float* n, float* hn, float* h_out) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < H; ++k) {
      const int64_t g = b * 3 * H, e = b * H + k;
      r[e] = sigmoid(gi[g + k] + gh[g + k]);
      z[e] = sigmoid(gi[g + H + k] + gh[g + H + k]);
      hn[e] = gh[g + 2 * H + k];
      n[e] = std::tanh(gi[g + 2 * H + k] + r[e] * hn[e]);
      h_out[e] = (1.0f - z[e]) * n[e] + z[e] * h[e];
    }
}

// Given dh' (d loss / d h'): writes dgi, dgh [B, 3H] and adds the direct path z ⊙ dh' into dh.
void gru_pointwise_backward(const float* h, const float* r, const float* z, const float* n, const float* hn,
                            const float* dh_out, int64_t B, int64_t H, float* dgi, float* dgh, float* dh) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < H; ++k) {
      const int64_t g = b * 3 * H, e = b * H + k;
      // h' = (1 − z)·n + z·h
      const float dn = dh_out[e] * (1.0f - z[e]);
      const float dz = dh_out[e] * (h[e] - n[e]);
      dh[e] += dh_out[e] * z[e];
      // n = tanh(gi_n + r·hn)
      const float dn_pre = dn * (1.0f - n[e] * n[e]);
      const float dr = dn_pre * hn[e];
      // r = σ(gi_r + gh_r), z = σ(gi_z + gh_z)
      const float dr_pre = dr * r[e] * (1.0f - r[e]);
      const float dz_pre = dz * z[e] * (1.0f - z[e]);
      dgi[g + k] = dgh[g + k] = dr_pre;
      dgi[g + H + k] = dgh[g + H + k] = dz_pre;
      dgi[g + 2 * H + k] = dn_pre;
      dgh[g + 2 * H + k] = dn_pre * r[e];
    }
}

// LSTM. pre = W_ih x + b_ih + W_hh h + b_hh [B, 4H] in the order i, f, g, o.
void lstm_pointwise(const float* pre, const float* c, int64_t B, int64_t H, float* i, float* f, float* g, float* o,
                    float* c_out, float* h_out) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < H; ++k) {
      const int64_t p = b * 4 * H, e = b * H + k;
      i[e] = sigmoid(pre[p + k]);
      f[e] = sigmoid(pre[p + H + k]);
      g[e] = std::tanh(pre[p + 2 * H + k]);
      o[e] = sigmoid(pre[p + 3 * H + k]);
      c_out[e] = f[e] * c[e] + i[e] * g[e];
      h_out[e] = o[e] * std::tanh(c_out[e]);
    }
}

// Given dh', dc': writes dpre [B, 4H] and adds f ⊙ dc_total into dc.
void lstm_pointwise_backward(const float* c, const float* i, const float* f, const float* g, const float* o,
                             const float* c_out, const float* dh_out, const float* dc_out, int64_t B, int64_t H,
                             float* dpre, float* dc) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < H; ++k) {
      const int64_t p = b * 4 * H, e = b * H + k;
      // h' = o·tanh(c'), c' = f·c + i·g
      const float tc = std::tanh(c_out[e]);
      const float d_o = dh_out[e] * tc;
      const float dct = dc_out[e] + dh_out[e] * o[e] * (1.0f - tc * tc);
      dc[e] += dct * f[e];
      dpre[p + k] = dct * g[e] * i[e] * (1.0f - i[e]);
      dpre[p + H + k] = dct * c[e] * f[e] * (1.0f - f[e]);
      dpre[p + 2 * H + k] = dct * i[e] * (1.0f - g[e] * g[e]);
      dpre[p + 3 * H + k] = d_o * o[e] * (1.0f - o[e]);
    }
}

void expect_matrix(const TensorView& t, int64_t rows, int64_t cols, const char* what) {
  expect_f32(t, 2, what);
  if (t.size(0) != rows || t.size(1) != cols)
    throw Error(std::string(what) + ": expected [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " +
                t.describe());
}

void init_recurrent(Parameter& p, int64_t hidden, Rng& rng) {
  init_uniform(p, 1.0f / std::sqrt(static_cast<float>(hidden)), rng);
}

float* data(Tensor& t) { return t.data_as<float>(); }
const float* data(const Tensor& t) { return t.data_as<float>(); }

}  // namespace

// ---- GRUCell ---------------------------------------------------------------------

GRUCell::GRUCell(int64_t input_size, int64_t hidden_size, bool bias, Rng& rng)
    : weight_ih(register_parameter("weight_ih", {3 * hidden_size, input_size})),
      weight_hh(register_parameter("weight_hh", {3 * hidden_size, hidden_size})),
      bias_ih(bias ? &register_parameter("bias_ih", {3 * hidden_size}) : nullptr),
      bias_hh(bias ? &register_parameter("bias_hh", {3 * hidden_size}) : nullptr),
      in_(input_size),
      hid_(hidden_size) {
  if (input_size < 1 || hidden_size < 1) throw Error("GRUCell: input_size and hidden_size must be ≥ 1");
  for (auto& [name, p] : named_parameters()) init_recurrent(*p, hidden_size, rng);
}

Tensor GRUCell::step(const TensorView& x, const TensorView& h, Cache& cache) {
  const int64_t B = x.rank() == 2 ? x.size(0) : 0;
  expect_matrix(x, B, in_, "GRUCell: x");
  expect_matrix(h, B, hid_, "GRUCell: h");
  const int64_t H = hid_;
  Tensor gi(DType::f32, {B, 3 * H}), gh(DType::f32, {B, 3 * H});
  ops::linear_forward(x.data_as<float>(), B, in_, weight_ih.value.data(), bias_ih ? bias_ih->value.data() : nullptr,
                      3 * H, data(gi));
  ops::linear_forward(h.data_as<float>(), B, H, weight_hh.value.data(), bias_hh ? bias_hh->value.data() : nullptr,
                      3 * H, data(gh));
  cache.x = clone(x);
  cache.h = clone(h);
  for (Tensor* t : {&cache.r, &cache.z, &cache.n, &cache.hn}) *t = Tensor(DType::f32, {B, H});
  Tensor out(DType::f32, {B, H});
  gru_pointwise(data(gi), data(gh), h.data_as<float>(), B, H, data(cache.r), data(cache.z), data(cache.n),
                data(cache.hn), data(out));
  return out;
}

void GRUCell::step_backward(const Cache& cache, const TensorView& dh_next, Tensor& dx, Tensor& dh) {
  const int64_t B = cache.h.shape()[0], H = hid_;
  expect_matrix(dh_next, B, H, "GRUCell.step_backward: dh_next");
  Tensor dgi(DType::f32, {B, 3 * H}), dgh(DType::f32, {B, 3 * H});
  gru_pointwise_backward(data(cache.h), data(cache.r), data(cache.z), data(cache.n), data(cache.hn),
                         dh_next.data_as<float>(), B, H, data(dgi), data(dgh), data(dh));
  ops::linear_backward(data(cache.x), data(dgi), B, in_, weight_ih.value.data(), 3 * H, data(dx),
                       weight_ih.grad.data(), bias_ih ? bias_ih->grad.data() : nullptr);
  ops::linear_backward(data(cache.h), data(dgh), B, H, weight_hh.value.data(), 3 * H, data(dh),
                       weight_hh.grad.data(), bias_hh ? bias_hh->grad.data() : nullptr);
}

std::pair<Tensor, Tensor> GRUCell::backward(const TensorView& dh_next) {
  if (last_.h.shape().empty()) throw Error("GRUCell.backward: backward called before forward");
  Tensor dx = zeros(last_.x.shape()), dh = zeros(last_.h.shape());
  step_backward(last_, dh_next, dx, dh);
  return {std::move(dx), std::move(dh)};
}

// ---- LSTMCell --------------------------------------------------------------------

LSTMCell::LSTMCell(int64_t input_size, int64_t hidden_size, bool bias, Rng& rng)
    : weight_ih(register_parameter("weight_ih", {4 * hidden_size, input_size})),
      weight_hh(register_parameter("weight_hh", {4 * hidden_size, hidden_size})),
      bias_ih(bias ? &register_parameter("bias_ih", {4 * hidden_size}) : nullptr),
      bias_hh(bias ? &register_parameter("bias_hh", {4 * hidden_size}) : nullptr),
      in_(input_size),
      hid_(hidden_size) {
  if (input_size < 1 || hidden_size < 1) throw Error("LSTMCell: input_size and hidden_size must be ≥ 1");
  for (auto& [name, p] : named_parameters()) init_recurrent(*p, hidden_size, rng);
}

std::pair<Tensor, Tensor> LSTMCell::step(const TensorView& x, const TensorView& h, const TensorView& c,
                                         Cache& cache) {
  const int64_t B = x.rank() == 2 ? x.size(0) : 0, H = hid_;
  expect_matrix(x, B, in_, "LSTMCell: x");
  expect_matrix(h, B, H, "LSTMCell: h");
  expect_matrix(c, B, H, "LSTMCell: c");
  Tensor pre(DType::f32, {B, 4 * H});
  ops::linear_forward(x.data_as<float>(), B, in_, weight_ih.value.data(), bias_ih ? bias_ih->value.data() : nullptr,
                      4 * H, data(pre));
  if (bias_hh)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k < 4 * H; ++k) data(pre)[b * 4 * H + k] += bias_hh->value[k];
  ops::gemm(false, true, B, 4 * H, H, 1.0f, h.data_as<float>(), H, weight_hh.value.data(), H, 1.0f, data(pre), 4 * H);
  cache.x = clone(x);
  cache.h = clone(h);
  cache.c = clone(c);
  for (Tensor* t : {&cache.i, &cache.f, &cache.g, &cache.o, &cache.c_next}) *t = Tensor(DType::f32, {B, H});
  Tensor h_out(DType::f32, {B, H});
  lstm_pointwise(data(pre), c.data_as<float>(), B, H, data(cache.i), data(cache.f), data(cache.g), data(cache.o),
                 data(cache.c_next), data(h_out));
  return {std::move(h_out), clone(cache.c_next)};
}

void LSTMCell::step_backward(const Cache& cache, const TensorView& dh_next, const TensorView& dc_next, Tensor& dx,
                             Tensor& dh, Tensor& dc) {
  const int64_t B = cache.h.shape()[0], H = hid_;
  expect_matrix(dh_next, B, H, "LSTMCell.step_backward: dh_next");
  expect_matrix(dc_next, B, H, "LSTMCell.step_backward: dc_next");
  Tensor dpre(DType::f32, {B, 4 * H});
  lstm_pointwise_backward(data(cache.c), data(cache.i), data(cache.f), data(cache.g), data(cache.o),
                          data(cache.c_next), dh_next.data_as<float>(), dc_next.data_as<float>(), B, H, data(dpre),
                          data(dc));
  ops::linear_backward(data(cache.x), data(dpre), B, in_, weight_ih.value.data(), 4 * H, data(dx),
                       weight_ih.grad.data(), bias_ih ? bias_ih->grad.data() : nullptr);
  ops::linear_backward(data(cache.h), data(dpre), B, H, weight_hh.value.data(), 4 * H, data(dh),
                       weight_hh.grad.data(), bias_hh ? bias_hh->grad.data() : nullptr);
}

// ---- layers ----------------------------------------------------------------------

struct RecurrentLayers::Direction {
  Parameter *w_ih = nullptr, *w_hh = nullptr, *b_ih = nullptr, *b_hh = nullptr;
  int64_t in = 0;
  bool reverse = false;
  // Caches of the last forward, time-major rows t·B + b.
  Tensor hprev, cprev;          // state before step t
  Tensor a, b, c, d;            // GRU: r, z, n, hn; LSTM: i, f, g, o
  Tensor cnext;                 // LSTM: cell state after step t
};

RecurrentLayers::RecurrentLayers(Kind kind, const RecurrentConfig& config, Rng& rng)
    : kind_(kind), cfg_(config), gates_(kind == Kind::gru ? 3 : 4), dirs_(config.bidirectional ? 2 : 1) {
  const char* name = kind == Kind::gru ? "GRU" : "LSTM";
  if (cfg_.input_size < 1 || cfg_.hidden_size < 1 || cfg_.num_layers < 1)
    throw Error(std::string(name) + ": input_size, hidden_size and num_layers must be ≥ 1");
  if (!(cfg_.dropout >= 0.0f && cfg_.dropout < 1.0f))
    throw Error(std::string(name) + ": dropout must be in [0, 1), got " + std::to_string(cfg_.dropout));
  const int64_t H = cfg_.hidden_size, G = gates_;
  for (int64_t l = 0; l < cfg_.num_layers; ++l)
    for (int64_t d = 0; d < dirs_; ++d) {
      auto dir = std::make_unique<Direction>();
      dir->in = l == 0 ? cfg_.input_size : dirs_ * H;
      dir->reverse = d == 1;
      const std::string suffix = "_l" + std::to_string(l) + (d == 1 ? "_reverse" : "");
      dir->w_ih = &register_parameter("weight_ih" + suffix, {G * H, dir->in});
      dir->w_hh = &register_parameter("weight_hh" + suffix, {G * H, H});
      if (cfg_.bias) {
        dir->b_ih = &register_parameter("bias_ih" + suffix, {G * H});
        dir->b_hh = &register_parameter("bias_hh" + suffix, {G * H});
      }
      dirs_by_layer_.push_back(std::move(dir));
    }
  for (auto& [n, p] : named_parameters()) init_recurrent(*p, H, rng);
  for (int64_t l = 0; l + 1 < cfg_.num_layers; ++l) {
    dropouts_.push_back(std::make_unique<Dropout>(cfg_.dropout, cfg_.seed * 0x9E3779B97F4A7C15ull + l + 1));
    register_module("", *dropouts_.back());
  }
}

RecurrentLayers::~RecurrentLayers() = default;

namespace {
// [B, L, F] ↔ [L, B, F] (the same function both ways with the first two sizes swapped).
Tensor swap01(const float* x, int64_t n0, int64_t n1, int64_t f) {
  Tensor out(DType::f32, {n1, n0, f});
  for (int64_t a = 0; a < n0; ++a)
    for (int64_t b = 0; b < n1; ++b) std::memcpy(data(out) + (b * n0 + a) * f, x + (a * n1 + b) * f, sizeof(float) * f);
  return out;
}
}  // namespace

void RecurrentLayers::run_direction(Direction& d, const float* x, int64_t in, const float* h0, const float* c0,
                                    float* out, int64_t out_stride, float* hn, float* cn) {
  const int64_t L = L_, B = B_, H = cfg_.hidden_size, GH = gates_ * H;
  const bool lstm = kind_ == Kind::lstm;
  Tensor gi(DType::f32, {L * B, GH}), gh(DType::f32, {B, GH});
  ops::linear_forward(x, L * B, in, d.w_ih->value.data(), d.b_ih ? d.b_ih->value.data() : nullptr, GH, data(gi));
  for (Tensor* t : {&d.hprev, &d.a, &d.b, &d.c, &d.d}) *t = Tensor(DType::f32, {L * B, H});
  if (lstm) {
    d.cprev = Tensor(DType::f32, {L * B, H});
    d.cnext = Tensor(DType::f32, {L * B, H});
  }
  std::vector<float> h(h0, h0 + B * H), c(lstm ? c0 : h0, (lstm ? c0 : h0) + B * H), h_new(B * H), c_new(B * H);
  for (int64_t s = 0; s < L; ++s) {
    const int64_t t = d.reverse ? L - 1 - s : s;
    const int64_t row = t * B * H;
    std::memcpy(data(d.hprev) + row, h.data(), sizeof(float) * B * H);
    ops::linear_forward(h.data(), B, H, d.w_hh->value.data(), d.b_hh ? d.b_hh->value.data() : nullptr, GH, data(gh));
    if (lstm) {
      std::memcpy(data(d.cprev) + row, c.data(), sizeof(float) * B * H);
      float* pre = data(gh);
      const float* gin = data(gi) + t * B * GH;
      for (int64_t e = 0; e < B * GH; ++e) pre[e] += gin[e];
      lstm_pointwise(pre, c.data(), B, H, data(d.a) + row, data(d.b) + row, data(d.c) + row, data(d.d) + row,
                     c_new.data(), h_new.data());
    } else {
      gru_pointwise(data(gi) + t * B * GH, data(gh), h.data(), B, H, data(d.a) + row, data(d.b) + row,
                    data(d.c) + row, data(d.d) + row, h_new.data());
    }
    for (int64_t b = 0; b < B; ++b) {
      float* o = out + (t * B + b) * out_stride;
      if (t >= lengths_[b]) {  // past this sequence's end: the state stays, the output is 0
        std::memcpy(h_new.data() + b * H, h.data() + b * H, sizeof(float) * H);
        if (lstm) std::memcpy(c_new.data() + b * H, c.data() + b * H, sizeof(float) * H);
        std::fill_n(o, H, 0.0f);
      } else {
        std::memcpy(o, h_new.data() + b * H, sizeof(float) * H);
      }
    }
    if (lstm) std::memcpy(data(d.cnext) + row, c_new.data(), sizeof(float) * B * H);
    h.swap(h_new);
    c.swap(c_new);
  }
  std::memcpy(hn, h.data(), sizeof(float) * B * H);
  if (lstm) std::memcpy(cn, c.data(), sizeof(float) * B * H);
}

RecurrentOutput RecurrentLayers::forward(const TensorView& input, const TensorView& h0, const TensorView& c0,
                                         const TensorView& lengths) {
  const char* name = kind_ == Kind::gru ? "GRU" : "LSTM";
  const std::string what = std::string(name) + ".forward: ";
  expect_f32(input, 3, (what + "input").c_str());
  const int64_t I = cfg_.input_size, H = cfg_.hidden_size, D = dirs_, NL = cfg_.num_layers;
  L_ = cfg_.batch_first ? input.size(1) : input.size(0);
  B_ = cfg_.batch_first ? input.size(0) : input.size(1);
  if (input.size(2) != I) throw Error(what + "input's last dimension must be input_size " + std::to_string(I) + ", got " + input.describe());
  if (L_ < 1 || B_ < 1) throw Error(what + "input must have at least one step and one sequence, got " + input.describe());
  const bool lstm = kind_ == Kind::lstm;
  auto check_state = [&](const TensorView& s, const char* n) {
    if (s.empty()) return;
    expect_f32(s, 3, (what + n).c_str());
    if (s.size(0) != NL * D || s.size(1) != B_ || s.size(2) != H)
      throw Error(what + n + " must be [" + std::to_string(NL * D) + ", " + std::to_string(B_) + ", " +
                  std::to_string(H) + "] (num_layers·directions, batch, hidden), got " + s.describe());
  };
  check_state(h0, "h0");
  if (!lstm && !c0.empty()) throw Error(what + "c0 is for LSTM only");
  check_state(c0, "c0");
  lengths_.assign(static_cast<size_t>(B_), static_cast<int32_t>(L_));
  if (!lengths.empty()) {
    if (lengths.dtype() != DType::i32 || lengths.rank() != 1 || lengths.size(0) != B_ || !lengths.is_contiguous())
      throw Error(what + "lengths must be int32 [" + std::to_string(B_) + "], got " + lengths.describe());
    for (int64_t b = 0; b < B_; ++b) {
      const int32_t n = lengths.data_as<int32_t>()[b];
      if (n < 1 || n > L_)
        throw Error(what + "lengths[" + std::to_string(b) + "] must be in [1, " + std::to_string(L_) + "], got " +
                    std::to_string(n));
      lengths_[b] = n;
    }
  }
  Tensor zero_state = zeros({NL * D, B_, H});
  const float* h0p = h0.empty() ? data(zero_state) : h0.data_as<float>();
  const float* c0p = c0.empty() ? data(zero_state) : c0.data_as<float>();

  RecurrentOutput r;
  r.h_n = Tensor(DType::f32, {NL * D, B_, H});
  if (lstm) r.c_n = Tensor(DType::f32, {NL * D, B_, H});
  layer_inputs_.clear();
  layer_inputs_.push_back(cfg_.batch_first ? swap01(input.data_as<float>(), B_, L_, I) : clone(input));
  Tensor y;
  for (int64_t l = 0; l < NL; ++l) {
    if (l > 0) layer_inputs_.push_back(dropouts_[l - 1]->forward(y));
    y = Tensor(DType::f32, {L_, B_, D * H});
    for (int64_t d = 0; d < D; ++d) {
      const int64_t k = l * D + d;
      Direction& dir = *dirs_by_layer_[k];
      run_direction(dir, data(layer_inputs_[l]), dir.in, h0p + k * B_ * H, c0p + k * B_ * H, data(y) + d * H, D * H,
                    data(r.h_n) + k * B_ * H, lstm ? data(r.c_n) + k * B_ * H : nullptr);
    }
  }
  r.output = cfg_.batch_first ? swap01(data(y), L_, B_, D * H) : std::move(y);
  have_forward_ = true;
  return r;
}

void RecurrentLayers::backprop_direction(Direction& d, const float* dout, int64_t out_stride, float* dx, float* dh,
                                         float* dc) {
  const int64_t L = L_, B = B_, H = cfg_.hidden_size, GH = gates_ * H;
  const bool lstm = kind_ == Kind::lstm;
  Tensor dgi = zeros({L * B, GH}), dgh = zeros({L * B, GH});
  std::vector<float> dh_total(B * H), dh_prev(B * H), dc_prev(B * H), dc_total(B * H);
  // Walk the steps in the opposite order to the forward's processing order.
  for (int64_t s = L; s-- > 0;) {
    const int64_t t = d.reverse ? L - 1 - s : s;
    const int64_t row = t * B * H;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k < H; ++k)
        dh_total[b * H + k] = dh[b * H + k] + (t < lengths_[b] ? dout[(t * B + b) * out_stride + k] : 0.0f);
    std::fill(dh_prev.begin(), dh_prev.end(), 0.0f);
    float* gi_t = data(dgi) + t * B * GH;
    float* gh_t = data(dgh) + t * B * GH;
    if (lstm) {
      std::fill(dc_prev.begin(), dc_prev.end(), 0.0f);
      lstm_pointwise_backward(data(d.cprev) + row, data(d.a) + row, data(d.b) + row, data(d.c) + row,
                              data(d.d) + row, data(d.cnext) + row, dh_total.data(), dc, B, H, gi_t, dc_prev.data());
    } else {
      gru_pointwise_backward(data(d.hprev) + row, data(d.a) + row, data(d.b) + row, data(d.c) + row,
                             data(d.d) + row, dh_total.data(), B, H, gi_t, gh_t, dh_prev.data());
    }
    for (int64_t b = 0; b < B; ++b)
      if (t >= lengths_[b]) {  // the step did nothing for this sequence: gradients pass straight through
        std::fill_n(gi_t + b * GH, GH, 0.0f);
        std::fill_n(gh_t + b * GH, GH, 0.0f);
        std::memcpy(dh_prev.data() + b * H, dh + b * H, sizeof(float) * H);
        if (lstm) std::memcpy(dc_prev.data() + b * H, dc + b * H, sizeof(float) * H);
      }
    if (lstm) std::memcpy(gh_t, gi_t, sizeof(float) * B * GH);  // one pre-activation feeds both products
    // dh_prev += dgh·W_hh
    ops::gemm(false, false, B, H, GH, 1.0f, gh_t, GH, d.w_hh->value.data(), H, 1.0f, dh_prev.data(), H);
    std::memcpy(dh, dh_prev.data(), sizeof(float) * B * H);
    if (lstm) std::memcpy(dc, dc_prev.data(), sizeof(float) * B * H);
  }
  // Weight gradients over all steps at once.
  ops::linear_backward(data(d.hprev), data(dgh), L * B, H, nullptr, GH, nullptr, d.w_hh->grad.data(),
                       d.b_hh ? d.b_hh->grad.data() : nullptr);
  const Tensor* x = nullptr;  // this direction's layer input
  for (size_t k = 0; k < dirs_by_layer_.size(); ++k)
    if (dirs_by_layer_[k].get() == &d) x = &layer_inputs_[k / dirs_];
  ops::linear_backward(data(*x), data(dgi), L * B, d.in, d.w_ih->value.data(), GH, dx, d.w_ih->grad.data(),
                       d.b_ih ? d.b_ih->grad.data() : nullptr);
}

RecurrentGrads RecurrentLayers::backward(const TensorView& doutput, const TensorView& dh_n, const TensorView& dc_n) {
  if (!have_forward_) throw Error("RecurrentLayers.backward: backward called before forward");
  const int64_t H = cfg_.hidden_size, D = dirs_, NL = cfg_.num_layers, I = cfg_.input_size;
  const bool lstm = kind_ == Kind::lstm;
  const std::vector<int64_t> out_shape =
      cfg_.batch_first ? std::vector<int64_t>{B_, L_, D * H} : std::vector<int64_t>{L_, B_, D * H};
  ops::expect_shape(doutput, out_shape, "RecurrentLayers.backward: doutput");
  if (!dh_n.empty()) ops::expect_shape(dh_n, {NL * D, B_, H}, "RecurrentLayers.backward: dh_n");
  if (!dc_n.empty()) ops::expect_shape(dc_n, {NL * D, B_, H}, "RecurrentLayers.backward: dc_n");
  RecurrentGrads g;
  g.dh0 = dh_n.empty() ? zeros({NL * D, B_, H}) : clone(dh_n);
  if (lstm) g.dc0 = dc_n.empty() ? zeros({NL * D, B_, H}) : clone(dc_n);
  Tensor dy = cfg_.batch_first ? swap01(doutput.data_as<float>(), B_, L_, D * H) : clone(doutput);
  for (int64_t l = NL; l-- > 0;) {
    const int64_t in = l == 0 ? I : D * H;
    Tensor dx = zeros({L_, B_, in});
    for (int64_t d = 0; d < D; ++d) {
      const int64_t k = l * D + d;
      backprop_direction(*dirs_by_layer_[k], data(dy) + d * H, D * H, data(dx), data(g.dh0) + k * B_ * H,
                         lstm ? data(g.dc0) + k * B_ * H : nullptr);
    }
    dy = l > 0 ? dropouts_[l - 1]->backward(dx) : std::move(dx);
  }
  g.dinput = cfg_.batch_first ? swap01(data(dy), L_, B_, I) : std::move(dy);
  return g;
}

}  // namespace attn::nn
