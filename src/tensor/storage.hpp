// Aligned storage for tensors and for the kernels' scratch: 64-byte lines, and for
// large buffers 2 MiB boundaries offered to the kernel as transparent huge pages.
#pragma once

#include <cstddef>

namespace attn::detail {

/// Buffers from this size on are placed on 2 MiB boundaries and, on Linux, advised
/// as transparent huge pages (madvise: under the THP mode "madvise", Debian's default,
/// nothing else gives a process any). NumPy advises its arrays from 4 MiB on.
constexpr size_t kHugeStorageMinBytes = size_t{8} << 20;

/// The bytes allocate_storage reserves for a request of `bytes`: `bytes` rounded up to
/// a multiple of the alignment it uses (64 bytes, or 2 MiB for large buffers).
size_t storage_bytes(size_t bytes);

/// storage_bytes(bytes) bytes of uninitialised storage, 64-byte aligned (2 MiB-aligned
/// and advised as huge pages from kHugeStorageMinBytes on), or nullptr when the
/// system has none to give. Release with std::free.
void* allocate_storage(size_t bytes) noexcept;

}  // namespace attn::detail
