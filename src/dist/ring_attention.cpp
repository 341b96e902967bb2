// Ring attention (attn/dist.hpp): each rank keeps its queries while the key/value
// blocks of all ranks pass around the ring, one hop per step; at step t rank r holds
// the block of rank r − t. The next block's transfer is posted before the local
// kernels run, so communication hides behind compute. Each (query segment, key
// segment) pair runs the fused kernel placed at its positions in the whole sequence
// (src/placed_attention.hpp), and the partial outputs are merged by log-sum-exp in
// f32 in step order, so the result does not depend on timing.
//
// The backward sends the blocks around again, now with f32 accumulators for their
// dk and dv: rank r adds its contribution to the accumulator of block r − t, passes it
// on, and after the last step each accumulator goes straight home to its owner.
//
// Steps that no rank needs (every pair out of every window) are not taken at all.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attn/dist.hpp"
#include "dist/agreement.hpp"
#include "dist/ring_schedule.hpp"
#include "dist/scratch.hpp"
#include "dist/transfer.hpp"
#include "dist/views.hpp"
#include "placed_attention.hpp"
#include "problem.hpp"
#include "tensor/convert.hpp"

namespace attn::dist {
namespace {

using detail::narrow;
using detail::World;

constexpr int kTagKV = 101, kTagGrad = 102, kTagHome = 103;

// The shapes of one call and the views of a travelling block: k [B, L, Hkv, d] then
// v [B, L, Hkv, dv], packed back to back in `es`-byte elements.
struct Shapes {
  int64_t B, Hq, Hkv, d, dv;
  DType dtype;
  int64_t es;
  explicit Shapes(const TensorView& q, const TensorView& k, const TensorView& v)
      : B(q.size(0)), Hq(q.size(2)), Hkv(k.size(2)), d(q.size(3)), dv(v.size(3)), dtype(q.dtype()),
        es(static_cast<int64_t>(dtype_size(q.dtype()))) {}
  int64_t k_elems(int64_t L) const { return B * L * Hkv * d; }
  int64_t kv_elems(int64_t L) const { return B * L * Hkv * (d + dv); }
  TensorView k_of(void* base, int64_t L, DType t) const { return TensorView(base, t, {B, L, Hkv, d}); }
  TensorView v_of(void* base, int64_t L, DType t) const {
    return TensorView(static_cast<char*>(base) + k_elems(L) * static_cast<int64_t>(dtype_size(t)), t,
                      {B, L, Hkv, dv});
  }
};

// Adds src into dst (n floats).
void add_into(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// Adds a contiguous f32 [B, n, H, D] block into rows [row, row + n) of an f32 view.
void add_rows(const TensorView& dst_whole, int64_t row, int64_t n, const float* part) {
  const int64_t B = dst_whole.size(0), H = dst_whole.size(2), D = dst_whole.size(3);
  float* base = dst_whole.data_as<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      float* out = base + b * dst_whole.stride(0) + (row + i) * dst_whole.stride(1);
      const float* in = part + (b * n + i) * H * D;
      for (int64_t h = 0; h < H; ++h) add_into(out + h * dst_whole.stride(2), in + h * D, D);
    }
  }
}

double now() { return MPI_Wtime(); }

}  // namespace

