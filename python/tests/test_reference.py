"""reference=True: attn's float64 reference from Python, against PyTorch's explicit float64
pipeline (conftest.reference) and float64 autograd through it. The reference computes in
float64 and rounds once, so it must agree with them to about one unit in the last place
of the output dtype — a bound the fused kernels, whose float32 sums round many times,
are not held to."""
import numpy as np
import pytest
import torch

import attn
from conftest import SEED, reference
from test_backward import rand, reference_grads


def within_one_rounding(got, want, eps, spacing=0.0):
    """|got − want| ≤ 2·eps·|want| + spacing + 1e-12·max|want| per element (eps: the
    dtype's unit roundoff; spacing: its subnormals' step, the absolute rounding of values
    below its normal range, which float16 outputs near 0 reach; the last term covers
    float64 sums done in another order, which can move an element that sits on a rounding
    boundary by one unit)."""
    got = torch.as_tensor(np.asarray(got, dtype=np.float64) if not torch.is_tensor(got) else got.double())
    want = torch.as_tensor(want).double()
    finite = torch.isfinite(want)
    assert bool(torch.equal(torch.isfinite(got), finite))
    g, w = got[finite], want[finite]
    if w.numel() == 0:
        return
    bound = 2 * eps * w.abs() + spacing + 1e-12 * float(w.abs().max())
    worst = float(((g - w).abs() - bound).max())
    assert worst <= 0, "exceeds one rounding by %g (seed %d)" % (worst, SEED)


F32_EPS = 2.0**-24


def f32_scale(d):
    """The default scale as the library takes it: 1/sqrt(d) rounded to float32 (a scale
    is a float parameter, as softcap and the ALiBi slopes are)."""
    return float(np.float32(1.0 / np.sqrt(d)))


def options_of(case, rng, hq, L, S):
    opts, ref = {}, {}
    if case % 3 == 0:
        opts.update(is_causal=True, causal_alignment="bottom_right")
        ref.update(is_causal=True, alignment="bottom_right")
    if case % 4 == 1:
        opts["window"] = ref["window"] = (4, 2)
    if case % 5 == 2:
        opts["softcap"] = ref["softcap"] = 5.0
    if case % 7 == 3:
        slopes = rng.uniform(0.05, 0.5, hq).astype(np.float32)
        opts["alibi_slopes"] = ref["alibi"] = slopes
    if case % 2:
        mask = rand(rng, 1, hq, L, S) if case % 4 == 1 else rng.random((L, S)) < 0.8
        opts["attn_mask"] = ref["mask"] = mask
    return opts, ref


@pytest.mark.parametrize("case", range(14))
def test_forward_is_the_float64_result_rounded_once(rng, case):
    B, hkv = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 3]))
    L, S = int(rng.choice([1, 3, 17, 40])), int(rng.choice([1, 5, 17, 67]))
    d = int(rng.choice([1, 8, 33]))
    q, k, v = rand(rng, B, hq, L, d), rand(rng, B, hkv, S, d), rand(rng, B, hkv, S, d)
    opts, ref = options_of(case, rng, hq, L, S)
    out, lse = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, reference=True, **opts)
    want, want_lse = reference(q, k, v, scale=f32_scale(d), **ref)
    assert out.dtype == np.float32 and out.shape == tuple(want.shape)
    within_one_rounding(out, want, F32_EPS)
    within_one_rounding(lse, want_lse, F32_EPS)
    # The same call on the fused kernels agrees to their own tolerance.
    fused = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, **opts)
    assert np.abs(fused - out).max() <= 1e-5 * max(1.0, float(np.abs(out).max()))


def test_sixteen_bit_inputs_keep_their_dtype(rng):
    q, k, v = (rand(rng, 2, 3, 19, 16) for _ in range(3))
    q16, k16, v16 = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    out = attn.scaled_dot_product_attention(q16, k16, v16, is_causal=True, reference=True)
    assert out.dtype == torch.bfloat16
    want, _ = reference(q16.double(), k16.double(), v16.double(), is_causal=True)
    within_one_rounding(out, want, 2.0**-8)
    h = tuple(x.astype(np.float16) for x in (q, k, v))
    out16 = attn.scaled_dot_product_attention(*h, reference=True)
    assert out16.dtype == np.float16
    want16, _ = reference(*(x.astype(np.float64) for x in h))
    within_one_rounding(out16, want16, 2.0**-11, spacing=2.0**-24)


