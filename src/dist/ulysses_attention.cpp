// Head-parallel attention (DeepSpeed-Ulysses; attn/dist.hpp): one all-to-all turns
// every rank's sequence slice [B, L_r, H, d] into a head slice [B, L, H / R, d] of
// the whole sequence, each rank runs the kernel on its heads (placed at head h0 of
// Hq, so ALiBi slopes and dropout decisions are those of the single call), and a
// second all-to-all returns every rank its rows. With GQA, each rank receives the
// kv heads its query heads read; when several ranks share a kv head (Hkv < R), their
// dk, dv contributions are summed in rank order at the owner, in f32.
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/dist.hpp"
#include "dist/agreement.hpp"
#include "dist/scratch.hpp"
#include "dist/views.hpp"
#include "placed_attention.hpp"
#include "problem.hpp"
#include "tensor/convert.hpp"

namespace attn::dist {
namespace {

using detail::copy_view;
using detail::narrow;
using detail::World;

double now() { return MPI_Wtime(); }

// Which heads rank s computes: query heads [h0, h0 + Hr), kv heads [kh0, kh0 + Hk).
struct Heads {
  int64_t h0, Hr, kh0, Hk;
  Heads(int64_t Hq, int64_t Hkv, int s, int R) {
    const int64_t g = Hq / Hkv;
    Hr = Hq / R;
    h0 = s * Hr;
    kh0 = h0 / g;
    Hk = (h0 + Hr - 1) / g + 1 - kh0;
  }
};

// One all-to-all: rank s's region of the send buffer and rank p's region of the
// receive buffer, in scratch slots 0 and 1 (scratch.hpp: no fresh pages per call).
// Both sides compute every size from the shapes, so no counts are exchanged.
class Exchange {
 public:
  Exchange(const std::vector<int64_t>& send_bytes, const std::vector<int64_t>& recv_bytes)
      : send_bytes_(send_bytes), recv_bytes_(recv_bytes), send_at_(offsets(send_bytes)), recv_at_(offsets(recv_bytes)) {
    send_ = detail::scratch<char>(0, static_cast<size_t>(send_at_.back()));
    recv_ = detail::scratch<char>(1, static_cast<size_t>(recv_at_.back()));
  }
  /// Where the data for rank s goes.
  char* to(int s) const { return send_ + send_at_[static_cast<size_t>(s)]; }
  /// Where rank p's data arrives.
  const char* from(int p) const { return recv_ + recv_at_[static_cast<size_t>(p)]; }
  /// Checks that rank s's region was filled exactly (the sizes are computed twice).
  void filled(int s, const char* end) const {
    if (end != to(s) + send_bytes_[static_cast<size_t>(s)]) throw std::logic_error("ulysses: packed size mismatch");
  }
  void run(const char* fn, MPI_Comm comm, double* bytes_sent) const {
    if (send_at_.back() > INT32_MAX || recv_at_.back() > INT32_MAX) {
      throw Error(std::string(fn) + ": more than 2 GiB per all-to-all on one rank; use ring_attention for this size");
    }
    auto ints = [](const std::vector<int64_t>& v) { return std::vector<int>(v.begin(), v.end()); };
    const std::vector<int> sc = ints(send_bytes_), sd = ints(send_at_), rc = ints(recv_bytes_), rd = ints(recv_at_);
    MPI_Alltoallv(send_, sc.data(), sd.data(), MPI_BYTE, recv_, rc.data(), rd.data(), MPI_BYTE, comm);
    *bytes_sent += static_cast<double>(send_at_.back());
  }

