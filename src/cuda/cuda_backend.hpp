// The interface between attn_core and the CUDA backend (attn_cuda, built from the .cu
// files beside this header when nvcc is found). Plain structs and functions only, so
// that attn_core compiles without CUDA and the backend without the core: attn_core
// checks the arguments, builds these parameters and turns a non-empty error string into
// an attn::Error. Pointers in the parameters are device pointers unless marked host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace attn::cuda {

/// Element types the kernels read and write (the order is attn::DType's, for the
/// dtypes the GPU path takes).
enum class Elem : uint8_t { f32, bf16, f16 };

/// One sequence of the batch: offsets (in elements) of its row 0, head 0 in q, k, v,
/// out, lse and probs; its query and key counts; the bottom-right diagonal shift.
struct SeqDesc {
  int64_t q_offset, k_offset, v_offset, out_offset, lse_offset, probs_offset;
  int32_t Lq, Lk;  // Lk: the keys in use (key_lengths applied)
  int64_t align;   // query i's diagonal key is i + align (before q_pos0 / k_pos0)
};

/// Everything one forward call needs. Semantics are attention()'s (attn/attention.hpp).
struct ForwardParams {
  Elem in = Elem::bf16;     // dtype of q, k, v and out; f32 inputs are rounded to bf16 (Precision::bf16)
  int B = 0, Hq = 0, Hkv = 0, d = 0;  // dv = d on the GPU path
  int max_lq = 0;           // the longest sequence's queries (grid size)
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;      // written by the forward, read by the backward
  int64_t q_row = 0, q_head = 0, k_row = 0, k_head = 0, v_row = 0, v_head = 0;
  int64_t out_row = 0, out_head = 0;
  const SeqDesc* seqs_host = nullptr;  // host memory, B entries; copied to the device

  float scale = 1.0f;
  float softcap = 0.0f;     // 0 = off
  int causal = 0;           // 0 none, 1 top-left, 2 bottom-right
  int window_left = -1, window_right = -1;

  const float* alibi = nullptr;        // slope of (b, h) at b·alibi_b + h·alibi_h
  int64_t alibi_b = 0, alibi_h = 0;

  // Mask element (b, h, i, j) at b·mask_b + h·mask_h + i·mask_i + j·mask_j; at most one.
  const uint8_t* bool_mask = nullptr;
  const float* add_mask = nullptr;
  int64_t mask_b = 0, mask_h = 0, mask_i = 0, mask_j = 0;

  // Block-sparse mask (attn::BlockMask; nullptr = none): the entry of block (qb, kb) of
  // (b, h) at b·bm_b + h·bm_h + qb·bm_qb + kb·bm_kb is −1 (empty), −2 (full) or a tile
  // t whose element (r, c) is bm_tiles[t·bm_t + r·bm_r + c] (0 = removed).
  const int32_t* bm_blocks = nullptr;
  int64_t bm_b = 0, bm_h = 0, bm_qb = 0, bm_kb = 0;
  const uint8_t* bm_tiles = nullptr;
  int64_t bm_t = 0, bm_r = 0;
  int bm_bq = 1, bm_bk = 1;

  float* lse = nullptr;                // lse(b, h, i) at seq.lse_offset + h·lse_h + i·lse_i (read by the backward)
  int64_t lse_h = 0, lse_i = 0;

  // probs(b, h, i, j) at seq.probs_offset + h·probs_h + i·probs_i + j, probs_cols
  // columns per row (columns ≥ the sequence's Lk are 0); nullptr = not wanted.
  float* probs = nullptr;
  int64_t probs_h = 0, probs_i = 0;
  int probs_cols = 0;

  // Dropout (keyed exactly as the CPU's: dropout/philox.hpp) at global positions.
  float dropout_p = 0.0f;
  uint64_t seed = 0, offset = 0;
  int heads_total = 0, h0 = 0;
  int64_t q_pos0 = 0, k_pos0 = 0;

  int device = 0;           // CUDA ordinal
  void* stream = nullptr;   // cudaStream_t
};

/// Per sequence of a backward call: offsets (in elements) of row 0, head 0 of dout,
/// dq, dk and dv.
struct BackwardSeq {
  int64_t dout_offset, dq_offset, dk_offset, dv_offset;
};

/// A gradient tensor as [n0][n1][n2][d] with element strides s0, s1, s2 (the last
/// dimension contiguous): all of it is zeroed before the kernels add the gradients of
/// the rows that take part (packed batches have tokens outside every sequence, key
/// lengths leave keys out).
struct GradExtent {
  int64_t n0 = 0, s0 = 0, n1 = 0, s1 = 0, n2 = 0, s2 = 0;
};

/// Everything one backward call needs: the forward's parameters (whose out and lse
/// are read here) and the gradients. Semantics are attention_backward()'s.
struct BackwardParams {
  ForwardParams fwd;
  int max_lk = 0;                      // the longest sequence's keys (grid size)
  const BackwardSeq* bseqs_host = nullptr;  // host memory, fwd.B entries
  const void* dout = nullptr;
  int64_t dout_row = 0, dout_head = 0;
  void* dq = nullptr;
  int64_t dq_row = 0, dq_head = 0;
  void* dk = nullptr;
  int64_t dk_row = 0, dk_head = 0;
  void* dv = nullptr;
  int64_t dv_row = 0, dv_head = 0;
  GradExtent dq_extent, dk_extent, dv_extent;
  // ∂L/∂(additive mask), f32, nullptr = not wanted: the element for (b, h, i, j) at
  // b·dbias_stride[0] + h·dbias_stride[1] + i·dbias_stride[2] + j·dbias_stride[3] of a
  // tensor of dbias_dims (the mask's shape, right-aligned to [B, Hq, Lq, Lk], 1 where
  // absent; stride 0 where it broadcasts), summed over the broadcast dimensions.
  float* dbias = nullptr;
  int64_t dbias_dims[4] = {1, 1, 1, 1};
  int64_t dbias_stride[4] = {0, 0, 0, 0};
};

/// The head dimensions the kernels are compiled for.
bool supported_head_dim(int d);

/// Runs the fused forward on params.stream (asynchronously). Returns "" or why not.
std::string forward(const ForwardParams& params);

/// Runs the fused backward (deterministic: no atomics, every sum in a fixed order) on
/// params.fwd.stream, asynchronously. Returns "" or why not.
std::string backward(const BackwardParams& params);

/// "" when CUDA device `device` can run the kernels (a driver, the device exists, and
/// it is sm_80 or newer), else why not.
std::string device_usable(int device);

/// Copies `bytes` from device memory to host memory, ordered on `stream`, and waits
/// for it. Returns "" or the CUDA error.
std::string copy_to_host(void* dst, const void* src, size_t bytes, int device, void* stream);

}  // namespace attn::cuda
