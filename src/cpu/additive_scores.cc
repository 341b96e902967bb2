// Additive-attention scores with Highway's vectorised tanh (runtime dispatch).
#include "cpu/additive_scores.hpp"

#include <cmath>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/additive_scores.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void AdditiveScores(const float* qp, const float* kp, const float* v, int64_t S, int64_t A, float* e) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t j = 0; j < S; ++j) {
    const float* k = kp + j * A;
    auto acc = hn::Zero(d);
    int64_t a = 0;
    for (; a + N <= A; a += N) {
      const auto t = hn::Tanh(d, hn::Add(hn::LoadU(d, qp + a), hn::LoadU(d, k + a)));
      acc = hn::MulAdd(hn::LoadU(d, v + a), t, acc);
    }
    float s = hn::GetLane(hn::SumOfLanes(d, acc));
    for (; a < A; ++a) s += v[a] * std::tanh(qp[a] + k[a]);
    e[j] = s;
  }
}

void AdditiveScoresBackward(const float* qp, const float* kp, const float* v, const float* de, int64_t S, int64_t A,
                            float* dqp, float* dkp, float* dv) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto one = hn::Set(d, 1.0f);
  for (int64_t j = 0; j < S; ++j) {
    if (de[j] == 0.0f) continue;  // masked keys (and exact zeros) contribute nothing
    const float* k = kp + j * A;
    float* dk = dkp + j * A;
    const auto dej = hn::Set(d, de[j]);
    int64_t a = 0;
    for (; a + N <= A; a += N) {
      // forward: e_j = Σ_a v_a·t_a, t = tanh(qp + kp_j)
      const auto t = hn::Tanh(d, hn::Add(hn::LoadU(d, qp + a), hn::LoadU(d, k + a)));
      hn::StoreU(hn::MulAdd(dej, t, hn::LoadU(d, dv + a)), d, dv + a);
      const auto g = hn::Mul(hn::Mul(dej, hn::LoadU(d, v + a)), hn::NegMulAdd(t, t, one));
      hn::StoreU(hn::Add(hn::LoadU(d, dqp + a), g), d, dqp + a);
      hn::StoreU(hn::Add(hn::LoadU(d, dk + a), g), d, dk + a);
    }
    for (; a < A; ++a) {
      const float t = std::tanh(qp[a] + k[a]);
      dv[a] += de[j] * t;
      const float g = de[j] * v[a] * (1.0f - t * t);
      dqp[a] += g;
      dk[a] += g;
    }
  }
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

HWY_EXPORT(AdditiveScores);
HWY_EXPORT(AdditiveScoresBackward);

void additive_scores(const float* qp, const float* kp, const float* v, int64_t S, int64_t A, float* e) {
  HWY_DYNAMIC_DISPATCH(AdditiveScores)(qp, kp, v, S, A, e);
}

void additive_scores_backward(const float* qp, const float* kp, const float* v, const float* de, int64_t S,
                              int64_t A, float* dqp, float* dkp, float* dv) {
  HWY_DYNAMIC_DISPATCH(AdditiveScoresBackward)(qp, kp, v, de, S, A, dqp, dkp, dv);
}

}  // namespace attn::detail
#endif  // HWY_ONCE
