// Files that are whole or absent: every write the library makes goes through here, so a
// full disk or an I/O error leaves the previous file (or none) in place, never half of a
// new one, and no temporary file behind. Reads are bounded, so a directory or a huge
// file where a small file is expected gives an error instead of an allocation failure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace attn::io {

/// Writes `size` bytes to `path` (created or truncated) and flushes them to the disk
/// (fsync). On any failure the partial file is removed and attn::Error names the path
/// and the system's reason ("No space left on device", …).
void write_file_synced(const std::string& path, const void* data, size_t size);

/// Replaces `path` by `size` bytes atomically: they go to `path + ".tmp"`, are synced,
/// and the temporary file is renamed over `path`. A reader sees the old file or the new
/// one; on failure the old file is untouched and the temporary file is removed.
void write_file_atomically(const std::string& path, const void* data, size_t size);

/// Makes the renames done inside directory `dir` durable (fsync of the directory).
/// Best effort: file systems that cannot sync a directory are not an error.
void sync_directory(const std::string& dir);

/// The bytes of regular file `path`. Throws attn::Error naming `what` and the path when
/// it is missing, is not a regular file (a directory, a device), cannot be read, or is
/// larger than `max_bytes`.
std::vector<uint8_t> read_regular_file(const std::string& path, size_t max_bytes, const std::string& what);

/// The CRC-32 (zlib's, the one in PNG and gzip) of `size` bytes.
uint32_t crc32_of(const void* data, size_t size);

namespace testing {
/// Fault injection for tests: while set, every write_file_synced whose path satisfies
/// `fails` writes half its bytes and then fails as a full disk does (ENOSPC). Pass an
/// empty function to stop. Not thread-safe; for tests only.
void inject_write_failure(std::function<bool(const std::string& path)> fails);
}  // namespace testing

}  // namespace attn::io
