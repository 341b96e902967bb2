// PNG, SVG and terminal renderings of attention maps.
#include "attn/io/heatmap.hpp"

#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "attn/error.hpp"
#include "io/files.hpp"
#include "io/font5x7.hpp"

namespace attn::io {

namespace {

struct Rgb {
  uint8_t r, g, b;
};

// A perceptually ordered ramp (dark blue → teal → yellow, like viridis), by linear
// interpolation between anchors.
Rgb color_of(float v) {
  static const Rgb anchors[] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  const float x = std::clamp(v, 0.0f, 1.0f) * 4.0f;
  const int i = std::min(3, static_cast<int>(x));
  const float t = x - float(i);
  auto mix = [&](uint8_t a, uint8_t b) { return static_cast<uint8_t>(std::lround(a + (b - a) * t)); };
  return {mix(anchors[i].r, anchors[i + 1].r), mix(anchors[i].g, anchors[i + 1].g), mix(anchors[i].b, anchors[i + 1].b)};
}

void check(const Heatmap& m) {
  if (m.values.size() != m.row_labels.size())
    throw Error("heatmap \"" + m.title + "\": " + std::to_string(m.values.size()) + " rows but " +
                std::to_string(m.row_labels.size()) + " row labels");
  for (const auto& row : m.values)
    if (row.size() != m.col_labels.size())
      throw Error("heatmap \"" + m.title + "\": a row has " + std::to_string(row.size()) + " values but there are " +
                  std::to_string(m.col_labels.size()) + " column labels");
}

// Geometry shared by PNG and SVG (pixels).
constexpr int kCell = 22, kScale = 2, kCharW = (font::kWidth + 1) * kScale, kCharH = font::kHeight * kScale;
constexpr int kPad = 12;

size_t longest(const std::vector<std::string>& v) {
  size_t n = 1;
  for (const auto& s : v) n = std::max(n, s.size());
  return n;
}

struct Layout {
  int label_w, label_h, title_h, panel_w, panel_h;
};
Layout layout_of(const Heatmap& m) {
  Layout l;
  l.label_w = static_cast<int>(longest(m.row_labels)) * kCharW + kPad;
  l.label_h = static_cast<int>(longest(m.col_labels)) * (kCharH + kScale) + kPad;  // stacked vertically
  l.title_h = kCharH + kPad;
  l.panel_w = l.label_w + static_cast<int>(m.col_labels.size()) * kCell + kPad;
  l.panel_h = l.title_h + l.label_h + static_cast<int>(m.row_labels.size()) * kCell + kPad;
  return l;
}

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}
  void fill(int x, int y, int w, int h, Rgb c) {
    for (int j = std::max(0, y); j < std::min(h_, y + h); ++j)
      for (int i = std::max(0, x); i < std::min(w_, x + w); ++i) {
        uint8_t* p = &px_[(static_cast<size_t>(j) * w_ + i) * 3];
        p[0] = c.r, p[1] = c.g, p[2] = c.b;
      }
  }
  // Text at (x, y) top-left; vertical text stacks upright characters downwards
  // (easier to read than rotated glyphs for the one-character labels of char models).
  void text(int x, int y, const std::string& s, bool vertical = false) {
    for (size_t k = 0; k < s.size(); ++k) {
      const char* const* g = font::glyph(s[k]);
      const int cx = vertical ? x : x + int(k) * kCharW, cy = vertical ? y + int(k) * (kCharH + kScale) : y;
      for (int r = 0; r < font::kHeight; ++r)
        for (int c = 0; c < font::kWidth; ++c)
          if (g[r][c] == '#') fill(cx + c * kScale, cy + r * kScale, kScale, kScale, {0, 0, 0});
    }
  }
  int width() const { return w_; }
  int height() const { return h_; }
  const uint8_t* row(int y) const { return &px_[static_cast<size_t>(y) * w_ * 3]; }

