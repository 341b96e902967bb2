// The built-in tasks, generated from a seed: date normalisation, reversal, sorting.
#include <algorithm>
#include <cctype>
#include <functional>
#include <unordered_set>

#include "attn/error.hpp"
#include "attn/train/data.hpp"

namespace attn::train {

namespace {

uint64_t next(uint64_t& s) {  // SplitMix64: tiny, fast, identical everywhere
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
int uniform(uint64_t& s, int lo, int hi) { return lo + static_cast<int>(next(s) % uint64_t(hi - lo + 1)); }

const char* const kMonths[] = {"January", "February", "March",     "April",   "May",      "June",
                               "July",    "August",   "September", "October", "November", "December"};
const char* const kDays[] = {"Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"};

bool leap(int y) { return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0; }
int days_in(int y, int m) {
  static const int d[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return m == 2 && leap(y) ? 29 : d[m - 1];
}

// "November" in one of three cases, optionally abbreviated to three letters.
std::string name(const char* full, int style, bool abbreviate) {
  std::string s = abbreviate ? std::string(full, 3) : std::string(full);
  for (size_t i = 0; i < s.size(); ++i) {
    if (style == 0) s[i] = static_cast<char>(std::tolower(static_cast<unsigned char>(s[i])));
    else if (style == 2) s[i] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[i])));
  }
  return s;
}

std::string two(int v) { return (v < 10 ? "0" : "") + std::to_string(v); }
std::string ordinal(int d) {
  const char* suffix = (d % 10 == 1 && d != 11) ? "st" : (d % 10 == 2 && d != 12) ? "nd" : (d % 10 == 3 && d != 13) ? "rd" : "th";
  return std::to_string(d) + suffix;
}

std::string random_letters(uint64_t& s, int len) {
  std::string w;
  for (int i = 0; i < len; ++i) w += static_cast<char>('a' + uniform(s, 0, 25));
  return w;
}

}  // namespace

int day_of_week(int y, int m, int d) {  // Sakamoto's method; 0 = Monday
  static const int t[] = {0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4};
  if (m < 3) y -= 1;
  const int sunday0 = (y + y / 4 - y / 100 + y / 400 + t[m - 1] + d) % 7;  // 0 = Sunday
  return (sunday0 + 6) % 7;
}

Example random_date(uint64_t& s) {
  const int y = uniform(s, 1950, 2049), m = uniform(s, 1, 12), d = uniform(s, 1, days_in(y, m));
  const int style = uniform(s, 0, 2);  // lower, Title, UPPER
  const std::string month = name(kMonths[m - 1], style, false), mon = name(kMonths[m - 1], style, true);
  const std::string wday = name(kDays[day_of_week(y, m, d)], style, false);
  const std::string wd = name(kDays[day_of_week(y, m, d)], style, true);
  const std::string Y = std::to_string(y), yy = two(y % 100), D = std::to_string(d), M = std::to_string(m);
  std::string text;
  switch (uniform(s, 0, 12)) {
    case 0: text = D + " " + month + " " + Y; break;                       // 22 November 2026
    case 1: text = D + " " + mon + " " + Y; break;                         // 22 nov 2026
    case 2: text = mon + " " + D + ", " + Y; break;                        // nov 22, 2026
    case 3: text = month + " " + D + ", " + Y; break;                      // November 22, 2026
    case 4: text = wday + ", " + month + " " + D + ", " + Y; break;        // Sunday, November 22, 2026
    case 5: text = wd + ", " + D + " " + mon + " " + Y; break;             // Sun, 22 Nov 2026
    case 6: text = M + "/" + D + "/" + yy; break;                          // 11/22/26 (US, two-digit year)
    case 7: text = two(m) + "/" + two(d) + "/" + yy; break;                // 01/05/26
    case 8: text = two(d) + "." + two(m) + "." + Y; break;                 // 22.11.2026
    case 9: text = D + "." + M + "." + Y; break;                           // 5.1.2026
    case 10: text = ordinal(d) + " " + month + " " + Y; break;             // 22nd November 2026
    case 11: text = month + " " + ordinal(d) + ", " + Y; break;            // November 22nd, 2026
    default: text = Y + "/" + two(m) + "/" + two(d); break;                // 2026/11/22
  }
  return {text, Y + "-" + two(m) + "-" + two(d)};
}

