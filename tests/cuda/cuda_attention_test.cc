// attention() and attention_backward() on a CUDA device (issue 13), against the float64
// reference on the host:
// every option the GPU path has, bf16 and f16, head dims 64/96/128/256 and odd lengths,
// under FlashAttention's rule (error ≤ 2× that of a plain implementation with the same
// rounding: bf16/f16 inputs, exact softmax, P rounded before P·V, f32 accumulation),
// pooled per option with a 10× screen per case. Also probs, varlen and key lengths,
// fully masked rows, non-finite values of removed keys, dropout drawing the CPU's decisions,
// user streams, and the GPU path's argument errors. The backward: the same options and
// shapes under the backward's form of the rule, bitwise reproducibility, varlen and key
// lengths (every gradient element written), non-finite numbers where they take no part,
// rows with huge |lse|, block-sparse masks, the mask's gradient, and Precision::bf16.
//
// Every test skips, saying why, where no usable GPU is present (cuda_status()).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "lowp_harness.hpp"

namespace attn::testing {
namespace {

#define SKIP_WITHOUT_GPU()                                                        \
  if (const std::string why = cuda_status(0).unusable; !why.empty()) {           \
    GTEST_SKIP() << "no usable GPU: " << why;                                     \
  }

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

const Device kGpu = Device::cuda(0);

// A device copy of a host array, freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
  }
  template <class T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    if (bytes_ > 0) EXPECT_EQ(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  template <class T>
  void to_host(std::vector<T>& host) const {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(host.data(), ptr_, host.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The same view over a device copy of its memory (from its first element to its last).
TensorView on_gpu(const TensorView& t, std::vector<std::unique_ptr<DeviceBuffer>>& keep) {
  if (t.empty()) return t;
  int64_t span = 1;
  for (int i = 0; i < t.rank(); ++i) span += (t.size(i) - 1) * t.stride(i);
  std::vector<uint8_t> bytes(static_cast<size_t>(span) * dtype_size(t.dtype()));
  std::memcpy(bytes.data(), t.data(), bytes.size());
  keep.push_back(std::make_unique<DeviceBuffer>(bytes));
  return TensorView(keep.back()->get(), t.dtype(), t.shape(), t.strides()).on(kGpu);
}

// Option cases the GPU path has: the CPU suites' (lowp_harness.hpp) less the mask in the
// input dtype, which the GPU path rejects.
std::vector<OptionCase> gpu_option_cases() {
  std::vector<OptionCase> cases;
  for (OptionCase& oc : option_cases()) {
    if (std::string(oc.name) != "mask in the input dtype") cases.push_back(std::move(oc));
  }
  return cases;
}

// Head dims 64, 96, 128, 256 with odd lengths (1, 3, 17, 1000), GQA and MQA.
const Shape kGpuShapes[] = {{1, 1, 1, 1, 1, 64, 64},      {2, 3, 17, 4, 2, 64, 64},     {1, 17, 3, 2, 1, 96, 96},
                            {1, 100, 100, 2, 2, 128, 128}, {2, 33, 65, 3, 1, 128, 128}, {1, 70, 1000, 2, 1, 64, 64},
                            {1, 129, 300, 1, 1, 256, 256}, {1, 1000, 37, 2, 2, 96, 96}};

// x [B, L, H, D] copied with one element more per row, so that no row but the first
// starts on a 16-byte boundary (the kernels' copies without cp.async); `store` holds it.
TensorView unaligned_rows(const LowpCall& c, const std::vector<uint16_t>& x, int L, int H, int D,
                          std::vector<uint16_t>& store) {
  const int64_t row = int64_t{H} * D + 1;
  store.assign(size_t(c.B) * L * row, 0);
  for (int64_t r = 0; r < int64_t{c.B} * L; ++r) {
    std::copy_n(x.begin() + r * H * D, H * D, store.begin() + r * row);
  }
  return TensorView(store.data(), c.dt, {c.B, L, H, D}, {L * row, row, D, 1});
}

// One call on the GPU and its yardsticks: the reference (float64 on the rounded inputs)
// and the plain implementation built from the reference's probabilities. With
// `unaligned`, q, k and v rows are not 16-byte aligned.
CaseErrors run_gpu_case(DType dt, const Shape& s, const OptionCase& oc, std::mt19937_64& rng, bool unaligned = false) {
  LowpCall c(dt, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
  OptionStore store;
  AttentionOptions o = oc.make(store, c, rng);
  const AttentionOptions host_options = o;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  o.mask = on_gpu(o.mask, keep);
  o.alibi_slopes = on_gpu(o.alibi_slopes, keep);
  std::vector<uint16_t> qs, ks, vs;
  auto host = [&](const std::vector<uint16_t>& x, int L, int H, int D, std::vector<uint16_t>& st) {
    return unaligned ? unaligned_rows(c, x, L, H, D, st) : c.view(x, L, H, D);
  };
  const TensorView q = on_gpu(host(c.q, s.Lq, s.Hq, s.d, qs), keep), k = on_gpu(host(c.k, s.Lk, s.Hkv, s.d, ks), keep),
                   v = on_gpu(host(c.v, s.Lk, s.Hkv, s.dv, vs), keep);
  DeviceBuffer out(c.out.size() * 2), lse(c.lse.size() * 4);
  attention(q, k, v, TensorView(out.get(), dt, {s.B, s.Lq, s.Hq, s.dv}).on(kGpu), o,
            TensorView(lse.get(), DType::f32, {s.B, s.Hq, s.Lq}).on(kGpu));
  out.to_host(c.out);
  lse.to_host(c.lse);

  return compare_forward_with_reference(c, host_options, store);
}

// The dtypes of the GPU suites, and their names in test names.
const auto kGpuDtypes = ::testing::Values(DType::bf16, DType::f16);
std::string DtypeName(const ::testing::TestParamInfo<DType>& i) { return dtype_name(i.param); }

class CudaForward : public ::testing::TestWithParam<DType> {};
INSTANTIATE_TEST_SUITE_P(Dtypes, CudaForward, kGpuDtypes, DtypeName);

TEST_P(CudaForward, EveryOptionWithinTwiceThePlainError) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1301);
  for (const OptionCase& oc : gpu_option_cases()) {
    ExpectWithinPlainBf16Error(kGpuShapes, oc, [&](const Shape& s) { return run_gpu_case(GetParam(), s, oc, rng); });
  }
}

// On Hopper, the calls above without element-wise modifiers or dropout ran on the wgmma
// kernel (flash_forward_wgmma.cu); the same calls on the mma.sync kernel, which every
// other GPU runs.
TEST_P(CudaForward, TheMmaSyncKernelWhereTheWgmmaKernelWouldRun) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv mma_sync("ATTN_CUDA_WGMMA", "0");
  std::mt19937_64 rng = make_rng(1310);
  for (const OptionCase& oc : gpu_option_cases()) {
    const std::string name = oc.name;
    if (name != "plain" && name != "causal" && name != "bottom-right window") continue;
    ExpectWithinPlainBf16Error(kGpuShapes, oc, [&](const Shape& s) { return run_gpu_case(GetParam(), s, oc, rng); });
  }
}

// The warp-specialised kernel (flash_forward_ws.cu, ATTN_CUDA_WGMMA=ws) on the calls the
// wgmma kernel takes on Hopper; elsewhere these are the other kernels' calls again.
TEST_P(CudaForward, TheWarpSpecialisedKernelWhereTheWgmmaKernelWouldRun) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv ws("ATTN_CUDA_WGMMA", "ws");
  std::mt19937_64 rng = make_rng(1312);
  for (const OptionCase& oc : gpu_option_cases()) {
    const std::string name = oc.name;
    if (name != "plain" && name != "causal" && name != "bottom-right window") continue;
    ExpectWithinPlainBf16Error(kGpuShapes, oc, [&](const Shape& s) { return run_gpu_case(GetParam(), s, oc, rng); });
    const Shape long_odd[] = {{1, 4097, 4097, 2, 1, 128, 128}, {3, 300, 1000, 4, 2, 64, 64}};
    ExpectWithinPlainBf16Error(long_odd, oc, [&](const Shape& s) { return run_gpu_case(GetParam(), s, oc, rng); });
  }
}

// Rows that are not 16-byte aligned: the tiles are copied without cp.async.
TEST_P(CudaForward, UnalignedRows) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1311);
  for (const OptionCase& oc : gpu_option_cases()) {
    const std::string name = oc.name;
    if (name != "plain" && name != "causal" && name != "boolean mask") continue;
    ExpectWithinPlainBf16Error(kGpuShapes, oc,
                               [&](const Shape& s) { return run_gpu_case(GetParam(), s, oc, rng, true); });
  }
}

