// Parity with PyTorch 1.13: modules built from PyTorch's weights must reproduce its
// float64 outputs and every input and parameter gradient within 1e-5 relative, or
// within 4x the error of PyTorch's own float32 run where a tensor is ill-conditioned
// (ParityCase::expect_close). The cases are written by tests/parity/make_parity.py (run
// by ctest first, fresh random draws).
#include <gtest/gtest.h>

#include "attn/nn/multihead_attention.hpp"
#include "attn/nn/recurrent.hpp"
#include "attn/nn/transformer.hpp"
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
                                           "float_padding", "causal_self", "one_head_odd"),
                         [](const auto& info) { return std::string(info.param); });

nn::TransformerLayerConfig layer_config(const nlohmann::json& cfg) {
  nn::TransformerLayerConfig c;
  c.d_model = cfg["E"];
  c.nhead = cfg["H"];
  c.dim_feedforward = cfg["F"];
  c.batch_first = cfg["batch_first"];
  c.norm_first = cfg.value("norm_first", false);
  c.activation = nn::activation_from_name(cfg.value("activation", std::string("relu")));
  return c;
}

// PyTorch's boolean causal mask [L, L]: true above the diagonal (not allowed).
Tensor causal_mask(int64_t L) {
  Tensor m(DType::boolean, {L, L});
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j) m.data_as<uint8_t>()[i * L + j] = j > i;
  return m;
}

class LayerParity : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(LayerParity, EncoderLayer) {
  const auto [norm_first, batch_first] = GetParam();
  ParityCase c("encoder_layer_nf" + std::to_string(norm_first) + "_bf" + std::to_string(batch_first) +
               ".safetensors");
  nn::Rng rng(0);
  nn::TransformerEncoderLayer layer(layer_config(c.config), rng);
  c.load_params(layer);
  Tensor src = c.tensor("in.src"), kpm = c.tensor("in.src_key_padding_mask");
  c.expect_close("out.output", layer.forward(src, {}, kpm));
  c.expect_close("grad.src", layer.backward(c.tensor("dout.output")));
  c.expect_param_grads(layer);
}

TEST_P(LayerParity, DecoderLayer) {
  const auto [norm_first, batch_first] = GetParam();
  ParityCase c("decoder_layer_nf" + std::to_string(norm_first) + "_bf" + std::to_string(batch_first) +
               ".safetensors");
  nn::Rng rng(0);
  nn::TransformerDecoderLayer layer(layer_config(c.config), rng);
  c.load_params(layer);
  Tensor tgt = c.tensor("in.tgt"), memory = c.tensor("in.memory"), mkpm = c.tensor("in.memory_key_padding_mask");
  c.expect_close("out.output", layer.forward(tgt, memory, {}, {}, {}, mkpm, /*tgt_is_causal=*/true));
  nn::DecoderGrads g = layer.backward(c.tensor("dout.output"));
  c.expect_close("grad.tgt", g.dtgt);
  c.expect_close("grad.memory", g.dmemory);
  c.expect_param_grads(layer);
}

INSTANTIATE_TEST_SUITE_P(PyTorch, LayerParity, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "pre_norm" : "post_norm") +
                                  (std::get<1>(info.param) ? "_batch_first" : "_seq_first");
                         });

TEST(StackParity, EncoderWithFinalNorm) {
  ParityCase c("encoder_stack.safetensors");
  nn::Rng rng(0);
  nn::TransformerEncoder enc(layer_config(c.config), c.config["layers"], /*final_norm=*/true, rng);
  c.load_params(enc);
  c.expect_close("out.output", enc.forward(c.tensor("in.src")));
  c.expect_close("grad.src", enc.backward(c.tensor("dout.output")));
  c.expect_param_grads(enc);
}

TEST(StackParity, DecoderWithFinalNormAndABooleanCausalMask) {
  ParityCase c("decoder_stack.safetensors");
  nn::Rng rng(0);
  nn::TransformerDecoder dec(layer_config(c.config), c.config["layers"], /*final_norm=*/true, rng);
  c.load_params(dec);
  Tensor mask = causal_mask(c.config["L"]);
  c.expect_close("out.output", dec.forward(c.tensor("in.tgt"), c.tensor("in.memory"), mask));
  nn::DecoderGrads g = dec.backward(c.tensor("dout.output"));
  c.expect_close("grad.tgt", g.dtgt);
  c.expect_close("grad.memory", g.dmemory);
  c.expect_param_grads(dec);
}

class RecurrentParity : public ::testing::TestWithParam<std::tuple<const char*, bool>> {};

void check_recurrent(const ParityCase& c, bool lstm) {
  nn::RecurrentConfig rc;
  rc.input_size = c.config["input_size"];
  rc.hidden_size = c.config["hidden_size"];
  rc.num_layers = c.config["num_layers"];
  rc.bidirectional = c.config["bidirectional"];
  rc.batch_first = c.config["batch_first"];
  nn::Rng rng(0);
  nn::RecurrentLayers rnn(lstm ? nn::RecurrentLayers::Kind::lstm : nn::RecurrentLayers::Kind::gru, rc, rng);
  c.load_params(rnn);
  Tensor c0 = lstm && c.has("in.c0") ? c.tensor("in.c0") : Tensor();
  Tensor h0 = c.has("in.h0") ? c.tensor("in.h0") : Tensor();
  std::vector<int32_t> lengths = c.has("in.lengths") ? c.file().at("in.lengths").to_i32() : std::vector<int32_t>{};
  const TensorView lengths_view = lengths.empty() ? TensorView()
                                                  : TensorView(lengths.data(), DType::i32, {int64_t(lengths.size())});
  auto out = rnn.forward(c.tensor("in.input"), c.has("in.h0") ? h0.view() : TensorView(),
                         lstm && c.has("in.c0") ? c0.view() : TensorView(), lengths_view);
  c.expect_close("out.output", out.output);
  c.expect_close("out.h_n", out.h_n);
  if (lstm) c.expect_close("out.c_n", out.c_n);
  Tensor dc = lstm ? c.tensor("dout.c_n") : Tensor();
  auto g = rnn.backward(c.tensor("dout.output"), c.tensor("dout.h_n"), lstm ? dc.view() : TensorView());
  c.expect_close("grad.input", g.dinput);
  if (c.has("grad.h0")) c.expect_close("grad.h0", g.dh0);
  if (c.has("grad.c0")) c.expect_close("grad.c0", g.dc0);
  c.expect_param_grads(rnn);
}

TEST_P(RecurrentParity, TwoLayerBidirectional) {
  const auto [kind, batch_first] = GetParam();
  check_recurrent(ParityCase(std::string(kind) + "_bf" + std::to_string(batch_first) + ".safetensors"),
                  std::string(kind) == "lstm");
}

TEST(RecurrentParity, VariableLengthsAsPackedSequences) {
  check_recurrent(ParityCase("gru_packed.safetensors"), false);
  check_recurrent(ParityCase("lstm_packed.safetensors"), true);
}

INSTANTIATE_TEST_SUITE_P(PyTorch, RecurrentParity,
                         ::testing::Combine(::testing::Values("gru", "lstm"), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_batch_first" : "_seq_first");
                         });

}  // namespace
}  // namespace attn::testing
