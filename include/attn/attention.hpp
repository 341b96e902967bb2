// The attention operator: out = softmax(scale · q kᵀ (modified, masked)) · v.
//
// Layout (FlashAttention's BSHD), any strides but a contiguous last dimension:
//   q   [B, Lq, Hq,  d ]      k [B, Lk, Hkv, d]      v [B, Lk, Hkv, dv]
//   out [B, Lq, Hq,  dv]      lse [B, Hq, Lq]        probs [B, Hq, Lq, Lk]
// Packed variable-length batches (opt.cu_seqlens_q/k given) drop the batch
// dimension: q [total_q, Hq, d], k [total_k, Hkv, d], v [total_k, Hkv, dv],
// out [total_q, Hq, dv], lse [Hq, total_q], probs [Hq, total_q, max_seqlen_k].
//
// Order of operations for one score (DESIGN.md):
//   s = scale·(q·k);  s = softcap·tanh(s/softcap) if softcap > 0;
//   s += alibi bias + additive mask;  s = score_mod(s, b, h, i, j);
//   keys that are not visible (causal, window, key length, boolean mask, mask_mod)
//   are removed; softmax over the visible keys; weighted sum of the values.
// A query row with no visible key gives out = 0 and lse = −∞ (PyTorch gives NaN).
//
// Non-finite and extreme numbers (the float64 reference and PyTorch agree):
//   - a NaN among a row's visible scores (from q, k, the mask, ALiBi, softcap or a
//     score_mod) makes that row's out and lse NaN; a +∞ score does too (e^(∞−∞));
//   - only −∞ (or false, or the band) removes a key. A removed key takes no part:
//     its value row and its gradients are never touched, so a NaN or ∞ in the v
//     (or k, q, dO) of keys that are masked away cannot reach any output;
//   - a NaN or ∞ in the value of a visible key makes the output elements it
//     feeds non-finite; gradients are non-finite exactly where the reference's are;
//   - huge finite scores and masks are values: −FLT_MAX on every key of a row (Hugging
//     Face's padding mask) gives the softmax over those keys, not a masked row;
//     scores are computed in f32, so a score that overflows f32 becomes ±∞.
// Dtypes: q, k, v and out (and dout, dq, dk, dv) share one dtype, f32, bf16 or f16;
// mixing them is an error. lse and probs are f32 in every case; an additive mask is f32
// or the inputs' dtype. bf16/f16 inputs are computed with f32 scores, softmax and
// accumulation, and the outputs rounded once to the input dtype. One exception, on
// the CPU: out may be f32 for bf16/f16 inputs. attention() then writes the output
// before that rounding (rounding it to the inputs' dtype gives bitwise the output of a
// call with a 16-bit out), and attention_backward() given it computes D = rowsum(dO ∘ O)
// from it. FlashAttention and PyTorch take D from the rounded output; where a row's
// softmax is sharply peaked, dO·v_j − D is a small difference of large terms and that
// rounding (2⁻⁹ of O for bf16) can dominate dq and dk (seen: 0.5 relative error in dq
// on a 3-key row, against 2e-3 with the f32 output). The Python autograd keeps the
// f32 output for its backward so.
// Memory: an output must not overlap an input or another output (attn::Error),
// except that out may be exactly q, k or v (the same view); interleaved views
// that share no element (q, k, v or dq, dk, dv sliced from one packed
// [B, L, 3, H, d] buffer) are fine. Negative strides are rejected.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "attn/error.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Causal alignment. With Lq queries and Lk keys (Lk = the batch's key length):
///   TopLeft:     key j visible to query i iff j ≤ i             (PyTorch is_causal)
///   BottomRight: key j visible to query i iff j ≤ i + Lk − Lq   (FlashAttention ≥ 2.1;
///                the last query sees every key, as decoding with a KV cache needs)
enum class Causal : uint8_t { None, TopLeft, BottomRight };

