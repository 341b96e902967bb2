// Argument checking for attention(): every invalid argument becomes an attn::Error
// naming the argument, what was expected and what was given, before any output
// is touched. The result is a normalised Problem (src/problem.hpp).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "arg_checker.hpp"
#include "block_mask_args.hpp"
#include "device.hpp"
#include "number_text.hpp"
#include "problem.hpp"
#include "tensor/overlap.hpp"

namespace attn::detail {
namespace {

// A rank-1 int32 tensor's elements, read on the host (copied first when it is in a
// device's memory).
std::vector<int32_t> read_i32(const Checker& c, const TensorView& t, const char* name) {
  std::vector<int32_t> v(static_cast<size_t>(t.size(0)));
  if (v.empty()) return v;
  const int64_t stride = t.stride(0);
  std::vector<int32_t> device_copy;
  const int32_t* p = t.data_as<const int32_t>();
  if (!t.device().is_cpu()) {
    device_copy.resize(static_cast<size_t>((t.size(0) - 1) * stride + 1));
    copy_to_host(c, device_copy.data(), t, device_copy.size() * sizeof(int32_t), name);
    p = device_copy.data();
  }
  for (size_t i = 0; i < v.size(); ++i) v[i] = p[static_cast<int64_t>(i) * stride];
  return v;
}

// Checks cu_seqlens (int32 [B+1], non-decreasing, from ≥ 0 to ≤ total).
std::vector<int32_t> check_cu_seqlens(const Checker& c, const TensorView& t, const char* name,
                                      int64_t total) {
  c.require(t.dtype() == DType::i32,
            [&] { return std::string(name) + " must have dtype i32, got " + dtype_name(t.dtype()); });
  c.require(t.rank() == 1 && t.size(0) >= 2,
            [&] { return std::string(name) + " must be a rank-1 i32 tensor of length B+1 >= 2, got " + t.describe(); });
  c.require(t.data() != nullptr, [&] { return std::string(name) + " has a null data pointer"; });
  c.nonnegative_strides(t, name);
  c.metadata_on_device_or_host(t, name);
  std::vector<int32_t> cu = read_i32(c, t, name);
  c.require(cu[0] >= 0, [&] { return std::string(name) + "[0] must be >= 0, got " + std::to_string(cu[0]); });
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      c.fail(std::string(name) + " must be non-decreasing, got " + name + "[" +
             std::to_string(i - 1) + "]=" + std::to_string(cu[i - 1]) + " > " + name + "[" +
             std::to_string(i) + "]=" + std::to_string(cu[i]));
    }
  }
  if (cu.back() > total) {
    c.fail(std::string(name) + "[B]=" + std::to_string(cu.back()) +
           " goes beyond the tensor's " + std::to_string(total) + " tokens");
  }
  return cu;
}

// The sizes every later step checks against: the tensors' position dimensions
// (tokens when packed), the longest sequence, and the packed boundaries.
struct Extent {
  bool varlen = false;
  int o = 1;                // index of the position dimension (0 when packed)
  int64_t Lq = 0, Lk = 0;   // q's and k's position dimension
  int max_lq = 0, max_lk = 0;
  std::vector<int32_t> cu_q, cu_k;
};

