// attn::dropout_mask: the dropout decisions of attention(), materialised.

#include "attn/attention.hpp"
#include "dropout/philox.hpp"
#include "number_text.hpp"

namespace attn {

void dropout_mask(const TensorView& mask, float dropout_p, uint64_t seed, uint64_t offset) {
  if (mask.empty() || mask.dtype() != DType::boolean || mask.rank() != 4) {
    throw Error("dropout_mask: mask must be a boolean [B, Hq, Lq, Lk] tensor, got " + mask.describe());
  }
  if (mask.data() == nullptr && mask.numel() > 0) throw Error("dropout_mask: mask has a null data pointer");
  if (!mask.device().is_cpu()) {
    throw Error("dropout_mask: mask is on " + mask.device().describe() +
                ", but dropout_mask takes tensors in host memory (device cpu) only");
  }
  if (!(dropout_p >= 0.0f && dropout_p < 1.0f)) {
    throw Error("dropout_mask: dropout_p must be in [0, 1), got " + detail::number_text(dropout_p));
  }
  const detail::DropoutRng rng(dropout_p, seed, offset, static_cast<int>(mask.size(1)));
  uint8_t* m = mask.data_as<uint8_t>();
  for (int b = 0; b < mask.size(0); ++b) {
    for (int h = 0; h < mask.size(1); ++h) {
      for (int i = 0; i < mask.size(2); ++i) {
        for (int j = 0; j < mask.size(3); ++j) {
          m[b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2) + j * mask.stride(3)] =
              rng.keep(b, h, i, j) ? 1 : 0;
        }
      }
    }
  }
}

}  // namespace attn