/// Arithmetic for f32 inputs (like torch.backends.cuda.matmul.allow_bf16_reduced_precision
/// and torch.set_float32_matmul_precision). Outputs stay f32; ignored for bf16/f16 inputs.
///   f32     computes on the inputs as given (PyTorch's "highest").
///   bf16    rounds q, k and v to bf16 inside the call (then as for bf16 inputs: f32
///           scores, softmax and accumulation), for the fast bf16 kernels ("medium").
///           Relative error ~2⁻⁹ per operand.
///   bf16x3  splits every f32 operand into two bf16 pieces, x ≈ hi + lo with
///           hi = bf16(x) and lo = bf16(x − hi) (16 significant bits: |x − hi − lo| ≤
///           2⁻¹⁸·|x|), P likewise, and takes three bf16 products per product
///           (hi·hi + lo·hi + hi·lo, f32 accumulation), on AMX tiles: about 2× the f32
///           kernel's speed at ~5e-6 relative error (PyTorch's "high", which also names
///           this scheme bf16x3). Where the CPU has no AMX tiles, and for what the tile
///           kernels decline (see attention()), the f32 kernel runs instead: never less
///           accurate than asked. Not on CUDA devices.
enum class Precision : uint8_t { f32, bf16, bf16x3 };

/// Sliding window around the bottom-right-aligned diagonal i' = i + Lk − Lq:
/// key j visible iff i' − left ≤ j ≤ i' + right. −1 means unbounded on that side.
/// {-1, 0} with causal None equals BottomRight causal.
struct Window {
  int left = -1;
  int right = -1;
};

/// A block-sparse boolean mask (FlexAttention's BlockMask, built without a compiler).
/// The [Lq, Lk] plane of each (batch, head) is cut into blocks of block_q × block_k
/// positions (the last row and column of blocks clipped to the plane), and each block is
///   BlockMask::kEmpty  every key removed: the kernels skip the block's score tiles;
///   BlockMask::kFull   every key kept: no mask work at all;
///   t ≥ 0              partial: tiles[t][r][c] says whether query i0 + r may attend to
///                      key j0 + c (true = attend, PyTorch's convention).
/// It means the boolean mask M[b][h][i][j] = entry is kFull, or entry is t ≥ 0 and
/// tiles[t][i mod block_q][j mod block_k], and combines with every other option (it
/// removes keys in addition to them). Positions are within the sequence, also with
/// cu_seqlens. From Python, attn.block_mask() builds one from a predicate.
///   blocks  i32 [Bm, Hm, ceil(Lq/block_q), ceil(Lk/block_k)] with Bm ∈ {1, B} and
///           Hm ∈ {1, Hq} (1 broadcasts). With cu_seqlens, Lq and Lk are the longest
///           sequence's, and more blocks are accepted (as for mask).
///   tiles   boolean [T, block_q, block_k], last dimension contiguous; every t in
///           blocks must be < T. May be absent when no block is partial.
/// Block sizes are free (≥ 1); multiples of 64, the kernels' tile, skip the most work.
struct BlockMask {
  static constexpr int32_t kEmpty = -1;
  static constexpr int32_t kFull = -2;
  int block_q = 0;
  int block_k = 0;
  TensorView blocks;
  TensorView tiles;
  bool empty() const { return blocks.empty(); }
};

/// Every option of the operator; all optional and combinable.
struct AttentionOptions {
  /// Multiplies q·k. Default (unset): 1/√d. Must be finite and > 0.
  std::optional<float> scale;
  Causal causal = Causal::None;
  Window window;
  /// Boolean (DType::boolean, true = may attend, PyTorch's convention) or additive
  /// f32 mask, broadcastable over [B, Hq, Lq, Lk] by NumPy's rules (rank ≤ 4,
  /// aligned to the right, size-1 dimensions broadcast). With cu_seqlens the last
  /// two dimensions are indexed by sequence-local positions (sizes ≥ max lengths).
  TensorView mask;
  /// Block-sparse boolean mask (see BlockMask): empty blocks cost nothing, full
  /// blocks no mask work; combinable with mask and every other option.
  BlockMask block_mask;
  /// f32 [Hq] or [B, Hq]: adds −slope·|i' − j| to each score (ALiBi).
  TensorView alibi_slopes;
  /// Gemma-2 soft-capping: s ← softcap·tanh(s/softcap). 0 = off; else > 0.
  float softcap = 0.0f;
  /// Packed variable-length batch: int32 [B+1] prefix sums of the sequence lengths
  /// (as flash_attn_varlen_func). Give both or neither.
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
  /// int32 [B]: batch b uses only keys j < key_lengths[b] (padded batches, KV
  /// caches). Causal and window alignment then use key_lengths[b] as Lk.
  TensorView key_lengths;
  /// Dropout on the probabilities: each is kept with probability 1 − dropout_p
  /// and scaled by 1/(1 − dropout_p), else zeroed. dropout_p ∈ [0, 1). The
  /// decisions come from Philox-4x32-10 keyed by (seed, offset, b, h, i, j), so
  /// the forward and the backward agree and no result depends on the tiling or
  /// the threads; advance `offset` between calls for fresh masks. lse is that of
  /// the scores before dropout; `probs` returns the probabilities after it.
  float dropout_p = 0.0f;
  uint64_t seed = 0;
  uint64_t offset = 0;
  /// See Precision: f32 inputs may be rounded to bf16, or split into two bf16
  /// pieces, for speed.
  Precision precision = Precision::f32;
};

