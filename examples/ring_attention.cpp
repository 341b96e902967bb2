// Causal self-attention over a sequence split across MPI processes: ring attention
// (key/value blocks circulate) and Ulysses (heads are redistributed), forward and
// backward, checked against one process computing the whole sequence.
//
//   mpirun -np 2 build/release/examples/ring_attention [L]
//   mpirun -np 4 --oversubscribe build/release/examples/ring_attention 1001
//
// Each rank holds a zigzag slice of the sequence (chunks r and 2R − 1 − r of 2R, so
// causal work is balanced). Here every rank draws the whole sequence from one seed and
// keeps its slice; a real program would load only its own.
#include <attn/attention.hpp>
#include <attn/dist.hpp>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

using attn::DType;
using attn::TensorView;

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::fmax(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int64_t L = argc > 1 ? std::atoll(argv[1]) : 777;
  if (L < 1) {
    if (rank == 0) std::fprintf(stderr, "usage: ring_attention [L >= 1]\n");
    MPI_Finalize();
    return 2;
  }
  const int64_t B = 1, H = 8, Hkv = 4, d = 64;  // GQA: two query heads per kv head
  const auto layout = attn::dist::Layout::zigzag;

  // The whole sequence (same seed on every rank), then this rank's slice of it.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> q(B * L * H * d), k(B * L * Hkv * d), v(k.size()), dout(q.size());
  for (auto* t : {&q, &k, &v, &dout})
    for (float& x : *t) x = normal(rng);
  const TensorView Q(q.data(), DType::f32, {B, L, H, d}), K(k.data(), DType::f32, {B, L, Hkv, d}),
      V(v.data(), DType::f32, {B, L, Hkv, d}), dO(dout.data(), DType::f32, {B, L, H, d});
  const int64_t Lr = attn::dist::shard_length(L, rank, ranks, layout);
  std::vector<float> ql(B * Lr * H * d), kl(B * Lr * Hkv * d), vl(kl.size()), dol(ql.size());
  const TensorView q_r(ql.data(), DType::f32, {B, Lr, H, d}), k_r(kl.data(), DType::f32, {B, Lr, Hkv, d}),
      v_r(vl.data(), DType::f32, {B, Lr, Hkv, d}), do_r(dol.data(), DType::f32, {B, Lr, H, d});
  attn::dist::shard(Q, q_r, rank, ranks, layout);
  attn::dist::shard(K, k_r, rank, ranks, layout);
  attn::dist::shard(V, v_r, rank, ranks, layout);
  attn::dist::shard(dO, do_r, rank, ranks, layout);

  attn::AttentionOptions opt;
  opt.causal = attn::Causal::TopLeft;

  // One process, whole sequence: what the distributed calls must reproduce.
  std::vector<float> out1(q.size()), lse1(B * H * L), dq1(q.size()), dk1(k.size()), dv1(v.size());
  const TensorView lse1v(lse1.data(), DType::f32, {B, H, L});
  attn::attention(Q, K, V, TensorView(out1.data(), DType::f32, {B, L, H, d}), opt, lse1v);
  attn::attention_backward(Q, K, V, TensorView(out1.data(), DType::f32, {B, L, H, d}), lse1v, dO,
                           TensorView(dq1.data(), DType::f32, {B, L, H, d}),
                           TensorView(dk1.data(), DType::f32, {B, L, Hkv, d}),
                           TensorView(dv1.data(), DType::f32, {B, L, Hkv, d}), opt);

  int failures = 0;
  for (const char* strategy : {"ring", "ulysses"}) {
    const bool ring = strategy[0] == 'r';
    if (!ring && H % ranks != 0) continue;  // Ulysses splits the heads over the ranks
    std::vector<float> o(B * Lr * H * d), lse(B * H * Lr), dq(ql.size()), dk(kl.size()), dv(vl.size());
    const TensorView o_r(o.data(), DType::f32, {B, Lr, H, d}), lse_r(lse.data(), DType::f32, {B, H, Lr});
    const TensorView dq_r(dq.data(), DType::f32, {B, Lr, H, d}), dk_r(dk.data(), DType::f32, {B, Lr, Hkv, d}),
        dv_r(dv.data(), DType::f32, {B, Lr, Hkv, d});
    attn::dist::Stats st;
    if (ring) {
      attn::dist::ring_attention(MPI_COMM_WORLD, q_r, k_r, v_r, o_r, opt, lse_r, layout, &st);
      attn::dist::ring_attention_backward(MPI_COMM_WORLD, q_r, k_r, v_r, o_r, lse_r, do_r, dq_r, dk_r, dv_r, opt,
                                          layout);
    } else {
      attn::dist::ulysses_attention(MPI_COMM_WORLD, q_r, k_r, v_r, o_r, opt, lse_r, layout, &st);
      attn::dist::ulysses_attention_backward(MPI_COMM_WORLD, q_r, k_r, v_r, o_r, lse_r, do_r, dq_r, dk_r, dv_r, opt,
                                             layout);
    }
    // Gather every rank's slice back into whole-sequence arrays and compare.
    std::vector<float> out(q.size()), dqa(q.size()), dka(k.size()), dva(v.size());
    attn::dist::allgather_sequence(MPI_COMM_WORLD, o_r, TensorView(out.data(), DType::f32, {B, L, H, d}), layout);
    attn::dist::allgather_sequence(MPI_COMM_WORLD, dq_r, TensorView(dqa.data(), DType::f32, {B, L, H, d}), layout);
    attn::dist::allgather_sequence(MPI_COMM_WORLD, dk_r, TensorView(dka.data(), DType::f32, {B, L, Hkv, d}), layout);
    attn::dist::allgather_sequence(MPI_COMM_WORLD, dv_r, TensorView(dva.data(), DType::f32, {B, L, Hkv, d}), layout);
    const double e_out = max_abs_diff(out, out1), e_dq = max_abs_diff(dqa, dq1), e_dk = max_abs_diff(dka, dk1),
                 e_dv = max_abs_diff(dva, dv1);
    const bool ok = e_out < 1e-4 && e_dq < 1e-3 && e_dk < 1e-3 && e_dv < 1e-3;
    failures += !ok;
    if (rank == 0) {
      std::printf("%-7s over %d ranks, L=%lld causal: max |difference| from one process: out %.1e, dq %.1e, "
                  "dk %.1e, dv %.1e (%s); rank 0 computed %d block(s), waited %.1f ms\n",
                  strategy, ranks, static_cast<long long>(L), e_out, e_dq, e_dk, e_dv, ok ? "ok" : "TOO LARGE",
                  st.steps, st.wait_s * 1e3);
    }
  }

  // Arguments that disagree between ranks are an error on every rank, not a hang.
  attn::AttentionOptions mismatched = opt;
  mismatched.softcap = rank == 0 ? 0.0f : 30.0f;
  try {
    std::vector<float> o(B * Lr * H * d);
    attn::dist::ring_attention(MPI_COMM_WORLD, q_r, k_r, v_r, TensorView(o.data(), DType::f32, {B, Lr, H, d}),
                               mismatched, {}, layout);
    if (ranks > 1) ++failures;
  } catch (const attn::Error& e) {
    if (rank == 0) std::printf("as expected: %s\n", e.what());
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
