// Context parallelism over MPI: attention over a sequence split across processes
// (ranks), on one machine or many. Link the CMake target attn::dist (built when
// Open MPI is found); it is not part of <attn/attn.hpp>, so that attn itself never
// needs MPI.
//
// Two strategies, both exact (the result is attention() over the whole sequence,
// within the f32 rounding of an extra merge) and deterministic (bitwise identical
// across runs with the same number of ranks):
//
//   ring_attention     each rank keeps its queries; the key/value blocks travel
//                      around a ring of ranks (non-blocking sends overlapped with
//                      the local kernel) and the partial results are merged by their
//                      log-sum-exps (merge_attention_states). Memory per rank: its
//                      slice plus two blocks. Traffic per rank: (R − 1) key/value
//                      blocks (and as many f32 gradient blocks in the backward).
//   ulysses_attention  DeepSpeed-Ulysses: one all-to-all turns sequence slices into
//                      head slices (every position, Hq / R heads), each rank runs
//                      attention on its heads, and a second all-to-all returns the
//                      output. Needs Hq divisible by R. See docs/DIST.md for which wins.
//
// Layout on every rank (as attention(), any strides with a contiguous last dimension):
//   q [B, L_r, Hq, d]   k [B, L_r, Hkv, d]   v [B, L_r, Hkv, dv]
//   out [B, L_r, Hq, dv]  lse f32 [B, Hq, L_r] (optional in the forward)
// where L_r is the number of positions rank r holds (shard_length()). q, k and v hold
// the same positions: this is self-attention over one sequence of L = Σ L_r.
//
// Options (AttentionOptions, identical on every rank, with the meaning they have for
// one call over the whole sequence): scale, causal (TopLeft and BottomRight agree when
// Lq = Lk), window, alibi_slopes ([Hq] or [B, Hq]), softcap, key_lengths (int32 [B],
// keys in use of the whole sequence: key padding), dropout_p / seed / offset (the
// decisions of the single-process call, position for position), precision. Not
// supported, rejected with attn::Error: mask (an L × L tensor defeats the point of
// splitting the sequence; use causal, window, key_lengths or ALiBi), cu_seqlens.
//
// Errors: every rank checks its own arguments, then the ranks compare theirs with one
// MPI_Allgather; if any rank's arguments are bad or they disagree (shapes, dtypes,
// options, lengths that do not fit the layout), every rank throws attn::Error naming
// the rank and the argument, and nothing is written. All ranks of `comm` must call.
// MPI must be initialised; any thread level works (attn calls MPI from the calling
// thread only).
//
// Threads: each rank runs the kernels on attn::num_threads() threads. With several
// ranks on one machine, set ATTN_NUM_THREADS (or set_num_threads) to cores / ranks.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "attn/attention.hpp"

namespace attn::dist {

/// How the L positions of a sequence are split over R ranks.
enum class Layout : uint8_t {
  /// Rank r holds one run of consecutive positions, after those of ranks < r. With
  /// shard()/shard_length() the runs differ in length by at most one; ring_attention
  /// accepts any lengths (even 0). Causal attention then loads the last rank most.
  contiguous,
  /// The sequence is cut into 2R chunks whose lengths differ by at most one (the first
  /// L mod 2R are one longer); rank r holds chunk r followed by chunk 2R − 1 − r. Every
  /// rank then does the same causal work (up to one row per chunk). The default.
  zigzag,
};

/// One run of consecutive positions that a rank holds: local rows
/// [local_row, local_row + length) are positions [position, position + length).
struct Segment {
  int64_t local_row = 0;
  int64_t position = 0;
  int64_t length = 0;
};

/// The positions rank `rank` of `ranks` holds of a sequence of `length` positions laid
/// out by shard() (non-empty segments, in local row order).
std::vector<Segment> shard_segments(int64_t length, int rank, int ranks, Layout layout = Layout::zigzag);

/// Number of positions rank `rank` holds: L_r above.
int64_t shard_length(int64_t length, int rank, int ranks, Layout layout = Layout::zigzag);

/// Copies rank `rank`'s positions of `whole` into `local`. The sequence runs along
/// dimension `seq_dim` (1 for q, k, v, out [B, L, H, d]; 2 for lse [B, H, L]); every
/// other dimension and the dtype must match. Any strides.
void shard(const TensorView& whole, const TensorView& local, int rank, int ranks, Layout layout = Layout::zigzag,
           int seq_dim = 1);

/// The inverse: writes `local` (rank `rank`'s positions) into its places in `whole`,
/// leaving the other positions untouched.
void unshard(const TensorView& local, const TensorView& whole, int rank, int ranks, Layout layout = Layout::zigzag,
             int seq_dim = 1);

/// Gathers every rank's `local` into `whole` on every rank (MPI_Allgatherv; the
/// inverse of shard over all ranks). Collective over comm.
void allgather_sequence(MPI_Comm comm, const TensorView& local, const TensorView& whole,
                        Layout layout = Layout::zigzag, int seq_dim = 1);

/// What one call did, for benchmarks (all times in seconds, on this rank).
struct Stats {
  int steps = 0;             // ring steps computed (blocks this rank attended to, incl. its own)
  int steps_skipped = 0;     // ring steps every rank skipped (out of every window)
  double compute_s = 0;      // local kernels (and merges)
  double wait_s = 0;         // blocked in MPI waiting for blocks not yet arrived
  double total_s = 0;        // the whole call
  double bytes_sent = 0;     // payload this rank sent
};

/// Ring attention forward (see the top of this file). out in q's dtype, or f32 for
/// bf16/f16 inputs: the output before its rounding, as attention() takes it (rounding
/// it gives the 16-bit out bit for bit), which the backward then reads D = rowsum(dO ∘ O)
/// from, keeping dq and dk near the exact gradient on sharply peaked rows
/// (attn/attention.hpp, "Dtypes"). lse optional.
void ring_attention(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const AttentionOptions& options = {}, const TensorView& lse = {},
                    Layout layout = Layout::zigzag, Stats* stats = nullptr);

/// Ring attention backward: given the forward's out and lse (this rank's rows) and
/// dout = ∂L/∂out (q's dtype; out as the forward's, either dtype), writes dq, dk, dv
/// (shaped like q, k, v, in their dtype) for this
/// rank's positions. The key/value blocks travel the ring again, with f32 gradient
/// accumulators for their dk, dv, which return to their owner at the end.
void ring_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const TensorView& dout,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                             const AttentionOptions& options = {}, Layout layout = Layout::zigzag,
                             Stats* stats = nullptr);

/// Head-parallel (DeepSpeed-Ulysses) attention forward: same arguments and results as
/// ring_attention. Requires Hq divisible by the number of ranks; with GQA a kv head
/// is sent to every rank whose query heads read it.
void ulysses_attention(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const AttentionOptions& options = {}, const TensorView& lse = {},
                       Layout layout = Layout::zigzag, Stats* stats = nullptr);

/// Head-parallel backward (lse required, as for ring_attention_backward).
void ulysses_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& lse, const TensorView& dout,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                const AttentionOptions& options = {}, Layout layout = Layout::zigzag,
                                Stats* stats = nullptr);

}  // namespace attn::dist
