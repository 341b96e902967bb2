#include "dist/transfer.hpp"

#include <algorithm>

namespace attn::dist::detail {
namespace {
// Both sides derive the sizes from the same World, so an empty buffer is no message.
constexpr int64_t kMaxMessage = int64_t{1} << 30;
}  // namespace

void Transfers::recv(void* data, int64_t bytes, int from, int tag, MPI_Comm comm) {
  char* p = static_cast<char*>(data);
  for (int64_t at = 0; at < bytes; at += kMaxMessage) {
    const int n = static_cast<int>(std::min(kMaxMessage, bytes - at));
    requests_.emplace_back();
    MPI_Irecv(p + at, n, MPI_BYTE, from, tag, comm, &requests_.back());
  }
}

double Transfers::send(const void* data, int64_t bytes, int to, int tag, MPI_Comm comm) {
  const char* p = static_cast<const char*>(data);
  for (int64_t at = 0; at < bytes; at += kMaxMessage) {
    const int n = static_cast<int>(std::min(kMaxMessage, bytes - at));
    requests_.emplace_back();
    MPI_Isend(p + at, n, MPI_BYTE, to, tag, comm, &requests_.back());
  }
  return static_cast<double>(bytes);
}

void Transfers::progress() {
  if (requests_.empty()) return;
  int done = 0;
  MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE);
  if (done) requests_.clear();
}

void Transfers::wait() {
  if (requests_.empty()) return;
  MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
  requests_.clear();
}

}  // namespace attn::dist::detail
