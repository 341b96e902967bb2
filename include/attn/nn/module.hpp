// Modules: named parameters with their gradients, and the tree that names them.
//
// Every module in attn::nn has an explicit forward and backward in the style of
// llm.c: forward keeps what backward needs (inside the module, for the most
// recent call), and backward takes d(loss)/d(output), returns d(loss)/d(input)
// and *adds* into each parameter's gradient. Parameters carry PyTorch's names
// ("self_attn.in_proj_weight", "weight_hh_l0_reverse"), so weights move between
// attn and PyTorch through safetensors files (attn/io/safetensors.hpp).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::nn {

/// A learnable f32 tensor and the gradient accumulated into it (same shape).
struct Parameter {
  std::vector<int64_t> shape;
  std::vector<float> value;
  std::vector<float> grad;
  int64_t numel() const { return static_cast<int64_t>(value.size()); }
};

/// Base of every module: owns its parameters, knows its child modules.
/// Modules are neither copied nor moved (children are referred to by address);
/// hold them by value inside the parent or in std::unique_ptr.
class Module {
 public:
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  virtual ~Module() = default;

  /// All parameters of this module and its children, depth first, as
  /// (PyTorch name, parameter), e.g. ("layers.0.linear1.weight", …).
  std::vector<std::pair<std::string, Parameter*>> named_parameters();
  /// The parameter with this full name; throws attn::Error if there is none.
  Parameter& parameter(const std::string& name);
  /// Sets every gradient to zero (backward adds into them).
  void zero_grad();
  /// Total number of learnable scalars.
  int64_t num_parameters();

  /// Training mode switches dropout on; evaluation mode (the default after
  /// construction is training, as in PyTorch) switches it off. Recursive.
  void train(bool on = true);
  void eval() { train(false); }
  bool training() const { return training_; }

 protected:
  /// Creates a parameter of this shape (value and gradient zero-filled).
  Parameter& register_parameter(const std::string& name, std::vector<int64_t> shape);
  /// Makes `child`'s parameters appear under "name." (directly under this
  /// module's prefix when `name` is empty, as PyTorch's flat layer names need).
  void register_module(const std::string& name, Module& child);

 private:
  void collect(const std::string& prefix, std::vector<std::pair<std::string, Parameter*>>& out);

  bool training_ = true;
  std::deque<std::pair<std::string, Parameter>> params_;  // deque: stable addresses
  std::vector<std::pair<std::string, Module*>> children_;
};

/// A seeded, platform-independent random stream (SplitMix64 seeding xoshiro256**),
/// for initialisation and test data: the same seed gives the same numbers everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next_u64();
  /// Uniform in [lo, hi).
  float uniform(float lo, float hi);
  /// Standard normal (Box–Muller).
  float normal();

 private:
  uint64_t s_[4];
};

/// Fills `p` with U(-bound, bound).
void init_uniform(Parameter& p, float bound, Rng& rng);
/// Fills `p` with N(0, std²).
void init_normal(Parameter& p, float std, Rng& rng);
/// Xavier/Glorot uniform for a [fan_out, fan_in] matrix: bound √(6/(fan_in+fan_out)).
void init_xavier_uniform(Parameter& p, Rng& rng);
/// Fills `p` with a constant.
void init_constant(Parameter& p, float value);

/// Threads OpenBLAS may use for the modules' matrix products. The products of small
/// models (a few hundred rows) run fastest on one thread: OpenBLAS's own pool costs more
/// than it saves there, so training tools call set_blas_threads(1).
void set_blas_threads(int n);

/// An owning f32 tensor of this shape filled with zeros.
Tensor zeros(std::vector<int64_t> shape);
/// A contiguous f32 copy of `t` (which must be contiguous f32).
Tensor clone(const TensorView& t);
/// Checks that `t` is a contiguous f32 tensor of this rank (any rank when rank < 0);
/// throws attn::Error naming `what` otherwise.
void expect_f32(const TensorView& t, int rank, const char* what);

}  // namespace attn::nn