TEST_P(CudaForward, LongOddSequences) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1302);
  const Shape shapes[] = {{1, 4097, 4097, 2, 1, 128, 128}};
  for (const OptionCase& oc : gpu_option_cases()) {
    if (std::string(oc.name) != "plain" && std::string(oc.name) != "causal") continue;
    ExpectWithinPlainBf16Error(shapes, oc, [&](const Shape& s) { return run_gpu_case(GetParam(), s, oc, rng); });
  }
}

// probs (the probabilities after dropout) against the reference's, every option case
// and odd shapes, fully masked rows included.
TEST_P(CudaForward, ProbsMatchTheReference) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1309);
  const Shape shapes[] = {{1, 1, 1, 1, 1, 64, 64}, {2, 17, 130, 4, 2, 64, 64}, {1, 70, 33, 2, 1, 128, 128}};
  for (const OptionCase& oc : gpu_option_cases()) {
    for (const Shape& s : shapes) {
      SCOPED_TRACE(std::string(oc.name) + " Lq=" + std::to_string(s.Lq) + " Lk=" + std::to_string(s.Lk));
      LowpCall c(GetParam(), s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
      OptionStore store;
      AttentionOptions o = oc.make(store, c, rng);
      const AttentionOptions host_options = o;
      std::vector<std::unique_ptr<DeviceBuffer>> keep;
      o.mask = on_gpu(o.mask, keep);
      o.alibi_slopes = on_gpu(o.alibi_slopes, keep);
      const size_t n = size_t(s.B) * s.Hq * s.Lq * s.Lk;
      DeviceBuffer out(c.out.size() * 2), probs(n * 4);
      attention(on_gpu(c.view(c.q, s.Lq, s.Hq, s.d), keep), on_gpu(c.view(c.k, s.Lk, s.Hkv, s.d), keep),
                on_gpu(c.view(c.v, s.Lk, s.Hkv, s.dv), keep), TensorView(out.get(), c.dt, {s.B, s.Lq, s.Hq, s.dv}).on(kGpu),
                o, {}, TensorView(probs.get(), DType::f32, {s.B, s.Hq, s.Lq, s.Lk}).on(kGpu));
      std::vector<float> gpu(n), ref(n), ref_out(c.out.size());
      probs.to_host(gpu);
      attention_reference(c.view32(c.q32, s.Lq, s.Hq, s.d), c.view32(c.k32, s.Lk, s.Hkv, s.d),
                          c.view32(c.v32, s.Lk, s.Hkv, s.dv), c.view32(ref_out, s.Lq, s.Hq, s.dv), host_options, {},
                          TensorView(ref.data(), DType::f32, {s.B, s.Hq, s.Lq, s.Lk}));
      for (size_t x = 0; x < n; ++x) ASSERT_NEAR(gpu[x], ref[x], 2e-3 * std::max(1.0f, std::fabs(ref[x]))) << x;
    }
  }
}