// q, k, v, out: one dtype, ranks, matching dimensions, sizes the kernels can count.
// Binds their pointers, strides, heads and head dims into p.
void bind_qkv(const Checker& c, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const AttentionOptions& opt, Extent* e, Problem* p) {
  const bool varlen = e->varlen;
  const int rank = varlen ? 3 : 4;
  const char* qlay = varlen ? "[total_q, Hq, d]" : "[B, Lq, Hq, d]";
  const char* klay = varlen ? "[total_k, Hkv, d]" : "[B, Lk, Hkv, d]";
  const char* vlay = varlen ? "[total_k, Hkv, dv]" : "[B, Lk, Hkv, dv]";
  const char* olay = varlen ? "[total_q, Hq, dv]" : "[B, Lq, Hq, dv]";
  // q decides the dtype (f32, bf16 or f16); k, v and out must share it.
  const DType dt = q.empty() ? DType::f32 : q.dtype();
  if (dt != DType::f32 && dt != DType::bf16 && dt != DType::f16)
    c.fail(std::string("q must have dtype f32, bf16 or f16, got ") + dtype_name(dt));
  c.tensor(q, "q", dt, rank, qlay);
  c.tensor(k, "k", dt, rank, klay);
  c.tensor(v, "v", dt, rank, vlay);
  c.tensor(out, "out", p->out_f32 ? DType::f32 : dt, rank, olay);  // out_f32: see make_problem
  c.last_contiguous(q, "q");
  c.last_contiguous(k, "k");
  c.last_contiguous(v, "v");
  c.last_contiguous(out, "out");

  const int o = e->o;
  const int64_t Hq = q.size(o + 1), Hkv = k.size(o + 1), d = q.size(o + 2), dv = v.size(o + 2);
  const int64_t Lq = q.size(o), Lk = k.size(o);
  if (!varlen) {
    c.dim_equals(k, "k", 0, q.size(0), "batch B, as q.shape[0]");
    c.dim_equals(v, "v", 0, q.size(0), "batch B, as q.shape[0]");
    c.dim_equals(out, "out", 0, q.size(0), "batch B, as q.shape[0]");
  }
  c.require(Hq >= 1,
            [&] { return "q.shape[" + std::to_string(o + 1) + "] (query heads) must be >= 1, got " + q.describe(); });
  c.require(Hkv >= 1,
            [&] { return "k.shape[" + std::to_string(o + 1) + "] (kv heads) must be >= 1, got " + k.describe(); });
  c.require(d >= 1,
            [&] { return "q.shape[" + std::to_string(o + 2) + "] (head dim d) must be >= 1, got " + q.describe(); });
  c.require(dv >= 1, [&] {
    return "v.shape[" + std::to_string(o + 2) + "] (value head dim dv) must be >= 1, got " + v.describe();
  });
  c.dim_equals(k, "k", o + 2, d, "head dim d, as q's last dimension");
  c.dim_equals(v, "v", o, Lk, "keys Lk, as k");
  c.dim_equals(v, "v", o + 1, Hkv, "kv heads, as k");
  c.dim_equals(out, "out", o, Lq, "queries Lq, as q");
  c.dim_equals(out, "out", o + 1, Hq, "query heads Hq, as q");
  c.dim_equals(out, "out", o + 2, dv, "value head dim dv, as v's last dimension");
  if (Hq % Hkv != 0) {
    c.fail("k.shape[" + std::to_string(o + 1) + "] (kv heads) must divide q.shape[" +
           std::to_string(o + 1) + "] (query heads): got Hq=" + std::to_string(Hq) +
           ", Hkv=" + std::to_string(Hkv));
  }
  c.require(Lq < INT_MAX && Lk < INT_MAX && d < INT_MAX && dv < INT_MAX && Hq < INT_MAX,
            [&] { return "sizes must be below 2^31, got q " + q.describe() + ", k " + k.describe(); });
  // The kernels count batches, rows of work and tiles in 32-bit integers.
  const int64_t batches = varlen ? opt.cu_seqlens_q.size(0) - 1 : q.size(0);
  c.require(batches < INT_MAX, [&] { return "batch B must be below 2^31, got " + std::to_string(batches); });
  const double query_rows = double(varlen ? 1 : batches) * double(Lq) * double(Hq);
  const double key_rows = double(varlen ? 1 : batches) * double(Lk) * double(Hkv);
  c.require(query_rows < 2147483648.0 && key_rows < 2147483648.0, [&] {
    return "B·Lq·Hq and B·Lk·Hkv must be below 2^31 (rows of work are counted in 32 bits), "
           "got q " +
           q.describe() + ", k " + k.describe();
  });

  e->Lq = Lq, e->Lk = Lk;
  p->B = static_cast<int>(batches);
  p->Hq = static_cast<int>(Hq);
  p->heads_total = p->Hq;
  p->Hkv = static_cast<int>(Hkv);
  p->d = static_cast<int>(d);
  p->dv = static_cast<int>(dv);
  p->dtype = dt;
  p->q = q.data_as<const float>();
  p->k = k.data_as<const float>();
  p->v = v.data_as<const float>();
  p->out = out.data_as<float>();
  p->q_row = q.stride(o), p->q_head = q.stride(o + 1);
  p->k_row = k.stride(o), p->k_head = k.stride(o + 1);
  p->v_row = v.stride(o), p->v_head = v.stride(o + 1);
  p->out_row = out.stride(o), p->out_head = out.stride(o + 1);
}

