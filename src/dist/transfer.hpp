// Non-blocking point-to-point transfers of byte buffers of any size (MPI counts are
// int: larger buffers go as several messages of at most 1 GiB, in order).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace attn::dist::detail {

class Transfers {
 public:
  Transfers() = default;
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;
  ~Transfers() { wait(); }

  /// Posts the receive of `bytes` bytes from rank `from` into data.
  void recv(void* data, int64_t bytes, int from, int tag, MPI_Comm comm);
  /// Posts the send of `bytes` bytes to rank `to`; returns bytes (for statistics).
  double send(const void* data, int64_t bytes, int to, int tag, MPI_Comm comm);
  /// Lets MPI move data (MPI_Testall) without waiting.
  void progress();
  /// Waits for everything posted.
  void wait();

 private:
  std::vector<MPI_Request> requests_;
};

}  // namespace attn::dist::detail