// Runs the same bf16 call on the GPU and on the CPU (the tested CPU kernels) and
// returns the largest difference of the outputs; lse must agree to f32 rounding.
double max_gpu_cpu_difference(LowpCall& c, const AttentionOptions& host_options, bool packed, int total_q, int total_k) {
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  auto shape = [&](int L, int H, int D) {
    return packed ? std::vector<int64_t>{L, H, D} : std::vector<int64_t>{c.B, L, H, D};
  };
  const int Lq = packed ? total_q : c.Lq, Lk = packed ? total_k : c.Lk;
  const TensorView q(c.q.data(), c.dt, shape(Lq, c.Hq, c.d)), k(c.k.data(), c.dt, shape(Lk, c.Hkv, c.d)),
      v(c.v.data(), c.dt, shape(Lk, c.Hkv, c.dv));
  const std::vector<int64_t> lse_shape =
      packed ? std::vector<int64_t>{c.Hq, total_q} : std::vector<int64_t>{c.B, c.Hq, c.Lq};
  std::vector<uint16_t> cpu_out(c.out.size()), gpu_out(c.out.size());
  std::vector<float> cpu_lse(c.lse.size()), gpu_lse(c.lse.size());
  attention(q, k, v, TensorView(cpu_out.data(), c.dt, shape(Lq, c.Hq, c.dv)), host_options,
            TensorView(cpu_lse.data(), DType::f32, lse_shape));
  AttentionOptions o = host_options;
  o.alibi_slopes = on_gpu(o.alibi_slopes, keep);
  o.cu_seqlens_q = on_gpu(o.cu_seqlens_q, keep);  // device metadata (host metadata: HostMetadata below)
  o.cu_seqlens_k = on_gpu(o.cu_seqlens_k, keep);
  o.key_lengths = on_gpu(o.key_lengths, keep);
  DeviceBuffer out(gpu_out.size() * 2), lse(gpu_lse.size() * 4);
  attention(on_gpu(q, keep), on_gpu(k, keep), on_gpu(v, keep), TensorView(out.get(), c.dt, shape(Lq, c.Hq, c.dv)).on(kGpu),
            o, TensorView(lse.get(), DType::f32, lse_shape).on(kGpu));
  out.to_host(gpu_out);
  lse.to_host(gpu_lse);
  double worst = 0;
  for (size_t i = 0; i < gpu_out.size(); ++i) {
    const double a = c.from(gpu_out[i]), b = c.from(cpu_out[i]);
    if (std::isnan(a) != std::isnan(b)) return INFINITY;
    if (!std::isnan(a)) worst = std::max(worst, std::fabs(a - b));
  }
  for (size_t i = 0; i < gpu_lse.size(); ++i) {
    if (std::isinf(cpu_lse[i])) {
      EXPECT_EQ(gpu_lse[i], cpu_lse[i]) << "lse " << i;
    } else {
      EXPECT_NEAR(gpu_lse[i], cpu_lse[i], 1e-4 * std::max(1.0f, std::fabs(cpu_lse[i]))) << "lse " << i;
    }
  }
  return worst;
}

TEST_P(CudaForward, VarlenAndKeyLengthsAgreeWithTheCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1303);
  // Packed: sequences of 1, 17, 0, 130 queries over 5, 200, 3, 130 keys.
  std::vector<int32_t> cu_q{0, 1, 18, 18, 148}, cu_k{0, 5, 205, 208, 338};
  LowpCall packed(GetParam(), 1, 148, 338, 4, 2, 64, 64, rng);
  for (Causal causal : {Causal::None, Causal::TopLeft, Causal::BottomRight}) {
    AttentionOptions o;
    o.cu_seqlens_q = TensorView(cu_q.data(), DType::i32, {5});
    o.cu_seqlens_k = TensorView(cu_k.data(), DType::i32, {5});
    o.causal = causal;
    EXPECT_LT(max_gpu_cpu_difference(packed, o, true, 148, 338), 0.03) << "varlen causal=" << int(causal);
  }
  // Padded batch with key lengths 0 (every row fully masked), 1 and 90.
  LowpCall padded(GetParam(), 3, 40, 90, 2, 1, 128, 128, rng);
  std::vector<int32_t> lengths{0, 1, 90};
  AttentionOptions o;
  o.key_lengths = TensorView(lengths.data(), DType::i32, {3});
  o.causal = Causal::BottomRight;
  o.window = {7, 0};
  EXPECT_LT(max_gpu_cpu_difference(padded, o, false, 0, 0), 0.03);
}

TEST_P(CudaForward, HostMetadataWorksToo) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1304);
  LowpCall c(GetParam(), 2, 33, 50, 2, 2, 64, 64, rng);
  std::vector<int32_t> lengths{7, 50};
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  AttentionOptions o;
  o.key_lengths = TensorView(lengths.data(), DType::i32, {2});  // host memory
  DeviceBuffer out(c.out.size() * 2);
  attention(on_gpu(c.view(c.q, 33, 2, 64), keep), on_gpu(c.view(c.k, 50, 2, 64), keep),
            on_gpu(c.view(c.v, 50, 2, 64), keep), TensorView(out.get(), c.dt, {2, 33, 2, 64}).on(kGpu), o);
  std::vector<uint16_t> gpu(c.out.size());
  out.to_host(gpu);
  attention(c.view(c.q, 33, 2, 64), c.view(c.k, 50, 2, 64), c.view(c.v, 50, 2, 64), c.view(c.out, 33, 2, 64), o);
  for (size_t i = 0; i < gpu.size(); ++i) EXPECT_NEAR(c.from(gpu[i]), c.from(c.out[i]), 0.03) << i;
}

TEST_P(CudaForward, DropoutDrawsTheCpusDecisions) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1305);
  LowpCall c(GetParam(), 2, 70, 133, 3, 1, 64, 64, rng);
  for (float p : {0.1f, 0.5f}) {
    AttentionOptions o;
    o.dropout_p = p;
    o.seed = 77;
    o.offset = 5;
    o.causal = Causal::BottomRight;
    // A different mask would move outputs by ~p·|v|; the rounding differences are ~1e-2.
    EXPECT_LT(max_gpu_cpu_difference(c, o, false, 0, 0), 0.03) << "p=" << p;
  }
}