// scale, softcap, window, causal, dropout.
void bind_scalars(const Checker& c, const AttentionOptions& opt, Problem* p) {
  p->scale = opt.scale.has_value() ? *opt.scale : static_cast<float>(1.0 / std::sqrt(double(p->d)));
  if (!std::isfinite(p->scale) || p->scale <= 0.0f) {
    c.fail("scale must be finite and > 0, got " + number_text(p->scale));
  }
  if (!std::isfinite(opt.softcap) || opt.softcap < 0.0f) {
    c.fail("softcap must be finite and >= 0 (0 = off), got " + number_text(opt.softcap));
  }
  p->softcap = opt.softcap;
  if (opt.window.left < -1 || opt.window.right < -1) {
    c.fail("window must have left >= -1 and right >= -1 (-1 = unbounded), got {" +
           std::to_string(opt.window.left) + ", " + std::to_string(opt.window.right) + "}");
  }
  p->window_left = opt.window.left;
  p->window_right = opt.window.right;
  p->causal = opt.causal;
  if (!(opt.dropout_p >= 0.0f && opt.dropout_p < 1.0f)) {
    c.fail("dropout_p must be in [0, 1), got " + number_text(opt.dropout_p));
  }
  p->dropout_p = opt.dropout_p;
  p->seed = opt.seed;
  p->offset = opt.offset;
  if (opt.precision != Precision::f32 && opt.precision != Precision::bf16 && opt.precision != Precision::bf16x3) {
    c.fail("precision must be Precision::f32, Precision::bf16 or Precision::bf16x3, got " +
           std::to_string(static_cast<int>(opt.precision)));
  }
  p->precision = opt.precision;
}

// The sequences: packed boundaries (cu_seqlens_q/k) or the batch rows, key_lengths,
// and each sequence's offsets into q, k, v and out.
void bind_sequences(const Checker& c, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const AttentionOptions& opt, Extent* e, Problem* p) {
  if (e->varlen) {
    e->cu_q = check_cu_seqlens(c, opt.cu_seqlens_q, "cu_seqlens_q", e->Lq);
    e->cu_k = check_cu_seqlens(c, opt.cu_seqlens_k, "cu_seqlens_k", e->Lk);
    c.require(e->cu_q.size() == e->cu_k.size(), [&] {
      return "cu_seqlens_k must have the length of cu_seqlens_q (B+1 = " + std::to_string(e->cu_q.size()) + "), got " +
             std::to_string(e->cu_k.size());
    });
  }
  std::vector<int32_t> key_lengths;
  if (!opt.key_lengths.empty()) {
    const TensorView& t = opt.key_lengths;
    c.require(t.dtype() == DType::i32,
              [&] { return std::string("key_lengths must have dtype i32, got ") + dtype_name(t.dtype()); });
    c.require(t.rank() == 1 && t.size(0) == p->B,
              [&] { return "key_lengths must be i32 [B] with B=" + std::to_string(p->B) + ", got " + t.describe(); });
    c.require(t.data() != nullptr || p->B == 0, "key_lengths has a null data pointer");
    c.nonnegative_strides(t, "key_lengths");
    c.metadata_on_device_or_host(t, "key_lengths");
    key_lengths = read_i32(c, t, "key_lengths");
  }
  const std::vector<int32_t>& cu_q = e->cu_q;
  const std::vector<int32_t>& cu_k = e->cu_k;
  p->seqs.resize(static_cast<size_t>(p->B));
  for (int b = 0; b < p->B; ++b) {
    Sequence& s = p->seqs[static_cast<size_t>(b)];
    if (e->varlen) {
      const int64_t q0 = cu_q[b], k0 = cu_k[b];
      s.q_token0 = q0, s.k_token0 = k0;
      s.Lq = cu_q[b + 1] - cu_q[b];
      s.Lk = cu_k[b + 1] - cu_k[b];
      s.q_offset = q0 * p->q_row;
      s.k_offset = k0 * p->k_row;
      s.v_offset = k0 * p->v_row;
      s.out_offset = q0 * p->out_row;
    } else {
      s.Lq = static_cast<int>(e->Lq);
      s.Lk = static_cast<int>(e->Lk);
      s.q_offset = b * q.stride(0);
      s.k_offset = b * k.stride(0);
      s.v_offset = b * v.stride(0);
      s.out_offset = b * out.stride(0);
    }
    s.Lk_rows = s.Lk;
    if (!key_lengths.empty()) {
      const int32_t kl = key_lengths[static_cast<size_t>(b)];
      if (kl < 0 || kl > s.Lk) {
        c.fail("key_lengths[" + std::to_string(b) + "] must be in [0, " + std::to_string(s.Lk) +
               "] (the keys of that sequence), got " + std::to_string(kl));
      }
      s.Lk = kl;
    }
    s.align = int64_t{s.Lk} - s.Lq;
    e->max_lq = std::max(e->max_lq, s.Lq);
    e->max_lk = std::max(e->max_lk, s.Lk_rows);
  }
}

