// The smallest complete use of attn: causal self-attention over a batch, with
// the logsumexp saved, checked against the float64 reference.
//
//   cmake --build build/release && ./build/release/examples/basic_usage
#include <attn/attention.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const int B = 2, L = 100, H = 8, d = 64;  // BSHD layout: [batch, position, head, dim]
  std::vector<float> q(B * L * H * d), k(q.size()), v(q.size()), out(q.size()), ref(q.size());
  std::vector<float> lse(B * H * L);
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  for (auto* t : {&q, &k, &v}) {
    for (float& x : *t) x = normal(rng);
  }

  attn::AttentionOptions opt;
  opt.causal = attn::Causal::TopLeft;  // query i sees keys 0..i, as PyTorch's is_causal
  const attn::TensorView qv(q.data(), attn::DType::f32, {B, L, H, d});
  const attn::TensorView kv(k.data(), attn::DType::f32, {B, L, H, d});
  const attn::TensorView vv(v.data(), attn::DType::f32, {B, L, H, d});
  attn::attention(qv, kv, vv, attn::TensorView(out.data(), attn::DType::f32, {B, L, H, d}), opt,
                  attn::TensorView(lse.data(), attn::DType::f32, {B, H, L}));
  attn::attention_reference(qv, kv, vv, attn::TensorView(ref.data(), attn::DType::f32, {B, L, H, d}), opt);

  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) num += (out[i] - ref[i]) * (out[i] - ref[i]), den += ref[i] * ref[i];
  std::printf("causal self-attention B=%d L=%d H=%d d=%d: relative error vs float64 %.2e, lse[0]=%.4f\n",
              B, L, H, d, std::sqrt(num / den), lse[0]);

  // Bad arguments throw attn::Error with a message naming the argument.
  try {
    attn::AttentionOptions bad;
    bad.window = {-3, 0};
    attn::attention(qv, kv, vv, attn::TensorView(out.data(), attn::DType::f32, {B, L, H, d}), bad);
  } catch (const attn::Error& e) {
    std::printf("as expected: %s\n", e.what());
  }
  return 0;
}
