// Which positions of a sequence each rank holds (contiguous or zigzag), and copies
// between a whole sequence and a rank's slice of it.
#include <mpi.h>

#include <string>
#include <vector>

#include "attn/dist.hpp"
#include "dist/views.hpp"

namespace attn::dist {
namespace {

[[noreturn]] void fail(const char* fn, const std::string& what) { throw Error(std::string(fn) + ": " + what); }

// Run p of n runs whose lengths differ by at most one (the first length mod n are longer).
Segment run(int64_t length, int p, int n) {
  const int64_t base = length / n, extra = length % n;
  Segment s;
  s.position = p * base + std::min<int64_t>(p, extra);
  s.length = base + (p < extra ? 1 : 0);
  return s;
}

void check_ranks(const char* fn, int rank, int ranks) {
  if (ranks < 1) fail(fn, "ranks must be >= 1, got " + std::to_string(ranks));
  if (rank < 0 || rank >= ranks) {
    fail(fn, "rank must be in [0, " + std::to_string(ranks) + "), got " + std::to_string(rank));
  }
}

// Checks whole and local against each other for shard/unshard; returns the length.
int64_t check_pair(const char* fn, const TensorView& whole, const TensorView& local, int rank, int ranks,
                   Layout layout, int seq_dim) {
  check_ranks(fn, rank, ranks);
  if (whole.empty() || local.empty()) fail(fn, "whole and local are required");
  if (whole.dtype() != local.dtype()) {
    fail(fn, std::string("local must have whole's dtype ") + dtype_name(whole.dtype()) + ", got " +
                 dtype_name(local.dtype()));
  }
  if (whole.rank() != local.rank()) fail(fn, "local must have whole's rank " + std::to_string(whole.rank()));
  if (seq_dim < 0 || seq_dim >= whole.rank()) {
    fail(fn, "seq_dim must be a dimension of whole (rank " + std::to_string(whole.rank()) + "), got " +
                 std::to_string(seq_dim));
  }
  const int64_t length = whole.size(seq_dim);
  for (int i = 0; i < whole.rank(); ++i) {
    const int64_t want = i == seq_dim ? shard_length(length, rank, ranks, layout) : whole.size(i);
    if (local.size(i) != want) {
      fail(fn, "local " + local.describe() + " must have size " + std::to_string(want) + " in dimension " +
                   std::to_string(i) + " (whole " + whole.describe() + ", rank " + std::to_string(rank) + " of " +
                   std::to_string(ranks) + ")");
    }
    if (whole.stride(i) < 0 || local.stride(i) < 0) fail(fn, "negative strides are not supported");
  }
  if (whole.numel() > 0 && (whole.data() == nullptr || local.data() == nullptr) && local.numel() > 0) {
    fail(fn, "null data pointer");
  }
  return length;
}

}  // namespace

std::vector<Segment> shard_segments(int64_t length, int rank, int ranks, Layout layout) {
  check_ranks("shard_segments", rank, ranks);
  if (length < 0) fail("shard_segments", "length must be >= 0, got " + std::to_string(length));
  std::vector<Segment> out;
  auto add = [&](Segment s) {
    if (s.length == 0) return;
    s.local_row = out.empty() ? 0 : out.back().local_row + out.back().length;
    out.push_back(s);
  };
  if (layout == Layout::contiguous) {
    add(run(length, rank, ranks));
  } else {
    add(run(length, rank, 2 * ranks));
    add(run(length, 2 * ranks - 1 - rank, 2 * ranks));
  }
  return out;
}

int64_t shard_length(int64_t length, int rank, int ranks, Layout layout) {
  int64_t n = 0;
  for (const Segment& s : shard_segments(length, rank, ranks, layout)) n += s.length;
  return n;
}

void shard(const TensorView& whole, const TensorView& local, int rank, int ranks, Layout layout, int seq_dim) {
  const int64_t length = check_pair("shard", whole, local, rank, ranks, layout, seq_dim);
  for (const Segment& s : shard_segments(length, rank, ranks, layout)) {
    detail::copy_view(detail::narrow(whole, seq_dim, s.position, s.length),
                      detail::narrow(local, seq_dim, s.local_row, s.length));
  }
}

void unshard(const TensorView& local, const TensorView& whole, int rank, int ranks, Layout layout, int seq_dim) {
  const int64_t length = check_pair("unshard", whole, local, rank, ranks, layout, seq_dim);
  for (const Segment& s : shard_segments(length, rank, ranks, layout)) {
    detail::copy_view(detail::narrow(local, seq_dim, s.local_row, s.length),
                      detail::narrow(whole, seq_dim, s.position, s.length));
  }
}

void allgather_sequence(MPI_Comm comm, const TensorView& local, const TensorView& whole, Layout layout,
                        int seq_dim) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  check_pair("allgather_sequence", whole, local, rank, ranks, layout, seq_dim);
  // Each rank's slice travels packed (local's shape, contiguous); then every rank
  // unshards every slice into whole.
  const size_t es = dtype_size(local.dtype());
  std::vector<int> counts(static_cast<size_t>(ranks)), displs(static_cast<size_t>(ranks));
  int64_t total = 0;
  std::vector<std::vector<int64_t>> shapes;
  for (int r = 0; r < ranks; ++r) {
    std::vector<int64_t> shape = whole.shape();
    shape[static_cast<size_t>(seq_dim)] = shard_length(whole.size(seq_dim), r, ranks, layout);
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    const int64_t bytes = n * static_cast<int64_t>(es);
    if (bytes > INT32_MAX || total + bytes > INT32_MAX) {
      fail("allgather_sequence", "the sequence is over 2 GiB, more than one MPI_Allgatherv moves");
    }
    counts[static_cast<size_t>(r)] = static_cast<int>(bytes);
    displs[static_cast<size_t>(r)] = static_cast<int>(total);
    total += bytes;
    shapes.push_back(shape);
  }
  std::vector<char> mine(static_cast<size_t>(counts[static_cast<size_t>(rank)]));
  detail::copy_view(local, TensorView(mine.data(), local.dtype(), shapes[static_cast<size_t>(rank)]));
  std::vector<char> all(static_cast<size_t>(total));
  MPI_Allgatherv(mine.data(), counts[static_cast<size_t>(rank)], MPI_BYTE, all.data(), counts.data(),
                 displs.data(), MPI_BYTE, comm);
  for (int r = 0; r < ranks; ++r) {
    unshard(TensorView(all.data() + displs[static_cast<size_t>(r)], local.dtype(), shapes[static_cast<size_t>(r)]),
            whole, r, ranks, layout, seq_dim);
  }
}

}  // namespace attn::dist
