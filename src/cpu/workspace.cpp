// Per-thread scratch buffers (see workspace.hpp).
#include "workspace.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <new>

#include "tensor/storage.hpp"

namespace attn::detail {
namespace {

struct Buffer {
  float* data = nullptr;
  size_t capacity = 0;  // in floats
  size_t largest = 0;   // the largest request, in floats
  ~Buffer() { std::free(data); }
};

thread_local Buffer g_buffers[kNumSlots];

}  // namespace

float* thread_scratch(int slot, size_t floats) {
  Buffer& b = g_buffers[slot];
  b.largest = std::max(b.largest, floats);
  if (floats > b.capacity) {
    // Grow by 1.5× so a slowly growing sequence of calls re-allocates rarely; when
    // that much is not to be had, ask for exactly what this call needs.
    // Large buffers land on huge pages (storage.hpp): the bf16 forward's packed
    // q/k/v then cost fewer TLB misses to write and to tile-load.
    void* p = nullptr;
    size_t got = 0;
    for (size_t ask : {floats + floats / 2, floats}) {
      if (ask > SIZE_MAX / sizeof(float)) continue;
      p = allocate_storage(ask * sizeof(float));
      got = storage_bytes(ask * sizeof(float)) / sizeof(float);
      if (p != nullptr) break;
    }
    if (p == nullptr) throw std::bad_alloc();
    std::free(b.data);
    b.data = static_cast<float*>(p);
    b.capacity = got;
  }
  return b.data;
}

size_t thread_scratch_needed_bytes() {
  size_t floats = 0;
  for (const Buffer& b : g_buffers) floats += b.largest;
  return floats * sizeof(float);
}

}  // namespace attn::detail
