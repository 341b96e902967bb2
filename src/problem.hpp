// The checked, normalised description of one attention call: raw pointers,
// strides in elements and per-sequence extents. Built by make_problem()
// (src/attention_args.cpp) after every argument check has passed; read by the
// reference (src/reference/) and by the fused kernels (src/cpu/). It holds no
// derived masking logic: each consumer decides visibility from the options itself,
// so the reference stays an independent oracle.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/attention.hpp"

namespace attn::detail {

/// One sequence of the batch (a batch row, or one packed sequence with cu_seqlens).
/// Offsets are in elements from the base pointers of Problem.
struct Sequence {
  int64_t q_offset = 0;      // q row 0, head 0 of this sequence
  int64_t k_offset = 0;      // k row 0, head 0
  int64_t v_offset = 0;      // v row 0, head 0
  int64_t out_offset = 0;    // out row 0, head 0
  int64_t lse_offset = 0;    // lse (head 0, row 0), if lse is wanted
  int64_t probs_offset = 0;  // probs (head 0, row 0, col 0), if probs is wanted
  int Lq = 0;                // queries in this sequence
  int Lk = 0;                // keys in use: the extent, or key_lengths[b] if given
  int Lk_rows = 0;           // rows of k (and v) this sequence spans (≥ Lk)
  int64_t q_token0 = 0;      // varlen: index of the first query / key token in the
  int64_t k_token0 = 0;      // packed tensors (0 for a padded batch)
  // Bottom-right alignment: query i sits on the diagonal of key i + align
  // (Problem.q_pos0/k_pos0 added). Lk − Lq, except for a call placed inside a longer
  // sequence (placed_attention.hpp), where it is that sequence's Lk − Lq.
  int64_t align = 0;
  // Backward only: offsets of row 0, head 0 in dout, dq, dk, dv.
  int64_t dout_offset = 0, dq_offset = 0, dk_offset = 0, dv_offset = 0;
};

struct Problem {
  int B = 0, Hq = 0, Hkv = 0, d = 0, dv = 0;
  // The dtype of q, k, v, out (and dout, dq, dk, dv). The pointers below address
  // storage of that dtype (offsets and strides in elements). The fused forward and the
  // AMX kernels read bf16/f16 in place; the backward and the reference read f32 only,
  // so their bf16/f16 problems are widened first (attention_lowp.cpp) and the
  // pointers are then those of the f32 copies.
  DType dtype = DType::f32;
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* out = nullptr;
  // Row (position) and head strides; the last dimension is contiguous.
  int64_t q_row = 0, q_head = 0, k_row = 0, k_head = 0, v_row = 0, v_head = 0;
  int64_t out_row = 0, out_head = 0;
  std::vector<Sequence> seqs;  // B entries

  float scale = 1.0f;
  float softcap = 0.0f;  // 0 = off
  Causal causal = Causal::None;
  int window_left = -1, window_right = -1;

  // ALiBi: slope of (b, h) = alibi[b·alibi_b + h·alibi_h]; nullptr = off.
  const float* alibi = nullptr;
  int64_t alibi_b = 0, alibi_h = 0;

  // Mask element (b, h, i, j) at offset b·mask_b + h·mask_h + i·mask_i + j·mask_j
  // (stride 0 on broadcast dimensions; mask_j is 0 or 1). At most one of the two.
  const uint8_t* bool_mask = nullptr;
  const float* add_mask = nullptr;
  DType mask_dtype = DType::f32;
  int64_t mask_b = 0, mask_h = 0, mask_i = 0, mask_j = 0;

