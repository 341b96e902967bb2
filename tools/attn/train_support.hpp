// What the training commands share: model presets, the progress bar, and drawing
// attention maps of translations (PNG, SVG, terminal).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "attn/io/heatmap.hpp"
#include "attn/train/trainer.hpp"

namespace attn::cli {

/// Model and training defaults for a model kind ("rnn" or "transformer"); throws attn::Error otherwise.
void preset(const std::string& kind, train::ModelConfig& model, train::TrainOptions& options);

/// A progress reporter: a live bar on a terminal, a line every few seconds otherwise.
std::function<void(const train::Progress&)> progress_printer(bool tty);

/// Map `index` of a translation as a heatmap panel (rows: output tokens, the last one
/// <eos>; columns: input tokens).
io::Heatmap heatmap_of(const train::Session& s, const std::string& text, const train::Translation& t, size_t index);

/// Writes every map of one translation as panels of PREFIX.png and PREFIX.svg (a grid
/// with a column per head) and, when asked, prints the first in the terminal.
std::vector<std::string> draw_maps(train::Session& s, const std::string& text, const train::Translation& t,
                                   const std::string& path_prefix, bool print_terminal);

/// Creates directory `dir` if needed and checks that a file can be written in it, so a
/// command fails before it trains rather than after; throws attn::Error naming `option`.
void ensure_writable_directory(const std::string& dir, const std::string& option);

/// CLI11 validators for numeric options: a finite number in (0, max], a finite number ≥ 0.
CLI::Validator finite_positive(double max);
CLI::Validator finite_non_negative();

/// True when stdout is a terminal (and TERM is not "dumb").
bool stdout_is_tty();

}  // namespace attn::cli
