// GRU and LSTM: cells (one time step, for decoders that step by hand) and layers
// (multi-layer, bidirectional, variable lengths), with PyTorch's parameter layout,
// gate order and names, and backward through time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attn/nn/layers.hpp"

namespace attn::nn {

/// One GRU step, PyTorch's nn.GRUCell: gates in the order r, z, n,
///   r = σ(W_ir x + b_ir + W_hr h + b_hr),  z = σ(W_iz x + b_iz + W_hz h + b_hz),
///   n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)),  h' = (1 − z) ⊙ n + z ⊙ h.
/// Parameters weight_ih [3H, I], weight_hh [3H, H], bias_ih [3H], bias_hh [3H],
/// initialised U(±1/√H) as PyTorch.
class GRUCell : public Module {
 public:
  /// What step_backward needs from one step (owned by the caller, one per step).
  struct Cache {
    Tensor x, h, r, z, n, hn;  // hn = W_hn h + b_hn
  };
  GRUCell(int64_t input_size, int64_t hidden_size, bool bias, Rng& rng);
  /// x [B, I], h [B, H] → h' [B, H]; records the step in `cache`.
  Tensor step(const TensorView& x, const TensorView& h, Cache& cache);
  /// Backward of one step given d(loss)/d(h'): adds into dx [B, I] and dh [B, H]
  /// (both must be zero-initialised or hold other contributions) and the parameters' grads.
  void step_backward(const Cache& cache, const TensorView& dh_next, Tensor& dx, Tensor& dh);
  /// Module-style single step (keeps the cache of the last call).
  Tensor forward(const TensorView& x, const TensorView& h) { return step(x, h, last_); }
  /// Returns {dx, dh} of the last forward.
  std::pair<Tensor, Tensor> backward(const TensorView& dh_next);

  int64_t input_size() const { return in_; }
  int64_t hidden_size() const { return hid_; }
  Parameter &weight_ih, &weight_hh;
  Parameter *bias_ih, *bias_hh;

 private:
  int64_t in_, hid_;
  Cache last_;
};

/// One LSTM step, PyTorch's nn.LSTMCell: gates i, f, g, o,
///   c' = σ(f) ⊙ c + σ(i) ⊙ tanh(g),  h' = σ(o) ⊙ tanh(c').
/// Parameters weight_ih [4H, I], weight_hh [4H, H], bias_ih [4H], bias_hh [4H].
class LSTMCell : public Module {
 public:
  struct Cache {
    Tensor x, h, c, i, f, g, o, c_next;
  };
  LSTMCell(int64_t input_size, int64_t hidden_size, bool bias, Rng& rng);
  /// x [B, I], (h, c) [B, H] → (h', c').
  std::pair<Tensor, Tensor> step(const TensorView& x, const TensorView& h, const TensorView& c, Cache& cache);
  /// Adds into dx, dh, dc given d(loss)/d(h') and d(loss)/d(c').
  void step_backward(const Cache& cache, const TensorView& dh_next, const TensorView& dc_next, Tensor& dx,
                     Tensor& dh, Tensor& dc);

  int64_t input_size() const { return in_; }
  int64_t hidden_size() const { return hid_; }
  Parameter &weight_ih, &weight_hh;
  Parameter *bias_ih, *bias_hh;

 private:
  int64_t in_, hid_;
};

struct RecurrentConfig {
  int64_t input_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 1;
  bool bias = true;
  bool batch_first = false;
  float dropout = 0.0f;  ///< between layers (not after the last), training mode only
  bool bidirectional = false;
  uint64_t seed = 0;     ///< dropout stream
};

struct RecurrentOutput {
  Tensor output;  ///< [L, B, D·H] ([B, L, D·H] when batch_first); zero past a sequence's length
  Tensor h_n;     ///< [num_layers·D, B, H]: each direction's state after its last valid step
  Tensor c_n;     ///< LSTM only: the cell states, like h_n
};

struct RecurrentGrads {
  Tensor dinput, dh0, dc0;  ///< dc0 for LSTM only
};

/// Multi-layer, optionally bidirectional GRU or LSTM with PyTorch's names:
/// weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k}, and "_reverse" for the
/// backward direction. Layer k > 0 reads [forward ‖ backward] outputs of layer k − 1.
/// Variable lengths (optional, int32 [B], each in [1, L]) behave as PyTorch's packed
/// sequences: steps past a sequence's length leave its state unchanged and output 0,
/// and the reverse direction starts at the sequence's own last position.
class RecurrentLayers : public Module {
 public:
  enum class Kind { gru, lstm };
  RecurrentLayers(Kind kind, const RecurrentConfig& config, Rng& rng);
  ~RecurrentLayers() override;

  /// input [L, B, I] ([B, L, I] when batch_first); h0 (and c0 for LSTM)
  /// [num_layers·D, B, H] or absent for zeros; lengths int32 [B] or absent.
  RecurrentOutput forward(const TensorView& input, const TensorView& h0 = {}, const TensorView& c0 = {},
                          const TensorView& lengths = {});
  /// Gradients of the last forward: doutput like output; dh_n, dc_n like h_n or absent.
  RecurrentGrads backward(const TensorView& doutput, const TensorView& dh_n = {}, const TensorView& dc_n = {});

  const RecurrentConfig& config() const { return cfg_; }
  Kind kind() const { return kind_; }

 private:
  struct Direction;  // weights and the caches of one (layer, direction)
  void run_direction(Direction& d, const float* x, int64_t in, const float* h0, const float* c0, float* out,
                     int64_t out_stride, float* hn, float* cn);
  void backprop_direction(Direction& d, const float* dout, int64_t out_stride, float* dx, float* dh, float* dc);

  Kind kind_;
  RecurrentConfig cfg_;
  int64_t gates_, dirs_;
  std::vector<std::unique_ptr<Direction>> dirs_by_layer_;  // layer·D + direction
  std::vector<std::unique_ptr<Dropout>> dropouts_;
  // Last forward.
  int64_t L_ = 0, B_ = 0;
  std::vector<int32_t> lengths_;
  std::vector<Tensor> layer_inputs_;  // time-major [L·B, in] per layer (after dropout)
  bool have_forward_ = false;
};

/// nn.GRU: RecurrentLayers with GRU cells.
class GRU : public RecurrentLayers {
 public:
  GRU(const RecurrentConfig& config, Rng& rng) : RecurrentLayers(Kind::gru, config, rng) {}
};

/// nn.LSTM: RecurrentLayers with LSTM cells (forward takes c0 and returns c_n).
class LSTM : public RecurrentLayers {
 public:
  LSTM(const RecurrentConfig& config, Rng& rng) : RecurrentLayers(Kind::lstm, config, rng) {}
};

}  // namespace attn::nn