  // Block-sparse mask (AttentionOptions::block_mask; nullptr = none). The entry of
  // block (qb, kb) of (b, h) is bm_blocks[b·bm_b + h·bm_h + qb·bm_qb + kb·bm_kb]
  // (stride 0 on broadcast dimensions): BlockMask::kEmpty, kFull, or the index t of
  // a partial block whose element (r, c) is bm_tiles[t·bm_t + r·bm_r + c].
  const int32_t* bm_blocks = nullptr;
  int64_t bm_b = 0, bm_h = 0, bm_qb = 0, bm_kb = 0;
  const uint8_t* bm_tiles = nullptr;
  int64_t bm_t = 0, bm_r = 0;
  int bm_bq = 0, bm_bk = 0;
  /// The entry of the block holding (i, j) for (b, h); positions within the sequence.
  int32_t BlockEntry(int b, int h, int i, int j) const {
    return bm_blocks[b * bm_b + h * bm_h + (i / bm_bq) * bm_qb + (j / bm_bk) * bm_kb];
  }

  // Optional outputs (nullptr = not wanted). lse(b,h,i) at seq.lse_offset +
  // h·lse_h + i·lse_i; probs(b,h,i,j) at seq.probs_offset + h·probs_h + i·probs_i + j,
  // with probs_cols columns per row (columns ≥ seq.Lk are written 0).
  float* lse = nullptr;
  int64_t lse_h = 0, lse_i = 0;
  float* probs = nullptr;
  int64_t probs_h = 0, probs_i = 0;
  int probs_cols = 0;

  const UserMods* mods = nullptr;  // user score_mod / mask_mod, or nullptr

  // Placement in a longer sequence (ring and head-parallel attention, src/dist/):
  // query row i is position i + q_pos0 and key row j position j + k_pos0 of the
  // whole sequence, and query head h is head h + h0 of heads_total. The band,
  // ALiBi and dropout read these global positions. 0, 0, 0, Hq for an ordinary call.
  int64_t q_pos0 = 0, k_pos0 = 0;
  int h0 = 0, heads_total = 0;
  // out is f32 although dtype is bf16/f16: a placed call's partial result, merged
  // before it is rounded, or the output before rounding that attention() was given
  // room for (and that attention_backward() reads D = rowsum(dO ∘ O) from). Both
  // forward kernels (tiles and portable) and both backward ones honour it.
  bool out_f32 = false;
  /// The dtype out is stored in.
  DType out_dtype() const { return out_f32 ? DType::f32 : dtype; }
  // What the caller allows for f32 inputs (AttentionOptions::precision).
  Precision precision = Precision::f32;
  /// f32 inputs that the bf16 tile kernels take as hi + lo pieces (Precision::bf16x3).
  bool split_f32() const { return dtype == DType::f32 && precision == Precision::bf16x3; }
  /// f32 inputs rounded to bf16 (Precision::bf16): the f32 kernel rounds them as it
  /// packs and loads them.
  bool round_bf16() const { return dtype == DType::f32 && precision == Precision::bf16; }
  /// bf16 pieces per value in the tile kernels: 2 (hi + lo, three tile products per
  /// product) for f16 inputs and split f32 ones, else 1.
  int pieces() const { return dtype == DType::f16 || split_f32() ? 2 : 1; }

  // Dropout on the probabilities (0 = off): keep with probability 1 − p, scale
  // kept ones by 1/(1 − p); decisions from DropoutRng(p, seed, offset, heads_total)
  // at the global positions (cpu/dropout_tile-inl.h).
  float dropout_p = 0.0f;
  uint64_t seed = 0, offset = 0;

