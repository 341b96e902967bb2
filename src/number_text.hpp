// Numbers in messages without iostreams: an Error's text must not depend on the global
// locale (std::ostream groups digits under some), nor on iostream state that a module
// linking libstdc++ statically can leave unset (seen on the GPU image's GCC 13.3 in
// /opt/gcc: TensorView::describe() crashed in ostream's integer output from Python).
#pragma once

#include <cstdio>
#include <string>

namespace attn::detail {

/// x as printf's %g writes it ("0.5", "1e+30", "nan", "-inf"): what std::ostream printed.
inline std::string number_text(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}

}  // namespace attn::detail