void ring_attention(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const AttentionOptions& options, const TensorView& lse, Layout layout,
                    Stats* stats) {
  const char* fn = "ring_attention";
  AttentionOptions local = options;
  local.key_lengths = {};  // global lengths: checked by agree(), placed per block
  const World w = detail::agree(fn, comm, q, k, v, options, layout, [&] {
    ::attn::detail::make_problem(fn, q, k, v, out, local, lse, {}, nullptr, false, ::attn::detail::wide_out(q, out));
  });
  const double start = now();
  Stats st;
  const Shapes sh(q, k, v);
  const int R = w.ranks, r = w.rank, next = (r + 1) % R, prev = (r + R - 1) % R;
  const int64_t Lr = q.size(1);
  const detail::RingSchedule plan(w, options);

  // Accumulators for this rank's rows, and a partial result of the largest segment
  // (scratch.hpp: reused across calls).
  const size_t n_out = static_cast<size_t>(sh.B * Lr * sh.Hq * sh.dv), n_lse = static_cast<size_t>(sh.B * sh.Hq * Lr);
  float* acc = detail::scratch<float>(2, n_out);
  float* acc_lse = detail::scratch<float>(3, n_lse);
  std::fill(acc, acc + n_out, 0.0f);
  std::fill(acc_lse, acc_lse + n_lse, -INFINITY);
  const TensorView acc_v(acc, DType::f32, {sh.B, Lr, sh.Hq, sh.dv});
  const TensorView acc_lse_v(acc_lse, DType::f32, {sh.B, sh.Hq, Lr});
  float* part = detail::scratch<float>(4, n_out);
  float* part_lse = detail::scratch<float>(5, n_lse);

  // Two block buffers: the one being computed on and the one arriving.
  const int64_t max_L = *std::max_element(w.local_lengths.begin(), w.local_lengths.end());
  char* buf[2] = {detail::scratch<char>(0, static_cast<size_t>(sh.kv_elems(max_L) * sh.es)),
                  detail::scratch<char>(1, static_cast<size_t>(sh.kv_elems(max_L) * sh.es))};
  detail::copy_view(k, sh.k_of(buf[0], Lr, sh.dtype));
  detail::copy_view(v, sh.v_of(buf[0], Lr, sh.dtype));

  ::attn::detail::Placement where;
  where.Lq_total = where.Lk_total = w.length;
  where.key_lengths = w.key_lengths;
  for (int t = 0; t <= plan.last_step; ++t) {
    const int src = (r - t + R) % R, cur = t % 2;
    const int64_t Ls = w.local_lengths[static_cast<size_t>(src)];
    detail::Transfers kv;
    if (t < plan.last_step) {
      const int incoming = (src + R - 1) % R;
      kv.recv(buf[1 - cur], sh.kv_elems(w.local_lengths[static_cast<size_t>(incoming)]) * sh.es, prev,
              kTagKV, comm);
      st.bytes_sent += kv.send(buf[cur], sh.kv_elems(Ls) * sh.es, next, kTagKV, comm);
    }
    const double c0 = now();
    const TensorView kb = sh.k_of(buf[cur], Ls, sh.dtype), vb = sh.v_of(buf[cur], Ls, sh.dtype);
    bool any = false;
    for (const Segment& qs : w.segments(r)) {
      for (const Segment& ks : w.segments(src)) {
        if (!plan.may_attend(qs, ks)) continue;
        any = true;
        where.q_pos0 = qs.position, where.k_pos0 = ks.position;
        const TensorView pv(part, DType::f32, {sh.B, qs.length, sh.Hq, sh.dv});
        const TensorView plv(part_lse, DType::f32, {sh.B, sh.Hq, qs.length});
        ::attn::detail::attention_placed(narrow(q, 1, qs.local_row, qs.length), narrow(kb, 1, ks.local_row, ks.length),
                                         narrow(vb, 1, ks.local_row, ks.length), pv, plv, local, where);
        const TensorView av = narrow(acc_v, 1, qs.local_row, qs.length);
        const TensorView alv = narrow(acc_lse_v, 2, qs.local_row, qs.length);
        merge_attention_states(av, alv, pv, plv, av, alv);
        kv.progress();
      }
    }
    st.steps += any ? 1 : 0;
    st.compute_s += now() - c0;
    const double w0 = now();
    kv.wait();
    st.wait_s += now() - w0;
  }
  ::attn::detail::from_f32_contiguous(acc, out);
  if (!lse.empty()) detail::copy_view(acc_lse_v, lse);
  st.steps_skipped = R - 1 - plan.last_step;
  st.total_s = now() - start;
  if (stats != nullptr) *stats = st;
}

