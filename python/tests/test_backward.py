"""Gradients: attn.attention_backward and the autograd wrapper against PyTorch autograd of
the explicit float64 pipeline; torch.autograd.gradcheck in f32 with suitable tolerances;
mask gradients; dropout reproduced by the backward."""
import numpy as np
import pytest
import torch

import attn
import attn.torch
from conftest import SEED, reference, rel_err


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def reference_grads(q, k, v, g, dtype=torch.float64, **opts):
    """Autograd through the explicit pipeline in float64 (the oracle) or, with
    dtype=torch.float32, the plain f32 implementation whose error FlashAttention's rule
    compares with."""
    leaves = [torch.tensor(np.asarray(x), dtype=dtype, requires_grad=True) for x in (q, k, v)]
    mask = opts.pop("mask", None)
    mask_leaf = None
    if mask is not None and np.asarray(mask).dtype == np.float32:
        mask_leaf = torch.tensor(np.asarray(mask), dtype=dtype, requires_grad=True)
        mask = mask_leaf
    out, _ = reference(*leaves, mask=mask, dtype=dtype, **opts)
    (out * torch.as_tensor(np.asarray(g), dtype=dtype)).sum().backward()
    grads = [t.grad for t in leaves]
    return grads + ([mask_leaf.grad] if mask_leaf is not None else [])


@pytest.mark.parametrize("case", range(16))
def test_gradients_match_float64_autograd(rng, case):
    B, hkv = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2]))
    L, S = int(rng.choice([1, 7, 33, 80])), int(rng.choice([3, 33, 80]))
    d = int(rng.choice([8, 32, 64]))
    q, k, v = rand(rng, B, hq, L, d), rand(rng, B, hkv, S, d), rand(rng, B, hkv, S, d)
    g = rand(rng, B, hq, L, d)
    opts = {}
    if case % 3 == 0:
        opts.update(is_causal=True, causal_alignment="bottom_right")
    if case % 4 == 1:
        opts["window"] = (5, 3)
    if case % 5 == 2:
        opts["softcap"] = 8.0
    mask = rand(rng, 1, hq, L, S) if case % 2 else None
    out, lse = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True, **opts)
    grads = attn.attention_backward(g, q, k, v, out, lse, attn_mask=mask, enable_gqa=True,
                                    return_mask_grad=mask is not None, **opts)
    ref_opts = {"is_causal": opts.get("is_causal", False), "alignment": opts.get("causal_alignment", "top_left"),
                "window": opts.get("window"), "softcap": opts.get("softcap")}
    want = reference_grads(q, k, v, g, mask=mask, **ref_opts)
    plain = reference_grads(q, k, v, g, dtype=torch.float32, mask=mask, **ref_opts)
    for name, got, w, pl in zip(("dq", "dk", "dv", "dmask"), grads, want, plain):
        assert got.shape == tuple(w.shape), name
        # 1e-5, or 10× the plain f32 pipeline's error where that is larger: the mask's
        # gradient P∘(dP − D) sums to zero over each row, so with few keys it can be a
        # small difference of large terms that no f32 computation gets to 1e-5.
        assert rel_err(got, w) <= max(1e-5, 10 * rel_err(pl, w)), "%s seed %d case %d" % (name, SEED, case)


def test_autograd_wrapper_matches_float64_autograd(rng):
    q, k, v = (torch.from_numpy(rand(rng, 2, 4, 19, 16)).requires_grad_() for _ in range(3))
    mask = torch.from_numpy(rand(rng, 19, 19)).requires_grad_()
    out = attn.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    g = torch.from_numpy(rand(rng, 2, 4, 19, 16))
    (out * g).sum().backward()
    want = reference_grads(q.detach(), k.detach(), v.detach(), g.numpy(), mask=mask.detach().numpy(), is_causal=True)
    for got, w in zip((q.grad, k.grad, v.grad, mask.grad), want):
        assert rel_err(got, w) <= 1e-5


def test_gradcheck_in_float32():
    torch.manual_seed(SEED)
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    mask = torch.randn(5, 5, requires_grad=True)

    def f(q, k, v, mask):
        return attn.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask, window=(2, 1))

    # f32: central differences with eps 1e-2 are good to ~1e-3.
    with pytest.warns(UserWarning):  # gradcheck warns that the inputs are not float64
        assert torch.autograd.gradcheck(f, (q, k, v, mask), eps=1e-2, atol=5e-3, rtol=5e-2)


