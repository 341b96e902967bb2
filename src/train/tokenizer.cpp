// Character- and word-level tokenizers.
#include <algorithm>
#include <set>

#include "attn/error.hpp"
#include "attn/train/data.hpp"

namespace attn::train {

namespace {
const char* const kSpecials[] = {"<pad>", "<bos>", "<eos>", "<unk>"};

// Splits UTF-8 text into characters (a lead byte and its continuation bytes).
std::vector<std::string> utf8_chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = 1;
    while (i + n < s.size() && (static_cast<unsigned char>(s[i + n]) & 0xC0) == 0x80) ++n;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      if (!cur.empty()) out.push_back(cur), cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}
}  // namespace

std::vector<std::string> Tokenizer::split(const std::string& text) const {
  return kind_ == Kind::character ? utf8_chars(text) : words(text);
}

Tokenizer Tokenizer::build(Kind kind, const std::vector<std::string>& texts) {
  Tokenizer t;
  t.kind_ = kind;
  std::set<std::string> seen;
  for (const std::string& text : texts)
    for (std::string& tok : t.split(text)) seen.insert(std::move(tok));
  for (const char* s : kSpecials) {
    t.tokens_.emplace_back(s);
    seen.erase(s);
  }
  t.tokens_.insert(t.tokens_.end(), seen.begin(), seen.end());
  return t;
}

std::vector<int32_t> Tokenizer::encode(const std::string& text, int64_t* unknown) const {
  std::vector<int32_t> ids;
  for (const std::string& tok : split(text)) {
    // Tokens after the specials are sorted: binary search.
    auto it = std::lower_bound(tokens_.begin() + 4, tokens_.end(), tok);
    if (it != tokens_.end() && *it == tok) {
      ids.push_back(static_cast<int32_t>(it - tokens_.begin()));
    } else {
      ids.push_back(kUnk);
      if (unknown) ++*unknown;
    }
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 4 || id >= size()) continue;
    if (kind_ == Kind::word && !out.empty()) out += ' ';
    out += tokens_[id];
  }
  return out;
}

const std::string& Tokenizer::token(int32_t id) const {
  if (id < 0 || id >= size())
    throw Error("Tokenizer: id " + std::to_string(id) + " outside the vocabulary of " + std::to_string(size()));
  return tokens_[id];
}

nlohmann::json Tokenizer::to_json() const {
  return {{"kind", kind_ == Kind::character ? "char" : "word"}, {"tokens", tokens_}};
}

Tokenizer Tokenizer::from_json(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("kind") || !j.contains("tokens") || !j["kind"].is_string() ||
      !j["tokens"].is_array())
    throw Error("tokenizer JSON: expected {\"kind\": \"char\"|\"word\", \"tokens\": [...]}");
  Tokenizer t;
  const std::string kind = j["kind"];
  if (kind != "char" && kind != "word") throw Error("tokenizer JSON: unknown kind \"" + kind + "\"");
  t.kind_ = kind == "char" ? Kind::character : Kind::word;
  for (const auto& tok : j["tokens"]) {
    if (!tok.is_string()) throw Error("tokenizer JSON: tokens must be strings");
    t.tokens_.push_back(tok.get<std::string>());
  }
  if (t.tokens_.size() < 4) throw Error("tokenizer JSON: the vocabulary lacks the four special tokens");
  for (int i = 0; i < 4; ++i)
    if (t.tokens_[i] != kSpecials[i]) throw Error("tokenizer JSON: special token " + std::to_string(i) + " must be " + kSpecials[i]);
  if (!std::is_sorted(t.tokens_.begin() + 4, t.tokens_.end()))
    throw Error("tokenizer JSON: tokens after the specials must be sorted");
  return t;
}

}  // namespace attn::train
