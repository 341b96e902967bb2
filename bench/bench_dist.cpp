// bench_dist: ring and head-parallel (Ulysses) attention over MPI, timed against
// single-process attention() on the same machine. Run it under mpirun, e.g.
//
//   mpirun -np 2 build/release/bench/bench_dist --length 16384
//
// For each strategy (and the forward, then the backward) it prints, as medians over
// --reps calls: the time per call (the slowest rank's), GFLOP/s, the time the ranks
// spent in their kernels and blocked in MPI waiting for data, the communication
// alone (the same transfers with no compute, measured separately) and the fraction of
// it hidden behind compute: 1 − waited / alone. Then the single-process time on rank
// 0 with as many threads as there are ranks × --threads (the other ranks sleep, so
// they leave the cores to it), and the ratio. Inputs are uniform random numbers.
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/dist.hpp"
#include "tensor/convert.hpp"
#include "timing.hpp"

namespace {

using attn::bench::median;

using attn::DType;
using attn::TensorView;
using attn::dist::Layout;

struct Config {
  int64_t length = 16384, batch = 1;
  int heads = 8, kv_heads = 8, dim = 64, threads = 1, reps = 3;
  bool causal = false, backward = true;
  std::string dtype = "f32", layout = "zigzag", strategies = "ring,ulysses";
};

// Waits at a barrier without spinning, so that a rank that waits leaves its core to
// the one that works (MPI_Barrier polls).
void sleeping_barrier(MPI_Comm comm) {
  MPI_Request req;
  MPI_Ibarrier(comm, &req);
  int done = 0;
  while (!done) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) usleep(2000);
  }
}

struct Buffer {
  std::vector<char> bytes;
  TensorView view;
  Buffer(DType t, std::vector<int64_t> shape, std::mt19937_64& rng) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    std::vector<float> f(static_cast<size_t>(n));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : f) x = u(rng);
    bytes.resize(static_cast<size_t>(n) * attn::dtype_size(t));
    view = TensorView(bytes.data(), t, shape);
    attn::detail::from_f32_contiguous(f.data(), view);
  }
};

// Forward FLOPs of the whole sequence (4·Lq·Lk·d per head, visible pairs only).
double forward_flops(const Config& c) {
  const double L = static_cast<double>(c.length);
  const double pairs = c.causal ? L * (L + 1) / 2 : L * L;
  return 4.0 * pairs * c.dim * c.heads * c.batch;
}

struct Timing {
  double total = 0, compute = 0, wait = 0, alone = 0;
};