std::vector<std::string> task_names() { return {"dates", "reverse", "sort"}; }

TaskData make_task(const std::string& task, uint64_t seed, int64_t train_size, int64_t validation_size,
                   int64_t test_size) {
  std::function<Example(uint64_t&)> gen;
  if (task == "dates") {
    gen = random_date;
  } else if (task == "reverse") {
    gen = [](uint64_t& s) {
      std::string w = random_letters(s, uniform(s, 3, 12));
      return Example{w, std::string(w.rbegin(), w.rend())};
    };
  } else if (task == "sort") {
    gen = [](uint64_t& s) {
      std::string w = random_letters(s, uniform(s, 3, 12)), sorted = w;
      std::sort(sorted.begin(), sorted.end());
      return Example{w, sorted};
    };
  } else {
    std::string names;
    for (const auto& n : task_names()) names += (names.empty() ? "" : ", ") + n;
    throw Error("unknown task \"" + task + "\" (expected one of: " + names + ")");
  }
  if (train_size < 0 || validation_size < 0 || test_size < 0) throw Error("make_task: split sizes must be ≥ 0");
  if (train_size > kMaxSplitSize || validation_size > kMaxSplitSize || test_size > kMaxSplitSize)
    throw Error("make_task: a split size is too large (at most " + std::to_string(kMaxSplitSize) + " examples)");
  TaskData data;
  data.task = task;
  uint64_t state = seed * 0x2545F4914F6CDD1Dull + 17;
  std::unordered_set<std::string> held_out;
  // Held-out splits first; train then skips their sources (a test date is never seen).
  auto fill = [&](std::vector<Example>& split, int64_t n, bool is_train) {
    int64_t attempts = 0;
    while (static_cast<int64_t>(split.size()) < n) {
      if (++attempts > 20 * n + 1000) throw Error("make_task: cannot draw " + std::to_string(n) + " distinct examples");
      Example e = gen(state);
      if (is_train) {
        if (held_out.count(e.source)) continue;
      } else if (!held_out.insert(e.source).second) {
        continue;
      }
      split.push_back(std::move(e));
    }
  };
  fill(data.test, test_size, false);
  fill(data.validation, validation_size, false);
  fill(data.train, train_size, true);
  return data;
}

Batch make_batch(const std::vector<const Example*>& examples, const Tokenizer& src_tok, const Tokenizer& tgt_tok) {
  const int64_t B = static_cast<int64_t>(examples.size());
  if (B == 0) throw Error("make_batch: no examples");
  std::vector<std::vector<int32_t>> src(B), tgt(B);
  int64_t S = 1, T = 1;
  for (int64_t b = 0; b < B; ++b) {
    src[b] = src_tok.encode(examples[b]->source);
    tgt[b] = tgt_tok.encode(examples[b]->target);
    if (src[b].empty()) src[b].push_back(kUnk);  // an empty source still has one position
    S = std::max<int64_t>(S, static_cast<int64_t>(src[b].size()));
    T = std::max<int64_t>(T, static_cast<int64_t>(tgt[b].size()) + 1);
  }
  Batch batch;
  batch.src = Tensor(DType::i32, {B, S});
  batch.src_lengths = Tensor(DType::i32, {B});
  batch.tgt_in = Tensor(DType::i32, {B, T});
  batch.tgt_out.assign(static_cast<size_t>(B * T), kPad);
  for (int64_t b = 0; b < B; ++b) {
    int32_t* s = batch.src.data_as<int32_t>() + b * S;
    int32_t* ti = batch.tgt_in.data_as<int32_t>() + b * T;
    std::fill_n(s, S, kPad);
    std::fill_n(ti, T, kPad);
    std::copy(src[b].begin(), src[b].end(), s);
    batch.src_lengths.data_as<int32_t>()[b] = static_cast<int32_t>(src[b].size());
    ti[0] = kBos;
    for (size_t i = 0; i < tgt[b].size(); ++i) {
      ti[i + 1] = tgt[b][i];
      batch.tgt_out[b * T + i] = tgt[b][i];
    }
    batch.tgt_out[b * T + tgt[b].size()] = kEos;
  }
  return batch;
}

}  // namespace attn::train