/// Fused attention forward (f32, bf16 or f16 inputs; see "Dtypes"). Computes `out`; optionally writes `lse` (natural
/// log-sum-exp of the final scores, −∞ for rows with no visible key) and `probs`
/// (the explicit softmax probabilities, 0 where masked) when those views are given.
/// Throws attn::Error (naming the argument) before writing anything if an argument
/// is invalid. Bitwise identical results for any number of threads.
///
/// On a CUDA device (every tensor placed with TensorView::on(Device::cuda(...)); needs
/// a build with the CUDA backend, see cuda_status()): runs asynchronously on q's
/// stream, with the same semantics, for bf16 and f16 inputs (f32 inputs with
/// Precision::bf16), d = dv ∈ {64, 96, 128, 256}, and every option except bf16/f16
/// masks and user modifiers (each an attn::Error naming it); block_mask's tables on the
/// device too (its entries are read back, synchronously, to be checked). probs costs a
/// second, row-wise pass (it is for inspection, not speed).
/// cu_seqlens and key_lengths may be on the device (read back with a synchronous copy,
/// for checking) or in host memory.
void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionOptions& options = {},
               const TensorView& lse = {}, const TensorView& probs = {});

/// The same operator computed by the plain float64 reference (src/reference/):
/// explicit Lq×Lk scores, no tiling, no SIMD, no threads. Slow; for checking.
/// Outputs are rounded to f32 (out: to the inputs' dtype).
void attention_reference(const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& out, const AttentionOptions& options = {},
                         const TensorView& lse = {}, const TensorView& probs = {});

/// Gradients of attention() (FlashAttention-2's backward; dout, dq, dk, dv in the
/// inputs' dtype, f32 arithmetic inside; bf16 on a CPU with AMX or AVX512-BF16
/// multiplies bf16 operands on the tile unit or with vdpbf16ps, rounding P and dS to
/// bf16 as FlashAttention does; f16 on a CPU with AMX multiplies each value as two
/// exact bf16 pieces on the tile unit, P and dS split likewise). Given the forward's
/// inputs, its `out` and `lse` (computed with the same options) and dout = ∂L/∂out
/// (shaped like out), writes dq, dk, dv (shaped like q, k, v; with GQA, dk and dv
/// sum over each group of query heads). dbias (optional, f32, the shape of
/// options.mask, which must then be additive): ∂L/∂mask, summed over the mask's
/// broadcast dimensions, so a learned bias can train. Rows with no visible key get
/// zero gradients. Dropout uses the forward's decisions (same seed and offset).
/// Bitwise identical for any number of threads. Throws attn::Error for bad
/// arguments before writing anything. On a CUDA device (the tensors' device, as
/// attention()): asynchronously on q's stream, with the forward's GPU dtypes, head
/// dims and options, bitwise reproducible from run to run (no atomics); dbias there
/// takes a device workspace of B·Hq·Lq·Lk floats.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options = {}, const TensorView& dbias = {});

/// The same gradients from the float64 reference (explicit scores; slow).
void attention_backward_reference(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse,
                                  const TensorView& dout, const TensorView& dq,
                                  const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options = {},
                                  const TensorView& dbias = {});

