// ModelConfig: JSON form, limits and validation (kept apart from the models so that the
// checkpoint reader can be fuzzed without building any).
#include <cmath>
#include <string>

#include "attn/error.hpp"
#include "attn/train/models.hpp"
#include "train/json_fields.hpp"

namespace attn::train {

nlohmann::json ModelConfig::to_json() const {
  return {{"kind", kind},         {"src_vocab", src_vocab}, {"tgt_vocab", tgt_vocab}, {"embed_dim", embed_dim},
          {"hidden", hidden},     {"attn_dim", attn_dim},   {"layers", layers},       {"heads", heads},
          {"dropout", dropout},   {"seed", seed}};
}

double ModelConfig::parameter_bound() const {
  const double V = double(src_vocab) + double(tgt_vocab), E = double(embed_dim), H = double(hidden),
               A = double(attn_dim), L = double(layers);
  // Generous: embeddings and the output layer, then the recurrent or attention blocks.
  if (kind == "rnn") return V * (E + 4 * H + 1) + 16 * H * (E + H + 1) + 4 * A * (H + 1);
  return V * (2 * E + 1) + L * (16 * E * E + 4 * E * H + 16 * E + 2 * H) + 4096 * E;
}

void ModelConfig::validate() const {
  if (kind != "rnn" && kind != "transformer")
    throw Error("model config: unknown kind \"" + kind + "\" (expected rnn or transformer)");
  const struct {
    const char* name;
    int64_t value, limit;
  } sizes[] = {{"src_vocab", src_vocab, 1 << 24}, {"tgt_vocab", tgt_vocab, 1 << 24}, {"embed_dim", embed_dim, 65536},
               {"hidden", hidden, 65536},         {"attn_dim", attn_dim, 65536},     {"layers", layers, 256},
               {"heads", heads, 1024}};
  for (const auto& s : sizes) {
    if (s.value < 1) throw Error(std::string("model config: \"") + s.name + "\" must be ≥ 1, got " + std::to_string(s.value));
    if (s.value > s.limit)
      throw Error(std::string("model config: \"") + s.name + "\" is too large: " + std::to_string(s.value) +
                  " (at most " + std::to_string(s.limit) + ")");
  }
  if (!(dropout >= 0.0f && dropout < 1.0f))
    throw Error("model config: \"dropout\" must be in [0, 1), got " + std::to_string(dropout));
  const double n = parameter_bound();
  if (n > kMaxParameters)
    throw Error("model config: the model is too large (up to " + std::to_string(static_cast<long long>(n)) +
                " weights; at most " + std::to_string(static_cast<long long>(kMaxParameters)) + ")");
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw Error("model config: expected a JSON object, got " + describe_json(j));
  const std::string ctx = "model config";
  ModelConfig c;
  c.kind = json_string(j, "kind", ctx);
  if (c.kind != "rnn" && c.kind != "transformer")
    throw Error("model config: unknown kind \"" + c.kind + "\" (expected rnn or transformer)");
  // The ranges are validate()'s job; here only the types.
  c.src_vocab = json_int(j, "src_vocab", 1, INT64_MAX, ctx);
  c.tgt_vocab = json_int(j, "tgt_vocab", 1, INT64_MAX, ctx);
  c.embed_dim = json_int(j, "embed_dim", 1, INT64_MAX, ctx);
  c.hidden = json_int(j, "hidden", 1, INT64_MAX, ctx);
  c.attn_dim = json_int(j, "attn_dim", 1, INT64_MAX, ctx);
  c.layers = json_int(j, "layers", 1, INT64_MAX, ctx);
  c.heads = json_int(j, "heads", 1, INT64_MAX, ctx);
  if (j.contains("dropout")) c.dropout = static_cast<float>(json_number(j, "dropout", 0.0, 0.999999, ctx));
  if (j.contains("seed")) c.seed = json_seed(j, "seed", ctx);
  c.validate();
  return c;
}

}  // namespace attn::train