TEST_P(CudaForward, ValuesOfRemovedKeysNeverReachAnOutput) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1306);
  LowpCall c(GetParam(), 1, 70, 90, 2, 1, 64, 64, rng);
  c.v[7 * 64 + 3] = c.to(INFINITY);  // key 7: rows 0..6 cannot see it under top-left causal
  c.v[80 * 64 + 5] = c.to(NAN);      // key 80: beyond every row's band
  AttentionOptions o;
  o.causal = Causal::TopLeft;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  DeviceBuffer out(c.out.size() * 2);
  attention(on_gpu(c.view(c.q, 70, 2, 64), keep), on_gpu(c.view(c.k, 90, 1, 64), keep),
            on_gpu(c.view(c.v, 90, 1, 64), keep), TensorView(out.get(), c.dt, {1, 70, 2, 64}).on(kGpu), o);
  out.to_host(c.out);
  for (int i = 0; i < 70; ++i)
    for (int h = 0; h < 2; ++h)
      for (int x = 0; x < 64; ++x) {
        const float y = c.from(c.out[(size_t(i) * 2 + h) * 64 + x]);
        if (i >= 7 && x == 3) {
          EXPECT_TRUE(std::isinf(y)) << "row " << i << " sees key 7's +inf";
        } else {
          EXPECT_TRUE(std::isfinite(y)) << "row " << i << " head " << h << " column " << x;
        }
      }
}

// The pre-pass flags V's non-finite tiles per (sequence, kv head): values of one
// sequence and head must neither leak into another's outputs nor be missed in their own.
TEST_P(CudaForward, NonFiniteValuesAreFlaggedPerSequenceAndHead) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1307);
  const int B = 3, Lq = 70, Lk = 90, Hq = 4, Hkv = 2, d = 64;
  LowpCall c(GetParam(), B, Lq, Lk, Hq, Hkv, d, d, rng);
  auto v_at = [&](int b, int j, int hk, int x) -> uint16_t& { return c.v[((size_t(b) * Lk + j) * Hkv + hk) * d + x]; };
  v_at(2, 7, 1, 3) = c.to(INFINITY);  // rows ≥ 7 of sequence 2, heads 2 and 3, see it
  v_at(2, 80, 1, 5) = c.to(NAN);      // beyond every row's band (top-left causal)
  v_at(0, 80, 0, 6) = c.to(-INFINITY);
  AttentionOptions o;
  o.causal = Causal::TopLeft;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  DeviceBuffer out(c.out.size() * 2);
  attention(on_gpu(c.view(c.q, Lq, Hq, d), keep), on_gpu(c.view(c.k, Lk, Hkv, d), keep),
            on_gpu(c.view(c.v, Lk, Hkv, d), keep), TensorView(out.get(), c.dt, {B, Lq, Hq, d}).on(kGpu), o);
  out.to_host(c.out);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < Lq; ++i)
      for (int h = 0; h < Hq; ++h)
        for (int x = 0; x < d; ++x) {
          const float y = c.from(c.out[((size_t(b) * Lq + i) * Hq + h) * d + x]);
          if (b == 2 && h / 2 == 1 && i >= 7 && x == 3) {
            EXPECT_TRUE(std::isinf(y)) << "sequence 2 head " << h << " row " << i << " sees key 7's +inf";
          } else {
            EXPECT_TRUE(std::isfinite(y)) << "sequence " << b << " row " << i << " head " << h << " column " << x;
          }
        }
}

// ---------------------------------------------------------------------------------
// The backward.

struct GpuGrads {
  std::vector<uint16_t> dq, dk, dv;
};

// Forward and backward of c on the GPU with `host_options` (their tensors copied to
// the device): c.out and c.lse receive the GPU forward's results; returns the gradients.
GpuGrads run_gpu_forward_backward(LowpCall& c, const AttentionOptions& host_options) {
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  AttentionOptions o = host_options;
  o.mask = on_gpu(o.mask, keep);
  o.alibi_slopes = on_gpu(o.alibi_slopes, keep);
  o.key_lengths = on_gpu(o.key_lengths, keep);
  o.block_mask.blocks = on_gpu(o.block_mask.blocks, keep);
  o.block_mask.tiles = on_gpu(o.block_mask.tiles, keep);
  const TensorView q = on_gpu(c.view(c.q, c.Lq, c.Hq, c.d), keep), k = on_gpu(c.view(c.k, c.Lk, c.Hkv, c.d), keep),
                   v = on_gpu(c.view(c.v, c.Lk, c.Hkv, c.dv), keep),
                   dout = on_gpu(c.view(c.dout, c.Lq, c.Hq, c.dv), keep);
  DeviceBuffer out(c.out.size() * 2), lse(c.lse.size() * 4), dq(c.q.size() * 2), dk(c.k.size() * 2),
      dv(c.v.size() * 2);
  const TensorView outv = TensorView(out.get(), c.dt, {c.B, c.Lq, c.Hq, c.dv}).on(kGpu),
                   lsev = TensorView(lse.get(), DType::f32, {c.B, c.Hq, c.Lq}).on(kGpu);
  attention(q, k, v, outv, o, lsev);
  attention_backward(q, k, v, outv, lsev, dout, TensorView(dq.get(), c.dt, {c.B, c.Lq, c.Hq, c.d}).on(kGpu),
                     TensorView(dk.get(), c.dt, {c.B, c.Lk, c.Hkv, c.d}).on(kGpu),
                     TensorView(dv.get(), c.dt, {c.B, c.Lk, c.Hkv, c.dv}).on(kGpu), o);
  GpuGrads g;
  g.dq.resize(c.q.size()), g.dk.resize(c.k.size()), g.dv.resize(c.v.size());
  out.to_host(c.out);
  lse.to_host(c.lse);
  dq.to_host(g.dq);
  dk.to_host(g.dk);
  dv.to_host(g.dv);
  return g;
}

// The CPU backward (the tested CPU kernels) on the same inputs and the same forward
// results (c.out, c.lse), in c's dtype.
GpuGrads run_cpu_backward(const LowpCall& c, const AttentionOptions& o) {
  GpuGrads g;
  g.dq.resize(c.q.size()), g.dk.resize(c.k.size()), g.dv.resize(c.v.size());
  attention_backward(c.view(c.q, c.Lq, c.Hq, c.d), c.view(c.k, c.Lk, c.Hkv, c.d), c.view(c.v, c.Lk, c.Hkv, c.dv),
                     c.view(c.out, c.Lq, c.Hq, c.dv), c.lse_view(), c.view(c.dout, c.Lq, c.Hq, c.dv),
                     c.view(g.dq, c.Lq, c.Hq, c.d), c.view(g.dk, c.Lk, c.Hkv, c.d), c.view(g.dv, c.Lk, c.Hkv, c.dv), o);
  return g;
}

