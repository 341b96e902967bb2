#include "dist/scratch.hpp"

#include <cstdlib>
#include <memory>
#include <new>

#include "attn/error.hpp"

namespace attn::dist::detail {
namespace {

struct Free {
  void operator()(void* p) const { std::free(p); }
};

struct Slot {
  std::unique_ptr<void, Free> data;
  size_t bytes = 0;
};

constexpr int kSlots = 16;

}  // namespace

void* scratch_bytes(int slot, size_t bytes) {
  thread_local Slot slots[kSlots];
  if (slot < 0 || slot >= kSlots) throw Error("attn::dist: scratch slot out of range");
  Slot& s = slots[slot];
  if (s.bytes < bytes || !s.data) {
    const size_t rounded = (bytes + 63) / 64 * 64 + 64;
    s.data.reset(std::aligned_alloc(64, rounded));
    if (!s.data) throw std::bad_alloc();
    s.bytes = rounded;
  }
  return s.data.get();
}

}  // namespace attn::dist::detail
