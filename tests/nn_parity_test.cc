// Parity with PyTorch 1.13: modules built from PyTorch's weights must reproduce its
// outputs and every input and parameter gradient within 1e-5 relative. The cases are
// written by tests/parity/make_parity.py (run by ctest first, fresh random draws).
#include <gtest/gtest.h>

#include "attn/nn/multihead_attention.hpp"
#include "nn_parity.hpp"

namespace attn::testing {
namespace {

class MhaParity : public ::testing::TestWithParam<const char*> {};

TEST_P(MhaParity, OutputsWeightsAndGradients) {
  ParityCase c(std::string("mha_") + GetParam() + ".safetensors");
  const auto& cfg = c.config;
  nn::MultiheadAttentionConfig mc;
  mc.embed_dim = cfg["E"];
  mc.num_heads = cfg["H"];
  mc.kdim = cfg["kdim"];
  mc.vdim = cfg["vdim"];
  mc.batch_first = cfg["batch_first"];
  nn::Rng rng(0);
  nn::MultiheadAttention mha(mc, rng);
  c.load_params(mha);
  const bool self = cfg.value("self_attn", false);
  Tensor q = c.tensor("in.query");
  Tensor k = self ? Tensor() : c.tensor("in.key");
  Tensor v = self ? Tensor() : c.tensor("in.value");
  Tensor kpm = c.has("in.key_padding_mask") ? c.tensor("in.key_padding_mask") : Tensor();
  Tensor am = c.has("in.attn_mask") ? c.tensor("in.attn_mask") : Tensor();
  const bool need = cfg["need_weights"];
  auto view = [](const Tensor& t) { return t.shape().empty() ? TensorView() : t.view(); };
  auto out = mha.forward(q, self ? q.view() : k.view(), self ? q.view() : v.view(), view(kpm), need, view(am),
                         cfg["average"], cfg.value("causal", false));
  c.expect_close("out.output", out.output);
  if (need) c.expect_close("out.weights", out.weights);
  auto g = mha.backward(c.tensor("dout.output"));
  if (self) {
    Tensor dx = nn::clone(g.dquery);
    for (int64_t i = 0; i < dx.numel(); ++i)
      dx.data_as<float>()[i] += g.dkey.data_as<float>()[i] + g.dvalue.data_as<float>()[i];
    c.expect_close("grad.query", dx);
  } else {
    c.expect_close("grad.query", g.dquery);
    c.expect_close("grad.key", g.dkey);
    c.expect_close("grad.value", g.dvalue);
  }
  c.expect_param_grads(mha);
}

INSTANTIATE_TEST_SUITE_P(PyTorch, MhaParity,
                         ::testing::Values("basic", "batch_first_cross", "kdim_vdim", "float_masks_per_head",
                                           "float_padding", "causal_self", "one_head_odd"));

}  // namespace
}  // namespace attn::testing
