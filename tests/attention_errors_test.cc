// Every invalid argument throws attn::Error naming it, before any output is
// written. Each case starts from a valid call and breaks one thing.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "attn/attention.hpp"

namespace attn {
namespace {

constexpr float kSentinel = 12345.0f;

// A valid call of B=2, L=5, H=4 (kv 2), d=8, and the means to break it.
struct Call {
  int B = 2, Lq = 5, Lk = 6, Hq = 4, Hkv = 2, d = 8, dv = 8;
  std::vector<float> q, k, v, out, lse, probs;
  TensorView qv, kv, vv, ov, lv, pv;
  AttentionOptions opt;
  Call() {
    q.assign(B * Lq * Hq * d, 0.25f);
    k.assign(B * Lk * Hkv * d, 0.5f);
    v.assign(B * Lk * Hkv * dv, 1.0f);
    out.assign(B * Lq * Hq * dv, kSentinel);
    lse.assign(B * Hq * Lq, kSentinel);
    probs.assign(B * Hq * Lq * Lk, kSentinel);
    qv = TensorView(q.data(), DType::f32, {B, Lq, Hq, d});
    kv = TensorView(k.data(), DType::f32, {B, Lk, Hkv, d});
    vv = TensorView(v.data(), DType::f32, {B, Lk, Hkv, dv});
    ov = TensorView(out.data(), DType::f32, {B, Lq, Hq, dv});
    lv = TensorView(lse.data(), DType::f32, {B, Hq, Lq});
    pv = TensorView(probs.data(), DType::f32, {B, Hq, Lq, Lk});
  }
  void run() { attention(qv, kv, vv, ov, opt, lv, pv); }
  bool outputs_untouched() const {
    for (const auto* vec : {&out, &lse, &probs}) {
      for (float x : *vec) {
        if (x != kSentinel) return false;
      }
    }
    return true;
  }
};

// Expects attn::Error whose message contains every one of `needles`, and no output written.
void expect_error(const std::function<void(Call&)>& breakit, std::vector<std::string> needles) {
  Call c;
  breakit(c);
  try {
    c.run();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << needles[0] << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg;
    EXPECT_TRUE(c.outputs_untouched()) << "an output was written before the error: " << msg;
  }
}

TEST(AttentionErrors, ValidCallSucceeds) {
  Call c;
  EXPECT_NO_THROW(c.run());
  EXPECT_FALSE(c.outputs_untouched());
}

TEST(AttentionErrors, MissingTensorsRanksAndDtypes) {
  expect_error([](Call& c) { c.qv = TensorView(); }, {"q is required"});
  expect_error([](Call& c) { c.kv = TensorView(c.k.data(), DType::f32, {c.B * c.Lk, c.Hkv, c.d}); },
               {"k must have rank 4", "[B, Lk, Hkv, d]"});
  expect_error([](Call& c) { c.vv = TensorView(c.v.data(), DType::bf16, {c.B, c.Lk, c.Hkv, c.dv}); },
               {"v must have dtype f32 (the dtype of q; mixed dtypes are an error)", "got bf16"});
  expect_error([](Call& c) { c.qv = TensorView(c.q.data(), DType::i32, {c.B, c.Lq, c.Hq, c.d}); },
               {"q must have dtype f32, bf16 or f16, got i32"});
  expect_error([](Call& c) { c.ov = TensorView(c.out.data(), DType::f16, {c.B, c.Lq, c.Hq, c.dv}); },
               {"out must have dtype f32"});
}

TEST(AttentionErrors, ShapeMismatches) {
  expect_error([](Call& c) { c.kv = TensorView(c.k.data(), DType::f32, {1, c.Lk, c.Hkv, c.d}); },
               {"k.shape[0]", "batch"});
  expect_error([](Call& c) { c.kv = TensorView(c.k.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.d - 1}); },
               {"k.shape[3]", "head dim", "must be 8"});
  expect_error([](Call& c) { c.vv = TensorView(c.v.data(), DType::f32, {c.B, c.Lk - 1, c.Hkv, c.dv}); },
               {"v.shape[1]", "keys"});
  expect_error([](Call& c) { c.ov = TensorView(c.out.data(), DType::f32, {c.B, c.Lq, c.Hq, c.dv - 1}); },
               {"out.shape[3]", "value head dim"});
  expect_error([](Call& c) { c.ov = TensorView(c.out.data(), DType::f32, {c.B, c.Lq - 1, c.Hq, c.dv}); },
               {"out.shape[1]", "queries"});
}

TEST(AttentionErrors, HeadsMustDivide) {
  std::vector<float> k3(2 * 6 * 3 * 8, 0.5f), v3(2 * 6 * 3 * 8, 1.0f);
  expect_error([&](Call& c) { c.kv = TensorView(k3.data(), DType::f32, {c.B, c.Lk, 3, c.d});
                              c.vv = TensorView(v3.data(), DType::f32, {c.B, c.Lk, 3, c.dv}); },
               {"must divide", "Hq=4", "Hkv=3"});
}

TEST(AttentionErrors, NonContiguousLastDimension) {
  expect_error([](Call& c) {
    c.qv = TensorView(c.q.data(), DType::f32, {c.B, c.Lq, c.Hq, c.d / 2},
                      {c.Lq * c.Hq * c.d, c.Hq * c.d, c.d, 2});
    c.kv = TensorView(c.k.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.d / 2});
  }, {"q must have a contiguous last dimension"});
}

