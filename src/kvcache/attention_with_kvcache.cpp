// attention_with_kvcache() and kvcache_append(): check, append, attend.
#include "attn/kvcache.hpp"

#include <vector>

#include "attention_lowp.hpp"
#include "kvcache/decode_problem.hpp"
#include "kvcache/prefill_on_tiles.hpp"

namespace attn {

void attention_with_kvcache(const TensorView& q, const KVCache& cache, const TensorView& cache_seqlens,
                            const TensorView& out, const AttentionOptions& options, const KVCacheOptions& kv,
                            const TensorView& lse) {
  const detail::DecodeProblem p = detail::make_decode_problem("attention_with_kvcache", q, cache, cache_seqlens, out,
                                                              options, kv, lse, /*attend=*/true);
  if (p.attn.mask_dtype == DType::bf16 || p.attn.mask_dtype == DType::f16) {
    // The kernel reads f32 masks: a bf16/f16 mask (checked above) is widened once,
    // then the call starts again, before anything is appended.
    std::vector<float> mask32;
    attention_with_kvcache(q, cache, cache_seqlens, out, detail::with_f32_mask(options, mask32), kv, lse);
    return;
  }
  detail::append_to_cache(p);
  // Many queries (chunked prefill) run on attention()'s tiled kernels, a few on the
  // decode kernel.
  if (detail::attention_prefill_on_tiles(p, num_threads())) return;
  detail::attention_decode_cpu(p, num_threads());
}

void kvcache_append(const KVCache& cache, const TensorView& cache_seqlens, const KVCacheOptions& kv) {
  const detail::DecodeProblem p =
      detail::make_decode_problem("kvcache_append", {}, cache, cache_seqlens, {}, {}, kv, {}, /*attend=*/false);
  detail::append_to_cache(p);
}

}  // namespace attn
