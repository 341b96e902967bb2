// Cross-entropy, clipping, optimizers and schedules.
#include "attn/train/optim.hpp"

#include <cmath>
#include <limits>

#include "attn/error.hpp"
#include "train/json_fields.hpp"

namespace attn::train {

CrossEntropyResult cross_entropy(const TensorView& logits, const std::vector<int32_t>& targets, int32_t ignore_index,
                                 float label_smoothing) {
  nn::expect_f32(logits, -1, "cross_entropy: logits");
  if (logits.rank() < 1) throw Error("cross_entropy: logits must have a class dimension");
  const int64_t V = logits.size(logits.rank() - 1), N = V == 0 ? 0 : logits.numel() / V;
  if (static_cast<int64_t>(targets.size()) != N)
    throw Error("cross_entropy: " + std::to_string(targets.size()) + " targets for " + std::to_string(N) +
                " rows of logits " + logits.describe());
  if (!(label_smoothing >= 0.0f && label_smoothing <= 1.0f))
    throw Error("cross_entropy: label_smoothing must be in [0, 1], got " + std::to_string(label_smoothing));
  CrossEntropyResult r;
  r.dlogits = nn::zeros(logits.shape());
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    if (t == ignore_index) continue;
    if (t < 0 || t >= V)
      throw Error("cross_entropy: target " + std::to_string(t) + " (row " + std::to_string(n) + ") outside [0, " +
                  std::to_string(V) + ")");
    ++r.counted;
  }
  if (r.counted == 0) return r;
  const double eps = label_smoothing, inv_count = 1.0 / double(r.counted);
  const float* x = logits.data_as<float>();
  float* g = r.dlogits.data_as<float>();
  double total = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    if (t == ignore_index) continue;
    const float* row = x + n * V;
    double mx = -std::numeric_limits<double>::infinity(), sum = 0, mean_logit = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
    for (int64_t v = 0; v < V; ++v) {
      sum += std::exp(row[v] - mx);
      mean_logit += row[v];
    }
    const double lse = mx + std::log(sum);
    mean_logit /= double(V);
    // loss = (1 − ε)·(lse − x_t) + ε·(lse − mean(x))
    total += (1.0 - eps) * (lse - row[t]) + eps * (lse - mean_logit);
    // d loss / d x_v = softmax_v − (1 − ε)·[v = t] − ε/V, averaged over the counted rows
    for (int64_t v = 0; v < V; ++v) {
      const double p = std::exp(row[v] - lse);
      g[n * V + v] = static_cast<float>((p - (v == t ? 1.0 - eps : 0.0) - eps / double(V)) * inv_count);
    }
  }
  r.loss = total * inv_count;
  return r;
}

double clip_grad_norm(const std::vector<nn::Parameter*>& params, double max_norm) {
  double sq = 0;
  for (const nn::Parameter* p : params)
    for (float g : p->grad) sq += double(g) * g;
  const double norm = std::sqrt(sq);
  if (norm > max_norm) {
    const float scale = static_cast<float>(max_norm / (norm + 1e-6));
    for (nn::Parameter* p : params)
      for (float& g : p->grad) g *= scale;
  }
  return norm;
}

std::vector<nn::Parameter*> parameters_of(nn::Module& m) {
  std::vector<nn::Parameter*> out;
  for (auto& [name, p] : m.named_parameters()) out.push_back(p);
  return out;
}

io::SafeTensors Optimizer::state() const {
  io::SafeTensors s;
  for (size_t i = 0; i < m_.size(); ++i)
    s.tensors["m." + std::to_string(i)] = io::SafeTensor::from_f32({int64_t(m_[i].size())}, m_[i].data());
  for (size_t i = 0; i < v_.size(); ++i)
    s.tensors["v." + std::to_string(i)] = io::SafeTensor::from_f32({int64_t(v_[i].size())}, v_[i].data());
  s.metadata["steps"] = std::to_string(steps_);
  return s;
}