def test_precision_bf16_rounds_the_inputs_first(rng):
    q, k, v = (rand(rng, 1, 2, 23, 24) for _ in range(3))
    out = attn.scaled_dot_product_attention(q, k, v, precision="bf16", reference=True)
    assert out.dtype == np.float32
    rounded = [torch.from_numpy(x).to(torch.bfloat16).double() for x in (q, k, v)]
    want, _ = reference(*rounded, scale=f32_scale(24))
    within_one_rounding(out, want, F32_EPS)
    # and that is not the unrounded result
    exact, _ = reference(q, k, v, scale=f32_scale(24))
    assert float((torch.from_numpy(out).double() - exact).abs().max()) > 1e-4


def test_dropout_takes_the_kernels_decisions(rng):
    q, k, v = (rand(rng, 1, 2, 31, 16) for _ in range(3))
    ref = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.25, seed=77, reference=True)
    fused = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.25, seed=77)
    assert np.abs(fused - ref).max() <= 1e-5 * max(1.0, float(np.abs(ref).max()))
    other = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.25, seed=78, reference=True)
    assert np.abs(other - ref).max() > 1e-2


@pytest.mark.parametrize("case", range(10))
def test_backward_is_float64_autograd_rounded_once(rng, case):
    B, hkv = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2]))
    L, S = int(rng.choice([1, 7, 33])), int(rng.choice([3, 17, 45]))
    d = int(rng.choice([4, 17, 32]))
    q, k, v = rand(rng, B, hq, L, d), rand(rng, B, hkv, S, d), rand(rng, B, hkv, S, d)
    g = rand(rng, B, hq, L, d)
    opts, ref = options_of(case, rng, hq, L, S)
    opts.pop("alibi_slopes", None), ref.pop("alibi", None)
    # rows that see no key have gradient 0 in attn, NaN through torch's softmax: keep
    # every row seeing a key (no window, mask with its diagonal allowed)
    opts.pop("window", None), ref.pop("window", None)
    mask = opts.get("attn_mask")
    if mask is not None and mask.dtype == bool:
        mask[np.arange(min(L, S)) + 0, (np.arange(min(L, S)) + max(0, S - L)) % S] = True
        mask[:, -1] = True
    out, lse = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **opts)
    grads = attn.attention_backward(g, q, k, v, out, lse, enable_gqa=True, reference=True,
                                    return_mask_grad=mask is not None and mask.dtype == np.float32, **opts)
    want = reference_grads(q, k, v, g, scale=f32_scale(d), **ref)
    for name, got, w in zip(("dq", "dk", "dv", "dmask"), grads, want):
        assert got.shape == tuple(w.shape), name
        within_one_rounding(got, w, F32_EPS)


def test_varlen_reference_matches_each_sequence(rng):
    lengths = [3, 1, 17]
    total = sum(lengths)
    q, k, v = (rand(rng, total, 2, 8) for _ in range(3))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    out = attn.varlen_attention(q, k, v, cu, cu, causal=True, reference=True)
    for a, b in zip(cu[:-1], cu[1:]):
        per = [torch.from_numpy(x[a:b]).permute(1, 0, 2) for x in (q, k, v)]
        want, _ = reference(*per, is_causal=True, alignment="bottom_right", scale=f32_scale(8))
        within_one_rounding(torch.from_numpy(out[a:b]).permute(1, 0, 2), want, F32_EPS)


def test_reference_reports_bad_arguments_as_the_kernels_do(rng):
    q, k, v = rand(rng, 1, 2, 5, 8), rand(rng, 1, 2, 6, 8), rand(rng, 1, 2, 6, 4)
    with pytest.raises(ValueError, match="window"):
        attn.scaled_dot_product_attention(q, k, v, window=(-2, 0), reference=True)
    with pytest.raises(ValueError, match="attn_mask"):
        attn.scaled_dot_product_attention(q, k, v, attn_mask=rand(rng, 5, 7), reference=True)