// A view with no elements has no layout to check: zero strides (what PyTorch gives an
// empty tensor made from an empty NumPy array) are accepted, and the call writes the
// rows there are (none, or zeros and lse −∞ without keys).
TEST(AttentionErrors, EmptyViewsTakeAnyStrides) {
  Call c;
  c.qv = TensorView(c.q.data(), DType::f32, {c.B, 0, c.Hq, c.d}, {0, 0, 0, 0});
  c.ov = TensorView(c.out.data(), DType::f32, {c.B, 0, c.Hq, c.dv}, {0, 0, 0, 0});
  c.lv = TensorView(c.lse.data(), DType::f32, {c.B, c.Hq, 0});
  c.pv = TensorView();
  EXPECT_NO_THROW(c.run());
  Call n;
  n.kv = TensorView(n.k.data(), DType::f32, {n.B, 0, n.Hkv, n.d}, {0, 0, 0, 0});
  n.vv = TensorView(n.v.data(), DType::f32, {n.B, 0, n.Hkv, n.dv}, {0, 0, 0, 0});
  n.pv = TensorView();
  n.run();
  for (float x : n.out) EXPECT_EQ(x, 0.0f);
  for (float x : n.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

TEST(AttentionErrors, NullPointerWithElements) {
  expect_error([](Call& c) { c.kv = TensorView(nullptr, DType::f32, {c.B, c.Lk, c.Hkv, c.d}); },
               {"k has a null data pointer"});
}

TEST(AttentionErrors, ScalarOptions) {
  expect_error([](Call& c) { c.opt.scale = 0.0f; }, {"scale must be finite and > 0", "0"});
  expect_error([](Call& c) { c.opt.scale = -1.0f; }, {"scale"});
  expect_error([](Call& c) { c.opt.scale = std::numeric_limits<float>::quiet_NaN(); }, {"scale"});
  expect_error([](Call& c) { c.opt.scale = INFINITY; }, {"scale"});
  expect_error([](Call& c) { c.opt.softcap = -1.0f; }, {"softcap"});
  expect_error([](Call& c) { c.opt.softcap = NAN; }, {"softcap"});
  expect_error([](Call& c) { c.opt.window = {-2, 0}; }, {"window", "{-2, 0}"});
  expect_error([](Call& c) { c.opt.window = {3, -5}; }, {"window"});
  expect_error([](Call& c) { c.opt.dropout_p = 1.0f; }, {"dropout_p must be in [0, 1)"});
  expect_error([](Call& c) { c.opt.dropout_p = NAN; }, {"dropout_p"});
  expect_error([](Call& c) { c.opt.dropout_p = -0.1f; }, {"dropout_p"});
}

TEST(AttentionErrors, CuSeqlens) {
  // Varlen calls use rank-3 tensors; start from a valid one.
  auto varlen = [](Call& c, std::vector<int32_t>* cu_q, std::vector<int32_t>* cu_k) {
    c.qv = TensorView(c.q.data(), DType::f32, {c.B * c.Lq, c.Hq, c.d});
    c.kv = TensorView(c.k.data(), DType::f32, {c.B * c.Lk, c.Hkv, c.d});
    c.vv = TensorView(c.v.data(), DType::f32, {c.B * c.Lk, c.Hkv, c.dv});
    c.ov = TensorView(c.out.data(), DType::f32, {c.B * c.Lq, c.Hq, c.dv});
    c.lv = TensorView();
    c.pv = TensorView();
    c.opt.cu_seqlens_q = TensorView(cu_q->data(), DType::i32, {static_cast<int64_t>(cu_q->size())});
    c.opt.cu_seqlens_k = TensorView(cu_k->data(), DType::i32, {static_cast<int64_t>(cu_k->size())});
  };
  std::vector<int32_t> ok_q = {0, 5, 10}, ok_k = {0, 6, 12};
  std::vector<int32_t> not_monotone = {0, 7, 3}, too_far = {0, 6, 13}, wrong_len = {0, 12};
  {
    Call c;
    varlen(c, &ok_q, &ok_k);
    EXPECT_NO_THROW(c.run());
  }
  expect_error([&](Call& c) { varlen(c, &ok_q, &not_monotone); }, {"cu_seqlens_k must be non-decreasing"});
  expect_error([&](Call& c) { varlen(c, &ok_q, &too_far); }, {"cu_seqlens_k[B]=13", "beyond", "12 tokens"});
  expect_error([&](Call& c) { varlen(c, &ok_q, &wrong_len); }, {"cu_seqlens_k must have the length of cu_seqlens_q"});
  expect_error([&](Call& c) { varlen(c, &ok_q, &ok_k); c.opt.cu_seqlens_k = TensorView(); },
               {"cu_seqlens_q and cu_seqlens_k must be given together"});
  expect_error([&](Call& c) {
    varlen(c, &ok_q, &ok_k);
    c.opt.cu_seqlens_q = TensorView(ok_q.data(), DType::f32, {3});
  }, {"cu_seqlens_q must have dtype i32"});
  expect_error([&](Call& c) {  // rank-4 tensors with cu_seqlens
    c.opt.cu_seqlens_q = TensorView(ok_q.data(), DType::i32, {3});
    c.opt.cu_seqlens_k = TensorView(ok_k.data(), DType::i32, {3});
  }, {"q must have rank 3", "[total_q, Hq, d]"});
}

TEST(AttentionErrors, KeyLengths) {
  std::vector<int32_t> too_long = {3, 7}, negative = {-1, 2}, wrong_count = {1, 2, 3};
  expect_error([&](Call& c) { c.opt.key_lengths = TensorView(too_long.data(), DType::i32, {2}); },
               {"key_lengths[1] must be in [0, 6]", "got 7"});
  expect_error([&](Call& c) { c.opt.key_lengths = TensorView(negative.data(), DType::i32, {2}); },
               {"key_lengths[0]"});
  expect_error([&](Call& c) { c.opt.key_lengths = TensorView(wrong_count.data(), DType::i32, {3}); },
               {"key_lengths must be i32 [B]"});
}

TEST(AttentionErrors, MasksMustBroadcast) {
  std::vector<float> m(2 * 4 * 5 * 6, 0.0f);
  std::vector<int32_t> im(6, 1);
  expect_error([&](Call& c) { c.opt.mask = TensorView(m.data(), DType::f32, {3, 4, 5, 6}); },
               {"not broadcastable", "dimension 0 (B) must be 1 or 2, got 3"});
  expect_error([&](Call& c) { c.opt.mask = TensorView(m.data(), DType::f32, {5, 7}); },
               {"not broadcastable", "(Lk) must be 1 or 6, got 7"});
  expect_error([&](Call& c) { c.opt.mask = TensorView(m.data(), DType::f32, {1, 2, 4, 5, 6}); },
               {"mask must have rank <= 4"});
  expect_error([&](Call& c) { c.opt.mask = TensorView(im.data(), DType::i32, {6}); },
               {"mask must be boolean", "i32"});
  expect_error([&](Call& c) { c.opt.mask = TensorView(m.data(), DType::f32, {5, 6}, {12, 2}); },
               {"mask must have a contiguous last dimension"});
}

TEST(AttentionErrors, AlibiSlopes) {
  std::vector<float> s(8, 0.5f);
  expect_error([&](Call& c) { c.opt.alibi_slopes = TensorView(s.data(), DType::f32, {3}); },
               {"alibi_slopes must be f32 [Hq] or [B, Hq]", "Hq=4"});
  expect_error([&](Call& c) { c.opt.alibi_slopes = TensorView(s.data(), DType::f32, {4, 2}); },
               {"alibi_slopes"});
  expect_error([&](Call& c) { c.opt.alibi_slopes = TensorView(s.data(), DType::bf16, {4}); },
               {"alibi_slopes must have dtype f32"});
}

TEST(AttentionErrors, OptionalOutputs) {
  expect_error([](Call& c) { c.lv = TensorView(c.lse.data(), DType::f32, {c.B, c.Lq, c.Hq}); },
               {"lse.shape[1]", "query heads"});
  expect_error([](Call& c) { c.pv = TensorView(c.probs.data(), DType::f32, {c.B, c.Hq, c.Lq, c.Lk - 1}); },
               {"probs.shape[3]", "keys"});
  expect_error([](Call& c) { c.lv = TensorView(c.lse.data(), DType::f32, {c.B, c.Hq}); },
               {"lse must have rank 3"});
}

TEST(AttentionErrors, ThreadCount) {
  EXPECT_THROW(set_num_threads(0), Error);
}

}  // namespace
}  // namespace attn

