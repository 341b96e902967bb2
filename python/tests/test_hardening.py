"""Issue 10, the Python items: varlen coverage, once-differentiable autograd, H = 0,
dropout seeds, thread limits, NaN semantics and overlapping outputs."""
import numpy as np
import pytest
import torch

import attn
import attn.torch


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# Item 13: tokens not covered by cu_seqlens were returned as uninitialised memory.
def test_varlen_requires_cu_seqlens_to_cover_every_token(rng):
    q, k, v = rand(rng, 10, 2, 8), rand(rng, 10, 2, 8), rand(rng, 10, 2, 8)
    ok = np.array([0, 4, 10], np.int32)
    out = attn.varlen_attention(q, k, v, ok, ok)
    assert np.isfinite(out).all()
    for bad, what in ((np.array([1, 4, 10], np.int32), r"cu_seqlens_q\[0\]=1"),
                      (np.array([0, 4, 9], np.int32), r"cu_seqlens_q\[-1\]=9")):
        with pytest.raises(ValueError, match=what):
            attn.varlen_attention(q, k, v, bad, ok)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        attn.varlen_attention(q, k, v, ok, np.array([0, 4, 8], np.int32))


# Item 14: double backward silently returned zeros.
def test_double_backward_raises():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    out = attn.torch.scaled_dot_product_attention(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|differentiable"):
        torch.autograd.grad(gq.sum(), q)


# Item 15: H = 0 raised ZeroDivisionError.
def test_zero_heads_is_a_value_error(rng):
    with pytest.raises(ValueError, match="at least one head"):
        attn.scaled_dot_product_attention(rand(rng, 1, 2, 4, 8), rand(rng, 1, 0, 4, 8), rand(rng, 1, 0, 4, 8),
                                          enable_gqa=True)
    with pytest.raises(ValueError, match="at least one head"):
        attn.scaled_dot_product_attention(rand(rng, 1, 0, 4, 8), rand(rng, 1, 0, 4, 8), rand(rng, 1, 0, 4, 8))


# Item 16: dropout without a seed could not be reproduced by the backward.
def test_dropout_seed_is_returned_and_required_by_the_backward(rng):
    q, k, v = rand(rng, 1, 2, 6, 8), rand(rng, 1, 2, 7, 8), rand(rng, 1, 2, 7, 8)
    out, lse, seed = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, return_lse=True, return_seed=True)
    assert isinstance(seed, int) and seed == attn.last_dropout_seed()
    again = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=seed)
    np.testing.assert_array_equal(out, again)
    g = rand(rng, *out.shape)
    with pytest.raises(ValueError, match="needs seed="):
        attn.attention_backward(g, q, k, v, out, lse, dropout_p=0.3)
    dq, dk, dv = attn.attention_backward(g, q, k, v, out, lse, dropout_p=0.3, seed=seed)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    # Without dropout no seed is needed.
    out0, lse0 = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    attn.attention_backward(g, q, k, v, out0, lse0)


# Item 10 from Python: absurd thread counts are refused, not crashes.
def test_set_num_threads_is_capped():
    saved = attn.num_threads()
    for n in (100000, 2 ** 30, 0):
        with pytest.raises(ValueError, match=r"set_num_threads: n must be in \[1, 4096\]"):
            attn.set_num_threads(n)
    assert attn.num_threads() == saved


# Item 1 from Python: NaN keys are not dropped; -FLT_MAX masks are values (as PyTorch).
def test_nan_and_huge_masks_match_pytorch(rng):
    q = np.ones((1, 1, 1, 1), np.float32)
    k = np.array([np.nan, 1], np.float32).reshape(1, 1, 2, 1)
    v = np.array([10, 20], np.float32).reshape(1, 1, 2, 1)
    assert np.isnan(attn.scaled_dot_product_attention(q, k, v)).all()
    q, k, v = rand(rng, 1, 2, 3, 8), rand(rng, 1, 2, 5, 8), rand(rng, 1, 2, 5, 8)
    mask = np.zeros((3, 5), np.float32)
    mask[0, :] = np.finfo(np.float32).min
    mask[1, :3] = np.finfo(np.float32).min
    ours = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # PyTorch's own math (1.13 has no scaled_dot_product_attention): softmax over
    # the equal -FLT_MAX scores of row 0 is uniform, not "masked".
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    scores = tq @ tk.transpose(-1, -2) / np.sqrt(8) + torch.from_numpy(mask)
    theirs = (torch.softmax(scores, dim=-1) @ tv).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