/// Materialises the dropout decisions attention() makes for these options:
/// mask[b][h][i][j] = 1 where the probability of key j for query i (positions
/// within the sequence) is kept, 0 where it is dropped. mask: DType::boolean
/// [B, Hq, Lq, Lk], any strides. For tests and debugging.
void dropout_mask(const TensorView& mask, float dropout_p, uint64_t seed, uint64_t offset = 0);

/// Extra memory in bytes that attention() needs for these arguments when run with
/// `threads` threads: K and V packed for the SIMD kernel (the size of k and v in
/// f32, padded; on the AMX and AVX512-BF16 paths q, k and v in bf16, twice that for f16
/// on AMX, whose values are packed as hi + lo bf16 pieces) plus one tile workspace per
/// thread, and for f32 inputs with Precision::bf16 on the portable path their rounded
/// f32 copies (bf16/f16 inputs there are widened in the kernel; a bf16/f16 mask is
/// copied to f32). The packed operands and tiles are held per calling thread and
/// reused by later calls (a buffer grows by up to 1.5× what a call asks, so that
/// growing calls re-allocate rarely, and from 8 MiB on is rounded up to whole 2 MiB
/// huge pages); the Lq×Lk matrix is never stored.
size_t attention_workspace_bytes(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& out, const AttentionOptions& options,
                                 int threads);

/// Extra memory in bytes that attention_backward() needs for these arguments when run
/// with `threads` threads (the arguments as attention_backward()'s, checked the same
/// way). On the AMX and AVX512-BF16 paths: q, k, v and dout packed as bf16 tiles
/// (for f16 on AMX, twice that: hi + lo pieces), an f32 dQ accumulator the size of q
/// with d padded to 32, per-row lse and D, and one tile scratch per thread. On the
/// portable f32 kernel: K (in two layouts) and V packed in f32; scale·q, dout and a
/// dQ accumulator packed per query tile (d and dv padded to whole vectors); per-row
/// statistics and one tile scratch per thread; bf16/f16 inputs there (and every call
/// the bf16 kernels leave to it: softcap, a dbias, f16 without AMX, calls that would
/// fill their tiles only in small part) are widened where they are packed, and f32
/// inputs with Precision::bf16 rounded there, at no extra memory; a bf16/f16 mask
/// adds its f32 copy. The bf16 kernels also hand a call whose q, k, v or dout
/// holds a NaN or ±∞, or whose lse reaches ±128, to the portable path; those values
/// are not known here, so that call can take the portable path's bytes instead. The
/// packed tiles and the scratch are held per calling thread and reused by later calls
/// (a buffer grows by up to 1.5× what a call asks, so that growing calls re-allocate
/// rarely, and from 8 MiB on is rounded up to whole 2 MiB huge pages); the rest is
/// allocated per call. The Lq×Lk matrix is never stored.
size_t attention_backward_workspace_bytes(const TensorView& q, const TensorView& k, const TensorView& v,
                                          const TensorView& out, const TensorView& lse, const TensorView& dout,
                                          const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                          const AttentionOptions& options, int threads,
                                          const TensorView& dbias = {});

/// Combines two attentions of the same queries over disjoint sets of keys (two halves
/// of a KV cache, two ranks of a ring) into the attention over their union, exactly in
/// the log-sum-exp sense: with m = max(lse_a, lse_b),
///   out = (e^(lse_a − m)·out_a + e^(lse_b − m)·out_b) / (e^(lse_a − m) + e^(lse_b − m))
///   lse = m + ln(e^(lse_a − m) + e^(lse_b − m))
/// computed in float64 per element, then rounded to the output dtype. Shapes as attention()'s:
///   out_a, out_b, out  [B, L, H, dv] (or [total, H, dv] for packed sequences), f32, bf16
///                      or f16, all one dtype;
///   lse_a, lse_b, lse  [B, H, L] (or [H, total]), f32; lse is optional.
/// A part whose lse is −∞ (it saw no key) has weight 0 and its output is not read;
/// both −∞ gives out = 0, lse = −∞, as attention() does for a row with no visible key.
/// A NaN or +∞ lse makes the row's out and lse NaN (what the whole attention gives).
/// out may be the very view out_a or out_b (and lse the view lse_a or lse_b), to merge
/// in place; any other overlap between outputs and inputs is an attn::Error, as are
/// shapes, dtypes and strides that do not fit (the message names the argument).
void merge_attention_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                            const TensorView& lse_b, const TensorView& out, const TensorView& lse = {});