// Largest |gpu − cpu| / max(1, |cpu|) over a gradient; ∞ where one is NaN and the
// other not, or where one is finite and the other not.
double relative_difference(const LowpCall& c, const std::vector<uint16_t>& gpu, const std::vector<uint16_t>& cpu) {
  double worst = 0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double a = c.from(gpu[i]), b = c.from(cpu[i]);
    if (std::isfinite(a) != std::isfinite(b)) return INFINITY;
    if (std::isfinite(a)) worst = std::max(worst, std::fabs(a - b) / std::max(1.0, std::fabs(b)));
  }
  return worst;
}

void expect_close_to_cpu(const LowpCall& c, const GpuGrads& gpu, const GpuGrads& cpu, const std::string& what) {
  EXPECT_LT(relative_difference(c, gpu.dq, cpu.dq), 0.05) << what << ": dq";
  EXPECT_LT(relative_difference(c, gpu.dk, cpu.dk), 0.05) << what << ": dk";
  EXPECT_LT(relative_difference(c, gpu.dv, cpu.dv), 0.05) << what << ": dv";
}

class CudaBackward : public ::testing::TestWithParam<DType> {};
INSTANTIATE_TEST_SUITE_P(Dtypes, CudaBackward, kGpuDtypes, DtypeName);

TEST_P(CudaBackward, EveryOptionWithinTwiceThePlainError) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1311);
  for (const OptionCase& oc : gpu_option_cases()) {
    ExpectWithinPlainBf16Error(kGpuShapes, oc, [&](const Shape& s) {
      LowpCall c(GetParam(), s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
      OptionStore store;
      const AttentionOptions o = oc.make(store, c, rng);
      const GpuGrads g = run_gpu_forward_backward(c, o);
      return compare_backward_with_reference(c, o, store, g.dq, g.dk, g.dv);
    });
  }
}

// The wgmma dQ and dK/dV kernels (flash_backward_wgmma.cu, ATTN_CUDA_WGMMA_BWD=1) on the
// calls they take on Hopper (bf16/f16, d = 64 or 128, the band alone); elsewhere these
// are the mma.sync kernels' calls again. Odd lengths and GQA cross their 64-row tiles.
TEST_P(CudaBackward, TheWgmmaKernelsWhereTheyApply) {
  SKIP_WITHOUT_GPU();
  const ScopedEnv wgmma_bwd("ATTN_CUDA_WGMMA_BWD", "1");
  std::mt19937_64 rng = make_rng(1313);
  const Shape shapes[] = {{2, 3, 17, 4, 2, 64, 64},       {1, 100, 100, 2, 2, 128, 128}, {2, 33, 65, 3, 1, 128, 128},
                          {1, 70, 1000, 2, 1, 64, 64},    {1, 300, 257, 4, 1, 128, 128}, {1, 1, 1, 1, 1, 64, 64}};
  for (const OptionCase& oc : gpu_option_cases()) {
    const std::string name = oc.name;
    if (name != "plain" && name != "causal" && name != "bottom-right window") continue;
    ExpectWithinPlainBf16Error(shapes, oc, [&](const Shape& s) {
      LowpCall c(GetParam(), s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
      OptionStore store;
      const AttentionOptions o = oc.make(store, c, rng);
      const GpuGrads g = run_gpu_forward_backward(c, o);
      return compare_backward_with_reference(c, o, store, g.dq, g.dk, g.dv);
    });
  }
}

TEST_P(CudaBackward, IsBitwiseReproducible) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1312);
  LowpCall c(GetParam(), 2, 300, 513, 8, 2, 128, 128, rng);
  AttentionOptions o;
  o.causal = Causal::BottomRight;
  o.dropout_p = 0.1f;
  o.seed = 9;
  const GpuGrads a = run_gpu_forward_backward(c, o), b = run_gpu_forward_backward(c, o);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
}