 private:
  int w_, h_;
  std::vector<uint8_t> px_;
};

struct Grid {
  int cols, rows, cell_w, cell_h, caption_h;
};
Grid grid_of(const std::vector<Heatmap>& panels, int columns, const std::string& caption) {
  if (panels.empty()) throw Error("heatmap: no panels to draw");
  Grid g{std::max(1, std::min<int>(columns, static_cast<int>(panels.size()))), 0, 0, 0,
         caption.empty() ? 0 : kCharH + kPad};
  g.rows = (static_cast<int>(panels.size()) + g.cols - 1) / g.cols;
  for (const Heatmap& m : panels) {
    check(m);
    const Layout l = layout_of(m);
    g.cell_w = std::max(g.cell_w, l.panel_w);
    g.cell_h = std::max(g.cell_h, l.panel_h);
  }
  return g;
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

}  // namespace

void write_heatmap_png(const std::string& path, const std::vector<Heatmap>& panels, int columns,
                       const std::string& caption) {
  const Grid g = grid_of(panels, columns, caption);
  Canvas canvas(g.cols * g.cell_w + kPad, g.rows * g.cell_h + g.caption_h + kPad);
  if (!caption.empty()) canvas.text(kPad, kPad, caption);
  for (size_t p = 0; p < panels.size(); ++p) {
    const Heatmap& m = panels[p];
    const Layout l = layout_of(m);
    const int ox = kPad + static_cast<int>(p % g.cols) * g.cell_w;
    const int oy = g.caption_h + kPad + static_cast<int>(p / g.cols) * g.cell_h;
    canvas.text(ox, oy, m.title);
    const int gx = ox + l.label_w, gy = oy + l.title_h + l.label_h;
    for (size_t c = 0; c < m.col_labels.size(); ++c)
      canvas.text(gx + int(c) * kCell + (kCell - font::kWidth * kScale) / 2, oy + l.title_h, m.col_labels[c],
                  /*vertical=*/true);
    for (size_t r = 0; r < m.row_labels.size(); ++r) {
      const int tx = gx - kPad / 2 - static_cast<int>(m.row_labels[r].size()) * kCharW;
      canvas.text(tx, gy + int(r) * kCell + (kCell - kCharH) / 2, m.row_labels[r]);
      for (size_t c = 0; c < m.col_labels.size(); ++c)
        canvas.fill(gx + int(c) * kCell, gy + int(r) * kCell, kCell - 1, kCell - 1, color_of(m.values[r][c]));
    }
  }
  // Encoded in memory and then written whole, so a failed write never truncates an
  // existing picture.
  std::vector<uint8_t> encoded;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    throw Error("heatmap: libpng failed encoding \"" + path + "\"");
  }
  png_set_write_fn(
      png, &encoded,
      [](png_structp p, png_bytep data, png_size_t n) {
        auto* out = static_cast<std::vector<uint8_t>*>(png_get_io_ptr(p));
        out->insert(out->end(), data, data + n);
      },
      nullptr);
  png_set_IHDR(png, info, canvas.width(), canvas.height(), 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < canvas.height(); ++y) png_write_row(png, const_cast<png_bytep>(canvas.row(y)));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  try {
    write_file_atomically(path, encoded.data(), encoded.size());
  } catch (const Error& e) {
    throw Error(std::string("heatmap: ") + e.what());
  }
}