// alibi_slopes: f32 [Hq] or [B, Hq].
void bind_alibi(const Checker& c, const TensorView& t, Problem* p) {
  if (t.empty()) return;
  c.require(t.dtype() == DType::f32,
            [&] { return std::string("alibi_slopes must have dtype f32, got ") + dtype_name(t.dtype()); });
  const bool per_head = t.rank() == 1 && t.size(0) == p->Hq;
  const bool per_batch = t.rank() == 2 && t.size(0) == p->B && t.size(1) == p->Hq;
  c.require(per_head || per_batch, [&] {
    return "alibi_slopes must be f32 [Hq] or [B, Hq] with B=" + std::to_string(p->B) + ", Hq=" + std::to_string(p->Hq) +
           ", got " + t.describe();
  });
  c.require(t.data() != nullptr, "alibi_slopes has a null data pointer");
  c.nonnegative_strides(t, "alibi_slopes");
  c.on_device(t, "alibi_slopes");
  p->alibi = t.data_as<const float>();
  p->alibi_h = t.stride(t.rank() - 1);
  p->alibi_b = per_batch ? t.stride(0) : 0;
}

// options.mask, broadcast over [B, Hq, Lq, Lk] (NumPy's rules; packed sequences
// may pass larger Lq/Lk dimensions, indexed by position within the sequence).
void bind_mask(const Checker& c, const TensorView& m, const Extent& e, Problem* p) {
  if (m.empty()) return;
  const DType dt = p->dtype;
  c.require(m.dtype() == DType::boolean || m.dtype() == DType::f32 || m.dtype() == dt, [&] {
    return std::string("mask must be boolean (true = attend) or additive in f32") +
           (dt != DType::f32 ? std::string(" or ") + dtype_name(dt) : std::string()) + ", got " + dtype_name(m.dtype());
  });
  c.require(m.rank() <= 4,
            [&] { return "mask must have rank <= 4 (broadcast over [B, Hq, Lq, Lk]), got " + m.describe(); });
  c.require(m.data() != nullptr || m.numel() == 0, "mask has a null data pointer");
  c.nonnegative_strides(m, "mask");
  c.on_device(m, "mask");
  const int64_t full[4] = {p->B, p->Hq, e.max_lq, e.max_lk};
  const char* names[4] = {"B", "Hq", e.varlen ? "max seqlen_q" : "Lq", e.varlen ? "max seqlen_k" : "Lk"};
  for (int i = 0; i < m.rank(); ++i) {
    const int dim = 4 - m.rank() + i;
    const int64_t sz = m.size(i);
    const bool ok = sz == 1 || (e.varlen && dim >= 2 ? sz >= full[dim] : sz == full[dim]);
    if (!ok) {
      c.fail("mask " + m.describe() + " is not broadcastable to [B, Hq, Lq, Lk] = [" + std::to_string(full[0]) +
             ", " + std::to_string(full[1]) + ", " + std::to_string(full[2]) + ", " + std::to_string(full[3]) +
             "]: dimension " + std::to_string(i) + " (" + names[dim] + ") must be 1 or " +
             std::to_string(full[dim]) + (e.varlen && dim >= 2 ? " or more" : "") + ", got " + std::to_string(sz));
    }
  }
  bind_mask_layout(c, m, "mask", p);
}

