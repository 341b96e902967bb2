// Data for the built-in tasks: tokenizers (character- and word-level, vocabulary built
// from data, saved as JSON) and the task generators (date normalisation, reversal,
// sorting), all deterministic for a seed; and batching into padded id tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/tensor.hpp"

namespace attn::train {

/// Token ids of the special tokens, the same in every vocabulary.
constexpr int32_t kPad = 0, kBos = 1, kEos = 2, kUnk = 3;

/// A vocabulary and the rule that splits text into its tokens: "char" (every UTF-8
/// byte sequence of one character is a token) or "word" (whitespace-separated).
class Tokenizer {
 public:
  enum class Kind { character, word };
  Tokenizer() = default;
  /// The vocabulary of `texts` (specials first, then tokens in sorted order).
  static Tokenizer build(Kind kind, const std::vector<std::string>& texts);

  /// Token ids of `text` (no bos/eos). Unknown tokens become kUnk and are counted in *unknown.
  std::vector<int32_t> encode(const std::string& text, int64_t* unknown = nullptr) const;
  /// Text of ids (specials dropped; words joined with spaces).
  std::string decode(const std::vector<int32_t>& ids) const;
  /// The token (text) of one id, specials as "<pad>", "<bos>", "<eos>", "<unk>".
  const std::string& token(int32_t id) const;
  /// Tokens of `text` as strings (what encode maps to ids).
  std::vector<std::string> split(const std::string& text) const;

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  Kind kind() const { return kind_; }

  nlohmann::json to_json() const;
  /// Throws attn::Error when the JSON is not a tokenizer written by to_json.
  static Tokenizer from_json(const nlohmann::json& j);

 private:
  Kind kind_ = Kind::character;
  std::vector<std::string> tokens_;
};

/// One example: source text and its target text.
struct Example {
  std::string source, target;
};

/// A task's three splits; no source of validation or test appears in train.
struct TaskData {
  std::string task;
  std::vector<Example> train, validation, test;
};

/// The built-in tasks: "dates" (human-written dates → ISO 8601), "reverse" (a word →
/// the word reversed), "sort" (letters → sorted letters). Throws attn::Error for others,
/// and for split sizes below 0 or above kMaxSplitSize.
inline constexpr int64_t kMaxSplitSize = 10'000'000;
TaskData make_task(const std::string& task, uint64_t seed, int64_t train_size, int64_t validation_size,
                   int64_t test_size);
/// The names accepted by make_task.
std::vector<std::string> task_names();

/// One random date written in one of the human formats, with its ISO form
/// ("Sunday, November 22, 2026" → "2026-11-22"). Years 1950–2049.
Example random_date(uint64_t& state);
/// Day of the week (0 = Monday … 6 = Sunday) of a Gregorian date.
int day_of_week(int year, int month, int day);

/// A padded batch: src [B, S] and its lengths, decoder input [B, T] (bos + target) and
/// the targets [B·T] (target + eos, kPad past the end, for cross_entropy with ignore kPad).
struct Batch {
  Tensor src, src_lengths, tgt_in;
  std::vector<int32_t> tgt_out;
  int64_t size() const { return src.shape().empty() ? 0 : src.shape()[0]; }
};
Batch make_batch(const std::vector<const Example*>& examples, const Tokenizer& src_tok, const Tokenizer& tgt_tok);

}  // namespace attn::train
