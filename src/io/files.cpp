// Whole-or-nothing file writes, bounded reads and checksums (see files.hpp).
#include "io/files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "attn/error.hpp"

namespace attn::io {

namespace {

std::function<bool(const std::string&)>& injected_failure() {
  static std::function<bool(const std::string&)> f;
  return f;
}

[[noreturn]] void fail_io(const std::string& what, const std::string& path, int err) {
  throw Error(what + " \"" + path + "\": " + std::strerror(err));
}

// write(2) until done; returns 0 or the errno of the failure.
int write_all(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return 0;
}

}  // namespace

void write_file_synced(const std::string& path, const void* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_io("cannot create", path, errno);
  const uint8_t* bytes = static_cast<const uint8_t*>(data);
  int err = 0;
  if (injected_failure() && injected_failure()(path)) {
    write_all(fd, bytes, size / 2);
    err = ENOSPC;
  } else {
    err = write_all(fd, bytes, size);
  }
  // fsync reports the errors of delayed allocation (a full disk on NFS or XFS shows up
  // here, not in write), so it is part of the write.
  if (err == 0 && ::fsync(fd) != 0 && errno != EINVAL && errno != EROFS) err = errno;
  if (::close(fd) != 0 && err == 0 && errno != EINTR) err = errno;
  if (err != 0) {
    ::unlink(path.c_str());
    fail_io("cannot write", path, err);
  }
}

void write_file_atomically(const std::string& path, const void* data, size_t size) {
  const std::string tmp = path + ".tmp";
  write_file_synced(tmp, data, size);  // removes tmp itself when it fails
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail_io("cannot replace", path, err);
  }
  const size_t slash = path.find_last_of('/');
  sync_directory(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash));
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

std::vector<uint8_t> read_regular_file(const std::string& path, size_t max_bytes, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail_io(what + ": cannot open", path, errno);
  if (S_ISDIR(st.st_mode)) throw Error(what + ": \"" + path + "\" is a directory, expected a file");
  if (!S_ISREG(st.st_mode)) throw Error(what + ": \"" + path + "\" is not a regular file");
  if (static_cast<uint64_t>(st.st_size) > max_bytes)
    throw Error(what + ": \"" + path + "\" is too large (" + std::to_string(st.st_size) + " bytes, at most " +
                std::to_string(max_bytes) + ")");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_io(what + ": cannot open", path, errno);
  std::vector<uint8_t> bytes(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const int err = r < 0 ? errno : EIO;
      ::close(fd);
      if (r == 0) throw Error(what + ": \"" + path + "\" changed while it was read");
      fail_io(what + ": cannot read", path, err);
    }
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  return bytes;
}

uint32_t crc32_of(const void* data, size_t size) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const Bytef* p = static_cast<const Bytef*>(data);
  while (size > 0) {  // zlib takes 32-bit lengths
    const uInt n = static_cast<uInt>(std::min<size_t>(size, 1u << 30));
    crc = ::crc32(crc, p, n);
    p += n;
    size -= n;
  }
  return static_cast<uint32_t>(crc);
}

namespace testing {
void inject_write_failure(std::function<bool(const std::string& path)> fails) { injected_failure() = std::move(fails); }
}  // namespace testing

}  // namespace attn::io