/// What the CPU kernels use on this machine.
struct CpuInfo {
  std::string simd_target;  // the f32 kernels' Highway target: "AVX3", "AVX2", ...
  bool amx_bf16 = false;    // AMX tiles usable: CPUID has AMX-BF16 and the OS granted tile data
  bool avx512_bf16 = false; // CPUID has AVX512-BF16 (vdpbf16ps)
  std::string amx_refused;  // why AMX is unusable although CPUID has it ("" otherwise)
  /// The path bf16 inputs (and f32 inputs under Precision::bf16) take now, forward
  /// and backward: "amx" (tiles), "avx512bf16" (vdpbf16ps; the default on AMD Zen 4/5)
  /// or "f32" (the f32 kernels on the values widened, or rounded, to f32; the default
  /// on Intel cores without usable AMX, where vdpbf16ps has half the FMA's rate).
  /// ATTN_ISA=amx|avx512bf16|f32 forces one; f16 inputs take "amx" where bf16 does
  /// (each value as two exact bf16 pieces), else "f32" (one bf16 cannot hold an f16
  /// value).
  std::string bf16_path;
};

/// The CUDA backend of this build, for device `device`: `built` when attn was compiled
/// with it (nvcc found at configure time), `unusable` "" when that device can run it,
/// else why not (no backend, no driver, no such device, older than sm_80).
struct CudaStatus {
  bool built = false;
  std::string unusable;
};
CudaStatus cuda_status(int device = 0);

/// Detects the CPU's features (once) and reads ATTN_ISA (each call). Throws
/// attn::Error when ATTN_ISA names an unknown path or one this machine cannot run.
CpuInfo cpu_info();

/// The most threads set_num_threads() and ATTN_NUM_THREADS accept.
inline constexpr int kMaxThreads = 4096;

/// Number of threads the kernels use (default: all cores, or ATTN_NUM_THREADS in
/// [1, kMaxThreads]). n outside [1, kMaxThreads] throws attn::Error. Calls may come
/// from several threads at once, including the threads of the caller's own OpenMP
/// parallel region: each such call opens a nested team, of one thread unless the
/// caller enabled nested parallelism (omp_set_max_active_levels), with the same bits.
void set_num_threads(int n);
int num_threads();

// ---------------------------------------------------------------------------
// User-defined score modifiers and mask predicates (FlexAttention's idea).
//
//   float score_mod(float s, int b, int h, int i, int j);  // returns the new score
//   bool  mask_mod(int b, int h, int i, int j);            // false removes key j
//
// b: batch, h: query head, i / j: query / key position within the sequence.
// Give score_mod (and score_grad) an `auto` score parameter to have the float64
// reference evaluate them in double; the kernels call them with float.
// score_mod sees the score after softcap, ALiBi and the additive mask, and is not
// called for keys already removed (or scored −∞). Pass attn::NoScoreMod{} or
// attn::NoMaskMod{} for the one you do not need. Both are called from the
// kernel's OpenMP threads, concurrently: they must be thread-safe and must not
// throw. They are inlined into a loop over each score tile, compiled in your
// translation unit; the built-in options cost less (they are vectorised).
// ---------------------------------------------------------------------------

struct NoScoreMod {
  float operator()(float s, int, int, int, int) const { return s; }
};
struct NoMaskMod {
  bool operator()(int, int, int, int) const { return true; }
};