namespace attn {
namespace {

// attention_backward: the forward's checks, plus the gradients' own.
struct BackwardCall : Call {
  std::vector<float> g_dout, g_dq, g_dk, g_dv, g_mask, g_dbias;
  TensorView doutv, dqv, dkv, dvv, dbv;
  BackwardCall() {
    g_dout.assign(out.size(), 0.5f), g_dq.assign(q.size(), kSentinel), g_dk.assign(k.size(), kSentinel),
        g_dv.assign(v.size(), kSentinel);
    doutv = TensorView(g_dout.data(), DType::f32, ov.shape());
    dqv = TensorView(g_dq.data(), DType::f32, qv.shape());
    dkv = TensorView(g_dk.data(), DType::f32, kv.shape());
    dvv = TensorView(g_dv.data(), DType::f32, vv.shape());
    attention(qv, kv, vv, ov, opt, lv);  // a valid forward first
  }
  void run_backward() { attention_backward(qv, kv, vv, ov, lv, doutv, dqv, dkv, dvv, opt, dbv); }
  bool grads_untouched() const {
    for (const auto* vec : {&g_dq, &g_dk, &g_dv}) {
      for (float x : *vec) {
        if (x != kSentinel) return false;
      }
    }
    return true;
  }
};

void expect_backward_error(const std::function<void(BackwardCall&)>& breakit,
                           std::vector<std::string> needles) {
  BackwardCall c;
  breakit(c);
  try {
    c.run_backward();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << needles[0] << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg;
    EXPECT_TRUE(c.grads_untouched()) << "a gradient was written before the error: " << msg;
  }
}

TEST(AttentionBackwardErrors, ValidCallSucceeds) {
  BackwardCall c;
  EXPECT_NO_THROW(c.run_backward());
  EXPECT_FALSE(c.grads_untouched());
}

TEST(AttentionBackwardErrors, GradientShapesAndDtypes) {
  expect_backward_error([](BackwardCall& c) { c.lv = TensorView(); }, {"lse is required"});
  expect_backward_error([](BackwardCall& c) { c.doutv = TensorView(); }, {"dout is required"});
  expect_backward_error([](BackwardCall& c) { c.doutv = TensorView(c.g_dout.data(), DType::f32, {c.B, c.Lq, c.Hq, c.dv - 1}); },
                        {"dout must have the shape of out"});
  expect_backward_error([](BackwardCall& c) { c.dqv = TensorView(c.g_dq.data(), DType::bf16, c.qv.shape()); },
                        {"dq must have dtype f32 (the dtype of q; mixed dtypes are an error)"});
  expect_backward_error([](BackwardCall& c) { c.dkv = TensorView(c.g_dk.data(), DType::f32, {c.B, c.Lk - 1, c.Hkv, c.d}); },
                        {"dk must have the shape of k"});
  expect_backward_error([](BackwardCall& c) { c.dvv = TensorView(c.g_dv.data(), DType::f32, {c.B, c.Lk, c.Hkv}); },
                        {"dv must have rank 4"});
  expect_backward_error([](BackwardCall& c) {
    c.dqv = TensorView(c.g_dq.data(), DType::f32, {c.B, c.Lq, c.Hq, c.d / 2}, {c.Lq * c.Hq * c.d, c.Hq * c.d, c.d, 2});
    c.qv = TensorView(c.q.data(), DType::f32, {c.B, c.Lq, c.Hq, c.d / 2});
    c.kv = TensorView(c.k.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.d / 2});
  }, {"dq must have a contiguous last dimension"});
}

TEST(AttentionBackwardErrors, BiasGradientNeedsAnAdditiveMaskOfItsShape) {
  expect_backward_error([](BackwardCall& c) {
    c.g_dbias.assign(c.Lq * c.Lk, 0.0f);
    c.dbv = TensorView(c.g_dbias.data(), DType::f32, {c.Lq, c.Lk});
  }, {"dbias needs an additive (f32) mask"});
  expect_backward_error([](BackwardCall& c) {
    c.g_mask.assign(c.Lq * c.Lk, 0.0f);
    c.opt.mask = TensorView(c.g_mask.data(), DType::f32, {c.Lq, c.Lk});
    c.g_dbias.assign(c.Lq * c.Lk, 0.0f);
    c.dbv = TensorView(c.g_dbias.data(), DType::f32, {c.Lk, c.Lq});
  }, {"dbias must have the shape of options.mask"});
}

}  // namespace
}  // namespace attn