// The ring's transfers with no compute: (R − 1) hops of this rank's block (k and v),
// and as many of the f32 gradient blocks in the backward.
double ring_transfers_alone(MPI_Comm comm, const Config& c, int64_t Lr, bool backward) {
  int rank, R;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &R);
  const size_t es = attn::dtype_size(c.dtype == "bf16" ? DType::bf16 : DType::f32);
  const size_t kv = static_cast<size_t>(c.batch * Lr * c.kv_heads * 2 * c.dim) * es;
  const size_t grad = backward ? static_cast<size_t>(c.batch * Lr * c.kv_heads * 2 * c.dim) * 4 : 0;
  std::vector<char> a(kv + grad), b(kv + grad);
  MPI_Barrier(comm);
  const double t0 = MPI_Wtime();
  for (int step = 0; step + 1 < R; ++step) {
    MPI_Sendrecv(a.data(), static_cast<int>(a.size()), MPI_BYTE, (rank + 1) % R, 7, b.data(),
                 static_cast<int>(b.size()), MPI_BYTE, (rank + R - 1) % R, 7, comm, MPI_STATUS_IGNORE);
  }
  return MPI_Wtime() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, R = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  Config c;
  CLI::App app{"Ring and Ulysses attention over MPI against single-process attention (run under mpirun)"};
  app.add_option("--length", c.length, "positions in the whole sequence")->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  app.add_option("--batch", c.batch, "sequences")->check(CLI::Range(1, 1024));
  app.add_option("--heads", c.heads, "query heads")->check(CLI::Range(1, 1024));
  app.add_option("--kv-heads", c.kv_heads, "kv heads (divides --heads)")->check(CLI::Range(1, 1024));
  app.add_option("--dim", c.dim, "head dimension (d = dv)")->check(CLI::Range(1, 1024));
  app.add_option("--threads", c.threads, "kernel threads per rank")->check(CLI::Range(1, 256));
  app.add_option("--reps", c.reps, "timed calls per figure (the median is reported)")->check(CLI::Range(1, 1000));
  app.add_flag("--causal", c.causal, "causal attention");
  app.add_option("--dtype", c.dtype, "f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--layout", c.layout, "zigzag or contiguous")->check(CLI::IsMember({"zigzag", "contiguous"}));
  app.add_option("--strategies", c.strategies, "comma-separated: ring, ulysses");
  bool forward_only = false;
  app.add_flag("--forward-only", forward_only, "skip the backward");
  try {
    app.parse(argc, argv);
    if (c.heads % c.kv_heads != 0) throw CLI::ValidationError("--kv-heads", "must divide --heads");
  } catch (const CLI::ParseError& e) {
    const int code = rank == 0 ? app.exit(e) : (e.get_exit_code() == 0 ? 0 : 2);
    MPI_Finalize();
    return code;
  }
  c.backward = !forward_only;
  attn::set_num_threads(c.threads);
  const DType dt = c.dtype == "bf16" ? DType::bf16 : DType::f32;
  const Layout layout = c.layout == "zigzag" ? Layout::zigzag : Layout::contiguous;
  const int64_t Lr = attn::dist::shard_length(c.length, rank, R, layout);
  std::mt19937_64 rng(1234 + rank);
  Buffer q(dt, {c.batch, Lr, c.heads, c.dim}, rng), k(dt, {c.batch, Lr, c.kv_heads, c.dim}, rng),
      v(dt, {c.batch, Lr, c.kv_heads, c.dim}, rng), out(dt, {c.batch, Lr, c.heads, c.dim}, rng),
      dout(dt, {c.batch, Lr, c.heads, c.dim}, rng), dq(dt, {c.batch, Lr, c.heads, c.dim}, rng),
      dk(dt, {c.batch, Lr, c.kv_heads, c.dim}, rng), dv(dt, {c.batch, Lr, c.kv_heads, c.dim}, rng);
  std::vector<float> lse(static_cast<size_t>(c.batch * c.heads * Lr));
  const TensorView lv(lse.data(), DType::f32, {c.batch, c.heads, Lr});
  attn::AttentionOptions o;
  if (c.causal) o.causal = attn::Causal::TopLeft;
  const double flops = forward_flops(c);
  if (rank == 0) {
    std::printf("bench_dist: %d ranks x %d thread(s); B=%lld L=%lld Hq=%d Hkv=%d d=%d %s %s, %s layout; "
                "medians of %d calls\n\n",
                R, c.threads, static_cast<long long>(c.batch), static_cast<long long>(c.length), c.heads, c.kv_heads,
                c.dim, c.dtype.c_str(), c.causal ? "causal" : "non-causal", c.layout.c_str(), c.reps);
    std::printf("| strategy | pass | ms / call | ms / step | GFLOP/s | compute ms | waited ms | transfers alone ms | hidden |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
  }
  // Ring: R steps (or fewer with windows); Ulysses: one step between its all-to-alls.
  auto report = [&](const char* strategy, const char* pass, const std::vector<Timing>& runs, double work, int steps) {
    std::vector<double> total, compute, wait, alone;
    for (const Timing& t : runs) {
      total.push_back(t.total), compute.push_back(t.compute), wait.push_back(t.wait), alone.push_back(t.alone);
    }
    const double tm = median(total), wm = median(wait), am = median(alone);
    const double hidden = am > 0 ? std::clamp(1.0 - wm / am, 0.0, 1.0) : 1.0;
    if (rank == 0) {
      std::printf("| %s | %s | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.0f%% |\n", strategy, pass, tm * 1e3,
                  tm * 1e3 / steps, work / tm * 1e-9, median(compute) * 1e3, wm * 1e3, am * 1e3, hidden * 100);
    }
    return tm;
  };
  std::vector<std::string> names;
  for (size_t at = 0; at <= c.strategies.size();) {
    const size_t comma = std::min(c.strategies.find(',', at), c.strategies.size());
    names.push_back(c.strategies.substr(at, comma - at));
    at = comma + 1;
  }
  double ring_forward_ms = 0;
  for (const std::string& s : names) {
    const bool ring = s == "ring";
    if (!ring && s != "ulysses") {
      if (rank == 0) std::fprintf(stderr, "bench_dist: unknown strategy '%s' (ring, ulysses)\n", s.c_str());
      MPI_Finalize();
      return 2;
    }
    if (!ring && c.heads % R != 0) continue;
    for (int pass = 0; pass < (c.backward ? 2 : 1); ++pass) {
      std::vector<Timing> runs;
      int steps = 1;
      for (int rep = 0; rep <= c.reps; ++rep) {  // rep 0 warms up
        attn::dist::Stats st;
        MPI_Barrier(MPI_COMM_WORLD);
        const double t0 = MPI_Wtime();
        if (pass == 0) {
          (ring ? attn::dist::ring_attention : attn::dist::ulysses_attention)(MPI_COMM_WORLD, q.view, k.view, v.view,
                                                                                out.view, o, lv, layout, &st);
        } else {
          (ring ? attn::dist::ring_attention_backward : attn::dist::ulysses_attention_backward)(
              MPI_COMM_WORLD, q.view, k.view, v.view, out.view, lv, dout.view, dq.view, dk.view, dv.view, o, layout,
              &st);
        }
        Timing t;
        t.total = MPI_Wtime() - t0;
        steps = ring ? R - st.steps_skipped : 1;
        t.compute = st.compute_s, t.wait = st.wait_s;
        // The slowest rank sets the time; waits and compute are the slowest rank's too.
        MPI_Allreduce(MPI_IN_PLACE, &t.total, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, &t.compute, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, &t.wait, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (ring) {
          t.alone = ring_transfers_alone(MPI_COMM_WORLD, c, Lr, pass == 1);
          MPI_Allreduce(MPI_IN_PLACE, &t.alone, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        } else {
          t.alone = t.wait;  // Ulysses' all-to-alls are not overlapped: all of it is waited
        }
        if (rep > 0) runs.push_back(t);
      }
      const double ms = report(ring ? "ring" : "ulysses", pass == 0 ? "forward" : "backward", runs,
                               pass == 0 ? flops : 2.5 * flops, steps) * 1e3;
      if (ring && pass == 0) ring_forward_ms = ms;
    }
  }

  // Single process on rank 0 with all the ranks' threads; the others sleep.
  std::vector<double> single;
  if (rank == 0) {
    // mpirun binds each rank to a core (Open MPI's default for few ranks); the
    // single-process run needs all the ranks' cores, so rank 0 widens its mask to
    // every online CPU before its extra threads start (they inherit it).
    cpu_set_t before;
    CPU_ZERO(&before);
    sched_getaffinity(0, sizeof(before), &before);
    cpu_set_t all;
    CPU_ZERO(&all);
    for (long cpu = 0; cpu < sysconf(_SC_NPROCESSORS_ONLN) && cpu < CPU_SETSIZE; ++cpu) CPU_SET(cpu, &all);
    if (CPU_COUNT(&before) < R * c.threads) {
      std::printf("\n(rank 0 was bound to %d CPU(s); widened to %d for the single-process run)\n",
                  CPU_COUNT(&before), CPU_COUNT(&all));
      sched_setaffinity(0, sizeof(all), &all);
    }
    attn::set_num_threads(R * c.threads);
    std::mt19937_64 r0(99);
    Buffer Q(dt, {c.batch, c.length, c.heads, c.dim}, r0), K(dt, {c.batch, c.length, c.kv_heads, c.dim}, r0),
        V(dt, {c.batch, c.length, c.kv_heads, c.dim}, r0), O(dt, {c.batch, c.length, c.heads, c.dim}, r0);
    for (int rep = 0; rep <= c.reps; ++rep) {
      const double t0 = MPI_Wtime();
      attn::attention(Q.view, K.view, V.view, O.view, o);
      if (rep > 0) single.push_back(MPI_Wtime() - t0);
    }
  }
  sleeping_barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    const double sm = median(single) * 1e3;
    std::printf("\nsingle process, %d threads, forward: %.1f ms (%.1f GFLOP/s)\n", R * c.threads, sm,
                flops / sm * 1e-6);
    if (ring_forward_ms > 0) {
      std::printf("ring forward / single process: %.3f\n", ring_forward_ms / sm);
    }
  }
  MPI_Finalize();
  return 0;
}