namespace detail {

/// Type-erased user modifiers. The kernels call `tile` once per score tile
/// (rows × cols scores at s, row stride ld, query rows i0.., key columns j0..);
/// the per-element lambda is inlined there, in the caller's translation unit.
/// The reference calls `score` and `mask` per element, in double precision.
struct UserMods {
  const void* ctx = nullptr;
  void (*tile)(const void* ctx, float* s, int64_t ld, int b, int h, int i0, int rows,
               int j0, int cols) = nullptr;
  double (*score)(const void* ctx, double s, int b, int h, int i, int j) = nullptr;
  bool (*mask)(const void* ctx, int b, int h, int i, int j) = nullptr;
  // Backward only: ds[r][c] *= score_mod'(t[r][c]) on a tile (t: the scores
  // before score_mod, row stride ld, −∞ where removed), and per element for the
  // reference. nullptr when the user gave no score_mod (its derivative is 1).
  void (*grad_tile)(const void* ctx, const float* t, float* ds, int64_t ld, int b, int h,
                    int i0, int rows, int j0, int cols) = nullptr;
  double (*score_grad)(const void* ctx, double t, int b, int h, int i, int j) = nullptr;
};

void attention_with_mods(const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& out, const AttentionOptions& options,
                         const TensorView& lse, const TensorView& probs,
                         const UserMods* mods);
void attention_reference_with_mods(const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& out,
                                   const AttentionOptions& options, const TensorView& lse,
                                   const TensorView& probs, const UserMods* mods);

template <class ScoreMod, class MaskMod>
struct ModPair {
  ScoreMod score_mod;
  MaskMod mask_mod;
};

/// score_mod, its derivative and mask_mod, for the backward.
template <class ScoreMod, class ScoreGrad, class MaskMod>
struct ModTriple {
  ScoreMod score_mod;
  ScoreGrad score_grad;
  MaskMod mask_mod;
};

void attention_backward_with_mods(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse,
                                  const TensorView& dout, const TensorView& dq,
                                  const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options, const TensorView& dbias,
                                  const UserMods* mods);
void attention_backward_reference_with_mods(const TensorView& q, const TensorView& k,
                                            const TensorView& v, const TensorView& out,
                                            const TensorView& lse, const TensorView& dout,
                                            const TensorView& dq, const TensorView& dk,
                                            const TensorView& dv, const AttentionOptions& options,
                                            const TensorView& dbias, const UserMods* mods);

template <class ScoreMod, class MaskMod>
void apply_mods_to_tile(const void* ctx, float* s, int64_t ld, int b, int h, int i0,
                        int rows, int j0, int cols) {
  const auto& m = *static_cast<const ModPair<ScoreMod, MaskMod>*>(ctx);
  for (int r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    for (int c = 0; c < cols; ++c) {
      if (row[c] == -INFINITY) continue;
      if constexpr (!std::is_same_v<MaskMod, NoMaskMod>) {
        if (!m.mask_mod(b, h, i0 + r, j0 + c)) {
          row[c] = -INFINITY;
          continue;
        }
      }
      if constexpr (!std::is_same_v<ScoreMod, NoScoreMod>) {
        row[c] = static_cast<float>(m.score_mod(row[c], b, h, i0 + r, j0 + c));
      }
    }
  }
}

template <class ScoreMod, class MaskMod>
UserMods make_user_mods(const ModPair<ScoreMod, MaskMod>& pair) {
  UserMods u;
  u.ctx = &pair;
  u.tile = &apply_mods_to_tile<ScoreMod, MaskMod>;
  u.score = [](const void* c, double s, int b, int h, int i, int j) -> double {
    return static_cast<const ModPair<ScoreMod, MaskMod>*>(c)->score_mod(s, b, h, i, j);
  };
  u.mask = [](const void* c, int b, int h, int i, int j) -> bool {
    return static_cast<const ModPair<ScoreMod, MaskMod>*>(c)->mask_mod(b, h, i, j);
  };
  return u;
}

template <class ScoreMod, class ScoreGrad, class MaskMod>
void apply_grad_to_tile(const void* ctx, const float* t, float* ds, int64_t ld, int b, int h,
                        int i0, int rows, int j0, int cols) {
  const auto& m = *static_cast<const ModTriple<ScoreMod, ScoreGrad, MaskMod>*>(ctx);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const float x = t[r * ld + c];
      if (x == -INFINITY) continue;
      ds[r * ld + c] *= static_cast<float>(m.score_grad(x, b, h, i0 + r, j0 + c));
    }
  }
}

