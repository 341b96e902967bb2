// The cross-rank argument check of the distributed entry points: every rank checks
// its own arguments, then one MPI_Allgather of a fixed-size summary lets every rank
// see every other's verdict, its shapes and options, so that all of them throw the
// same attn::Error (naming the rank and the argument) or none does — never a hang
// with some ranks waiting in a collective the others left.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/dist.hpp"

namespace attn::dist::detail {

/// What all ranks agree on after the check.
struct World {
  int rank = 0, ranks = 1;
  int64_t length = 0;                  // L, the whole sequence
  std::vector<int64_t> local_lengths;  // L_r of every rank
  std::vector<int32_t> key_lengths;    // options.key_lengths (empty if none)
  /// The positions rank r holds, in local row order.
  std::vector<Segment> segments(int r) const;
  Layout layout = Layout::zigzag;
};

/// Runs `local_check` (which throws attn::Error for a bad argument of this rank),
/// then compares every rank's shapes (q's batch, heads, head dims, dtype), options
/// and local length (against the layout) with MPI_Allgather. Throws the same
/// attn::Error on every rank if anything is wrong anywhere. `fn` names the entry point.
World agree(const char* fn, MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
            const AttentionOptions& options, Layout layout, const std::function<void()>& local_check);

}  // namespace attn::dist::detail
