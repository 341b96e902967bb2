"""Calls whose element offsets pass 2^31, where an index held in 32 bits would wrap: an
i8 cache of 2^31 + codes (attend over all of it, a window at its end, an append with
rotary embedding at the last positions), a paged bf16 cache whose last blocks lie past
2^31 elements, and scaled_dot_product_attention on f16 keys and values of 2^31 +
elements. Each needs 4.3–8.6 GB of memory and seconds, so the suite skips them unless
ATTN_TEST_LARGE=1 (docs/TESTING.md); the float64 reference runs over chunks of keys."""
import os

import numpy as np
import pytest
import torch

import attn

pytestmark = pytest.mark.skipif(os.environ.get("ATTN_TEST_LARGE") != "1",
                                reason="needs ~9 GB of memory: set ATTN_TEST_LARGE=1")
D = 128
PAST = (1 << 31) // D  # rows of D elements that reach 2^31


def reference(q, rows, keys, values, scale=D ** -0.5, chunk=1 << 20):
    """float64 softmax(q·kᵀ·scale)·v and lse for q [R, D] over key rows [0, rows), with
    keys(lo, hi) and values(lo, hi) giving float64 rows: an online softmax over chunks."""
    m, l = np.full(len(q), -np.inf), np.zeros(len(q))
    o = np.zeros((len(q), D))
    for lo in range(0, rows, chunk):
        hi = min(rows, lo + chunk)
        s = (q @ keys(lo, hi).T) * scale
        top = np.maximum(m, s.max(1))
        p, a = np.exp(s - top[:, None]), np.exp(m - top)
        l, o, m = l * a + p.sum(1), o * a[:, None] + p @ values(lo, hi), top
    return o / l[:, None], m + np.log(l)


def assert_close(out, lse, want, want_lse, tol):
    out = np.asarray(out, np.float64).reshape(want.shape)
    assert np.abs(out - want).max() <= tol * max(1.0, np.abs(want).max())
    assert np.abs(np.asarray(lse, np.float64).reshape(want_lse.shape) - want_lse).max() <= 1e-4


def test_i8_cache_past_2_31_codes(rng):
    cap = PAST + 4099
    k, v = (rng.integers(-127, 128, size=(1, cap, 1, D), dtype=np.int8) for _ in range(2))
    ks = (0.01 * rng.random((1, cap, 1)) + 1e-3).astype(np.float32)
    vs = (0.01 * rng.random((1, cap, 1))).astype(np.float32)
    q = rng.standard_normal((1, 2, 4, D)).astype(np.float32)
    for lens, left in ((cap - 3, -1), (cap, 37)):  # all keys; a window over the last ones
        out, lse = attn.attention_with_kvcache(q, k, v, cache_seqlens=np.array([lens], np.int32), k_scale=ks, v_scale=vs,
                                               causal=True, window_size=(left, 0), return_softmax_lse=True)
        lo = 0 if left < 0 else lens - 1 - left  # the last query row's first key
        want, want_lse = reference(q[0, 1].astype(np.float64), lens - lo,
                                   lambda a, b: k[0, lo + a:lo + b, 0] * ks[0, lo + a:lo + b].astype(np.float64),
                                   lambda a, b: v[0, lo + a:lo + b, 0] * vs[0, lo + a:lo + b].astype(np.float64))
        assert_close(out[0, 1], lse[0, :, 1], want, want_lse, 2e-5)
    # Append two rotated tokens at the last positions (quantize on append).
    lens = cap - 2
    new_k, new_v = (rng.standard_normal((1, 2, 1, D)).astype(np.float32) for _ in range(2))
    angle = np.outer(np.arange(cap - 2, cap), 1e-4 * np.arange(D // 2))
    cos, sin = np.zeros((cap, D // 2), np.float32), np.zeros((cap, D // 2), np.float32)
    cos[-2:], sin[-2:] = np.cos(angle), np.sin(angle)
    before = k[0, :lens, 0, :8].copy()
    attn.attention_with_kvcache(q, k, v, new_k, new_v, cache_seqlens=np.array([lens], np.int32), k_scale=ks,
                                v_scale=vs, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
    x1, x2 = new_k[0, :, 0, : D // 2], new_k[0, :, 0, D // 2:]
    rotated = np.concatenate([x1 * cos[-2:] - x2 * sin[-2:], x2 * cos[-2:] + x1 * sin[-2:]], axis=1)
    for cache, scale, want in ((k, ks, rotated), (v, vs, new_v[0, :, 0])):
        got = cache[0, lens:, 0] * scale[0, lens:].astype(np.float64)
        assert np.abs(got - want).max() <= 0.5 / 127 * np.abs(want).max(axis=1).max() * 1.001
    assert np.array_equal(k[0, :lens, 0, :8], before)


def test_paged_bf16_cache_with_blocks_past_2_31_elements(rng):
    page, hkv, used = 16, 2, 300
    blocks = PAST // (page * hkv) + 50
    g = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    k, v = (torch.randn(blocks, page, hkv, D, generator=g, dtype=torch.bfloat16) for _ in range(2))
    table = np.concatenate([[0], blocks - 1 - rng.permutation(used - 1)]).astype(np.int32)  # first and last pages
    q = torch.randn(1, 1, 2 * hkv, D, generator=g, dtype=torch.bfloat16)
    lens = used * page - 5
    out, lse = attn.attention_with_kvcache(q, k, v, cache_seqlens=np.array([lens], np.int32), block_table=table[None],
                                           return_softmax_lse=True)
    index = torch.as_tensor(table.astype(np.int64))
    for h in range(2 * hkv):
        keys, values = (c[index].reshape(-1, hkv, D)[:lens, h // 2].double().numpy() for c in (k, v))
        want, want_lse = reference(q[0, 0, h:h + 1].double().numpy(), lens, lambda a, b: keys[a:b],
                                   lambda a, b: values[a:b])
        assert_close(out[0, 0, h].float(), lse[0, h], want, want_lse, 1e-2)  # bf16 output: 2^-9 of it


def test_sdpa_on_f16_keys_past_2_31_elements(rng):
    S = PAST + 777
    k, v = (rng.standard_normal((1, 1, S, D), dtype=np.float32).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((1, 1, 3, D)).astype(np.float16)
    out, lse = attn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                                 return_lse=True)
    for r in range(3):  # row r sees keys [0, S − 2 + r)
        want, want_lse = reference(q[0, 0, r:r + 1].astype(np.float64), S - 2 + r,
                                   lambda a, b: k[0, 0, a:b].astype(np.float64), lambda a, b: v[0, 0, a:b].astype(np.float64))
        assert_close(out[0, 0, r], lse[0, 0, r], want, want_lse, 3e-3)
