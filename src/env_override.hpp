// Integer overrides from the environment, for tests and measurements that must pick
// a kernel's plan (ATTN_AMX_GROUP, ATTN_AMX_PANEL, ATTN_FEW_QUERIES). Read on every
// call, so a test can set one around a call; a bad value is an Error, not ignored.
#pragma once

#include <cstdlib>
#include <string>

#include "attn/error.hpp"

namespace attn::detail {

/// An integer in [lo, hi] from environment variable `name`, or `fallback` when it is
/// unset or empty; anything else is an Error naming the variable.
inline int env_override(const char* name, int lo, int hi, int fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || n < lo || n > hi) {
    throw Error(std::string(name) + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "], got \"" + env + "\"");
  }
  return static_cast<int>(n);
}

}  // namespace attn::detail
