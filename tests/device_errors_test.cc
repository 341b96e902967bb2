// Tensors on a CUDA device (TensorView::on): the CPU-only entry points reject them by
// name, one call never mixes devices, and a build or machine without a usable GPU says
// why. These run everywhere, with or without a GPU: every call below fails its checks
// before any kernel could touch the (host) memory the views point to.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"

namespace attn::testing {
namespace {

struct Call {
  int B = 2, L = 5, H = 4, d = 64;
  std::vector<uint16_t> q, k, v, out;
  std::vector<float> lse;
  std::vector<int32_t> cu{0, 3, 5};
  Call() : q(size_t(B) * L * H * d, 0x3f80), k(q), v(q), out(q), lse(size_t(B) * H * L, 0.0f) {}
  TensorView view(const std::vector<uint16_t>& x) const { return TensorView(x.data(), DType::bf16, {B, L, H, d}); }
  TensorView lse_view() const { return TensorView(lse.data(), DType::f32, {B, H, L}); }
};

const Device kGpu = Device::cuda(0);

TEST(DeviceViews, DescribeAndPlacement) {
  float x[6] = {};
  const TensorView t(x, DType::f32, {2, 3});
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_EQ(t.describe(), "f32[2, 3]");
  int stream_token = 0;
  const TensorView g = t.on(Device::cuda(1, &stream_token));
  EXPECT_TRUE(g.device().is_cuda());
  EXPECT_EQ(g.device().index, 1);
  EXPECT_EQ(g.device().stream, &stream_token);
  EXPECT_EQ(g.describe(), "f32[2, 3] on cuda:1");
  EXPECT_TRUE(t.device().is_cpu()) << "on() returns a copy";
  EXPECT_EQ(g.data(), t.data());
  EXPECT_TRUE(Device::cuda(1).same_memory(Device::cuda(1, &stream_token)));
  EXPECT_FALSE(Device::cuda(1).same_memory(Device::cuda(0)));
  EXPECT_FALSE(Device::cuda(0).same_memory(Device::cpu()));
}

TEST(DeviceViews, CudaStatusMatchesTheBuild) {
  const CudaStatus s = cuda_status(0);
  EXPECT_EQ(s.built, ATTN_TEST_CUDA_BUILT != 0);
  if (!s.built) EXPECT_NE(s.unusable.find("no CUDA backend"), std::string::npos) << s.unusable;
  // A device that no machine has is never usable.
  EXPECT_FALSE(cuda_status(1000).unusable.empty());
}

TEST(DeviceErrors, OneCallNeverMixesDevices) {
  Call c;
  const TensorView q = c.view(c.q), k = c.view(c.k), v = c.view(c.v), out = c.view(c.out);
  expect_attn_error([&] { attention(q, k.on(kGpu), v, out); },
                    "attention: k is on cuda:0 but q is on cpu: every tensor of one call must be on the same device");
  expect_attn_error([&] { attention(q, k, v, out.on(kGpu)); }, "out is on cuda:0 but q is on cpu");
  expect_attn_error([&] { attention(q, k, v, out, {}, c.lse_view().on(kGpu)); }, "lse is on cuda:0 but q is on cpu");
  std::vector<float> slopes(size_t(c.H), 0.5f);
  AttentionOptions o;
  o.alibi_slopes = TensorView(slopes.data(), DType::f32, {c.H}).on(kGpu);
  expect_attn_error([&] { attention(q, k, v, out, o); }, "alibi_slopes is on cuda:0 but q is on cpu");
  std::vector<float> mask(size_t(c.L) * c.L, 0.0f);
  o = {};
  o.mask = TensorView(mask.data(), DType::f32, {c.L, c.L}).on(kGpu);
  expect_attn_error([&] { attention(q, k, v, out, o); }, "mask is on cuda:0 but q is on cpu");
  // Device metadata for a host call would be read from device memory: refused.
  const TensorView packed_q(c.q.data(), DType::bf16, {c.L, c.H, c.d});
  o = {};
  o.cu_seqlens_q = TensorView(c.cu.data(), DType::i32, {3}).on(kGpu);
  o.cu_seqlens_k = TensorView(c.cu.data(), DType::i32, {3});
  expect_attn_error([&] { attention(packed_q, packed_q, packed_q, TensorView(c.out.data(), DType::bf16, {c.L, c.H, c.d}), o); },
                    "cu_seqlens_q is on cuda:0 but q is on cpu");
  // A block mask's table on a device, for a host call.
  std::vector<int32_t> blocks{BlockMask::kFull};
  o = {};
  o.block_mask.block_q = c.L, o.block_mask.block_k = c.L;
  o.block_mask.blocks = TensorView(blocks.data(), DType::i32, {1, 1, 1, 1}).on(kGpu);
  expect_attn_error([&] { attention(q, k, v, out, o); }, "options.block_mask.blocks is on cuda:0 but q is on cpu");
  // Two devices.
  expect_attn_error([&] { attention(q.on(kGpu), k.on(Device::cuda(1)), v.on(kGpu), out.on(kGpu)); },
                    cuda_status(0).unusable.empty() ? "k is on cuda:1 but q is on cuda:0" : "q is on cuda:0, but ");
}

TEST(DeviceErrors, DeviceCallsSayWhyTheyCannotRunOrWhatIsMissing) {
  Call c;
  const TensorView q = c.view(c.q).on(kGpu), k = c.view(c.k).on(kGpu), v = c.view(c.v).on(kGpu),
                   out = c.view(c.out).on(kGpu);
  const CudaStatus s = cuda_status(0);
  if (!s.unusable.empty()) {
    // No backend, no driver or no GPU: the reason, whatever the call.
    expect_attn_error([&] { attention(q, k, v, out); }, "attention: q is on cuda:0, but " + s.unusable);
  } else {
    // A usable GPU: options the GPU path lacks are named (the views point to host memory,
    // so only calls that fail their checks are made here).
    std::vector<float> probs(size_t(c.B) * c.H * c.L * c.L);
    expect_attn_error([&] { attention(q, k, v, out, {}, {}, TensorView(probs.data(), DType::f32, {c.B, c.H, c.L, c.L})); },
                      "probs is on cpu but q is on cuda:0");
    AttentionOptions o;
    o.precision = Precision::f32;
    std::vector<float> f(c.q.size());
    const TensorView f32 = TensorView(f.data(), DType::f32, {c.B, c.L, c.H, c.d}).on(kGpu);
    expect_attn_error([&] { attention(f32, f32, f32, f32, o); }, "Precision::bf16");
    expect_attn_error([&] { attention(q, k.on(Device::cpu()), v, out); },
                      "k is on cpu but q is on cuda:0");
  }
  std::vector<uint16_t> grads(c.q.size());
  const TensorView g = c.view(grads).on(kGpu);
  if (!s.unusable.empty()) {
    expect_attn_error([&] { attention_backward(q, k, v, out, c.lse_view().on(kGpu), g, g, g, g); },
                      "attention_backward: q is on cuda:0, but " + s.unusable);
  } else {
    expect_attn_error([&] { attention_backward(q, k, v, out, c.lse_view().on(kGpu), g, g, g, g.on(Device::cpu())); },
                      "dv is on cpu but q is on cuda:0");
  }
  // A host backward never reads a device gradient.
  const TensorView hq = c.view(c.q), hk = c.view(c.k), hv = c.view(c.v), hout = c.view(c.out);
  expect_attn_error([&] { attention_backward(hq, hk, hv, hout, c.lse_view(), hout, g, c.view(grads), c.view(grads)); },
                    "dq is on cuda:0 but q is on cpu");
}

TEST(DeviceErrors, CpuOnlyFunctionsNameTheDeviceTensor) {
  Call c;
  const TensorView q = c.view(c.q), k = c.view(c.k), v = c.view(c.v), out = c.view(c.out);
  expect_attn_error([&] { attention_reference(q.on(kGpu), k, v, out); },
                    "attention_reference: q is on cuda:0, but attention_reference takes tensors in host memory (device cpu) only");
  expect_attn_error([&] { attention_reference(q, k, v.on(kGpu), out); }, "v is on cuda:0, but attention_reference takes");
  const TensorView lse = c.lse_view();
  expect_attn_error([&] { merge_attention_states(out.on(kGpu), lse, out, lse, c.view(c.q)); },
                    "merge_attention_states: out_a is on cuda:0, but merge_attention_states takes tensors in host memory");
  expect_attn_error([&] { (void)attention_workspace_bytes(q, k, v, out.on(kGpu), {}, 1); }, "out is on cuda:0");
  std::vector<uint8_t> keep(size_t(c.B) * c.H * c.L * c.L);
  expect_attn_error([&] { dropout_mask(TensorView(keep.data(), DType::boolean, {c.B, c.H, c.L, c.L}).on(kGpu), 0.5f, 1); },
                    "dropout_mask: mask is on cuda:0, but dropout_mask takes tensors in host memory");
}

}  // namespace
}  // namespace attn::testing
