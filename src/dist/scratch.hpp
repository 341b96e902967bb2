// Buffers that persist across calls on the calling thread. The first touch of a
// freshly mapped page costs about 10 µs here (DESIGN.md, "Facts"): a 32 MiB block
// received into new memory took ~80 ms, more than the transfer itself, and showed up
// as waiting in the ring's backward. So the distributed entry points keep their
// blocks, accumulators and all-to-all buffers in numbered slots that only grow.
#pragma once

#include <cstddef>

namespace attn::dist::detail {

/// The bytes behind scratch<T>().
void* scratch_bytes(int slot, size_t bytes);

/// Slot `slot` (0 … 15) of this thread, holding at least `count` elements of T
/// (64-byte aligned; contents unspecified). Valid until the next call for that slot.
template <class T>
T* scratch(int slot, size_t count) {
  return static_cast<T*>(scratch_bytes(slot, count * sizeof(T)));
}

}  // namespace attn::dist::detail
