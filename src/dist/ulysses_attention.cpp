// Head-parallel attention (DeepSpeed-Ulysses; attn/dist.hpp): one all-to-all turns
// every rank's sequence slice [B, L_r, H, d] into a head slice [B, L, H / R, d] of
// the whole sequence, each rank runs the kernel on its heads (placed at head h0 of
// Hq, so ALiBi slopes and dropout decisions are those of the single call), and a
// second all-to-all returns every rank its rows. With GQA, each rank receives the
// kv heads its query heads read; when several ranks share a kv head (Hkv < R), their
// dk, dv contributions are summed in rank order at the owner, in f32.
#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "attn/dist.hpp"
#include "dist/agreement.hpp"
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

// Byte buffers, one per peer rank, exchanged with one MPI_Alltoallv.
using PerRank = std::vector<std::vector<char>>;

PerRank all_to_all(const char* fn, MPI_Comm comm, const PerRank& send, const std::vector<int64_t>& recv_bytes,
                   double* bytes_sent) {
  const size_t R = send.size();
  std::vector<int> scount(R), sdispl(R), rcount(R), rdispl(R);
  int64_t stotal = 0, rtotal = 0;
  for (size_t s = 0; s < R; ++s) {
    if (stotal + static_cast<int64_t>(send[s].size()) > INT32_MAX || rtotal + recv_bytes[s] > INT32_MAX) {
      throw Error(std::string(fn) + ": more than 2 GiB per all-to-all; use ring_attention for this size");
    }
    scount[s] = static_cast<int>(send[s].size()), sdispl[s] = static_cast<int>(stotal);
    rcount[s] = static_cast<int>(recv_bytes[s]), rdispl[s] = static_cast<int>(rtotal);
    stotal += scount[s], rtotal += rcount[s];
  }
  std::vector<char> sbuf(static_cast<size_t>(stotal)), rbuf(static_cast<size_t>(rtotal));
  for (size_t s = 0; s < R; ++s) std::copy(send[s].begin(), send[s].end(), sbuf.begin() + sdispl[s]);
  MPI_Alltoallv(sbuf.data(), scount.data(), sdispl.data(), MPI_BYTE, rbuf.data(), rcount.data(), rdispl.data(),
                MPI_BYTE, comm);
  *bytes_sent += static_cast<double>(stotal);
  PerRank out(R);
  for (size_t s = 0; s < R; ++s) out[s].assign(rbuf.begin() + rdispl[s], rbuf.begin() + rdispl[s] + rcount[s]);
  return out;
}

// Scatter side: this rank's rows of the given heads of `t` ([B, L_r, H, D]), packed.
void append_heads(std::vector<char>& buf, const TensorView& t, int64_t h0, int64_t H) {
  const size_t at = buf.size();
  buf.resize(at + static_cast<size_t>(t.size(0) * t.size(1) * H * t.size(3)) * dtype_size(t.dtype()));
  copy_view(narrow(t, 2, h0, H), TensorView(buf.data() + at, t.dtype(), {t.size(0), t.size(1), H, t.size(3)}));
}

// Gather side: the rows rank p sent (packed [B, L_p, H, D] at `at` in buf) into their
// positions of the whole-sequence tensor `whole` [B, L, H, D]. Returns the bytes read.
size_t place_rows(const World& w, int p, const char* buf, const TensorView& whole) {
  const int64_t Lp = w.local_lengths[static_cast<size_t>(p)];
  const TensorView packed(buf, whole.dtype(), {whole.size(0), Lp, whole.size(2), whole.size(3)});
  for (const Segment& s : w.segments(p)) {
    copy_view(narrow(packed, 1, s.local_row, s.length), narrow(whole, 1, s.position, s.length));
  }
  return static_cast<size_t>(packed.numel()) * dtype_size(whole.dtype());
}