  /// Query head h reads kv head h / group().
  int group() const { return Hq / Hkv; }
};

/// A backward call: the forward's problem (whose out and lse are inputs here)
/// plus the gradients. Strides as the forward's; per-sequence offsets in Sequence.
struct BackwardProblem {
  Problem fwd;
  const float* dout = nullptr;
  int64_t dout_row = 0, dout_head = 0;
  float* dq = nullptr;
  int64_t dq_row = 0, dq_head = 0;
  float* dk = nullptr;
  int64_t dk_row = 0, dk_head = 0;
  float* dv = nullptr;
  int64_t dv_row = 0, dv_head = 0;
  // ∂L/∂(additive mask) at b·dbias_b + h·dbias_h + i·dbias_i + j·dbias_j (stride 0
  // on the mask's broadcast dimensions, so accumulation reduces over them).
  float* dbias = nullptr;
  int64_t dbias_b = 0, dbias_h = 0, dbias_i = 0, dbias_j = 0;
  // True when dbias broadcasts over the batch or the heads, so that work items of
  // different (sequence, kv head) would add into the same elements.
  bool dbias_shared = false;
  // Packed batches: the tokens of q and k, all zeroed in the gradients (tokens
  // outside every sequence included); 0 for a padded batch.
  int64_t varlen_q_tokens = 0, varlen_k_tokens = 0;
  // dq, dk, dv are f32 although the inputs are bf16/f16: a placed call's
  // contributions, summed across blocks before they are rounded once.
  bool grads_f32 = false;
  /// The dtype dq, dk and dv are stored in.
  DType grad_dtype() const { return grads_f32 ? DType::f32 : fwd.dtype; }
};

/// Strides of a tensor of rank ≤ 4 broadcast over 4 dimensions [B, H, Lq, Lk]
/// (aligned to the right, as NumPy): 0 for a missing or size-1 dimension, else the
/// tensor's stride. Shared by the mask and its gradient dbias.
void broadcast_strides(const TensorView& t, int64_t strides[4]);

class Checker;

/// The mask fields of p from m, whose dtype and shape the caller has checked against
/// its own extent: strides broadcast over [B, Hq, Lq, Lk] (the last must be 1 or
/// broadcast, else an attn::Error naming `name`), the dtype, and the pointer (an
/// additive bf16/f16 mask is widened to f32 before any kernel reads it). Shared by
/// attention() and attention_with_kvcache().
void bind_mask_layout(const Checker& c, const TensorView& m, const char* name, Problem* p);

/// Checks every argument (throws attn::Error naming it) and builds the Problem, in
/// steps of one concern each (attention_args.cpp: bind_qkv, bind_scalars,
/// bind_sequences, bind_alibi, bind_mask, bind_block_mask, bind_lse_probs,
/// check_forward_overlaps), in that order, so the first bad argument is reported.
/// `fn` names the public function in messages. Every tensor must be in host memory,
/// unless `on_device` (the CUDA path), where every tensor must be on q's device
/// (cu_seqlens and key_lengths may also be in host memory; device copies are read
/// through a synchronous copy). The pointers are then device pointers. `out_f32`: out
/// must be f32 whatever the inputs' dtype (placed calls, Problem::out_f32); else it
/// has q's dtype.
Problem make_problem(const char* fn, const TensorView& q, const TensorView& k,
                     const TensorView& v, const TensorView& out, const AttentionOptions& opt,
                     const TensorView& lse, const TensorView& probs, const UserMods* mods,
                     bool on_device = false, bool out_f32 = false);

/// The same for attention_backward(): lse is required; dout is shaped like out,
/// dq like q, dk like k, dv like v; dbias like the (additive) mask. `on_device` as
/// make_problem's: every tensor on q's device. `grads_f32`: dq, dk and dv must be f32
/// whatever the inputs' dtype (placed calls, BackwardProblem::grads_f32); else they
/// have the inputs' dtype. `out_f32`: out is f32 for bf16/f16 inputs (the forward's
/// output before rounding; dout keeps the inputs' dtype).
BackwardProblem make_backward_problem(const char* fn, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& out,
                                      const TensorView& lse, const TensorView& dout,
                                      const TensorView& dq, const TensorView& dk,
                                      const TensorView& dv, const AttentionOptions& opt,
                                      const TensorView& dbias, const UserMods* mods,
                                      bool on_device = false, bool grads_f32 = false, bool out_f32 = false);

/// Whether a call on the CPU was given an f32 out for bf16/f16 inputs: the output
/// before rounding, which attention() writes and attention_backward() reads D from
/// (attention.hpp). Any other dtype pairing is left to the checks to report.
bool wide_out(const TensorView& q, const TensorView& out);

}  // namespace attn::detail