TEST_P(CudaBackward, VarlenAndKeyLengthsAgreeWithTheCpuAndZeroTheRest) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1313);
  // Packed: sequences of 1, 17, 0, 130 queries over 5, 200, 3, 130 keys; the last two
  // query tokens and three key tokens belong to no sequence.
  const int tq = 150, tk = 341, H = 4, Hkv = 2, d = 64;
  std::vector<int32_t> cu_q{0, 1, 18, 18, 148}, cu_k{0, 5, 205, 208, 338};
  LowpCall c(GetParam(), 1, tq, tk, H, Hkv, d, d, rng);
  auto packed = [&](std::vector<uint16_t>& x, int L, int heads) { return TensorView(x.data(), c.dt, {L, heads, d}); };
  for (Causal causal : {Causal::None, Causal::BottomRight}) {
    AttentionOptions o;
    o.cu_seqlens_q = TensorView(cu_q.data(), DType::i32, {5});
    o.cu_seqlens_k = TensorView(cu_k.data(), DType::i32, {5});
    o.causal = causal;
    std::vector<float> lse(size_t(H) * tq);
    const TensorView lse_host(lse.data(), DType::f32, {H, tq});
    attention(packed(c.q, tq, H), packed(c.k, tk, Hkv), packed(c.v, tk, Hkv), packed(c.out, tq, H), o, lse_host);
    GpuGrads cpu, gpu;
    cpu.dq.resize(c.q.size()), cpu.dk.resize(c.k.size()), cpu.dv.resize(c.v.size());
    gpu.dq.assign(c.q.size(), c.to(NAN)), gpu.dk.assign(c.k.size(), c.to(NAN)), gpu.dv.assign(c.v.size(), c.to(NAN));
    attention_backward(packed(c.q, tq, H), packed(c.k, tk, Hkv), packed(c.v, tk, Hkv), packed(c.out, tq, H), lse_host,
                       packed(c.dout, tq, H), packed(cpu.dq, tq, H), packed(cpu.dk, tk, Hkv), packed(cpu.dv, tk, Hkv),
                       o);
    std::vector<std::unique_ptr<DeviceBuffer>> keep;
    AttentionOptions od = o;
    od.cu_seqlens_q = on_gpu(o.cu_seqlens_q, keep);
    od.cu_seqlens_k = on_gpu(o.cu_seqlens_k, keep);
    // The gradients start as NaN on the device too: the backward must write every element.
    const TensorView dq = on_gpu(packed(gpu.dq, tq, H), keep), dk = on_gpu(packed(gpu.dk, tk, Hkv), keep),
                     dv = on_gpu(packed(gpu.dv, tk, Hkv), keep);
    attention_backward(on_gpu(packed(c.q, tq, H), keep), on_gpu(packed(c.k, tk, Hkv), keep),
                       on_gpu(packed(c.v, tk, Hkv), keep), on_gpu(packed(c.out, tq, H), keep), on_gpu(lse_host, keep),
                       on_gpu(packed(c.dout, tq, H), keep), dq, dk, dv, od);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(gpu.dq.data(), dq.data(), gpu.dq.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(gpu.dk.data(), dk.data(), gpu.dk.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(gpu.dv.data(), dv.data(), gpu.dv.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    expect_close_to_cpu(c, gpu, cpu, "varlen causal=" + std::to_string(int(causal)));
    for (size_t i = size_t(148) * H * d; i < gpu.dq.size(); ++i) ASSERT_EQ(c.from(gpu.dq[i]), 0.0f) << i;
    for (size_t i = size_t(338) * Hkv * d; i < gpu.dk.size(); ++i) ASSERT_EQ(c.from(gpu.dk[i]), 0.0f) << i;
  }
  // Padded batch with key lengths 0 (every row fully masked), 1 and 90.
  LowpCall p(GetParam(), 3, 40, 90, 2, 1, 128, 128, rng);
  std::vector<int32_t> lengths{0, 1, 90};
  AttentionOptions o;
  o.key_lengths = TensorView(lengths.data(), DType::i32, {3});
  o.causal = Causal::BottomRight;
  o.window = {7, 0};
  const GpuGrads gpu = run_gpu_forward_backward(p, o);
  expect_close_to_cpu(p, gpu, run_cpu_backward(p, o), "key lengths");
  for (int x = 0; x < 90 * 128; ++x) ASSERT_EQ(p.from(gpu.dk[x]), 0.0f) << "sequence 0 has no keys";
}

TEST_P(CudaBackward, NonFiniteNumbersWhereTheyTakeNoPartNeverReachAGradient) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1314);
  const int Lq = 70, Lk = 90, d = 64;
  LowpCall c(GetParam(), 1, Lq, Lk, 2, 1, d, d, rng);
  c.k[80 * d + 3] = c.to(NAN);       // keys 80 and 85: beyond every row's band
  c.v[85 * d + 5] = c.to(INFINITY);
  // Row 9 sees no key (its mask row is all false): its q and dO may hold anything.
  std::vector<uint8_t> mask(size_t(Lq) * Lk, 1);
  for (int j = 0; j < Lk; ++j) mask[9 * Lk + j] = 0;
  for (int h = 0; h < 2; ++h) {
    c.q[(9 * 2 + h) * d + 1] = c.to(NAN);
    c.dout[(9 * 2 + h) * d + 2] = c.to(-INFINITY);
  }
  AttentionOptions o;
  o.causal = Causal::TopLeft;
  o.mask = TensorView(mask.data(), DType::boolean, {Lq, Lk});
  const GpuGrads gpu = run_gpu_forward_backward(c, o);
  for (const auto* g : {&gpu.dq, &gpu.dk, &gpu.dv}) {
    for (uint16_t x : *g) ASSERT_TRUE(std::isfinite(c.from(x)));
  }
  for (int h = 0; h < 2; ++h)
    for (int x = 0; x < d; ++x) EXPECT_EQ(c.from(gpu.dq[(9 * 2 + h) * d + x]), 0.0f) << "row 9 sees no key";
  expect_close_to_cpu(c, gpu, run_cpu_backward(c, o), "non-finite");
}

// The pre-pass flags K's (dQ kernel) and Q's and dO's (dK/dV kernel) non-finite tiles
// per (sequence, head): each must be found in its own sequence and head only.
TEST_P(CudaBackward, NonFiniteNumbersAreFlaggedPerSequenceAndHead) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1315);
  const int B = 3, Lq = 70, Lk = 90, Hq = 4, Hkv = 2, d = 64;
  LowpCall c(GetParam(), B, Lq, Lk, Hq, Hkv, d, d, rng);
  auto kv_at = [&](std::vector<uint16_t>& t, int b, int j, int hk, int x) -> uint16_t& {
    return t[((size_t(b) * Lk + j) * Hkv + hk) * d + x];
  };
  auto q_at = [&](std::vector<uint16_t>& t, int b, int i, int h, int x) -> uint16_t& {
    return t[((size_t(b) * Lq + i) * Hq + h) * d + x];
  };
  kv_at(c.k, 2, 80, 1, 3) = c.to(NAN);  // keys beyond every row's band (top-left causal)
  kv_at(c.v, 1, 85, 1, 5) = c.to(INFINITY);
  kv_at(c.k, 0, 75, 0, 7) = c.to(-INFINITY);
  // Row 9 sees no key (its mask row is all false): its q and dO may hold anything.
  std::vector<uint8_t> mask(size_t(Lq) * Lk, 1);
  for (int j = 0; j < Lk; ++j) mask[9 * Lk + j] = 0;
  q_at(c.q, 2, 9, 3, 1) = c.to(NAN);
  q_at(c.dout, 2, 9, 3, 2) = c.to(-INFINITY);
  q_at(c.dout, 1, 9, 0, 4) = c.to(NAN);
  AttentionOptions o;
  o.causal = Causal::TopLeft;
  o.mask = TensorView(mask.data(), DType::boolean, {Lq, Lk});
  const GpuGrads gpu = run_gpu_forward_backward(c, o);
  for (uint16_t x : c.out) ASSERT_TRUE(std::isfinite(c.from(x)));
  for (const auto* g : {&gpu.dq, &gpu.dk, &gpu.dv}) {
    for (uint16_t x : *g) ASSERT_TRUE(std::isfinite(c.from(x)));
  }
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      for (int x = 0; x < d; ++x) {
        EXPECT_EQ(c.from(gpu.dq[((size_t(b) * Lq + 9) * Hq + h) * d + x]), 0.0f) << "row 9 sees no key";
      }
  expect_close_to_cpu(c, gpu, run_cpu_backward(c, o), "non-finite, 3 sequences");
}

