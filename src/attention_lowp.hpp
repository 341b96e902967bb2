// bf16 and f16 inputs (and f32 inputs with Precision::bf16) through the f32 kernels
// and the reference, by whole-tensor f32 copies: the tensors are widened (exactly:
// every bf16/f16 value is an f32 value), the f32 code runs on the copies, and the
// results are rounded once into the caller's outputs in their dtype. Costs the copies'
// memory (4 bytes per element of q, k, v, out; kept by the calling thread for its next
// call, as the kernels keep their scratch) and two passes over them. The fused forward
// needs no copies (it widens bf16/f16 rows, and rounds f32 ones under Precision::bf16,
// where it packs them); the portable backward, the reference and placed calls use these.
#pragma once

#include <functional>
#include <vector>

#include "attn/attention.hpp"
#include "cpu/isa.hpp"
#include "problem.hpp"

namespace attn::detail {

/// True when a call must go through the widening path: bf16/f16 tensors, or f32 inputs
/// with Precision::bf16.
bool needs_widening(const Problem& p, const AttentionOptions& options);

/// Which pass a kernel is chosen for: their tile kernels lose different amounts to padding.
enum class LowpPass { forward, backward };

/// The kernel a call (forward or backward) that needs widening runs on instead of the
/// portable path: LowpPath::amx or LowpPath::avx512bf16 for bf16 (or f32 with
/// Precision::bf16) where lowp_path() picks them; for f16, LowpPath::amx
/// where the CPU has AMX tiles (f16 values enter them as exact hi + lo bf16 pieces,
/// three tile products per product; on vdpbf16ps that would be slower than the f32
/// kernel). LowpPath::f32 (the portable path) otherwise, for calls that return
/// explicit probabilities, and on vdpbf16ps (unless ATTN_ISA forces it) for calls
/// whose 64×64 tile pairs their scores would fill only in small part: a backward of
/// any shape, a forward whose sequences each fit in one tile pair (TilesMostlyPadding
/// in attention.cpp). The choice depends on the shapes only, never
/// on the thread count, so results stay bitwise identical for any thread count.
LowpPath lowp_kernel(const Problem& p, const AttentionOptions& options, LowpPass pass);

/// The tiled kernel attention() runs the forward of p on: lowp_kernel()'s choice for
/// calls that need widening, else LowpPath::f32 (the f32 kernel).
LowpPath forward_tiles_path(const Problem& p, const AttentionOptions& options);

/// Runs the forward of p (checked, its mask f32) on `path`'s tile kernel, or on the f32
/// kernel for LowpPath::f32 and where the tile kernel declines non-finite inputs. What
/// attention() does once the few-queries route has passed a call by.
void forward_on_tiles(const Problem& p, LowpPath path, int threads);

/// Bytes of the f32 copy of a bf16/f16 mask (0 for an f32 mask or none).
size_t mask_widening_bytes(const AttentionOptions& options);

/// The options with an f32 copy of a bf16/f16 mask (held in `storage`) in place of the
/// mask, for kernels that read bf16 inputs but f32 masks; other options unchanged.
AttentionOptions with_f32_mask(const AttentionOptions& options, std::vector<float>& storage);

/// Runs `compute` on f32 copies of q, k, v (rounded to bf16 first for Precision::bf16),
/// an f32 out and an f32 additive mask, then rounds out into the caller's `out`.
using ForwardF32 = std::function<void(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const AttentionOptions& options)>;
void forward_widened(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                     const AttentionOptions& options, const ForwardF32& compute);

/// The same for the backward: q, k, v, out, dout widened; dq, dk, dv computed in f32 and
/// rounded into the caller's tensors.
using BackwardF32 = std::function<void(const TensorView& q, const TensorView& k, const TensorView& v,
                                       const TensorView& out, const TensorView& dout, const TensorView& dq,
                                       const TensorView& dk, const TensorView& dv,
                                       const AttentionOptions& options)>;
void backward_widened(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const AttentionOptions& options, const BackwardF32& compute);

}  // namespace attn::detail
