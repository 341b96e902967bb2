// `attn explain "a sentence"`: a worked example. Each word gets a fixed vector
// (the same word, the same vector) plus a sinusoidal position code; with no
// learned projections, q = k = v = those vectors, so the attention matrix shows
// attention as similarity: each word attends to itself and to its repeats, and
// a little to everything else. Printed as a labelled table with shading.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "commands.hpp"

namespace attn::cli {
namespace {

// FNV-1a: a stable hash, so a word's vector is the same on every machine.
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Shade for a probability in [0, 1]: Unicode blocks on a terminal, digits else.
const char* shade(float p, bool unicode) {
  static const char* blocks[] = {" ", "░", "▒", "▓", "█"};
  static const char* ascii[] = {" ", ".", ":", "*", "#"};
  const int i = std::min(4, static_cast<int>(p * 5.0f));
  return unicode ? blocks[i] : ascii[i];
}

}  // namespace

Command add_explain_command(CLI::App& app) {
  struct Args {
    std::string sentence = "the cat sat on the mat because the mat was warm";
    bool causal = false;
    int dim = 32;
  };
  auto args = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand(
      "explain", "Print the self-attention matrix of a small sentence (a worked example)");
  sub->add_option("sentence", args->sentence, "words separated by spaces");
  sub->add_flag("--causal", args->causal, "each word sees only itself and the words before it");
  sub->add_option("--dim", args->dim, "embedding size d")->check(CLI::Range(2, 1024));
  auto run = [args]() -> int {
    std::vector<std::string> words;
    std::istringstream is(args->sentence);
    for (std::string w; is >> w;) words.push_back(w);
    if (words.empty()) throw Error("explain: the sentence has no words");
    const int L = static_cast<int>(words.size()), d = args->dim;

    // x[i] = embedding(word i) + 0.3 · positional(i), the sinusoid of Vaswani et al.
    std::vector<float> x(size_t(L) * d), out(x.size()), probs(size_t(L) * L);
    for (int i = 0; i < L; ++i) {
      std::mt19937_64 rng(fnv1a(words[i]));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (int c = 0; c < d; ++c) {
        const double freq = std::pow(10000.0, -2.0 * (c / 2) / d);
        const double pos = c % 2 == 0 ? std::sin(i * freq) : std::cos(i * freq);
        x[size_t(i) * d + c] = normal(rng) + 0.3f * static_cast<float>(pos);
      }
    }
    const TensorView xv(x.data(), DType::f32, {1, L, 1, d});
    AttentionOptions opt;
    opt.causal = args->causal ? Causal::TopLeft : Causal::None;
    attention(xv, xv, xv, TensorView(out.data(), DType::f32, {1, L, 1, d}), opt, {},
              TensorView(probs.data(), DType::f32, {1, 1, L, L}));

    const bool tty = isatty(STDOUT_FILENO) != 0;
    size_t width = 5;
    for (const auto& w : words) width = std::max(width, w.size());
    std::printf("softmax(q·kᵀ/√%d) for \"%s\"%s\n", d, args->sentence.c_str(),
                args->causal ? " (causal)" : "");
    std::printf("rows: the attending word (query); columns: the word attended to (key); each row sums to 1\n\n");
    std::printf("%*s", static_cast<int>(width), "");
    for (const auto& w : words) std::printf(" %6.6s", w.c_str());
    std::printf("\n");
    for (int i = 0; i < L; ++i) {
      std::printf("%*s", static_cast<int>(width), words[i].c_str());
      for (int j = 0; j < L; ++j) {
        const float p = probs[size_t(i) * L + j];
        std::printf(" %s%.3f", shade(p, tty), p);
      }
      const int best = static_cast<int>(std::max_element(&probs[size_t(i) * L], &probs[size_t(i) * L] + L) -
                                        &probs[size_t(i) * L]);
      std::printf("   -> %s\n", words[best].c_str());
    }
    std::printf("\nWith no learned projections (q = k = v = embedding + position), attention is\n"
                "similarity: each word looks mostly at itself and at other copies of itself.\n");
    return 0;
  };
  return {sub, run};
}

}  // namespace attn::cli
