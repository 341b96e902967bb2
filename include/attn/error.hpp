// attn::Error: the one exception type the library throws for bad arguments.
#pragma once

#include <stdexcept>
#include <string>

namespace attn {

/// Thrown for every invalid argument. The message names the argument, what was
/// expected and what was given, e.g.
///   "attention: k.shape[2] (kv heads) must divide q.shape[2] (query heads): got Hq=8, Hkv=3".
/// Nothing is written to any output before the checks that may throw it have passed.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message) : std::invalid_argument(message) {}
};

}  // namespace attn
