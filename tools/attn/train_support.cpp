// Presets, progress bar and attention-map drawing for demo/train/translate/plot.
#include "train_support.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "attn/error.hpp"
#include "attn/io/heatmap.hpp"

namespace attn::cli {

void preset(const std::string& kind, train::ModelConfig& m, train::TrainOptions& o) {
  m.kind = kind;
  if (kind == "rnn") {
    // Bahdanau's model, small: 32-d embeddings, 64-unit GRUs, 64-d attention (~100k weights).
    m.embed_dim = 32, m.hidden = 64, m.attn_dim = 64;
    o.steps = 600, o.lr = 3e-3, o.warmup = 50, o.batch_size = 64;
  } else if (kind == "transformer") {
    // 2 + 2 pre-norm layers, d_model 64, 4 heads, FFN 128 (~174k weights).
    m.embed_dim = 64, m.hidden = 128, m.layers = 2, m.heads = 4, m.dropout = 0.0f;
    o.steps = 900, o.lr = 1.5e-3, o.warmup = 100, o.batch_size = 64;
  } else {
    throw Error("unknown model \"" + kind + "\" (expected rnn or transformer)");
  }
  o.eval_every = 100;
  o.eval_examples = 300;
}

void ensure_writable_directory(const std::string& dir, const std::string& option) {
  if (dir.empty()) throw Error(option + " is empty: give a directory");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir))
    throw Error(option + ": cannot create directory \"" + dir + "\"" + (ec ? ": " + ec.message() : ": a file is there"));
  const std::string probe = dir + "/.attn-write-test-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(option + ": cannot write in \"" + dir + "\": " + std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

namespace {
CLI::Validator finite_in(bool allow_zero, double max) {
  const std::string range = allow_zero ? "≥ 0" : "in (0, " + CLI::detail::to_string(max) + "]";
  return CLI::Validator(
      [allow_zero, max, range](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool ok = !text.empty() && end && *end == '\0' && std::isfinite(v) && (allow_zero ? v >= 0 : v > 0) &&
                        v <= max;
        return ok ? std::string() : "must be a finite number " + range + ", got \"" + text + "\"";
      },
      allow_zero ? "FINITE ≥ 0" : "FINITE > 0");
}
}  // namespace

CLI::Validator finite_positive(double max) { return finite_in(false, max); }
CLI::Validator finite_non_negative() { return finite_in(true, HUGE_VAL); }

bool stdout_is_tty() {
  const char* term = std::getenv("TERM");
  return isatty(STDOUT_FILENO) && !(term && std::string(term) == "dumb");
}

std::function<void(const train::Progress&)> progress_printer(bool tty) {
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  return [tty, last](const train::Progress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (!tty && !p.final && std::chrono::duration<double>(now - *last).count() < 3.0) return;
    *last = now;
    const double frac = p.total_steps > 0 ? double(p.step) / double(p.total_steps) : 0.0;
    char acc[32];
    if (p.accuracy >= 0) std::snprintf(acc, sizeof acc, "%5.1f%%", 100.0 * p.accuracy);
    else std::snprintf(acc, sizeof acc, "    – ");
    if (tty) {
      const int width = 24, filled = static_cast<int>(std::lround(frac * width));
      std::string bar;
      for (int i = 0; i < width; ++i) bar += i < filled ? "█" : "░";
      std::printf("\r  %s step %5lld/%lld  loss %.4f  val acc %s  %5.1f steps/s  ETA %3.0fs ", bar.c_str(),
                  static_cast<long long>(p.step), static_cast<long long>(p.total_steps), p.loss, acc,
                  p.steps_per_second, p.eta_seconds);
      if (p.final) std::printf("\n");
    } else {
      std::printf("  step %lld/%lld  loss %.4f  val acc %s  %.1f steps/s  ETA %.0fs\n", static_cast<long long>(p.step),
                  static_cast<long long>(p.total_steps), p.loss, acc, p.steps_per_second, p.eta_seconds);
    }
    std::fflush(stdout);
  };
}

io::Heatmap heatmap_of(const train::Session& s, const std::string& text, const train::Translation& t, size_t index) {
  io::Heatmap h;
  h.col_labels = s.src_tok.split(text);
  for (int32_t id : t.tokens) h.row_labels.push_back(s.tgt_tok.token(id));
  h.values = t.maps.at(index);
  // A map has a row per decoding step; the last step is the one that produced <eos>.
  while (h.row_labels.size() < h.values.size()) h.row_labels.push_back("<eos>");
  h.values.resize(h.row_labels.size(), std::vector<float>(h.col_labels.size(), 0.0f));
  for (auto& r : h.values) r.resize(h.col_labels.size(), 0.0f);
  h.title = t.maps.size() == 1 ? "attention" : t.map_names[index];
  return h;
}

std::vector<std::string> draw_maps(train::Session& s, const std::string& text, const train::Translation& t,
                                   const std::string& prefix, bool print_terminal) {
  std::vector<io::Heatmap> panels;
  for (size_t m = 0; m < t.maps.size(); ++m) panels.push_back(heatmap_of(s, text, t, m));
  const std::string caption = "\"" + text + "\" -> \"" + s.tgt_tok.decode(t.tokens) + "\"";
  const int columns = t.maps.size() == 1 ? 1 : std::max(1, static_cast<int>(s.model->config().heads));
  std::vector<std::string> written{prefix + ".png", prefix + ".svg"};
  io::write_heatmap_png(written[0], panels, columns, caption);
  io::write_heatmap_svg(written[1], panels, columns, caption);
  if (print_terminal) {
    const bool tty = stdout_is_tty();
    std::printf("%s\n", io::render_heatmap_text(panels.front(), tty, tty).c_str());
  }
  return written;
}

}  // namespace attn::cli