// The optional outputs lse ([B, Hq, Lq] or [Hq, total_q]) and probs ([B, Hq, Lq, Lk]
// or [Hq, total_q, max_seqlen_k]).
void bind_lse_probs(const Checker& c, const TensorView& lse, const TensorView& probs, const Extent& e, Problem* p) {
  const bool varlen = e.varlen;
  const int64_t Hq = p->Hq;
  if (!lse.empty()) {
    if (varlen) {
      c.tensor(lse, "lse", DType::f32, 2, "[Hq, total_q]");
      c.dim_equals(lse, "lse", 0, Hq, "query heads Hq");
      c.dim_equals(lse, "lse", 1, e.Lq, "total_q");
    } else {
      c.tensor(lse, "lse", DType::f32, 3, "[B, Hq, Lq]");
      c.dim_equals(lse, "lse", 0, p->B, "batch B");
      c.dim_equals(lse, "lse", 1, Hq, "query heads Hq");
      c.dim_equals(lse, "lse", 2, e.Lq, "queries Lq");
    }
    p->lse = lse.data_as<float>();
    p->lse_h = lse.stride(varlen ? 0 : 1);
    p->lse_i = lse.stride(varlen ? 1 : 2);
    for (int b = 0; b < p->B; ++b) {
      p->seqs[static_cast<size_t>(b)].lse_offset = varlen ? int64_t{e.cu_q[b]} * p->lse_i : b * lse.stride(0);
    }
  }
  if (!probs.empty()) {
    if (varlen) {
      c.tensor(probs, "probs", DType::f32, 3, "[Hq, total_q, max_seqlen_k]");
      c.dim_equals(probs, "probs", 0, Hq, "query heads Hq");
      c.dim_equals(probs, "probs", 1, e.Lq, "total_q");
      c.dim_equals(probs, "probs", 2, e.max_lk, "max seqlen_k");
    } else {
      c.tensor(probs, "probs", DType::f32, 4, "[B, Hq, Lq, Lk]");
      c.dim_equals(probs, "probs", 0, p->B, "batch B");
      c.dim_equals(probs, "probs", 1, Hq, "query heads Hq");
      c.dim_equals(probs, "probs", 2, e.Lq, "queries Lq");
      c.dim_equals(probs, "probs", 3, e.Lk, "keys Lk");
    }
    c.last_contiguous(probs, "probs");
    const int o2 = varlen ? 0 : 1;
    p->probs = probs.data_as<float>();
    p->probs_h = probs.stride(o2);
    p->probs_i = probs.stride(o2 + 1);
    p->probs_cols = static_cast<int>(probs.size(o2 + 2));
    for (int b = 0; b < p->B; ++b) {
      p->seqs[static_cast<size_t>(b)].probs_offset = varlen ? int64_t{e.cu_q[b]} * p->probs_i : b * probs.stride(0);
    }
  }
}

// Outputs must not overlap what is read or written elsewhere (out may be exactly
// q, k or v).
void check_forward_overlaps(const Checker& c, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const AttentionOptions& opt, const TensorView& lse,
                            const TensorView& probs) {
  c.writable(out, "out");
  c.writable(lse, "lse");
  c.writable(probs, "probs");
  const std::pair<const TensorView*, const char*> inputs[] = {
      {&q, "q"}, {&k, "k"}, {&v, "v"}, {&opt.mask, "mask"}, {&opt.alibi_slopes, "alibi_slopes"},
      {&opt.key_lengths, "key_lengths"}, {&opt.cu_seqlens_q, "cu_seqlens_q"},
      {&opt.cu_seqlens_k, "cu_seqlens_k"}, {&opt.block_mask.blocks, "options.block_mask.blocks"},
      {&opt.block_mask.tiles, "options.block_mask.tiles"}};
  for (const auto& [t, name] : inputs) {
    const bool qkv = t == &q || t == &k || t == &v;
    c.disjoint(out, "out", *t, name, /*exact_alias_ok=*/qkv);
    c.disjoint(lse, "lse", *t, name);
    c.disjoint(probs, "probs", *t, name);
  }
  c.disjoint(lse, "lse", out, "out");
  c.disjoint(probs, "probs", out, "out");
  c.disjoint(probs, "probs", lse, "lse");
}

}  // namespace

