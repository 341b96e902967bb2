// Attention maps as pictures: PNG (libpng, with a built-in bitmap font for the axis
// labels) and SVG heatmaps with labelled axes, several panels in a grid (one per layer
// and head), and a coloured map for the terminal.
#pragma once

#include <string>
#include <vector>

namespace attn::io {

/// One panel: values[row][col] in [0, 1] (attention weights: rows = output steps,
/// columns = input positions), with a label per row and per column and a title.
struct Heatmap {
  std::vector<std::vector<float>> values;
  std::vector<std::string> row_labels, col_labels;
  std::string title;
};

/// Writes the panels in a grid of `columns` panels per row. Throws attn::Error when a
/// panel's labels do not match its values or the file cannot be written.
void write_heatmap_png(const std::string& path, const std::vector<Heatmap>& panels, int columns = 1,
                       const std::string& caption = "");
void write_heatmap_svg(const std::string& path, const std::vector<Heatmap>& panels, int columns = 1,
                       const std::string& caption = "");

/// The map as text: 256-colour background cells when `color`, Unicode shades
/// (" ░▒▓█") when `unicode`, else digits 0–9 (plain text for logs and pipes).
std::string render_heatmap_text(const Heatmap& map, bool color, bool unicode);

}  // namespace attn::io
