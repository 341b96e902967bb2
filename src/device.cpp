// Device calls (device.hpp): the CUDA backend when built, clear errors when not.
#include "device.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "problem.hpp"
#ifdef ATTN_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace attn {

CudaStatus cuda_status(int device) {
  CudaStatus s;
#ifdef ATTN_WITH_CUDA
  s.built = true;
  s.unusable = cuda::device_usable(device);
#else
  (void)device;
  s.unusable = "this build of attn has no CUDA backend (nvcc was not found when it was configured)";
#endif
  return s;
}

namespace detail {

void require_cuda_device(const Checker& c, const TensorView& t, const char* name) {
  const CudaStatus s = cuda_status(t.device().index);
  if (!s.unusable.empty()) c.fail(std::string(name) + " is on " + t.device().describe() + ", but " + s.unusable);
}

void copy_to_host(const Checker& c, void* dst, const TensorView& t, size_t bytes, const char* name) {
  require_cuda_device(c, t, name);
#ifdef ATTN_WITH_CUDA
  const std::string e = cuda::copy_to_host(dst, t.data(), bytes, t.device().index, t.device().stream);
  if (!e.empty()) c.fail(std::string("reading ") + name + " from " + t.device().describe() + ": " + e);
#else
  (void)dst, (void)bytes;
#endif
}

namespace {

// Options the GPU path does not have yet fail here, by name: never a silent slow path.
void check_gpu_options(const Checker& c, const TensorView& q, const AttentionOptions& options,
                       const UserMods* mods) {
  require_cuda_device(c, q, "q");
  if (mods != nullptr) {
    c.fail("score_mod and mask_mod (user modifiers, compiled for the CPU) are not supported on " +
           q.device().describe() + "; use the built-in options, or tensors in host memory");
  }
  if (!options.mask.empty() && options.mask.dtype() != DType::f32 && options.mask.dtype() != DType::boolean) {
    c.fail(std::string("options.mask on a CUDA device must be f32 or bool, got ") + dtype_name(options.mask.dtype()));
  }
  if (q.dtype() == DType::f32 && options.precision != Precision::bf16) {
    c.fail("f32 inputs on a CUDA device need options.precision = Precision::bf16 (the GPU kernels multiply "
           "bf16 operands on the tensor cores, with f32 softmax and accumulation; TF32 and Precision::bf16x3 are "
           "not built for the GPU)");
  }
}

#ifdef ATTN_WITH_CUDA
// The kernels' view of a checked problem: shapes, strides, options and the sequence
// table (kept alive in `seqs` until the launch).
cuda::ForwardParams forward_params(const Checker& c, const Problem& p, const Device& device,
                                   std::vector<cuda::SeqDesc>& seqs) {
  if (p.dv != p.d) {
    c.fail("v's head dim (" + std::to_string(p.dv) + ") must equal q's (" + std::to_string(p.d) +
           ") on a CUDA device");
  }
  if (!cuda::supported_head_dim(p.d)) {
    c.fail("head dim d = " + std::to_string(p.d) + " is not supported on CUDA devices (64, 96, 128 or 256)");
  }
  c.require(p.B < 65536 && p.Hq < 65536, [&] {
    return "on a CUDA device, the batch (" + std::to_string(p.B) + ") and the query heads (" + std::to_string(p.Hq) +
           ") must each be below 65536";
  });
  cuda::ForwardParams f;
  f.in = p.dtype == DType::bf16 ? cuda::Elem::bf16 : p.dtype == DType::f16 ? cuda::Elem::f16 : cuda::Elem::f32;
  f.B = p.B, f.Hq = p.Hq, f.Hkv = p.Hkv, f.d = p.d;
  f.q = p.q, f.k = p.k, f.v = p.v, f.out = p.out;
  f.q_row = p.q_row, f.q_head = p.q_head, f.k_row = p.k_row, f.k_head = p.k_head;
  f.v_row = p.v_row, f.v_head = p.v_head, f.out_row = p.out_row, f.out_head = p.out_head;
  seqs.resize(p.seqs.size());
  for (size_t b = 0; b < seqs.size(); ++b) {
    const Sequence& s = p.seqs[b];
    seqs[b] = {s.q_offset, s.k_offset, s.v_offset, s.out_offset, s.lse_offset, s.probs_offset, s.Lq, s.Lk, s.align};
    f.max_lq = std::max(f.max_lq, s.Lq);
  }
  f.seqs_host = seqs.data();
  f.scale = p.scale, f.softcap = p.softcap;
  f.causal = p.causal == Causal::TopLeft ? 1 : p.causal == Causal::BottomRight ? 2 : 0;
  f.window_left = p.window_left, f.window_right = p.window_right;
  f.alibi = p.alibi, f.alibi_b = p.alibi_b, f.alibi_h = p.alibi_h;
  f.bool_mask = p.bool_mask, f.add_mask = p.add_mask;
  f.mask_b = p.mask_b, f.mask_h = p.mask_h, f.mask_i = p.mask_i, f.mask_j = p.mask_j;
  f.bm_blocks = p.bm_blocks, f.bm_b = p.bm_b, f.bm_h = p.bm_h, f.bm_qb = p.bm_qb, f.bm_kb = p.bm_kb;
  f.bm_tiles = p.bm_tiles, f.bm_t = p.bm_t, f.bm_r = p.bm_r;
  if (p.bm_blocks != nullptr) f.bm_bq = p.bm_bq, f.bm_bk = p.bm_bk;
  f.lse = p.lse, f.lse_h = p.lse_h, f.lse_i = p.lse_i;
  f.probs = p.probs, f.probs_h = p.probs_h, f.probs_i = p.probs_i, f.probs_cols = p.probs_cols;
  f.dropout_p = p.dropout_p, f.seed = p.seed, f.offset = p.offset;
  f.heads_total = p.heads_total, f.h0 = p.h0, f.q_pos0 = p.q_pos0, f.k_pos0 = p.k_pos0;
  f.device = device.index, f.stream = device.stream;
  return f;
}

// A gradient [B, L, H, d] or packed [T, H, d] as the zeroing pass sees it.
cuda::GradExtent grad_extent(const TensorView& g) {
  cuda::GradExtent e;
  if (g.rank() == 4) {
    e.n0 = g.size(0), e.s0 = g.stride(0), e.n1 = g.size(1), e.s1 = g.stride(1), e.n2 = g.size(2), e.s2 = g.stride(2);
  } else {
    e.n0 = 1, e.s0 = 0, e.n1 = g.size(0), e.s1 = g.stride(0), e.n2 = g.size(1), e.s2 = g.stride(1);
  }
  return e;
}
#endif

}  // namespace

void attention_forward_cuda(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const AttentionOptions& options, const TensorView& lse,
                            const TensorView& probs, const UserMods* mods) {
  const Checker c(fn);
  check_gpu_options(c, q, options, mods);
  const Problem p = make_problem(fn, q, k, v, out, options, lse, probs, mods, /*on_device=*/true);
#ifdef ATTN_WITH_CUDA
  std::vector<cuda::SeqDesc> seqs;
  const cuda::ForwardParams f = forward_params(c, p, q.device(), seqs);
  const std::string e = cuda::forward(f);
  if (!e.empty()) c.fail("on " + q.device().describe() + ": " + e);
#else
  (void)p;
#endif
}

void attention_backward_cuda(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const TensorView& dout,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                             const AttentionOptions& options, const TensorView& dbias, const UserMods* mods) {
  const Checker c(fn);
  check_gpu_options(c, q, options, mods);
  const BackwardProblem bp =
      make_backward_problem(fn, q, k, v, out, lse, dout, dq, dk, dv, options, dbias, mods, /*on_device=*/true);
#ifdef ATTN_WITH_CUDA
  std::vector<cuda::SeqDesc> seqs;
  cuda::BackwardParams b;
  b.fwd = forward_params(c, bp.fwd, q.device(), seqs);
  std::vector<cuda::BackwardSeq> bseqs(bp.fwd.seqs.size());
  for (size_t i = 0; i < bseqs.size(); ++i) {
    const Sequence& s = bp.fwd.seqs[i];
    bseqs[i] = {s.dout_offset, s.dq_offset, s.dk_offset, s.dv_offset};
    b.max_lk = std::max(b.max_lk, s.Lk);
  }
  b.bseqs_host = bseqs.data();
  b.dout = bp.dout, b.dout_row = bp.dout_row, b.dout_head = bp.dout_head;
  b.dq = bp.dq, b.dq_row = bp.dq_row, b.dq_head = bp.dq_head;
  b.dk = bp.dk, b.dk_row = bp.dk_row, b.dk_head = bp.dk_head;
  b.dv = bp.dv, b.dv_row = bp.dv_row, b.dv_head = bp.dv_head;
  b.dq_extent = grad_extent(dq), b.dk_extent = grad_extent(dk), b.dv_extent = grad_extent(dv);
  if (bp.dbias != nullptr) {
    b.dbias = bp.dbias;
    for (int i = 0; i < dbias.rank(); ++i) b.dbias_dims[4 - dbias.rank() + i] = dbias.size(i);
    b.dbias_stride[0] = bp.dbias_b, b.dbias_stride[1] = bp.dbias_h;
    b.dbias_stride[2] = bp.dbias_i, b.dbias_stride[3] = bp.dbias_j;
  }
  const std::string e = cuda::backward(b);
  if (!e.empty()) c.fail("on " + q.device().describe() + ": " + e);
#else
  (void)bp;
#endif
}

}  // namespace detail
}  // namespace attn