TEST_P(CudaBackward, RowsWithHugeLseGetTheirStatisticsRecomputed) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1315);
  const int L = 80, d = 64;
  LowpCall c(GetParam(), 1, L, L, 2, 2, d, d, rng);
  std::vector<float> mask(size_t(L) * L, 0.0f);
  for (int j = 0; j < L; ++j) mask[3 * L + j] = -1e9f, mask[50 * L + j] = -3.0e38f;  // rows 3 and 50
  AttentionOptions o;
  o.mask = TensorView(mask.data(), DType::f32, {L, L});
  const GpuGrads gpu = run_gpu_forward_backward(c, o);
  expect_close_to_cpu(c, gpu, run_cpu_backward(c, o), "huge lse");
}

// A block-sparse mask (empty, full and partial blocks; block sizes that match the
// kernels' tiles and odd ones), forward and backward, against the CPU kernels.
TEST_P(CudaBackward, BlockMaskAgreesWithTheCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1317);
  struct BlockCase { int bq, bk; };
  for (const BlockCase bc : {BlockCase{64, 64}, BlockCase{17, 33}}) {
    const int B = 2, Lq = 150, Lk = 201, H = 2, d = 64;
    LowpCall c(GetParam(), B, Lq, Lk, H, 1, d, d, rng);
    const int nqb = (Lq + bc.bq - 1) / bc.bq, nkb = (Lk + bc.bk - 1) / bc.bk, T = 3;
    std::vector<int32_t> blocks(size_t(H) * nqb * nkb);
    for (int32_t& e : blocks) e = int32_t(rng() % 5) - 2;  // −2 full, −1 empty, 0..2 partial
    std::vector<uint8_t> tiles(size_t(T) * bc.bq * bc.bk);
    for (uint8_t& x : tiles) x = rng() % 3 != 0;
    AttentionOptions o;
    o.block_mask.block_q = bc.bq, o.block_mask.block_k = bc.bk;
    o.block_mask.blocks = TensorView(blocks.data(), DType::i32, {1, H, nqb, nkb});  // broadcast over the batch
    o.block_mask.tiles = TensorView(tiles.data(), DType::boolean, {T, bc.bq, bc.bk});
    o.causal = Causal::BottomRight;
    const GpuGrads gpu = run_gpu_forward_backward(c, o);
    std::vector<uint16_t> out(c.out.size());
    std::vector<float> lse(c.lse.size());
    attention(c.view(c.q, Lq, H, d), c.view(c.k, Lk, 1, d), c.view(c.v, Lk, 1, d), c.view(out, Lq, H, d), o,
              TensorView(lse.data(), DType::f32, {B, H, Lq}));
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(c.from(c.out[i]), c.from(out[i]), 0.03) << "out " << i;
    for (size_t i = 0; i < lse.size(); ++i) {
      if (std::isinf(lse[i])) {
        ASSERT_EQ(c.lse[i], lse[i]) << "lse " << i;
      } else {
        ASSERT_NEAR(c.lse[i], lse[i], 1e-4 * std::max(1.0f, std::fabs(lse[i]))) << "lse " << i;
      }
    }
    expect_close_to_cpu(c, gpu, run_cpu_backward(c, o), "block " + std::to_string(bc.bq) + "x" + std::to_string(bc.bk));
  }
}

// dbias (the additive mask's gradient) against the CPU's, for masks that broadcast over
// the batch, the heads, the rows, or nothing; softcap and dropout on, so that dS is
// taken before softcap' and with the forward's dropout decisions.
TEST_P(CudaBackward, MaskGradientAgreesWithTheCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1318);
  const int B = 2, Lq = 70, Lk = 133, H = 2, d = 64;
  const std::vector<std::vector<int64_t>> shapes = {{Lq, Lk}, {B, 1, Lq, Lk}, {B, H, Lq, Lk}, {1, H, 1, Lk}};
  for (const auto& shape : shapes) {
    SCOPED_TRACE("mask rank " + std::to_string(shape.size()) + " first dim " + std::to_string(shape[0]));
    LowpCall c(GetParam(), B, Lq, Lk, H, H, d, d, rng);
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    std::vector<float> mask(static_cast<size_t>(n)), cpu(mask.size()), gpu(mask.size());
    std::uniform_real_distribution<float> u(-2, 2);
    for (float& x : mask) x = rng() % 8 == 0 ? -INFINITY : u(rng);
    AttentionOptions o;
    o.mask = TensorView(mask.data(), DType::f32, shape);
    o.softcap = 6.0f;
    o.dropout_p = 0.1f;
    o.seed = 3;
    (void)run_gpu_forward_backward(c, o);  // c.out and c.lse: the GPU forward's, for both backward passes
    std::vector<uint16_t> dq(c.q.size()), dk(c.k.size()), dv(c.v.size());
    attention_backward(c.view(c.q, Lq, H, d), c.view(c.k, Lk, H, d), c.view(c.v, Lk, H, d), c.view(c.out, Lq, H, d),
                       c.lse_view(), c.view(c.dout, Lq, H, d), c.view(dq, Lq, H, d), c.view(dk, Lk, H, d),
                       c.view(dv, Lk, H, d), o, TensorView(cpu.data(), DType::f32, shape));
    std::vector<std::unique_ptr<DeviceBuffer>> keep;
    AttentionOptions od = o;
    od.mask = on_gpu(o.mask, keep);
    DeviceBuffer g(gpu.size() * 4), gq(dq.size() * 2), gk(dk.size() * 2), gv(dv.size() * 2);
    attention_backward(on_gpu(c.view(c.q, Lq, H, d), keep), on_gpu(c.view(c.k, Lk, H, d), keep),
                       on_gpu(c.view(c.v, Lk, H, d), keep), on_gpu(c.view(c.out, Lq, H, d), keep),
                       on_gpu(c.lse_view(), keep), on_gpu(c.view(c.dout, Lq, H, d), keep),
                       TensorView(gq.get(), c.dt, {B, Lq, H, d}).on(kGpu), TensorView(gk.get(), c.dt, {B, Lk, H, d}).on(kGpu),
                       TensorView(gv.get(), c.dt, {B, Lk, H, d}).on(kGpu), od,
                       TensorView(g.get(), DType::f32, shape).on(kGpu));
    g.to_host(gpu);
    double scale = 0;
    for (float x : cpu) scale = std::max(scale, double(std::fabs(x)));
    ASSERT_GT(scale, 0.0);
    for (size_t x = 0; x < gpu.size(); ++x) ASSERT_NEAR(gpu[x], cpu[x], 0.02 * scale) << x;
  }
}

