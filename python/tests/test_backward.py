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
