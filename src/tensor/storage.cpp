// See storage.hpp.
//
// Why huge pages, measured on the Intel Xeon with AMX (docs/PERFORMANCE.md):
// - a paged KV cache whose pages of 16 tokens are scattered read 8–12% slower than
//   the same cache in order on 4 KiB pages, and 1–9% slower on huge pages (a TLB miss
//   per 4 KiB of scattered pages, whose page-table lines are scattered too, is the
//   likely cause);
// - the bf16 forward's packed q/k/v (10–19 MiB at N = 2048, H = 8) on huge pages made
//   the call 1% faster at d = 64 and 3–10% at d = 128.
#include "tensor/storage.hpp"

#include <cstdint>
#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attn::detail {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t alignment_for(size_t bytes) { return bytes >= kHugeStorageMinBytes ? kHugePage : 64; }

}  // namespace

size_t storage_bytes(size_t bytes) {
  const size_t align = alignment_for(bytes);
  // aligned_alloc needs a size that is a nonzero multiple of the alignment.
  return bytes == 0 ? align : (bytes + align - 1) / align * align;
}

void* allocate_storage(size_t bytes) noexcept {
  const size_t align = alignment_for(bytes);
  if (bytes > SIZE_MAX - align) return nullptr;
  const size_t rounded = storage_bytes(bytes);
  void* p = std::aligned_alloc(align, rounded);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (p != nullptr && align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advice: a refusal changes nothing
#endif
  return p;
}

}  // namespace attn::detail