void broadcast_strides(const TensorView& t, int64_t strides[4]) {
  for (int i = 0; i < 4; ++i) strides[i] = 0;
  for (int i = 0; i < t.rank(); ++i) {
    const int dim = 4 - t.rank() + i;  // aligned to the right, as NumPy broadcasting
    strides[dim] = t.size(i) == 1 ? 0 : t.stride(i);
  }
}

void bind_mask_layout(const Checker& c, const TensorView& m, const char* name, Problem* p) {
  int64_t strides[4];
  broadcast_strides(m, strides);
  c.require(strides[3] == 0 || strides[3] == 1, [&] {
    return std::string(name) + " must have a contiguous last dimension (stride 1) or broadcast it, got " +
           m.describe();
  });
  p->mask_b = strides[0], p->mask_h = strides[1], p->mask_i = strides[2], p->mask_j = strides[3];
  p->mask_dtype = m.dtype();
  if (m.dtype() == DType::boolean) {
    p->bool_mask = m.data_as<const uint8_t>();
  } else {
    p->add_mask = m.data_as<const float>();  // bf16/f16: widened before any kernel reads it
  }
}

Problem make_problem(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& out, const AttentionOptions& opt, const TensorView& lse,
                     const TensorView& probs, const UserMods* mods, bool on_device, bool out_f32) {
  Checker c(fn);
  // The call runs where q is (a function that runs on the CPU only keeps the default,
  // so that a device tensor is an error, never a host read of device memory).
  if (on_device && !q.empty()) c.set_device(q.device(), "q");
  c.on_device(probs, "probs");
  c.on_device(opt.block_mask.blocks, "options.block_mask.blocks");
  c.on_device(opt.block_mask.tiles, "options.block_mask.tiles");
  Extent e;
  e.varlen = !opt.cu_seqlens_q.empty() || !opt.cu_seqlens_k.empty();
  e.o = e.varlen ? 0 : 1;
  if (e.varlen && (opt.cu_seqlens_q.empty() || opt.cu_seqlens_k.empty())) {
    c.fail(std::string("cu_seqlens_q and cu_seqlens_k must be given together, got only ") +
           (opt.cu_seqlens_q.empty() ? "cu_seqlens_k" : "cu_seqlens_q"));
  }
  Problem p;
  p.out_f32 = out_f32;
  bind_qkv(c, q, k, v, out, opt, &e, &p);
  bind_scalars(c, opt, &p);
  bind_sequences(c, q, k, v, out, opt, &e, &p);
  bind_alibi(c, opt.alibi_slopes, &p);
  bind_mask(c, opt.mask, e, &p);
  bind_block_mask(c, opt.block_mask, p.B, p.Hq, e.max_lq, e.max_lk, e.varlen, &p);
  bind_lse_probs(c, lse, probs, e, &p);
  check_forward_overlaps(c, q, k, v, out, opt, lse, probs);
  p.mods = mods;
  return p;
}

bool wide_out(const TensorView& q, const TensorView& out) {
  return !q.empty() && !out.empty() && (q.dtype() == DType::bf16 || q.dtype() == DType::f16) &&
         out.dtype() == DType::f32;
}