 private:
  static std::vector<int64_t> offsets(const std::vector<int64_t>& bytes) {
    std::vector<int64_t> at(bytes.size() + 1, 0);
    for (size_t i = 0; i < bytes.size(); ++i) at[i + 1] = at[i] + bytes[i];
    return at;
  }
  std::vector<int64_t> send_bytes_, recv_bytes_, send_at_, recv_at_;
  char* send_ = nullptr;
  char* recv_ = nullptr;
};

// Scatter side: this rank's rows of the given heads of `t` ([B, L_r, H, D]), packed
// at `at`, which advances past them.
void pack_heads(char*& at, const TensorView& t, int64_t h0, int64_t H) {
  const TensorView packed(at, t.dtype(), {t.size(0), t.size(1), H, t.size(3)});
  copy_view(narrow(t, 2, h0, H), packed);
  at += packed.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
}

// Gather side: the rows rank p sent (packed [B, L_p, H, D], or lse [B, H, L_p] with
// seq_dim 2, at `at`, which advances) into their positions of `whole`.
void unpack_rows(const char*& at, const World& w, int p, const TensorView& whole, int seq_dim = 1) {
  std::vector<int64_t> shape = whole.shape();
  shape[static_cast<size_t>(seq_dim)] = w.local_lengths[static_cast<size_t>(p)];
  const TensorView packed(at, whole.dtype(), shape);
  for (const Segment& s : w.segments(p)) {
    copy_view(narrow(packed, seq_dim, s.local_row, s.length), narrow(whole, seq_dim, s.position, s.length));
  }
  at += packed.numel() * static_cast<int64_t>(dtype_size(whole.dtype()));
}

// Return side: the rows of `whole` that rank p holds, packed in p's local order at
// `at`, which advances.
void pack_rows(char*& at, const World& w, int p, const TensorView& whole, int seq_dim = 1) {
  std::vector<int64_t> shape = whole.shape();
  shape[static_cast<size_t>(seq_dim)] = w.local_lengths[static_cast<size_t>(p)];
  const TensorView packed(at, whole.dtype(), shape);
  for (const Segment& s : w.segments(p)) {
    copy_view(narrow(whole, seq_dim, s.position, s.length), narrow(packed, seq_dim, s.local_row, s.length));
  }
  at += packed.numel() * static_cast<int64_t>(dtype_size(whole.dtype()));
}

int64_t bytes_of(std::vector<int64_t> shape, DType t) {
  int64_t n = static_cast<int64_t>(dtype_size(t));
  for (int64_t x : shape) n *= x;
  return n;
}

// The options of rank r's head slice: ALiBi slopes narrowed to its heads.
AttentionOptions slice_options(const AttentionOptions& o, const Heads& hs) {
  AttentionOptions s = o;
  s.key_lengths = {};
  if (!o.alibi_slopes.empty()) {
    const int dim = o.alibi_slopes.rank() - 1;
    s.alibi_slopes = narrow(o.alibi_slopes, dim, hs.h0, hs.Hr);
  }
  return s;
}

// The local checks every Ulysses call adds to attention()'s own.
void check_heads(const char* fn, const TensorView& q, const TensorView& k, MPI_Comm comm) {
  int R = 1;
  MPI_Comm_size(comm, &R);
  if (q.rank() == 4 && q.size(2) % R != 0) {
    throw Error(std::string(fn) + ": the query heads Hq = " + std::to_string(q.size(2)) +
                " must be divisible by the number of ranks " + std::to_string(R) + " (each rank takes Hq / R heads)");
  }
  if (q.rank() == 4 && k.rank() == 4 && (k.size(2) == 0 || q.size(2) % k.size(2) != 0)) {
    throw Error(std::string(fn) + ": Hq = " + std::to_string(q.size(2)) + " must be a multiple of Hkv = " +
                std::to_string(k.size(2)));
  }
}

}  // namespace

void ulysses_attention(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const AttentionOptions& options, const TensorView& lse, Layout layout,
                       Stats* stats) {
  const char* fn = "ulysses_attention";
  AttentionOptions local = options;
  local.key_lengths = {};
  const World w = detail::agree(fn, comm, q, k, v, options, layout, [&] {
    check_heads(fn, q, k, comm);
    ::attn::detail::make_problem(fn, q, k, v, out, local, lse, {}, nullptr, false, ::attn::detail::wide_out(q, out));
  });
  const double start = now();
  Stats st;
  const int R = w.ranks, r = w.rank;
  const int64_t B = q.size(0), Hq = q.size(2), Hkv = k.size(2), d = q.size(3), dv = v.size(3), L = w.length;
  const int64_t Lr = q.size(1);
  const DType dt = q.dtype(), od = out.dtype();  // od: f32 for a bf16/f16 call's unrounded out
  const Heads mine(Hq, Hkv, r, R);
  auto length = [&w](int p) { return w.local_lengths[static_cast<size_t>(p)]; };

  // Sequence slices → head slices: rank s gets my rows of its q heads and kv heads.
  std::vector<int64_t> send(static_cast<size_t>(R)), recv(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) {
    const Heads hs(Hq, Hkv, s, R);
    send[static_cast<size_t>(s)] = bytes_of({B, Lr, hs.Hr, d}, dt) + bytes_of({B, Lr, hs.Hk, d + dv}, dt);
    recv[static_cast<size_t>(s)] = bytes_of({B, length(s), mine.Hr, d}, dt) + bytes_of({B, length(s), mine.Hk, d + dv}, dt);
  }
  double c0 = now();
  {
    const Exchange ex(send, recv);
    for (int s = 0; s < R; ++s) {
      const Heads hs(Hq, Hkv, s, R);
      char* at = ex.to(s);
      pack_heads(at, q, hs.h0, hs.Hr);
      pack_heads(at, k, hs.kh0, hs.Hk);
      pack_heads(at, v, hs.kh0, hs.Hk);
      ex.filled(s, at);
    }
    ex.run(fn, comm, &st.bytes_sent);
    st.wait_s += now() - c0;

    c0 = now();
    const size_t es = dtype_size(dt);
    const TensorView qv(detail::scratch<char>(2, static_cast<size_t>(B * L * mine.Hr * d) * es), dt, {B, L, mine.Hr, d});
    const TensorView kv(detail::scratch<char>(3, static_cast<size_t>(B * L * mine.Hk * d) * es), dt, {B, L, mine.Hk, d});
    const TensorView vv(detail::scratch<char>(4, static_cast<size_t>(B * L * mine.Hk * dv) * es), dt, {B, L, mine.Hk, dv});
    for (int p = 0; p < R; ++p) {
      const char* at = ex.from(p);
      unpack_rows(at, w, p, qv);
      unpack_rows(at, w, p, kv);
      unpack_rows(at, w, p, vv);
    }
    const TensorView ov(detail::scratch<float>(5, static_cast<size_t>(B * L * mine.Hr * dv)), DType::f32, {B, L, mine.Hr, dv});
    const TensorView lv(detail::scratch<float>(6, static_cast<size_t>(B * mine.Hr * L)), DType::f32, {B, mine.Hr, L});
    ::attn::detail::Placement where;
    where.Lq_total = where.Lk_total = L;
    where.key_lengths = w.key_lengths;
    where.h0 = static_cast<int>(mine.h0), where.heads_total = static_cast<int>(Hq);
    ::attn::detail::attention_placed(qv, kv, vv, ov, lv, slice_options(options, mine), where);
    // Rounded once here, to the output dtype: the owner only copies.
    const TensorView ov_dt = od == DType::f32 ? ov
                                              : TensorView(detail::scratch<char>(7, static_cast<size_t>(bytes_of(
                                                                                        {B, L, mine.Hr, dv}, od))),
                                                           od, {B, L, mine.Hr, dv});
    if (od != DType::f32) ::attn::detail::from_f32_contiguous(ov.data_as<float>(), ov_dt);
    st.compute_s += now() - c0;
    st.steps = 1;

    // Head slices → sequence slices: rank p gets its rows of my heads' out and lse.
    for (int p = 0; p < R; ++p) {
      send[static_cast<size_t>(p)] = bytes_of({B, length(p), mine.Hr, dv}, od) + bytes_of({B, mine.Hr, length(p)}, DType::f32);
      const Heads hs(Hq, Hkv, p, R);
      recv[static_cast<size_t>(p)] = bytes_of({B, Lr, hs.Hr, dv}, od) + bytes_of({B, hs.Hr, Lr}, DType::f32);
    }
    c0 = now();
    const Exchange back(send, recv);
    for (int p = 0; p < R; ++p) {
      char* at = back.to(p);
      pack_rows(at, w, p, ov_dt);
      pack_rows(at, w, p, lv, 2);
      back.filled(p, at);
    }
    back.run(fn, comm, &st.bytes_sent);
    st.wait_s += now() - c0;
    for (int s = 0; s < R; ++s) {
      const Heads hs(Hq, Hkv, s, R);
      const char* at = back.from(s);
      copy_view(TensorView(at, od, {B, Lr, hs.Hr, dv}), narrow(out, 2, hs.h0, hs.Hr));
      if (!lse.empty()) {
        copy_view(TensorView(at + bytes_of({B, Lr, hs.Hr, dv}, od), DType::f32, {B, hs.Hr, Lr}),
                  narrow(lse, 1, hs.h0, hs.Hr));
      }
    }
  }
  st.total_s = now() - start;
  if (stats != nullptr) *stats = st;
}

void ulysses_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& lse, const TensorView& dout,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                const AttentionOptions& options, Layout layout, Stats* stats) {
  const char* fn = "ulysses_attention_backward";
  AttentionOptions local = options;
  local.key_lengths = {};
  const World w = detail::agree(fn, comm, q, k, v, options, layout, [&] {
    check_heads(fn, q, k, comm);
    ::attn::detail::make_backward_problem(fn, q, k, v, out, lse, dout, dq, dk, dv, local, {}, nullptr, false, false,
                                          ::attn::detail::wide_out(q, out));
  });
  const double start = now();
  Stats st;
  const int R = w.ranks, r = w.rank;
  const int64_t B = q.size(0), Hq = q.size(2), Hkv = k.size(2), d = q.size(3), Dv = v.size(3), L = w.length;
  const int64_t Lr = q.size(1);
  const DType dt = q.dtype(), od = out.dtype();  // od: f32 for a bf16/f16 call's unrounded out
  const Heads mine(Hq, Hkv, r, R);
  auto length = [&w](int p) { return w.local_lengths[static_cast<size_t>(p)]; };

  // Sequence slices → head slices: q, k, v, out, dout and lse of rank s's heads.
  std::vector<int64_t> send(static_cast<size_t>(R)), recv(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) {
    const Heads hs(Hq, Hkv, s, R);
    send[static_cast<size_t>(s)] = bytes_of({B, Lr, hs.Hr, d + Dv}, dt) + bytes_of({B, Lr, hs.Hr, Dv}, od) +
                                   bytes_of({B, Lr, hs.Hk, d + Dv}, dt) + bytes_of({B, hs.Hr, Lr}, DType::f32);
    recv[static_cast<size_t>(s)] = bytes_of({B, length(s), mine.Hr, d + Dv}, dt) +
                                   bytes_of({B, length(s), mine.Hr, Dv}, od) +
                                   bytes_of({B, length(s), mine.Hk, d + Dv}, dt) +
                                   bytes_of({B, mine.Hr, length(s)}, DType::f32);
  }
  double c0 = now();
  const Exchange ex(send, recv);
  for (int s = 0; s < R; ++s) {
    const Heads hs(Hq, Hkv, s, R);
    char* at = ex.to(s);
    pack_heads(at, q, hs.h0, hs.Hr);
    pack_heads(at, k, hs.kh0, hs.Hk);
    pack_heads(at, v, hs.kh0, hs.Hk);
    pack_heads(at, out, hs.h0, hs.Hr);
    pack_heads(at, dout, hs.h0, hs.Hr);
    const TensorView lse_part(at, DType::f32, {B, hs.Hr, Lr});
    copy_view(narrow(lse, 1, hs.h0, hs.Hr), lse_part);
    at += bytes_of({B, hs.Hr, Lr}, DType::f32);
    ex.filled(s, at);
  }
  ex.run(fn, comm, &st.bytes_sent);
  st.wait_s += now() - c0;

  c0 = now();
  auto buffer = [&](int slot, std::vector<int64_t> shape, DType t) {
    return TensorView(detail::scratch<char>(slot, static_cast<size_t>(bytes_of(shape, t))), t, shape);
  };
  const TensorView qv = buffer(2, {B, L, mine.Hr, d}, dt), kv = buffer(3, {B, L, mine.Hk, d}, dt),
                   vv = buffer(4, {B, L, mine.Hk, Dv}, dt), ov = buffer(5, {B, L, mine.Hr, Dv}, od),
                   dov = buffer(6, {B, L, mine.Hr, Dv}, dt), lv = buffer(7, {B, mine.Hr, L}, DType::f32);
  for (int p = 0; p < R; ++p) {
    const char* at = ex.from(p);
    for (const TensorView* t : {&qv, &kv, &vv, &ov, &dov}) unpack_rows(at, w, p, *t);
    unpack_rows(at, w, p, lv, 2);
  }
  const TensorView gq = buffer(8, {B, L, mine.Hr, d}, DType::f32), gk = buffer(9, {B, L, mine.Hk, d}, DType::f32),
                   gv = buffer(10, {B, L, mine.Hk, Dv}, DType::f32);
  ::attn::detail::Placement where;
  where.Lq_total = where.Lk_total = L;
  where.key_lengths = w.key_lengths;
  where.h0 = static_cast<int>(mine.h0), where.heads_total = static_cast<int>(Hq);
  ::attn::detail::attention_backward_placed(qv, kv, vv, ov, lv, dov, gq, gk, gv, slice_options(options, mine), where);
  // dq of a head is complete here: round it once to the dtype. dk, dv may be partial
  // (kv heads shared between ranks): they travel in f32.
  const TensorView gq_dt = buffer(11, {B, L, mine.Hr, d}, dt);
  ::attn::detail::from_f32_contiguous(gq.data_as<float>(), gq_dt);
  st.compute_s += now() - c0;
  st.steps = 1;

  for (int p = 0; p < R; ++p) {
    send[static_cast<size_t>(p)] = bytes_of({B, length(p), mine.Hr, d}, dt) +
                                   bytes_of({B, length(p), mine.Hk, d + Dv}, DType::f32);
    const Heads hs(Hq, Hkv, p, R);
    recv[static_cast<size_t>(p)] = bytes_of({B, Lr, hs.Hr, d}, dt) + bytes_of({B, Lr, hs.Hk, d + Dv}, DType::f32);
  }
  c0 = now();
  // The first exchange's buffers are no longer needed: the same slots serve again.
  const Exchange back(send, recv);
  for (int p = 0; p < R; ++p) {
    char* at = back.to(p);
    pack_rows(at, w, p, gq_dt);
    pack_rows(at, w, p, gk);
    pack_rows(at, w, p, gv);
    back.filled(p, at);
  }
  back.run(fn, comm, &st.bytes_sent);
  st.wait_s += now() - c0;
  const TensorView dk_acc = buffer(12, {B, Lr, Hkv, d}, DType::f32), dv_acc = buffer(13, {B, Lr, Hkv, Dv}, DType::f32);
  std::fill_n(dk_acc.data_as<float>(), dk_acc.numel(), 0.0f);
  std::fill_n(dv_acc.data_as<float>(), dv_acc.numel(), 0.0f);
  std::vector<float> part;
  for (int s = 0; s < R; ++s) {  // in rank order: the sum is the same on every run
    const Heads hs(Hq, Hkv, s, R);
    const char* at = back.from(s);
    copy_view(TensorView(at, dt, {B, Lr, hs.Hr, d}), narrow(dq, 2, hs.h0, hs.Hr));
    at += bytes_of({B, Lr, hs.Hr, d}, dt);
    for (const TensorView* acc : {&dk_acc, &dv_acc}) {
      const int64_t D = acc->size(3);
      // Copied out: after bf16/f16 dq the f32 part may not be 4-byte aligned.
      part.resize(static_cast<size_t>(B * Lr * hs.Hk * D));
      if (!part.empty()) std::memcpy(part.data(), at, part.size() * sizeof(float));
      float* a = acc->data_as<float>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Lr; ++i)
          for (int64_t h = 0; h < hs.Hk; ++h)
            for (int64_t x = 0; x < D; ++x)
              a[((b * Lr + i) * Hkv + hs.kh0 + h) * D + x] += part[static_cast<size_t>(((b * Lr + i) * hs.Hk + h) * D + x)];
      at += bytes_of({B, Lr, hs.Hk, D}, DType::f32);
    }
  }
  ::attn::detail::from_f32_contiguous(dk_acc.data_as<float>(), dk);
  ::attn::detail::from_f32_contiguous(dv_acc.data_as<float>(), dv);
  st.total_s = now() - start;
  if (stats != nullptr) *stats = st;
}

}  // namespace attn::dist
