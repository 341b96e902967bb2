// Typed, range-checked reads of JSON fields for configs and checkpoints. Every failure is
// an attn::Error naming the context, the field and what was expected, so a malformed
// file gives one clear line (never a json::type_error or an allocation failure).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "attn/error.hpp"

namespace attn::train {

inline std::string describe_json(const nlohmann::json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 40) + "…" : s;
}

/// An integer field in [lo, hi]. JSON integers and integral floats (1e9) are accepted;
/// values above `hi` are reported as "too large".
inline int64_t json_int(const nlohmann::json& obj, const char* key, int64_t lo, int64_t hi, const std::string& ctx) {
  const std::string field = ctx + ": \"" + key + "\"";
  if (!obj.contains(key)) throw Error(field + " is missing");
  const nlohmann::json& v = obj[key];
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  double d = 0;
  if (v.is_number_unsigned()) d = double(v.get<uint64_t>());
  else if (v.is_number_integer()) d = double(v.get<int64_t>());
  else if (v.is_number_float()) d = v.get<double>();
  else throw Error(field + " must be an integer in " + range + ", got " + describe_json(v));
  if (!std::isfinite(d) || d != std::floor(d)) throw Error(field + " must be an integer, got " + describe_json(v));
  if (d > double(hi)) throw Error(field + " is too large: " + describe_json(v) + " (at most " + std::to_string(hi) + ")");
  if (d < double(lo)) throw Error(field + " must be ≥ " + std::to_string(lo) + ", got " + describe_json(v));
  return v.is_number_float() ? static_cast<int64_t>(d) : v.is_number_unsigned() ? int64_t(v.get<uint64_t>()) : v.get<int64_t>();
}

/// A finite number field in [lo, hi] (a string such as "nan" is a type error).
inline double json_number(const nlohmann::json& obj, const char* key, double lo, double hi, const std::string& ctx) {
  const std::string field = ctx + ": \"" + key + "\"";
  if (!obj.contains(key)) throw Error(field + " is missing");
  const nlohmann::json& v = obj[key];
  if (!v.is_number()) throw Error(field + " must be a number, got " + describe_json(v));
  const double d = v.get<double>();
  if (!(d >= lo && d <= hi))
    throw Error(field + " must be a finite number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                describe_json(v));
  return d;
}

/// A non-negative integer that fits 64 bits (seeds).
inline uint64_t json_seed(const nlohmann::json& obj, const char* key, const std::string& ctx) {
  const nlohmann::json& v = obj.contains(key) ? obj[key] : nlohmann::json();
  if (!v.is_number_unsigned()) throw Error(ctx + ": \"" + key + "\" must be a non-negative integer, got " + describe_json(v));
  return v.get<uint64_t>();
}

inline std::string json_string(const nlohmann::json& obj, const char* key, const std::string& ctx) {
  const nlohmann::json& v = obj.contains(key) ? obj[key] : nlohmann::json();
  if (!v.is_string()) throw Error(ctx + ": \"" + key + "\" must be a string, got " + describe_json(v));
  return v.get<std::string>();
}

/// A count written as decimal digits only ("abc", "-1", "1e30" and "12x" are errors).
inline int64_t parse_count(const std::string& text, int64_t hi, const std::string& what) {
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos)
    throw Error(what + " must be a whole number written in digits, got \"" + text.substr(0, 40) + "\"");
  const int64_t n = std::stoll(text);
  if (n > hi) throw Error(what + " is too large: " + text + " (at most " + std::to_string(hi) + ")");
  return n;
}

}  // namespace attn::train