BackwardProblem make_backward_problem(const char* fn, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& out,
                                      const TensorView& lse, const TensorView& dout,
                                      const TensorView& dq, const TensorView& dk,
                                      const TensorView& dv, const AttentionOptions& opt,
                                      const TensorView& dbias, const UserMods* mods, bool on_device,
                                      bool grads_f32, bool out_f32) {
  Checker c(fn);
  if (on_device && !q.empty()) c.set_device(q.device(), "q");
  if (lse.empty()) c.fail("lse is required (the forward's logsumexp), got none");
  BackwardProblem bp;
  bp.fwd = make_problem(fn, q, k, v, out, opt, lse, {}, mods, on_device, out_f32);
  const Problem& p = bp.fwd;
  const bool varlen = !opt.cu_seqlens_q.empty();

  // Each gradient has exactly the shape of its tensor; any strides, last one 1.
  auto like = [&](const TensorView& g, const char* name, const TensorView& t, const char* tname, DType dtype) {
    c.tensor(g, name, dtype, t.rank(), "(the shape of its tensor)");
    c.last_contiguous(g, name);
    for (int i = 0; i < t.rank(); ++i) {
      if (g.size(i) != t.size(i)) {
        c.fail(std::string(name) + " must have the shape of " + tname + " " + t.describe() +
               ", got " + g.describe());
      }
    }
  };
  bp.grads_f32 = grads_f32;
  like(dout, "dout", out, "out", p.dtype);
  like(dq, "dq", q, "q", bp.grad_dtype());
  like(dk, "dk", k, "k", bp.grad_dtype());
  like(dv, "dv", v, "v", bp.grad_dtype());
  const int o = varlen ? 0 : 1;
  bp.dout = dout.data_as<const float>();
  bp.dout_row = dout.stride(o), bp.dout_head = dout.stride(o + 1);
  bp.dq = dq.data_as<float>();
  bp.dq_row = dq.stride(o), bp.dq_head = dq.stride(o + 1);
  bp.dk = dk.data_as<float>();
  bp.dk_row = dk.stride(o), bp.dk_head = dk.stride(o + 1);
  bp.dv = dv.data_as<float>();
  bp.dv_row = dv.stride(o), bp.dv_head = dv.stride(o + 1);
  for (int b = 0; b < p.B; ++b) {
    Sequence& s = bp.fwd.seqs[static_cast<size_t>(b)];
    // Packed: the sequence starts at token token0; padded: at batch row b.
    auto base = [&](const TensorView& t, int64_t token0) {
      return varlen ? token0 * t.stride(0) : b * t.stride(0);
    };
    s.dout_offset = base(dout, s.q_token0);
    s.dq_offset = base(dq, s.q_token0);
    s.dk_offset = base(dk, s.k_token0);
    s.dv_offset = base(dv, s.k_token0);
  }

  if (!dbias.empty()) {
    if (p.add_mask == nullptr) {
      c.fail("dbias needs an additive (f32) mask in options.mask to be the gradient of, got " +
             std::string(opt.mask.empty() ? "no mask" : opt.mask.describe()));
    }
    c.tensor(dbias, "dbias", DType::f32, opt.mask.rank(), "(the shape of options.mask)");
    for (int i = 0; i < opt.mask.rank(); ++i) {
      if (dbias.size(i) != opt.mask.size(i)) {
        c.fail("dbias must have the shape of options.mask " + opt.mask.describe() + ", got " +
               dbias.describe());
      }
    }
    int64_t strides[4];
    broadcast_strides(dbias, strides);
    bp.dbias = dbias.data_as<float>();
    bp.dbias_b = strides[0], bp.dbias_h = strides[1], bp.dbias_i = strides[2], bp.dbias_j = strides[3];
    bp.dbias_shared = (bp.dbias_b == 0 && p.B > 1) || (bp.dbias_h == 0 && p.Hq > 1);
  }
  if (varlen) bp.varlen_q_tokens = q.size(0), bp.varlen_k_tokens = k.size(0);

  // Gradients must not overlap the inputs (not even exactly: dq = q would change
  // q while other tiles still read it), each other, or themselves.
  const std::pair<const TensorView*, const char*> grads[] = {
      {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}, {&dbias, "dbias"}};
  const std::pair<const TensorView*, const char*> reads[] = {
      {&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&lse, "lse"}, {&dout, "dout"},
      {&opt.mask, "mask"}, {&opt.alibi_slopes, "alibi_slopes"}, {&opt.key_lengths, "key_lengths"},
      {&opt.cu_seqlens_q, "cu_seqlens_q"}, {&opt.cu_seqlens_k, "cu_seqlens_k"}};
  for (size_t i = 0; i < 4; ++i) {
    const auto& [g, gname] = grads[i];
    if (g != &dbias) c.writable(*g, gname);
    for (const auto& [t, name] : reads) c.disjoint(*g, gname, *t, name);
    for (size_t j = i + 1; j < 4; ++j) c.disjoint(*g, gname, *grads[j].first, grads[j].second);
  }
  return bp;
}

}  // namespace attn::detail