// Return side: the rows of `whole` [B, L, H, D] (or lse [B, H, L], seq_dim 2) that
// rank p holds, packed in p's local order, appended to buf.
void append_rows(std::vector<char>& buf, const World& w, int p, const TensorView& whole, int seq_dim = 1) {
  std::vector<int64_t> shape = whole.shape();
  shape[static_cast<size_t>(seq_dim)] = w.local_lengths[static_cast<size_t>(p)];
  const size_t at = buf.size();
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  buf.resize(at + static_cast<size_t>(n) * dtype_size(whole.dtype()));
  const TensorView packed(buf.data() + at, whole.dtype(), shape);
  for (const Segment& s : w.segments(p)) {
    copy_view(narrow(whole, seq_dim, s.position, s.length), narrow(packed, seq_dim, s.local_row, s.length));
  }
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
    ::attn::detail::make_problem(fn, q, k, v, out, local, lse, {}, nullptr);
  });
  const double start = now();
  Stats st;
  const int R = w.ranks, r = w.rank;
  const int64_t B = q.size(0), Hq = q.size(2), Hkv = k.size(2), d = q.size(3), dv = v.size(3), L = w.length;
  const DType dt = q.dtype();
  const Heads mine(Hq, Hkv, r, R);

  // Sequence slices → head slices.
  PerRank send(static_cast<size_t>(R));
  std::vector<int64_t> recv(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) {
    const Heads hs(Hq, Hkv, s, R);
    append_heads(send[static_cast<size_t>(s)], q, hs.h0, hs.Hr);
    append_heads(send[static_cast<size_t>(s)], k, hs.kh0, hs.Hk);
    append_heads(send[static_cast<size_t>(s)], v, hs.kh0, hs.Hk);
    const int64_t Lp = w.local_lengths[static_cast<size_t>(s)];
    recv[static_cast<size_t>(s)] = bytes_of({B, Lp, mine.Hr, d}, dt) + bytes_of({B, Lp, mine.Hk, d + dv}, dt);
  }
  double c0 = now();
  const PerRank got = all_to_all(fn, comm, send, recv, &st.bytes_sent);
  st.wait_s += now() - c0;

  c0 = now();
  const size_t es = dtype_size(dt);
  std::vector<char> qw(static_cast<size_t>(B * L * mine.Hr * d) * es), kw(static_cast<size_t>(B * L * mine.Hk * d) * es),
      vw(static_cast<size_t>(B * L * mine.Hk * dv) * es);
  const TensorView qv(qw.data(), dt, {B, L, mine.Hr, d}), kv(kw.data(), dt, {B, L, mine.Hk, d}),
      vv(vw.data(), dt, {B, L, mine.Hk, dv});
  for (int p = 0; p < R; ++p) {
    const char* at = got[static_cast<size_t>(p)].data();
    at += place_rows(w, p, at, qv);
    at += place_rows(w, p, at, kv);
    place_rows(w, p, at, vv);
  }
  std::vector<float> ow(static_cast<size_t>(B * L * mine.Hr * dv)), lw(static_cast<size_t>(B * mine.Hr * L));
  const TensorView ov(ow.data(), DType::f32, {B, L, mine.Hr, dv}), lv(lw.data(), DType::f32, {B, mine.Hr, L});
  ::attn::detail::Placement where;
  where.Lq_total = where.Lk_total = L;
  where.key_lengths = w.key_lengths;
  where.h0 = static_cast<int>(mine.h0), where.heads_total = static_cast<int>(Hq);
  ::attn::detail::attention_placed(qv, kv, vv, ov, lv, slice_options(options, mine), where);
  // Rounded once here, to the output dtype: the owner only copies.
  std::vector<char> ow_dt(static_cast<size_t>(B * L * mine.Hr * dv) * es);
  const TensorView ov_dt(ow_dt.data(), dt, {B, L, mine.Hr, dv});
  ::attn::detail::from_f32_contiguous(ow.data(), ov_dt);
  st.compute_s += now() - c0;
  st.steps = 1;

  // Head slices → sequence slices.
  PerRank back(static_cast<size_t>(R));
  for (int p = 0; p < R; ++p) {
    append_rows(back[static_cast<size_t>(p)], w, p, ov_dt);
    append_rows(back[static_cast<size_t>(p)], w, p, lv, 2);
    recv[static_cast<size_t>(p)] = bytes_of({B, q.size(1), mine.Hr, dv}, dt) + bytes_of({B, mine.Hr, q.size(1)}, DType::f32);
  }
  c0 = now();
  const PerRank ret = all_to_all(fn, comm, back, recv, &st.bytes_sent);
  st.wait_s += now() - c0;
  const int64_t Lr = q.size(1);
  for (int s = 0; s < R; ++s) {
    const Heads hs(Hq, Hkv, s, R);
    const char* at = ret[static_cast<size_t>(s)].data();
    const TensorView o_part(at, dt, {B, Lr, hs.Hr, dv});
    copy_view(o_part, narrow(out, 2, hs.h0, hs.Hr));
    if (!lse.empty()) {
      const TensorView l_part(at + bytes_of({B, Lr, hs.Hr, dv}, dt), DType::f32, {B, hs.Hr, Lr});
      copy_view(l_part, narrow(lse, 1, hs.h0, hs.Hr));
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
    ::attn::detail::make_backward_problem(fn, q, k, v, out, lse, dout, dq, dk, dv, local, {}, nullptr);
  });
  const double start = now();
  Stats st;
  const int R = w.ranks, r = w.rank;
  const int64_t B = q.size(0), Hq = q.size(2), Hkv = k.size(2), d = q.size(3), Dv = v.size(3), L = w.length;
  const int64_t Lr = q.size(1);
  const DType dt = q.dtype();
  const Heads mine(Hq, Hkv, r, R);

  PerRank send(static_cast<size_t>(R));
  std::vector<int64_t> recv(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) {
    const Heads hs(Hq, Hkv, s, R);
    std::vector<char>& b = send[static_cast<size_t>(s)];
    append_heads(b, q, hs.h0, hs.Hr);
    append_heads(b, k, hs.kh0, hs.Hk);
    append_heads(b, v, hs.kh0, hs.Hk);
    append_heads(b, out, hs.h0, hs.Hr);
    append_heads(b, dout, hs.h0, hs.Hr);
    const size_t at = b.size();  // lse [B, Hr, L_r] of these heads
    b.resize(at + static_cast<size_t>(bytes_of({B, hs.Hr, Lr}, DType::f32)));
    copy_view(narrow(lse, 1, hs.h0, hs.Hr), TensorView(b.data() + at, DType::f32, {B, hs.Hr, Lr}));
    const int64_t Lp = w.local_lengths[static_cast<size_t>(s)];
    recv[static_cast<size_t>(s)] = bytes_of({B, Lp, mine.Hr, d + 2 * Dv}, dt) + bytes_of({B, Lp, mine.Hk, d + Dv}, dt) +
                                   bytes_of({B, mine.Hr, Lp}, DType::f32);
  }
  double c0 = now();
  const PerRank got = all_to_all(fn, comm, send, recv, &st.bytes_sent);
  st.wait_s += now() - c0;

  c0 = now();
  auto buffer = [&](std::vector<int64_t> shape, DType t) {
    return std::vector<char>(static_cast<size_t>(bytes_of(shape, t)));
  };
  std::vector<char> qw = buffer({B, L, mine.Hr, d}, dt), kw = buffer({B, L, mine.Hk, d}, dt),
                    vw = buffer({B, L, mine.Hk, Dv}, dt), ow = buffer({B, L, mine.Hr, Dv}, dt),
                    dow = buffer({B, L, mine.Hr, Dv}, dt), lw = buffer({B, mine.Hr, L}, DType::f32);
  const TensorView qv(qw.data(), dt, {B, L, mine.Hr, d}), kv(kw.data(), dt, {B, L, mine.Hk, d}),
      vv(vw.data(), dt, {B, L, mine.Hk, Dv}), ov(ow.data(), dt, {B, L, mine.Hr, Dv}),
      dov(dow.data(), dt, {B, L, mine.Hr, Dv}), lv(lw.data(), DType::f32, {B, mine.Hr, L});
  for (int p = 0; p < R; ++p) {
    const char* at = got[static_cast<size_t>(p)].data();
    for (const TensorView* t : {&qv, &kv, &vv, &ov, &dov}) at += place_rows(w, p, at, *t);
    const int64_t Lp = w.local_lengths[static_cast<size_t>(p)];
    const TensorView l_part(at, DType::f32, {B, mine.Hr, Lp});
    for (const Segment& s : w.segments(p)) {
      copy_view(narrow(l_part, 2, s.local_row, s.length), narrow(lv, 2, s.position, s.length));
    }
  }
  std::vector<float> gq(static_cast<size_t>(B * L * mine.Hr * d)), gk(static_cast<size_t>(B * L * mine.Hk * d)),
      gv(static_cast<size_t>(B * L * mine.Hk * Dv));
  const TensorView gqv(gq.data(), DType::f32, {B, L, mine.Hr, d}), gkv(gk.data(), DType::f32, {B, L, mine.Hk, d}),
      gvv(gv.data(), DType::f32, {B, L, mine.Hk, Dv});
  ::attn::detail::Placement where;
  where.Lq_total = where.Lk_total = L;
  where.key_lengths = w.key_lengths;
  where.h0 = static_cast<int>(mine.h0), where.heads_total = static_cast<int>(Hq);
  ::attn::detail::attention_backward_placed(qv, kv, vv, ov, lv, dov, gqv, gkv, gvv, slice_options(options, mine),
                                            where);
  // dq of a head is complete here: round it once to the dtype. dk, dv may be partial
  // (kv heads shared between ranks): they travel in f32.
  std::vector<char> gq_dt = buffer({B, L, mine.Hr, d}, dt);
  const TensorView gq_dtv(gq_dt.data(), dt, {B, L, mine.Hr, d});
  ::attn::detail::from_f32_contiguous(gq.data(), gq_dtv);
  st.compute_s += now() - c0;
  st.steps = 1;

  PerRank back(static_cast<size_t>(R));
  for (int p = 0; p < R; ++p) {
    append_rows(back[static_cast<size_t>(p)], w, p, gq_dtv);
    append_rows(back[static_cast<size_t>(p)], w, p, gkv);
    append_rows(back[static_cast<size_t>(p)], w, p, gvv);
    recv[static_cast<size_t>(p)] = 0;
  }
  for (int s = 0; s < R; ++s) {
    const Heads hs(Hq, Hkv, s, R);
    recv[static_cast<size_t>(s)] = bytes_of({B, Lr, hs.Hr, d}, dt) + bytes_of({B, Lr, hs.Hk, d + Dv}, DType::f32);
  }
  c0 = now();
  const PerRank ret = all_to_all(fn, comm, back, recv, &st.bytes_sent);
  st.wait_s += now() - c0;
  std::vector<float> dk_acc(static_cast<size_t>(B * Lr * Hkv * d), 0.0f), dv_acc(static_cast<size_t>(B * Lr * Hkv * Dv), 0.0f);
  for (int s = 0; s < R; ++s) {  // in rank order: the sum is the same on every run
    const Heads hs(Hq, Hkv, s, R);
    const char* at = ret[static_cast<size_t>(s)].data();
    copy_view(TensorView(at, dt, {B, Lr, hs.Hr, d}), narrow(dq, 2, hs.h0, hs.Hr));
    at += bytes_of({B, Lr, hs.Hr, d}, dt);
    for (auto [acc, D] : {std::pair{&dk_acc, d}, {&dv_acc, Dv}}) {
      // Copied out: after bf16/f16 dq the f32 part may not be 4-byte aligned.
      std::vector<float> part(static_cast<size_t>(B * Lr * hs.Hk * D));
      std::memcpy(part.data(), at, part.size() * sizeof(float));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Lr; ++i)
          for (int64_t h = 0; h < hs.Hk; ++h)
            for (int64_t x = 0; x < D; ++x)
              (*acc)[static_cast<size_t>(((b * Lr + i) * Hkv + hs.kh0 + h) * D + x)] +=
                  part[static_cast<size_t>(((b * Lr + i) * hs.Hk + h) * D + x)];
      at += bytes_of({B, Lr, hs.Hk, D}, DType::f32);
    }
  }
  ::attn::detail::from_f32_contiguous(dk_acc.data(), dk);
  ::attn::detail::from_f32_contiguous(dv_acc.data(), dv);
  st.total_s = now() - start;
  if (stats != nullptr) *stats = st;
}

}  // namespace attn::dist
