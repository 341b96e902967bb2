// Test harness for the attention forward: builds random inputs for a
// configuration, runs the fused kernel, the float64 reference (the oracle) and
// the same reference in f32 (the "plain f32 implementation"), and reports
// errors. Inputs are fresh random numbers every run; the seed is printed by
// gtest on failure (ATTN_TEST_SEED reproduces a run).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attn/attention.hpp"

namespace attn::testing {

/// The run's base seed: ATTN_TEST_SEED if set, else from std::random_device.
uint64_t base_seed();

/// A generator seeded from the base seed and a per-test salt.
std::mt19937_64 make_rng(uint64_t salt);

/// Expects `call` to throw attn::Error whose message contains `needle`.
inline void expect_attn_error(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no error; expected " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

/// Runs `call` with n kernel threads, then restores the thread count it found.
inline void with_threads(int n, const std::function<void()>& call) {
  const int before = num_threads();
  set_num_threads(n);
  call();
  set_num_threads(before);
}

/// Sets environment variable `name` for its lifetime (value nullptr: unsets it),
/// then restores the previous value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

/// Turns off the few-query route (ATTN_FEW_QUERIES=0, kvcache/few_queries.hpp) for its
/// lifetime, so that short calls run on the tiled kernels.
class FewQueriesOff : public ScopedEnv {
 public:
  FewQueriesOff() : ScopedEnv("ATTN_FEW_QUERIES", "0") {}
};

/// One configuration. Option tensors (masks, slopes, lengths) are owned here;
/// use the set_* helpers so the views in `opt` point at the storage.
struct Config {
  int B = 1, Lq = 17, Lk = 17, Hq = 1, Hkv = 1, d = 16, dv = 16;
  bool bhsd = false;             // store q, k, v, out as [B, H, L, d] and pass BSHD views
  std::vector<int> seq_q, seq_k;  // non-empty: packed varlen batch with these lengths
  float input_scale = 1.0f;      // q and k are uniform in ±input_scale
  bool want_lse = true, want_probs = false;
  AttentionOptions opt;

  std::vector<uint8_t> bool_mask_data;
  std::vector<float> add_mask_data, alibi_data;
  std::vector<int32_t> cu_q_data, cu_k_data, key_length_data;

  /// Random boolean mask of `shape` (broadcast over [B, Hq, Lq, Lk]), each entry
  /// true with probability p_true.
  void set_bool_mask(std::vector<int64_t> shape, std::mt19937_64& rng, double p_true = 0.7);
  /// Random additive mask of `shape`: uniform in ±2, with a fraction of −∞.
  void set_add_mask(std::vector<int64_t> shape, std::mt19937_64& rng, double p_neg_inf = 0.1);
  /// Random positive ALiBi slopes, [Hq] or [B, Hq].
  void set_alibi(bool per_batch, std::mt19937_64& rng);
  /// Random key lengths in [0, Lk] (min_len ≤ each).
  void set_key_lengths(std::mt19937_64& rng, int min_len = 0);
  /// Packed varlen batch of these lengths (sets B, Lq, Lk to the totals' maxima).
  void set_varlen(std::vector<int> lens_q, std::vector<int> lens_k);

  std::string describe() const;
};

/// Errors of one run. Relative errors are ‖x − ref‖₂ / ‖ref‖₂ over all elements
/// (0 when both are 0); for lse each entry is divided by max(1, |ref|) first and
/// only finite entries count. The squared sums are kept so that a test can pool
/// its cases (ErrorLedger).
struct Errors {
  // Relative errors divide by max(‖ref‖, floor·√n): a result that cancels to 0
  // exactly has no relative error, so below an RMS of `floor` per element the
  // error counts as absolute. Outputs: floor 1e-3 (typical elements 0.01–1);
  // gradients: floor 1e-2, about their typical size here (dq elements ~1e-2).
  struct Sums {
    double fused = 0, plain = 0, ref = 0;  // Σ(fused − ref)², Σ(plain − ref)², Σ ref²
    double count = 0;                      // elements
    double nonzero = 0;                    // elements whose reference is not 0 (exact zeros
                                           // of removed keys and rows carry no rounding)
    double floor = 1e-3;
    double fused_rel() const;
    double plain_rel() const;
    void add(const Sums& o) {
      fused += o.fused, plain += o.plain, ref += o.ref, count += o.count, nonzero += o.nonzero, floor = o.floor;
    }
  };
  Sums out, lse, probs;
  bool nan = false;                   // any NaN in a fused output
  bool lse_inf_mismatch = false;      // −∞ pattern of lse differs from the reference
  bool masked_rows_not_zero = false;  // a row with lse −∞ whose output is not 0
  std::string summary() const;
};

/// Optional user modifiers for run_case.
struct Mods {
  const detail::UserMods* mods = nullptr;
};

/// Runs the configuration with fresh inputs from rng.
Errors run_case(Config& s, std::mt19937_64& rng, Mods mods = {});

/// Errors of one backward run: dq, dk, dv, dbias against the float64 reference
/// backward (the plain f32 yardstick is the same reference in f32).
struct GradErrors {
  Errors::Sums dq, dk, dv, dbias;
  bool nan = false;
  std::string summary() const;
};

/// Runs forward then backward with fresh inputs (dout random); with
/// `want_dbias` and an additive mask in s.opt, also dbias.
GradErrors run_backward_case(Config& s, std::mt19937_64& rng, Mods mods = {}, bool want_dbias = false);

/// The bar for gradients: relative error ≤ 1e-5 (where the plain f32 code
/// is within half of that), no NaN, and a 10× plain screen; pooled 2× per test.
class GradLedger {
 public:
  /// `factor`: the pooled rule's multiple of the plain f32 error (2 = FlashAttention's).
  explicit GradLedger(double factor = 2.0) : factor_(factor) {}
  ::testing::AssertionResult check(const GradErrors& e);
  ::testing::AssertionResult pooled_within_factor_of_plain() const;

 private:
  Errors::Sums dq_, dk_, dv_, dbias_;
  int cases_ = 0;
  double factor_;
};

class PooledGradTest : public ::testing::Test {
 protected:
  void TearDown() override { EXPECT_TRUE(ledger.pooled_within_factor_of_plain()); }
  GradLedger ledger;
};

/// The fused backward's gradients (dq, dk, dv concatenated) for fixed inputs.
std::vector<float> run_backward_raw(Config& s, uint64_t input_seed);

/// The fused kernel's outputs for a fixed input (for bitwise comparisons).
std::vector<float> run_fused_raw(Config& s, uint64_t input_seed);

/// Checks one case against the bar: every relative error ≤ 1e-6 (where the
/// plain f32 code itself is within 0.5e-6, over 32 results or more), no NaN,
/// fully masked rows exactly 0 with lse −∞; and, as a screen for gross errors,
/// ≤ 10× the plain f32 error plus two f32 roundings. With absolute_bar = false the
/// 1e-6 bar is skipped: for large logits, f32 rounds each score to eps·|s| and
/// even the plain code misses it.
::testing::AssertionResult errors_ok(const Errors& e, bool absolute_bar = true);

/// FlashAttention's rule — the fused error is at most 2× the plain f32 error —
/// is statistical: one output row's error against another's is a coin flip, so
/// it is applied to all the cases of a test pooled together, as FA applies it
/// to a whole tensor, along with the 1e-6 bar. check() = errors_ok() + pooling.
class ErrorLedger {
 public:
  ::testing::AssertionResult check(const Errors& e, bool absolute_bar = true);
  ::testing::AssertionResult pooled_within_factor_of_plain() const;

 private:
  Errors::Sums out_, lse_, probs_;
  int cases_ = 0;
  bool all_absolute_ = true;  // every case asked for the 1e-6 bar
};

/// Test fixture that pools every case of a test and checks the 2× rule at the end.
class PooledErrorTest : public ::testing::Test {
 protected:
  void TearDown() override { EXPECT_TRUE(ledger.pooled_within_factor_of_plain()); }
  ErrorLedger ledger;
};

}  // namespace attn::testing
