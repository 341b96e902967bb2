"""attn.block_mask: classification against the predicate evaluated at every position
(both probes, odd sizes and block sizes), attention with a BlockMask against the float64
reference with the equivalent dense mask, gradients, batch/head-dependent predicates,
the border probe's documented limit, and errors."""
import numpy as np
import pytest
import torch

import attn
from conftest import lse_err, reference, rel_err


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def dense(mask_mod, B, H, lq, lk):
    """The predicate at every position, [B or 1, H or 1, Lq, Lk]."""
    b = np.arange(B or 1)[:, None, None, None]
    h = np.arange(H or 1)[None, :, None, None]
    q = np.arange(lq)[None, None, :, None]
    k = np.arange(lk)[None, None, None, :]
    return np.broadcast_to(mask_mod(b, h, q, k), ((B or 1), (H or 1), lq, lk))


def documents(rng, length, count):
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(count, length - 1), replace=False))
    ids = np.zeros(length, np.int64)
    ids[cuts] = 1
    return np.cumsum(ids)


def masks(rng, lq, lk):
    """Predicates of the kinds people use, for an lq × lk plane."""
    doc_q = documents(rng, max(lq, lk), 5)
    w = int(rng.integers(1, 40))
    return {
        "causal": lambda b, h, q, k: k <= q,
        "documents": lambda b, h, q, k: doc_q[q] == doc_q[k],
        "causal documents": attn.and_masks(lambda b, h, q, k: k <= q, lambda b, h, q, k: doc_q[q] == doc_q[k]),
        "window + global tokens": attn.or_masks(lambda b, h, q, k: np.abs(q - k) <= w,
                                                lambda b, h, q, k: (k < 3) | (q < 3)),
        "prefix LM": lambda b, h, q, k: (k <= q) | (k < lk // 3),
        "dilated": lambda b, h, q, k: (k - q) % 3 == 0,
    }


@pytest.mark.parametrize("lq,lk,block", [(1, 1, 64), (3, 17, 1), (17, 3, (2, 5)), (100, 1000, 64), (130, 67, (16, 100)),
                                         (257, 255, 7), (64, 128, (64, 128))])
def test_block_mask_classifies_exactly_with_both_probes(rng, lq, lk, block):
    for name, mod in masks(rng, lq, lk).items():
        truth = dense(mod, None, None, lq, lk)
        for probe in ("full", "border"):
            bm = attn.block_mask(mod, None, None, lq, lk, block_size=block, probe=probe)
            assert np.array_equal(bm.to_dense(), truth), (name, probe)
            # Every block's class is right: empty blocks hold no True, full ones no False.
            bq, bk = bm.block_size
            t = np.pad(truth[0, 0].astype(np.int8), ((0, -lq % bq), (0, -lk % bk)), constant_values=-1).reshape(
                lq // bq + (lq % bq > 0), bq, lk // bk + (lk % bk > 0), bk)
            real = t != -1
            any_true = ((t == 1) & real).any(axis=(1, 3))
            any_false = ((t == 0) & real).any(axis=(1, 3))
            table = bm.blocks[0, 0]
            assert np.array_equal(table == attn.masks.EMPTY, ~any_true), (name, probe)
            assert np.array_equal(table == attn.masks.FULL, ~any_false), (name, probe)


def test_batch_and_head_dependent_predicates(rng):
    B, H, L = 2, 3, 90
    docs = np.stack([documents(rng, L, 4), documents(rng, L, 7)])
    mod = lambda b, h, q, k: (docs[b, q] == docs[b, k]) & (np.abs(q - k) <= 10 + 20 * h)
    for probe in ("full", "border"):
        bm = attn.block_mask(mod, B, H, L, L, block_size=16, probe=probe)
        assert bm.blocks.shape == (B, H, 6, 6)
        assert np.array_equal(bm.to_dense(), dense(mod, B, H, L, L))


def test_border_probe_misses_islands_and_full_probe_does_not():
    # One True element inside a 64 × 64 block, away from its edges: the documented limit.
    mod = lambda b, h, q, k: (q == 30) & (k == 30)
    assert attn.block_mask(mod, None, None, 64, 64, probe="border").counts()["empty"] == 1
    full = attn.block_mask(mod, None, None, 64, 64, probe="full")
    assert full.counts() == {"empty": 0, "full": 0, "partial": 1}
    assert full.to_dense()[0, 0, 30, 30] and full.to_dense().sum() == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_with_block_mask_matches_reference(rng, dtype):
    for B, H, hkv, L, S, d, block in [(1, 2, 1, 1, 1, 8, 64), (2, 2, 2, 17, 100, 16, (5, 9)),
                                      (1, 4, 2, 200, 300, 64, 64), (2, 1, 1, 129, 129, 32, (128, 32))]:
        q, k, v = rand(rng, B, H, L, d), rand(rng, B, hkv, S, d), rand(rng, B, hkv, S, d)
        for name, mod in masks(rng, L, S).items():
            bm = attn.block_mask(mod, None, None, L, S, block_size=block, probe="border")
            m = torch.as_tensor(bm.to_dense()[0, 0])
            kw = dict(enable_gqa=hkv != H)
            if dtype == "bfloat16":
                tq, tk, tv = (torch.as_tensor(x).bfloat16() for x in (q, k, v))
                out = attn.scaled_dot_product_attention(tq, tk, tv, block_mask=bm, **kw)
                same = attn.scaled_dot_product_attention(tq, tk, tv, attn_mask=m, **kw)
                assert torch.equal(out, same), name  # bitwise: the same kernel path, blocks skipped
                want, _ = reference(tq.double(), tk.double(), tv.double(), mask=m)
                assert rel_err(out.double().numpy(), want.numpy()) < 1e-2, name
                continue
            out, lse = attn.scaled_dot_product_attention(q, k, v, block_mask=bm, return_lse=True, **kw)
            want, want_lse = reference(q, k, v, mask=m)
            assert rel_err(out, want.numpy()) < 2e-6, name
            assert lse_err(lse, want_lse.numpy()) < 2e-6, name


def test_block_mask_combines_with_options_and_gradients_match_dense_mask(rng):
    B, H, L, d = 2, 2, 150, 32
    q, k, v, g = rand(rng, B, H, L, d), rand(rng, B, H, L, d), rand(rng, B, H, L, d), rand(rng, B, H, L, d)
    docs = documents(rng, L, 6)
    bm = attn.block_mask(lambda b, h, qi, ki: docs[qi] == docs[ki], None, None, L, L, block_size=32)
    m = bm.to_dense()[0, 0]
    extra = rng.random((L, L)) < 0.9
    opts = dict(is_causal=True, softcap=5.0, alibi_slopes=np.array([0.1, 0.3], np.float32))
    out, lse = attn.scaled_dot_product_attention(q, k, v, attn_mask=extra, block_mask=bm, return_lse=True, **opts)
    want, _ = reference(q, k, v, mask=torch.as_tensor(m & extra), is_causal=True, softcap=5.0,
                        alibi=np.array([0.1, 0.3], np.float32))
    assert rel_err(out, want.numpy()) < 2e-6
    grads = attn.attention_backward(g, q, k, v, out, lse, attn_mask=extra, block_mask=bm, **opts)
    dense_out, dense_lse = attn.scaled_dot_product_attention(q, k, v, attn_mask=m & extra, return_lse=True, **opts)
    dense_grads = attn.attention_backward(g, q, k, v, dense_out, dense_lse, attn_mask=m & extra, **opts)
    assert np.array_equal(out, dense_out)
    for a, b in zip(grads, dense_grads):
        assert np.array_equal(a, b)


def test_block_mask_errors(rng):
    q = rand(rng, 1, 1, 10, 8)
    bm = attn.block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 10, 10, block_size=4)
    with pytest.raises(ValueError, match="built for Lq=10, Lk=10"):
        attn.scaled_dot_product_attention(rand(rng, 1, 1, 9, 8), q, q, block_mask=bm)
    with pytest.raises(ValueError, match="built for H=3"):
        attn.scaled_dot_product_attention(q, q, q, block_mask=attn.block_mask(lambda b, h, qi, ki: qi >= 0, None, 3, 10, 10))
    with pytest.raises(TypeError, match="attn.BlockMask"):
        attn.scaled_dot_product_attention(q, q, q, block_mask=np.ones((10, 10), bool))
    with pytest.raises(TypeError, match="must be callable"):
        attn.block_mask(None, None, None, 10, 10)
    with pytest.raises(ValueError, match="probe must be"):
        attn.block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 10, 10, probe="corners")
    with pytest.raises(TypeError, match="must return booleans"):
        attn.block_mask(lambda b, h, qi, ki: qi - ki, None, None, 10, 10)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        attn.block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 10, 10, block_size=0)
    with pytest.raises(ValueError, match="Lq must be >= 1"):
        attn.block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 0, 10)
    # A hand-made table with a bad entry reaches the library's own check.
    bad = attn.BlockMask(np.full((1, 1, 3, 3), 5, np.int32), np.zeros((1, 4, 4), bool), (4, 4), (None, None, 10, 10))
    with pytest.raises(attn.Error, match="tile index in \\[0, 1\\)"):
        attn.scaled_dot_product_attention(q, q, q, block_mask=bad)
    assert "sparsity" in repr(bm)
