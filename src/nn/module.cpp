// Module tree, parameter registry, seeded initialisation.
#include "attn/nn/module.hpp"

#include <cmath>
#include <cstring>

#include "attn/error.hpp"

namespace attn::nn {

Parameter& Module::register_parameter(const std::string& name, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  Parameter p;
  p.shape = std::move(shape);
  p.value.assign(static_cast<size_t>(n), 0.0f);
  p.grad.assign(static_cast<size_t>(n), 0.0f);
  params_.emplace_back(name, std::move(p));
  return params_.back().second;
}

void Module::register_module(const std::string& name, Module& child) { children_.emplace_back(name, &child); }

void Module::collect(const std::string& prefix, std::vector<std::pair<std::string, Parameter*>>& out) {
  for (auto& [name, p] : params_) out.emplace_back(prefix + name, &p);
  for (auto& [name, child] : children_) child->collect(name.empty() ? prefix : prefix + name + ".", out);
}

std::vector<std::pair<std::string, Parameter*>> Module::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  collect("", out);
  return out;
}

Parameter& Module::parameter(const std::string& name) {
  for (auto& [n, p] : named_parameters())
    if (n == name) return *p;
  throw Error("Module::parameter: no parameter named \"" + name + "\"");
}

void Module::zero_grad() {
  for (auto& [name, p] : named_parameters()) std::fill(p->grad.begin(), p->grad.end(), 0.0f);
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (auto& [name, p] : named_parameters()) n += p->numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

// ---- Rng -------------------------------------------------------------------

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Rng::Rng(uint64_t seed) {
  for (uint64_t& s : s_) s = splitmix64(seed);
}

uint64_t Rng::next_u64() {  // xoshiro256** (Blackman & Vigna)
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

float Rng::uniform(float lo, float hi) {
  const double u = static_cast<double>(next_u64() >> 11) * 0x1.0p-53;  // [0, 1)
  return static_cast<float>(lo + (hi - lo) * u);
}

float Rng::normal() {
  const double u1 = (static_cast<double>(next_u64() >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
  const double u2 = static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

void init_uniform(Parameter& p, float bound, Rng& rng) {
  for (float& x : p.value) x = rng.uniform(-bound, bound);
}
void init_normal(Parameter& p, float std, Rng& rng) {
  for (float& x : p.value) x = std * rng.normal();
}
void init_xavier_uniform(Parameter& p, Rng& rng) {
  const int64_t fan_out = p.shape[0];
  const int64_t fan_in = p.shape.size() > 1 ? p.numel() / fan_out : 1;
  init_uniform(p, static_cast<float>(std::sqrt(6.0 / double(fan_in + fan_out))), rng);
}
void init_constant(Parameter& p, float value) { std::fill(p.value.begin(), p.value.end(), value); }

// ---- tensor helpers ----------------------------------------------------------

Tensor zeros(std::vector<int64_t> shape) {
  Tensor t(DType::f32, std::move(shape));
  if (t.numel() > 0) std::memset(t.data(), 0, static_cast<size_t>(t.numel()) * sizeof(float));
  return t;
}

void expect_f32(const TensorView& t, int rank, const char* what) {
  if (t.empty()) throw Error(std::string(what) + ": a tensor is required, got none");
  if (t.dtype() != DType::f32)
    throw Error(std::string(what) + ": expected an f32 tensor, got " + t.describe());
  if (rank >= 0 && t.rank() != rank)
    throw Error(std::string(what) + ": expected rank " + std::to_string(rank) + ", got " + t.describe());
  if (!t.is_contiguous()) throw Error(std::string(what) + ": expected a contiguous tensor, got " + t.describe());
}

Tensor clone(const TensorView& t) {
  expect_f32(t, -1, "clone");
  Tensor out(DType::f32, t.shape());
  if (t.numel() > 0) std::memcpy(out.data(), t.data(), static_cast<size_t>(t.numel()) * sizeof(float));
  return out;
}

}  // namespace attn::nn