void ring_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const TensorView& dout,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                             const AttentionOptions& options, Layout layout, Stats* stats) {
  const char* fn = "ring_attention_backward";
  AttentionOptions local = options;
  local.key_lengths = {};
  const World w = detail::agree(fn, comm, q, k, v, options, layout, [&] {
    ::attn::detail::make_backward_problem(fn, q, k, v, out, lse, dout, dq, dk, dv, local, {}, nullptr, false, false,
                                          ::attn::detail::wide_out(q, out));
  });
  const double start = now();
  Stats st;
  const Shapes sh(q, k, v);
  const int R = w.ranks, r = w.rank, next = (r + 1) % R, prev = (r + R - 1) % R;
  const int64_t Lr = q.size(1);
  const detail::RingSchedule plan(w, options);

  // Buffers from scratch.hpp (reused across calls, so no page is touched first here).
  const size_t n_dq = static_cast<size_t>(sh.B * Lr * sh.Hq * sh.d);
  float* dq_acc = detail::scratch<float>(2, n_dq);
  std::fill(dq_acc, dq_acc + n_dq, 0.0f);
  const TensorView dq_acc_v(dq_acc, DType::f32, {sh.B, Lr, sh.Hq, sh.d});
  const int64_t max_L = *std::max_element(w.local_lengths.begin(), w.local_lengths.end());
  char* buf[2] = {detail::scratch<char>(0, static_cast<size_t>(sh.kv_elems(max_L) * sh.es)),
                  detail::scratch<char>(1, static_cast<size_t>(sh.kv_elems(max_L) * sh.es))};
  detail::copy_view(k, sh.k_of(buf[0], Lr, sh.dtype));
  detail::copy_view(v, sh.v_of(buf[0], Lr, sh.dtype));
  // f32 gradient accumulators of the travelling blocks ([dk | dv] as the blocks),
  // this step's contribution, and per-pair results.
  const size_t n_grad = static_cast<size_t>(sh.kv_elems(max_L));
  float* grad[2] = {detail::scratch<float>(3, n_grad), detail::scratch<float>(4, n_grad)};
  float* contrib = detail::scratch<float>(5, n_grad);
  float* dq_part = detail::scratch<float>(6, n_dq);
  float* dk_part = detail::scratch<float>(7, static_cast<size_t>(sh.k_elems(max_L)));
  float* dv_part = detail::scratch<float>(8, static_cast<size_t>(sh.B * max_L * sh.Hkv * sh.dv));
  detail::Transfers grad_sent[2];

  ::attn::detail::Placement where;
  where.Lq_total = where.Lk_total = w.length;
  where.key_lengths = w.key_lengths;
  for (int t = 0; t <= plan.last_step; ++t) {
    const int src = (r - t + R) % R, cur = t % 2;
    const int64_t Ls = w.local_lengths[static_cast<size_t>(src)];
    detail::Transfers kv, grad_in;
    if (t < plan.last_step) {
      const int incoming = (src + R - 1) % R;
      kv.recv(buf[1 - cur], sh.kv_elems(w.local_lengths[static_cast<size_t>(incoming)]) * sh.es, prev,
              kTagKV, comm);
      st.bytes_sent += kv.send(buf[cur], sh.kv_elems(Ls) * sh.es, next, kTagKV, comm);
    }
    if (t > 0) {  // block src's accumulator, from the rank that held the block last step
      grad_sent[cur].wait();  // the send of two steps ago used this buffer
      grad_in.recv(grad[cur], sh.kv_elems(Ls) * 4, prev, kTagGrad, comm);
    }
    const double c0 = now();
    std::fill(contrib, contrib + sh.kv_elems(Ls), 0.0f);
    const TensorView kb = sh.k_of(buf[cur], Ls, sh.dtype), vb = sh.v_of(buf[cur], Ls, sh.dtype);
    const TensorView ck = sh.k_of(contrib, Ls, DType::f32), cv = sh.v_of(contrib, Ls, DType::f32);
    bool any = false;
    for (const Segment& qs : w.segments(r)) {
      for (const Segment& ks : w.segments(src)) {
        if (!plan.may_attend(qs, ks)) continue;
        any = true;
        where.q_pos0 = qs.position, where.k_pos0 = ks.position;
        const int64_t n = qs.length, m = ks.length;
        ::attn::detail::attention_backward_placed(
            narrow(q, 1, qs.local_row, n), narrow(kb, 1, ks.local_row, m), narrow(vb, 1, ks.local_row, m),
            narrow(out, 1, qs.local_row, n), narrow(lse, 2, qs.local_row, n), narrow(dout, 1, qs.local_row, n),
            TensorView(dq_part, DType::f32, {sh.B, n, sh.Hq, sh.d}),
            TensorView(dk_part, DType::f32, {sh.B, m, sh.Hkv, sh.d}),
            TensorView(dv_part, DType::f32, {sh.B, m, sh.Hkv, sh.dv}), local, where);
        add_rows(dq_acc_v, qs.local_row, n, dq_part);
        add_rows(ck, ks.local_row, m, dk_part);
        add_rows(cv, ks.local_row, m, dv_part);
        kv.progress();
        grad_in.progress();
      }
    }
    st.steps += any ? 1 : 0;
    st.compute_s += now() - c0;
    const double w0 = now();
    if (t > 0) {
      grad_in.wait();
      add_into(grad[cur], contrib, sh.kv_elems(Ls));
    } else {
      std::copy(contrib, contrib + sh.kv_elems(Ls), grad[cur]);
    }
    if (t < plan.last_step) st.bytes_sent += grad_sent[cur].send(grad[cur], sh.kv_elems(Ls) * 4, next, kTagGrad, comm);
    kv.wait();
    st.wait_s += now() - w0;
  }
  // The last accumulator held here is block (r − last)'s: send it home, and receive
  // this rank's own from the rank that held it last.
  const double w0 = now();
  const int last = plan.last_step, held = (r - last + R) % R, mine_at = (r + last) % R;
  const float* own = grad[last % 2];
  if (last > 0) {
    float* home = detail::scratch<float>(9, static_cast<size_t>(sh.kv_elems(Lr)));
    detail::Transfers back;
    back.recv(home, sh.kv_elems(Lr) * 4, mine_at, kTagHome, comm);
    st.bytes_sent += back.send(grad[last % 2],
                               sh.kv_elems(w.local_lengths[static_cast<size_t>(held)]) * 4, held, kTagHome, comm);
    back.wait();
    own = home;
  }
  for (auto& g : grad_sent) g.wait();
  st.wait_s += now() - w0;
  ::attn::detail::from_f32_contiguous(dq_acc, dq);
  float* base = const_cast<float*>(own);
  ::attn::detail::from_f32_contiguous(sh.k_of(base, Lr, DType::f32).data_as<float>(), dk);
  ::attn::detail::from_f32_contiguous(sh.v_of(base, Lr, DType::f32).data_as<float>(), dv);
  st.steps_skipped = R - 1 - plan.last_step;
  st.total_s = now() - start;
  if (stats != nullptr) *stats = st;
}

}  // namespace attn::dist