def test_dropout_is_reproduced_by_the_backward(rng):
    q, k, v = (torch.from_numpy(rand(rng, 1, 2, 6, 8)).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return attn.torch.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=1234)

    a, b = f(q, k, v), f(q, k, v)
    assert torch.equal(a, b)
    assert not torch.equal(a, attn.torch.scaled_dot_product_attention(q, k, v))
    with pytest.warns(UserWarning):
        assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-2, atol=5e-3, rtol=5e-2)


def test_generic_function_on_tensors_that_require_grad_is_differentiable(rng):
    # attn.scaled_dot_product_attention takes NumPy arrays and torch tensors alike; given
    # tensors that require grad it must not return a result that trains nothing.
    q, k, v = (torch.from_numpy(rand(rng, 1, 2, 9, 8)).requires_grad_() for _ in range(3))
    mask = torch.from_numpy(rand(rng, 9, 9)).requires_grad_()
    out = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, window=(4, 0))
    assert out.requires_grad
    g = torch.from_numpy(rand(rng, 1, 2, 9, 8))
    (out * g).sum().backward()
    want = reference_grads(q.detach(), k.detach(), v.detach(), g.numpy(), mask=mask.detach().numpy(), is_causal=True,
                           window=(4, 0))
    for got, w in zip((q.grad, k.grad, v.grad, mask.grad), want):
        assert got is not None and rel_err(got, w) <= 1e-5
    with torch.no_grad():  # inference: no graph, no warning
        assert not attn.scaled_dot_product_attention(q, k, v).requires_grad
    with pytest.warns(UserWarning, match="records no gradient"):
        out, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert not out.requires_grad


def _column_major(x):
    """x's values in a layout whose last dimension is not contiguous (stride = its length)."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad", [True, False])
def test_autograd_wrapper_takes_any_layout(rng, dtype, grad):
    # PyTorch's SDPA takes any layout, and attn.torch is its drop-in (patch_sdpa puts it in
    # modules' calls): a column-major, stepped or transposed view is read through a
    # contiguous copy, with the numbers and gradients of that copy. (The NumPy functions
    # reject such a layout with a message instead: test_errors_and_memory.)
    def mk(*shape):
        return torch.from_numpy(rand(rng, *shape)).to(dtype)

    q = _column_major(mk(2, 4, 19, 16))
    k = mk(2, 2, 23, 32)[..., ::2]  # stepped: stride 2
    v = mk(2, 23, 2, 8).transpose(1, 2)  # [B, L, H, d] seen as [B, H, L, d]
    mask = _column_major(torch.from_numpy(rand(rng, 19, 23)))
    assert q.stride(-1) != 1 and k.stride(-1) != 1 and mask.stride(-1) != 1
    g = mk(2, 4, 19, 8)

    def run(q, k, v, mask):
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v, mask)]
        out = attn.torch.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], is_causal=False,
                                                      enable_gqa=True)
        if not grad:
            return [out]
        (out.float() * g.float()).sum().backward()
        return [out] + [t.grad for t in leaves]

    got = run(q, k, v, mask)
    want = run(*(t.contiguous() for t in (q, k, v, mask)))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    # and the copy's numbers are attention's (float64, on the inputs as given)
    ref, _ = reference(q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
                       mask=mask.double())
    assert rel_err(got[0].detach().double(), ref) <= (1e-5 if dtype == torch.float32 else 2e-2)
    # a broadcast mask row (stride 0) is read as it is, not copied
    row = torch.from_numpy(rand(rng, 1, 1, 1, 23)).expand(2, 4, 19, 23)
    assert torch.equal(attn.torch.scaled_dot_product_attention(q, k, v, attn_mask=row, enable_gqa=True),
                       attn.torch.scaled_dot_product_attention(q, k, v, attn_mask=row.contiguous(), enable_gqa=True))


@pytest.mark.parametrize("grad", [True, False])
def test_varlen_wrapper_takes_any_layout(rng, grad):
    cu = torch.tensor([0, 5, 17], dtype=torch.int32)
    q = _column_major(torch.from_numpy(rand(rng, 17, 2, 8)))
    k = torch.from_numpy(rand(rng, 17, 2, 16))[..., ::2]
    v = torch.from_numpy(rand(rng, 2, 17, 8)).transpose(0, 1)
    g = torch.from_numpy(rand(rng, 17, 2, 8))

    def run(q, k, v):
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        out = attn.torch.varlen_attention(*leaves, cu, cu, causal=True)
        if not grad:
            return [out]
        (out * g).sum().backward()
        return [out] + [t.grad for t in leaves]

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(q, k, v), run(q.contiguous(), k.contiguous(), v.contiguous())):
        assert torch.equal(a, b), name
