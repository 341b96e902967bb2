// GRU/LSTM cells by finite differences, cells against the layers, dropout between
// layers, errors. PyTorch parity of the layers is in nn_parity_test.
#include <gtest/gtest.h>

#include "attn/error.hpp"
#include "attn/nn/recurrent.hpp"
#include "nn_test_util.hpp"

namespace attn::testing {
namespace {

TEST(GRUCell, GradientsAndAgreementWithTheLayer) {
  nn::Rng rng = nn_rng(61);
  nn::GRUCell cell(5, 7, true, rng);
  Tensor x = random_tensor({3, 5}, rng), h = random_tensor({3, 7}, rng);
  std::pair<Tensor, Tensor> g;
  auto slots = parameter_slots(cell);
  slots.push_back({"x", x.data_as<float>(), x.numel(), [&] { return g.first.data_as<float>(); }});
  slots.push_back({"h", h.data_as<float>(), h.numel(), [&] { return g.second.data_as<float>(); }});
  cell.zero_grad();
  check_gradients([&] { return cell.forward(x, h); }, [&](const Tensor& dy) { g = cell.backward(dy); }, slots, rng);

  // A one-layer, one-step GRU with the cell's weights gives the same state.
  nn::RecurrentConfig rc;
  rc.input_size = 5;
  rc.hidden_size = 7;
  nn::GRU gru(rc, rng);
  gru.parameter("weight_ih_l0").value = cell.weight_ih.value;
  gru.parameter("weight_hh_l0").value = cell.weight_hh.value;
  gru.parameter("bias_ih_l0").value = cell.bias_ih->value;
  gru.parameter("bias_hh_l0").value = cell.bias_hh->value;
  Tensor h0 = nn::clone(TensorView(h.data(), DType::f32, {1, 3, 7}));
  auto out = gru.forward(TensorView(x.data(), DType::f32, {1, 3, 5}), h0);
  Tensor hc = cell.forward(x, h);
  EXPECT_LT(max_rel_diff(out.h_n.data_as<float>(), hc.data_as<float>(), 21), 1e-6);
}

TEST(LSTMCell, Gradients) {
  nn::Rng rng = nn_rng(62);
  nn::LSTMCell cell(4, 6, true, rng);
  Tensor x = random_tensor({2, 4}, rng), h = random_tensor({2, 6}, rng), c = random_tensor({2, 6}, rng);
  nn::LSTMCell::Cache cache;
  Tensor dx, dh, dc;
  // Loss over both outputs: concatenate h' and c' as [2, 12].
  auto forward = [&] {
    auto [hn, cn] = cell.step(x, h, c, cache);
    Tensor y(DType::f32, {2, 12});
    for (int b = 0; b < 2; ++b)
      for (int k = 0; k < 6; ++k) {
        y.data_as<float>()[b * 12 + k] = hn.data_as<float>()[b * 6 + k];
        y.data_as<float>()[b * 12 + 6 + k] = cn.data_as<float>()[b * 6 + k];
      }
    return y;
  };
  auto backward = [&](const Tensor& g) {
    Tensor gh(DType::f32, {2, 6}), gc(DType::f32, {2, 6});
    for (int b = 0; b < 2; ++b)
      for (int k = 0; k < 6; ++k) {
        gh.data_as<float>()[b * 6 + k] = g.data_as<float>()[b * 12 + k];
        gc.data_as<float>()[b * 6 + k] = g.data_as<float>()[b * 12 + 6 + k];
      }
    dx = nn::zeros({2, 4});
    dh = nn::zeros({2, 6});
    dc = nn::zeros({2, 6});
    cell.step_backward(cache, gh, gc, dx, dh, dc);
  };
  auto slots = parameter_slots(cell);
  slots.push_back({"x", x.data_as<float>(), x.numel(), [&] { return dx.data_as<float>(); }});
  slots.push_back({"h", h.data_as<float>(), h.numel(), [&] { return dh.data_as<float>(); }});
  slots.push_back({"c", c.data_as<float>(), c.numel(), [&] { return dc.data_as<float>(); }});
  cell.zero_grad();
  check_gradients(forward, backward, slots, rng);
}

TEST(RecurrentLayers, GradientsWithLengthsAndDropoutOff) {
  nn::Rng rng = nn_rng(63);
  for (auto kind : {nn::RecurrentLayers::Kind::gru, nn::RecurrentLayers::Kind::lstm}) {
    nn::RecurrentConfig rc;
    rc.input_size = 3;
    rc.hidden_size = 4;
    rc.num_layers = 2;
    rc.bidirectional = true;
    rc.batch_first = true;
    rc.dropout = 0.5f;
    nn::RecurrentLayers rnn(kind, rc, rng);
    rnn.eval();
    Tensor x = random_tensor({3, 5, 3}, rng);
    const int32_t lengths[] = {5, 2, 1};
    nn::RecurrentGrads g;
    auto slots = parameter_slots(rnn);
    slots.push_back({"input", x.data_as<float>(), x.numel(), [&] { return g.dinput.data_as<float>(); }});
    rnn.zero_grad();
    check_gradients([&] { return rnn.forward(x, {}, {}, TensorView(lengths, DType::i32, {3})).output; },
                    [&](const Tensor& dy) { g = rnn.backward(dy); }, slots, rng);
    // Padded positions output zero and get zero input gradient.
    auto out = rnn.forward(x, {}, {}, TensorView(lengths, DType::i32, {3}));
    for (int k = 0; k < 8; ++k) EXPECT_EQ(out.output.data_as<float>()[(2 * 5 + 3) * 8 + k], 0.0f);
    g = rnn.backward(random_tensor({3, 5, 8}, rng));
    for (int k = 0; k < 3; ++k) EXPECT_EQ(g.dinput.data_as<float>()[(1 * 5 + 4) * 3 + k], 0.0f);
  }
}

TEST(RecurrentLayers, DropoutBetweenLayersInTraining) {
  nn::Rng rng = nn_rng(64);
  nn::RecurrentConfig rc;
  rc.input_size = 3;
  rc.hidden_size = 8;
  rc.num_layers = 2;
  rc.dropout = 0.5f;
  nn::GRU gru(rc, rng);
  Tensor x = random_tensor({4, 2, 3}, rng);
  Tensor train = gru.forward(x).output;
  gru.eval();
  Tensor eval = gru.forward(x).output;
  EXPECT_GT(max_rel_diff(train.data_as<float>(), eval.data_as<float>(), train.numel()), 1e-3);
}

TEST(RecurrentLayers, NamesAndErrors) {
  nn::Rng rng(1);
  nn::RecurrentConfig rc;
  rc.input_size = 3;
  rc.hidden_size = 4;
  rc.num_layers = 2;
  rc.bidirectional = true;
  nn::LSTM lstm(rc, rng);
  EXPECT_EQ(lstm.parameter("weight_ih_l1_reverse").shape, (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(lstm.parameter("bias_hh_l0").shape, (std::vector<int64_t>{16}));
  EXPECT_EQ(lstm.named_parameters().size(), 16u);
  Tensor x = random_tensor({5, 2, 3}, rng);
  Tensor bad_h0 = random_tensor({2, 2, 4}, rng);
  try {
    lstm.forward(x, bad_h0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("h0 must be [4, 2, 4]"), std::string::npos) << e.what();
  }
  const int32_t too_long[] = {6, 1};
  EXPECT_THROW(lstm.forward(x, {}, {}, TensorView(too_long, DType::i32, {2})), Error);
  EXPECT_THROW(lstm.forward(random_tensor({5, 2, 4}, rng)), Error);
  nn::GRU gru(rc, rng);
  EXPECT_THROW(gru.backward(x), Error);
  EXPECT_THROW(gru.forward(x, {}, random_tensor({4, 2, 4}, rng)), Error);  // c0 for a GRU
}

}  // namespace
}  // namespace attn::testing
