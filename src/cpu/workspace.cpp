// Per-thread scratch buffers (see workspace.hpp).
#include "workspace.hpp"

#include <cstdlib>
#include <new>

namespace attn::detail {
namespace {

struct Buffer {
  float* data = nullptr;
  size_t capacity = 0;  // in floats
  ~Buffer() { std::free(data); }
};

thread_local Buffer g_buffers[kNumSlots];

}  // namespace

float* thread_scratch(int slot, size_t floats) {
  Buffer& b = g_buffers[slot];
  if (floats > b.capacity) {
    // Grow by at least 1.5× so a slowly growing sequence of calls re-allocates rarely.
    size_t want = floats + floats / 2;
    want = (want + 15) / 16 * 16;
    void* p = std::aligned_alloc(64, want * sizeof(float));
    if (p == nullptr) throw std::bad_alloc();
    std::free(b.data);
    b.data = static_cast<float*>(p);
    b.capacity = want;
  }
  return b.data;
}

}  // namespace attn::detail
