// A 5×7 bitmap font for the printable ASCII characters, drawn for attn's PNG
// attention maps (axis labels and titles). Each glyph is 7 rows of 5 pixels,
// '#' = ink; characters without a glyph render as a box.
#pragma once

#include <string_view>

namespace attn::io::font {

constexpr int kWidth = 5, kHeight = 7;

/// The 7 rows of `c`'s glyph (5 characters each, '#' = ink); a box for unknown characters.
const char* const* glyph(char c);

}  // namespace attn::io::font