template <class ScoreMod, class ScoreGrad, class MaskMod>
UserMods make_user_mods(const ModTriple<ScoreMod, ScoreGrad, MaskMod>& triple) {
  using Triple = ModTriple<ScoreMod, ScoreGrad, MaskMod>;
  UserMods u;
  u.ctx = &triple;
  u.tile = [](const void* c, float* s, int64_t ld, int b, int h, int i0, int rows, int j0, int cols) {
    const auto& m = *static_cast<const Triple*>(c);
    const ModPair<ScoreMod, MaskMod> pair{m.score_mod, m.mask_mod};
    apply_mods_to_tile<ScoreMod, MaskMod>(&pair, s, ld, b, h, i0, rows, j0, cols);
  };
  u.score = [](const void* c, double s, int b, int h, int i, int j) -> double {
    return static_cast<const Triple*>(c)->score_mod(s, b, h, i, j);
  };
  u.mask = [](const void* c, int b, int h, int i, int j) -> bool {
    return static_cast<const Triple*>(c)->mask_mod(b, h, i, j);
  };
  if constexpr (!std::is_same_v<ScoreMod, NoScoreMod>) {
    u.grad_tile = &apply_grad_to_tile<ScoreMod, ScoreGrad, MaskMod>;
    u.score_grad = [](const void* c, double t, int b, int h, int i, int j) -> double {
      return static_cast<const Triple*>(c)->score_grad(t, b, h, i, j);
    };
  }
  return u;
}

}  // namespace detail

/// attention_backward() for a forward run with user modifiers: the same
/// score_mod and mask_mod, plus score_grad(t, b, h, i, j) = ∂score_mod(t)/∂t.
/// Pass attn::NoScoreMod{} and any callable (unused) for score_grad when there is
/// no score_mod.
template <class ScoreMod, class ScoreGrad, class MaskMod>
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options, ScoreMod score_mod, ScoreGrad score_grad,
                        MaskMod mask_mod, const TensorView& dbias = {}) {
  const detail::ModTriple<ScoreMod, ScoreGrad, MaskMod> triple{score_mod, score_grad, mask_mod};
  const detail::UserMods mods = detail::make_user_mods(triple);
  detail::attention_backward_with_mods(q, k, v, out, lse, dout, dq, dk, dv, options, dbias, &mods);
}

/// attention_backward_reference() with user modifiers (see attention_backward).
template <class ScoreMod, class ScoreGrad, class MaskMod>
void attention_backward_reference(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse,
                                  const TensorView& dout, const TensorView& dq,
                                  const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options, ScoreMod score_mod,
                                  ScoreGrad score_grad, MaskMod mask_mod,
                                  const TensorView& dbias = {}) {
  const detail::ModTriple<ScoreMod, ScoreGrad, MaskMod> triple{score_mod, score_grad, mask_mod};
  const detail::UserMods mods = detail::make_user_mods(triple);
  detail::attention_backward_reference_with_mods(q, k, v, out, lse, dout, dq, dk, dv, options,
                                                 dbias, &mods);
}

/// attention() with a user score modifier and mask predicate (see above). A tile
/// of 64×64 scores that mask_mod removes entirely costs its scores but not its
/// softmax·V product. (Causal, window and length limits skip tiles before any work.)
template <class ScoreMod, class MaskMod>
void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionOptions& options, ScoreMod score_mod,
               MaskMod mask_mod, const TensorView& lse = {}, const TensorView& probs = {}) {
  const detail::ModPair<ScoreMod, MaskMod> pair{score_mod, mask_mod};
  const detail::UserMods mods = detail::make_user_mods(pair);
  detail::attention_with_mods(q, k, v, out, options, lse, probs, &mods);
}

/// attention_reference() with a user score modifier and mask predicate.
template <class ScoreMod, class MaskMod>
void attention_reference(const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& out, const AttentionOptions& options,
                         ScoreMod score_mod, MaskMod mask_mod, const TensorView& lse = {},
                         const TensorView& probs = {}) {
  const detail::ModPair<ScoreMod, MaskMod> pair{score_mod, mask_mod};
  const detail::UserMods mods = detail::make_user_mods(pair);
  detail::attention_reference_with_mods(q, k, v, out, options, lse, probs, &mods);
}

}  // namespace attn
