// Training pieces: softmax cross-entropy (fused, stable, with ignore_index and label
// smoothing), SGD with momentum, Adam and AdamW, gradient-norm clipping, and the
// learning-rate schedules of modern and original Transformer training. All of it is
// sequential and deterministic: a run is bitwise reproducible for a seed.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attn/io/safetensors.hpp"
#include "attn/nn/module.hpp"

namespace attn::train {

struct CrossEntropyResult {
  double loss = 0;        ///< mean over the counted rows (0 when none is counted)
  int64_t counted = 0;    ///< rows whose target is not ignore_index
  Tensor dlogits;         ///< d(loss)/d(logits), same shape as logits (0 on ignored rows)
};

/// Softmax cross-entropy of logits [N, V] (or [.., V]) against int32 targets (N of them),
/// as PyTorch's F.cross_entropy(reduction="mean"): rows whose target is ignore_index do not
/// count; with label smoothing ε the target distribution is (1 − ε)·onehot + ε/V. Computed
/// with a max-shifted log-sum-exp in double per row; returns the gradient too (fused).
CrossEntropyResult cross_entropy(const TensorView& logits, const std::vector<int32_t>& targets,
                                 int32_t ignore_index = -100, float label_smoothing = 0.0f);

/// Scales all gradients so that their global L2 norm is at most max_norm (PyTorch's
/// clip_grad_norm_: factor max_norm / (norm + 1e-6) when norm > max_norm). Returns the
/// norm before clipping.
double clip_grad_norm(const std::vector<nn::Parameter*>& params, double max_norm);

/// Every parameter of a module, in named_parameters() order (what optimizers take).
std::vector<nn::Parameter*> parameters_of(nn::Module& m);

/// Optimizers update parameters from their accumulated gradients (they do not zero them).
class Optimizer {
 public:
  explicit Optimizer(std::vector<nn::Parameter*> params) : params_(std::move(params)) {}
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void set_lr(double lr) { lr_ = lr; }
  double lr() const { return lr_; }
  int64_t steps() const { return steps_; }
  /// The optimizer's state (moments, step count) for checkpoints, and back.
  virtual io::SafeTensors state() const;
  virtual void load_state(const io::SafeTensors& state);

 protected:
  std::vector<nn::Parameter*> params_;
  double lr_ = 1e-3;
  int64_t steps_ = 0;
  std::vector<std::vector<float>> m_, v_;  // per-parameter moments (as the optimizer needs)
};

/// SGD with momentum (PyTorch's: buf = μ·buf + g (+ wd·p), p −= lr·buf; nesterov uses g + μ·buf).
class SGD : public Optimizer {
 public:
  SGD(std::vector<nn::Parameter*> params, double lr, double momentum = 0.0, double weight_decay = 0.0,
      bool nesterov = false);
  void step() override;

 private:
  double momentum_, weight_decay_;
  bool nesterov_;
};

/// Adam (Kingma & Ba) with bias correction; weight_decay is L2 added to the gradient
/// (torch.optim.Adam). With decoupled = true it is AdamW (Loshchilov & Hutter):
/// p −= lr·wd·p before the Adam update (torch.optim.AdamW).
class Adam : public Optimizer {
 public:
  Adam(std::vector<nn::Parameter*> params, double lr, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8,
       double weight_decay = 0.0, bool decoupled = false);
  void step() override;

 private:
  double b1_, b2_, eps_, wd_;
  bool decoupled_;
};

/// AdamW with PyTorch's default weight decay 0.01.
inline Adam AdamW(std::vector<nn::Parameter*> params, double lr, double weight_decay = 0.01) {
  return Adam(std::move(params), lr, 0.9, 0.999, 1e-8, weight_decay, /*decoupled=*/true);
}

/// Linear warm-up from 0 to peak over `warmup` steps, then a cosine decay to min_lr at
/// `total` steps (constant min_lr after). step counts from 1.
double warmup_cosine_lr(int64_t step, double peak, int64_t warmup, int64_t total, double min_lr = 0.0);
/// "Attention Is All You Need", eq. (3): factor · d_model^−0.5 · min(step^−0.5, step·warmup^−1.5).
double inverse_sqrt_lr(int64_t step, int64_t d_model, int64_t warmup, double factor = 1.0);

}  // namespace attn::train
