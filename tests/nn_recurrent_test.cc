// GRU/LSTM cells by finite differences, cells against the layers, dropout between
// layers, errors. PyTorch parity of the layers is in nn_parity_test.
#include <gtest/gtest.h>

#include <cstring>

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

// GRU and LSTM stacks drawn whole, 10 per run: 1–5 inputs, 1–6 hidden units, 1–3 layers,
// with or without bias, either layout, one or two directions, batches of 1–3, 1–7 steps,
// variable lengths or none, given or zero initial states. The loss reads the output and
// the final states, so every parameter's, the input's and the initial states' gradients
// are checked, through dh_n and dc_n too.
TEST(RecurrentLayers, GradientsOnDrawnShapes) {
  nn::Rng rng = nn_rng(65);
  const int64_t steps[] = {1, 2, 3, 5, 7};
  auto pick = [&](int64_t n) { return static_cast<int64_t>(rng.next_u64() % n); };
  for (int draw = 0; draw < 10; ++draw) {
    const auto kind = pick(2) ? nn::RecurrentLayers::Kind::gru : nn::RecurrentLayers::Kind::lstm;
    const bool lstm = kind == nn::RecurrentLayers::Kind::lstm;
    nn::RecurrentConfig rc;
    rc.input_size = 1 + pick(5);
    rc.hidden_size = 1 + pick(6);
    rc.num_layers = 1 + pick(3);
    rc.bias = pick(3) != 0;
    rc.batch_first = pick(2);
    rc.bidirectional = pick(2);
    const int64_t B = 1 + pick(3), L = steps[pick(5)], D = rc.bidirectional ? 2 : 1;
    const bool with_lengths = pick(2), with_h0 = pick(2), with_c0 = lstm && pick(2);
    SCOPED_TRACE(std::string(lstm ? "LSTM" : "GRU") + ", input " + std::to_string(rc.input_size) + ", hidden " +
                 std::to_string(rc.hidden_size) + ", layers " + std::to_string(rc.num_layers) + ", bias " +
                 std::to_string(rc.bias) + ", batch_first " + std::to_string(rc.batch_first) + ", directions " +
                 std::to_string(D) + ", B " + std::to_string(B) + ", L " + std::to_string(L) + ", lengths " +
                 std::to_string(with_lengths) + ", h0 " + std::to_string(with_h0) + ", c0 " +
                 std::to_string(with_c0) + " (" + seed_note() + ")");
    nn::RecurrentLayers rnn(kind, rc, rng);
    rnn.eval();
    Tensor x = random_tensor(rc.batch_first ? std::vector<int64_t>{B, L, rc.input_size}
                                            : std::vector<int64_t>{L, B, rc.input_size},
                             rng);
    const std::vector<int64_t> state_shape{rc.num_layers * D, B, rc.hidden_size};
    Tensor h0 = random_tensor(state_shape, rng), c0 = random_tensor(state_shape, rng);
    std::vector<int32_t> lengths(B);
    for (auto& n : lengths) n = static_cast<int32_t>(1 + pick(L));
    const TensorView lengths_view = with_lengths ? TensorView(lengths.data(), DType::i32, {B}) : TensorView();
    const int64_t out_n = B * L * D * rc.hidden_size, state_n = h0.numel();
    // Output, h_n and (LSTM) c_n, flattened into one tensor for the loss.
    auto forward = [&] {
      nn::RecurrentOutput o = rnn.forward(x, with_h0 ? TensorView(h0) : TensorView(),
                                          with_c0 ? TensorView(c0) : TensorView(), lengths_view);
      Tensor all(DType::f32, {out_n + (lstm ? 2 : 1) * state_n});
      float* at = all.data_as<float>();
      std::memcpy(at, o.output.data(), sizeof(float) * out_n);
      std::memcpy(at + out_n, o.h_n.data(), sizeof(float) * state_n);
      if (lstm) std::memcpy(at + out_n + state_n, o.c_n.data(), sizeof(float) * state_n);
      return all;
    };
    nn::RecurrentGrads g;
    auto backward = [&](const Tensor& dall) {
      const float* d = dall.data_as<float>();
      const std::vector<int64_t> out_shape = rc.batch_first ? std::vector<int64_t>{B, L, D * rc.hidden_size}
                                                            : std::vector<int64_t>{L, B, D * rc.hidden_size};
      g = rnn.backward(TensorView(d, DType::f32, out_shape), TensorView(d + out_n, DType::f32, state_shape),
                       lstm ? TensorView(d + out_n + state_n, DType::f32, state_shape) : TensorView());
    };
    auto slots = parameter_slots(rnn);
    slots.push_back({"input", x.data_as<float>(), x.numel(), [&] { return g.dinput.data_as<float>(); }});
    if (with_h0) slots.push_back({"h0", h0.data_as<float>(), h0.numel(), [&] { return g.dh0.data_as<float>(); }});
    if (with_c0) slots.push_back({"c0", c0.data_as<float>(), c0.numel(), [&] { return g.dc0.data_as<float>(); }});
    rnn.zero_grad();
    check_gradients(forward, backward, slots, rng, 3e-3f, 1e-2, 1e-3);
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
