// Reusable, 64-byte-aligned scratch memory. On these machines the first touch of
// a freshly mapped page costs ~10 µs, so kernels never allocate per call: each
// thread keeps its buffers and grows them only when a call needs more.
#pragma once

#include <cstddef>

namespace attn::detail {

/// Scratch owned by the calling thread, for the `slot`-th use (slots are
/// independent buffers). Returns at least `floats` floats, 64-byte aligned. The
/// contents are unspecified. Valid until the same thread asks the same slot again.
float* thread_scratch(int slot, size_t floats);

/// Bytes of the largest request the calling thread has made of each slot, summed
/// over the slots: what its calls so far needed at once (for tests of
/// attention_workspace_bytes; the buffers themselves may be up to 1.5× that).
size_t thread_scratch_needed_bytes();

enum ScratchSlot : int {
  kSlotPackedKv = 0,  // packed K/V panels of one call (owned by the calling thread)
  kSlotTile = 1,      // per-worker tile buffers (Q tile, scores, output accumulator)
  kSlotWidened = 2,   // the f32 copies of the portable backward (attention_lowp.cpp)
  kSlotDecode = 3,    // per-worker state of the decode kernel (cpu/attention_decode.cc)
  kSlotDecodeParts = 4,  // the decode kernel's split partials of one call (owned by the calling thread)
  kSlotGatheredKv = 5,   // a paged sequence's keys and values gathered for the tiled kernels (calling thread)
  kNumSlots = 6,
};

}  // namespace attn::detail
