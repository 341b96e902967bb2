// `attn check`: runs the fused forward against the float64 reference on random
// inputs of many shapes and options, on this machine, and says whether it holds.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "attn/attention.hpp"
#include "commands.hpp"

namespace attn::cli {
namespace {

struct CheckCase {
  const char* name;
  int Lq, Lk, H, Hkv, d;
  Causal causal;
  Window window;
  float softcap;
};

// Relative error ‖a − b‖ / ‖b‖.
double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace

Command add_check_command(CLI::App& app) {
  auto seed = std::make_shared<unsigned>(std::random_device{}());
  CLI::App* sub = app.add_subcommand(
      "check", "Verify the fused forward against the float64 reference on random inputs");
  sub->add_option("--seed", *seed, "random seed (default: a fresh one)");
  auto run = [seed]() -> int {
    const CheckCase cases[] = {
        {"plain", 100, 100, 4, 4, 64, Causal::None, {-1, -1}, 0},
        {"causal top-left, Lq<Lk", 65, 130, 4, 2, 128, Causal::TopLeft, {-1, -1}, 0},
        {"causal bottom-right, GQA 8:1", 63, 200, 8, 1, 80, Causal::BottomRight, {-1, -1}, 0},
        {"sliding window", 200, 200, 2, 2, 96, Causal::None, {16, 16}, 0},
        {"softcap", 64, 64, 2, 1, 256, Causal::None, {-1, -1}, 20},
        {"odd sizes", 17, 3, 3, 1, 7, Causal::BottomRight, {-1, -1}, 0},
    };
    std::mt19937 rng(*seed);
    std::uniform_real_distribution<float> u(-1, 1);
    int failures = 0;
    std::printf("attn check (seed %u): fused forward vs float64 reference, bar 1e-6\n", *seed);
    for (const CheckCase& c : cases) {
      std::vector<float> q(size_t(c.Lq) * c.H * c.d), k(size_t(c.Lk) * c.Hkv * c.d),
          v(size_t(c.Lk) * c.Hkv * c.d), out(q.size()), ref(q.size());
      for (auto* t : {&q, &k, &v}) {
        for (float& x : *t) x = u(rng);
      }
      AttentionOptions opt;
      opt.causal = c.causal, opt.window = c.window, opt.softcap = c.softcap;
      const TensorView qv(q.data(), DType::f32, {1, c.Lq, c.H, c.d}),
          kv(k.data(), DType::f32, {1, c.Lk, c.Hkv, c.d}), vv(v.data(), DType::f32, {1, c.Lk, c.Hkv, c.d});
      attention(qv, kv, vv, TensorView(out.data(), DType::f32, {1, c.Lq, c.H, c.d}), opt);
      attention_reference(qv, kv, vv, TensorView(ref.data(), DType::f32, {1, c.Lq, c.H, c.d}), opt);
      const double err = rel_error(out, ref);
      const bool ok = err <= 1e-6;
      failures += !ok;
      std::printf("  %-32s Lq=%-4d Lk=%-4d d=%-3d  rel. error %.2e  %s\n", c.name, c.Lq, c.Lk, c.d,
                  err, ok ? "ok" : "FAIL");
    }
    std::printf("%s\n", failures ? "FAILED" : "all ok");
    return failures ? 1 : 0;
  };
  return {sub, run};
}

}  // namespace attn::cli