TEST(CudaBackwardPrecision, Bf16PrecisionForF32InputsIsTheBf16KernelWithAnF32Output) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1316);
  const int B = 1, L = 77, H = 2, d = 96;
  LowpCall c(DType::bf16, B, L, L, H, H, d, d, rng);
  AttentionOptions o;
  o.causal = Causal::TopLeft;
  const GpuGrads g = run_gpu_forward_backward(c, o);
  // The same call on f32 tensors holding the bf16 values (out too), Precision::bf16.
  std::vector<float> out32(c.out.size()), dq(c.q.size()), dk(c.k.size()), dv(c.v.size());
  for (size_t i = 0; i < out32.size(); ++i) out32[i] = bf16_to_f32(c.out[i]);
  o.precision = Precision::bf16;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  auto dev32 = [&](const std::vector<float>& x) {
    return on_gpu(TensorView(x.data(), DType::f32, {B, L, H, d}), keep);
  };
  const TensorView gq = dev32(dq), gk = dev32(dk), gv = dev32(dv);
  attention_backward(dev32(c.q32), dev32(c.k32), dev32(c.v32), dev32(out32), on_gpu(c.lse_view(), keep),
                     dev32(c.dout32), gq, gk, gv, o);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dq.data(), gq.data(), dq.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dk.data(), gk.data(), dk.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv.data(), gv.data(), dv.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < dq.size(); ++i) ASSERT_EQ(f32_to_bf16(dq[i]), g.dq[i]) << "dq " << i;
  for (size_t i = 0; i < dk.size(); ++i) ASSERT_EQ(f32_to_bf16(dk[i]), g.dk[i]) << "dk " << i;
  for (size_t i = 0; i < dv.size(); ++i) ASSERT_EQ(f32_to_bf16(dv[i]), g.dv[i]) << "dv " << i;
}

TEST(CudaStreams, RunsOnTheStreamOfQ) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1307);
  LowpCall c(DType::bf16, 1, 300, 300, 2, 2, 128, 128, rng);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Device dev = Device::cuda(0, stream);
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  DeviceBuffer out(c.out.size() * 2);
  attention(on_gpu(c.view(c.q, 300, 2, 128), keep).on(dev), on_gpu(c.view(c.k, 300, 2, 128), keep).on(dev),
            on_gpu(c.view(c.v, 300, 2, 128), keep).on(dev), TensorView(out.get(), DType::bf16, {1, 300, 2, 128}).on(dev));
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<uint16_t> gpu(c.out.size());
  out.to_host(gpu);
  attention(c.view(c.q, 300, 2, 128), c.view(c.k, 300, 2, 128), c.view(c.v, 300, 2, 128), c.view(c.out, 300, 2, 128));
  for (size_t i = 0; i < gpu.size(); ++i) EXPECT_NEAR(c.from(gpu[i]), c.from(c.out[i]), 0.03) << i;
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(CudaErrors, UnsupportedShapesAndOptionsAreNamed) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = make_rng(1308);
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  LowpCall c(DType::bf16, 1, 5, 5, 1, 1, 80, 80, rng);
  const TensorView q = on_gpu(c.view(c.q, 5, 1, 80), keep);
  expect_attn_error([&] { attention(q, q, q, on_gpu(c.view(c.out, 5, 1, 80), keep)); },
                    "head dim d = 80 is not supported on CUDA devices");
  LowpCall m(DType::bf16, 1, 5, 5, 1, 1, 64, 64, rng);
  const TensorView q64 = on_gpu(m.view(m.q, 5, 1, 64), keep), o64 = on_gpu(m.view(m.out, 5, 1, 64), keep);
  expect_attn_error([&] { attention(q64, m.view(m.k, 5, 1, 64), q64, o64); },
                    "k is on cpu but q is on cuda:0");
  std::vector<uint16_t> mask(25);
  AttentionOptions o;
  o.mask = on_gpu(TensorView(mask.data(), DType::bf16, {5, 5}), keep);
  expect_attn_error([&] { attention(q64, q64, q64, o64, o); }, "options.mask on a CUDA device must be f32 or bool");
  std::vector<float> lse(5), dbias(25);
  std::vector<uint8_t> bmask(25, 1);
  o = {};
  o.mask = on_gpu(TensorView(bmask.data(), DType::boolean, {5, 5}), keep);
  const TensorView lse_d = on_gpu(TensorView(lse.data(), DType::f32, {1, 1, 5}), keep);
  expect_attn_error([&] {
    attention_backward(q64, q64, q64, o64, lse_d, o64, o64, o64, o64, o,
                       on_gpu(TensorView(dbias.data(), DType::f32, {5, 5}), keep));
  }, "dbias needs an additive (f32) mask");
}

}  // namespace
}  // namespace attn::testing
