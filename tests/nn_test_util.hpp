// Helpers for the nn tests: seeded random tensors and a finite-difference
// gradient check that works on any forward/backward pair.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attention_harness.hpp"  // base_seed(): fresh per run, ATTN_TEST_SEED reproduces
#include "attn/nn/module.hpp"

namespace attn::testing {

/// A generator for this run's seed and a per-test salt.
inline nn::Rng nn_rng(uint64_t salt) { return nn::Rng(base_seed() * 0x9E3779B97F4A7C15ull + salt); }

/// An f32 tensor of this shape with entries ~ U(lo, hi).
inline Tensor random_tensor(std::vector<int64_t> shape, nn::Rng& rng, float lo = -1.0f, float hi = 1.0f) {
  Tensor t(DType::f32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = rng.uniform(lo, hi);
  return t;
}

inline std::string seed_note() { return "ATTN_TEST_SEED=" + std::to_string(base_seed()); }

/// Something whose gradient is checked: its values (perturbed in place) and where
/// backward left the analytic gradient.
struct GradSlot {
  std::string name;
  float* value;
  int64_t size;
  std::function<const float*()> grad;  // read after backward
};

/// Slots for every parameter of `m` (call m.zero_grad() before the backward).
inline std::vector<GradSlot> parameter_slots(nn::Module& m) {
  std::vector<GradSlot> slots;
  for (auto& [name, p] : m.named_parameters())
    slots.push_back({name, p->value.data(), p->numel(), [p = p] { return p->grad.data(); }});
  return slots;
}

/// Central finite differences of L = Σ forward()·G (G random, fixed) against the
/// analytic gradient that backward(G) produces, on up to `samples` random elements
/// of each slot. All in f32, so the bar is relative over the sampled vector:
/// ‖fd − analytic‖ ≤ tol·‖analytic‖ + atol. A wrong formula is off by O(1).
inline void check_gradients(const std::function<Tensor()>& forward,
                            const std::function<void(const Tensor& dout)>& backward,
                            const std::vector<GradSlot>& slots, nn::Rng& rng, float eps = 1e-2f,
                            double tol = 1e-2, double atol = 1e-4, int samples = 24) {
  Tensor out = forward();
  Tensor g = random_tensor(out.shape(), rng);
  backward(g);
  auto loss = [&] {
    Tensor o = forward();
    double s = 0;
    for (int64_t i = 0; i < o.numel(); ++i) s += double(o.data_as<float>()[i]) * g.data_as<float>()[i];
    return s;
  };
  for (const GradSlot& slot : slots) {
    std::vector<double> fd, an;
    const float* grad = slot.grad();
    std::vector<float> analytic(grad, grad + slot.size);  // later forwards may move caches
    for (int s = 0; s < std::min<int64_t>(samples, slot.size); ++s) {
      const int64_t i = slot.size <= samples ? s : static_cast<int64_t>(rng.next_u64() % slot.size);
      const float x = slot.value[i];
      slot.value[i] = x + eps;
      const double lp = loss();
      slot.value[i] = x - eps;
      const double lm = loss();
      slot.value[i] = x;
      fd.push_back((lp - lm) / (2.0 * double(eps)));
      an.push_back(analytic[i]);
    }
    double diff = 0, norm = 0;
    for (size_t k = 0; k < fd.size(); ++k) {
      diff += (fd[k] - an[k]) * (fd[k] - an[k]);
      norm += an[k] * an[k];
    }
    diff = std::sqrt(diff);
    norm = std::sqrt(norm);
    EXPECT_LE(diff, tol * norm + atol) << "gradient of " << slot.name << ": |fd - analytic| = " << diff
                                       << ", |analytic| = " << norm << " (" << seed_note() << ")";
  }
}

/// Largest |a − b| / max(|b|max, tiny) over two arrays (relative to b's scale).
inline double max_rel_diff(const float* a, const float* b, int64_t n) {
  double scale = 1e-30, worst = 0;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(double(b[i])));
  for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return worst / scale;
}

}  // namespace attn::testing