void Optimizer::load_state(const io::SafeTensors& s) {
  auto load = [&](std::vector<std::vector<float>>& dst, const char* prefix) {
    for (size_t i = 0; i < dst.size(); ++i) {
      const std::vector<float> v = s.at(prefix + std::to_string(i)).to_f32();
      if (v.size() != dst[i].size())
        throw Error(std::string("optimizer state: ") + prefix + std::to_string(i) + " has " +
                    std::to_string(v.size()) + " values, the parameter " + std::to_string(dst[i].size()));
      dst[i] = v;
    }
  };
  load(m_, "m.");
  load(v_, "v.");
  auto it = s.metadata.find("steps");
  if (it == s.metadata.end()) throw Error("optimizer state: no step count");
  steps_ = parse_count(it->second, int64_t{1} << 50, "optimizer state: the step count (metadata \"steps\")");
}

SGD::SGD(std::vector<nn::Parameter*> params, double lr, double momentum, double weight_decay, bool nesterov)
    : Optimizer(std::move(params)), momentum_(momentum), weight_decay_(weight_decay), nesterov_(nesterov) {
  lr_ = lr;
  if (momentum_ != 0.0)
    for (nn::Parameter* p : params_) m_.emplace_back(p->value.size(), 0.0f);
}

void SGD::step() {
  ++steps_;
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter& p = *params_[i];
    for (size_t e = 0; e < p.value.size(); ++e) {
      double g = p.grad[e] + weight_decay_ * p.value[e];
      if (momentum_ != 0.0) {
        // PyTorch: the first step initialises the buffer with the gradient itself.
        const double buf = steps_ == 1 ? g : momentum_ * m_[i][e] + g;
        m_[i][e] = static_cast<float>(buf);
        g = nesterov_ ? g + momentum_ * buf : buf;
      }
      p.value[e] = static_cast<float>(p.value[e] - lr_ * g);
    }
  }
}

Adam::Adam(std::vector<nn::Parameter*> params, double lr, double beta1, double beta2, double eps, double weight_decay,
           bool decoupled)
    : Optimizer(std::move(params)), b1_(beta1), b2_(beta2), eps_(eps), wd_(weight_decay), decoupled_(decoupled) {
  lr_ = lr;
  for (nn::Parameter* p : params_) {
    m_.emplace_back(p->value.size(), 0.0f);
    v_.emplace_back(p->value.size(), 0.0f);
  }
}

void Adam::step() {
  ++steps_;
  const double c1 = 1.0 - std::pow(b1_, double(steps_)), c2 = 1.0 - std::pow(b2_, double(steps_));
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter& p = *params_[i];
    for (size_t e = 0; e < p.value.size(); ++e) {
      double w = p.value[e];
      double g = p.grad[e];
      if (decoupled_) w -= lr_ * wd_ * w;
      else g += wd_ * w;
      const double m = b1_ * m_[i][e] + (1.0 - b1_) * g;
      const double v = b2_ * v_[i][e] + (1.0 - b2_) * g * g;
      m_[i][e] = static_cast<float>(m);
      v_[i][e] = static_cast<float>(v);
      w -= lr_ * (m / c1) / (std::sqrt(v / c2) + eps_);
      p.value[e] = static_cast<float>(w);
    }
  }
}

double warmup_cosine_lr(int64_t step, double peak, int64_t warmup, int64_t total, double min_lr) {
  if (step < 1) step = 1;
  if (warmup > 0 && step <= warmup) return peak * double(step) / double(warmup);
  if (step >= total) return min_lr;
  const double progress = double(step - warmup) / double(std::max<int64_t>(1, total - warmup));
  return min_lr + 0.5 * (peak - min_lr) * (1.0 + std::cos(M_PI * progress));
}

double inverse_sqrt_lr(int64_t step, int64_t d_model, int64_t warmup, double factor) {
  if (step < 1) step = 1;
  return factor / std::sqrt(double(d_model)) *
         std::min(1.0 / std::sqrt(double(step)), double(step) * std::pow(double(std::max<int64_t>(1, warmup)), -1.5));
}

}  // namespace attn::train