void write_heatmap_svg(const std::string& path, const std::vector<Heatmap>& panels, int columns,
                       const std::string& caption) {
  const Grid g = grid_of(panels, columns, caption);
  const int W = g.cols * g.cell_w + kPad, H = g.rows * g.cell_h + g.caption_h + kPad;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << ' ' << H << "\" font-family=\"monospace\" font-size=\"13\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  if (!caption.empty()) o << "<text x=\"" << kPad << "\" y=\"" << kPad + kCharH << "\">" << xml_escape(caption) << "</text>\n";
  for (size_t p = 0; p < panels.size(); ++p) {
    const Heatmap& m = panels[p];
    const Layout l = layout_of(m);
    const int ox = kPad + static_cast<int>(p % g.cols) * g.cell_w;
    const int oy = g.caption_h + kPad + static_cast<int>(p / g.cols) * g.cell_h;
    const int gx = ox + l.label_w, gy = oy + l.title_h + l.label_h;
    o << "<g>\n<text x=\"" << ox << "\" y=\"" << oy + kCharH << "\" font-weight=\"bold\">" << xml_escape(m.title)
      << "</text>\n";
    for (size_t c = 0; c < m.col_labels.size(); ++c) {
      const int x = gx + int(c) * kCell + kCell / 2, y = gy - kPad / 2;
      if (m.col_labels[c].size() <= 1)  // one character: upright, centred on its column
        o << "<text x=\"" << x << "\" y=\"" << y << "\" text-anchor=\"middle\">" << xml_escape(m.col_labels[c]) << "</text>\n";
      else
        o << "<text transform=\"translate(" << x + 4 << ',' << y << ") rotate(-90)\">" << xml_escape(m.col_labels[c])
          << "</text>\n";
    }
    for (size_t r = 0; r < m.row_labels.size(); ++r) {
      o << "<text x=\"" << gx - kPad / 2 << "\" y=\"" << gy + int(r) * kCell + kCell / 2 + 4
        << "\" text-anchor=\"end\">" << xml_escape(m.row_labels[r]) << "</text>\n";
      for (size_t c = 0; c < m.col_labels.size(); ++c) {
        const Rgb k = color_of(m.values[r][c]);
        char fill[8];
        std::snprintf(fill, sizeof fill, "#%02x%02x%02x", k.r, k.g, k.b);
        o << "<rect x=\"" << gx + int(c) * kCell << "\" y=\"" << gy + int(r) * kCell << "\" width=\"" << kCell - 1
          << "\" height=\"" << kCell - 1 << "\" fill=\"" << fill << "\"><title>" << xml_escape(m.row_labels[r])
          << " ← " << xml_escape(m.col_labels[c]) << ": " << m.values[r][c] << "</title></rect>\n";
      }
    }
    o << "</g>\n";
  }
  o << "</svg>\n";
  const std::string text = o.str();
  try {
    write_file_atomically(path, text.data(), text.size());
  } catch (const Error& e) {
    throw Error(std::string("heatmap: ") + e.what());
  }
}

std::string render_heatmap_text(const Heatmap& m, bool color, bool unicode) {
  check(m);
  const size_t lw = longest(m.row_labels);
  std::ostringstream o;
  // Column labels, one character per column, stacked vertically.
  const size_t lh = longest(m.col_labels);
  for (size_t k = 0; k < lh; ++k) {
    o << std::string(lw + 1, ' ');
    for (const std::string& c : m.col_labels) o << (k < c.size() ? c[k] : ' ') << ' ';
    o << '\n';
  }
  static const char* shades[] = {" ", "░", "▒", "▓", "█"};
  for (size_t r = 0; r < m.values.size(); ++r) {
    o << std::string(lw - m.row_labels[r].size(), ' ') << m.row_labels[r] << ' ';
    for (float v : m.values[r]) {
      if (color) {
        // The 24 grey steps of the 256-colour palette (232–255), dark = low.
        const int grey = 232 + std::clamp(static_cast<int>(std::lround(v * 23)), 0, 23);
        o << "\x1b[48;5;" << grey << "m  \x1b[0m";
      } else if (unicode) {
        const std::string s = shades[std::clamp(static_cast<int>(std::lround(v * 4)), 0, 4)];
        o << s << s;
      } else {
        o << std::clamp(static_cast<int>(v * 10), 0, 9) << ' ';
      }
    }
    o << '\n';
  }
  return o.str();
}

}  // namespace attn::io
