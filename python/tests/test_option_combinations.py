"""Options in random combination, against the float64 reference: the other tests take the
options one or two at a time; here each case draws shapes (odd head dims, dv ≠ d, L ≠ S,
GQA), dtype and every option at once — causal in either alignment, window, softcap,
ALiBi, a boolean or additive mask, a scale, a block mask — for scaled_dot_product_attention
and its backward, and for attention_with_kvcache on contiguous and paged caches with appended
tokens and forced split counts; and that such calls (bf16 and i8 caches too) give
bitwise the same results on 1 and 2 threads. A time-bounded campaign of the same draws
(177k calls on AMD Zen 4, 2026-11-29) found no disagreement; these cases keep the
combinations covered."""
import numpy as np
import pytest
import torch

import attn
from conftest import SEED, lse_err, reference
from test_backward import reference_grads
from test_kvcache import _logical


def _block_mask(rng, B, Hq, L, S):
    """A random attn.BlockMask for a [B, Hq, L, S] call, and its predicate at every
    position, [B or 1, Hq or 1, L, S]: documents, a window with global tokens, or a
    pattern that changes across blocks, each maybe depending on the batch and head."""
    cuts = np.cumsum(rng.random((B, max(L, S))) < 0.05, axis=1)
    w, g = int(rng.integers(0, 20)), int(rng.integers(0, 4))
    mods = [lambda b, h, q, k: cuts[b, q] == cuts[b, k],
            lambda b, h, q, k: (np.abs(q - k) <= w + 3 * h) | (k < g) | (q < g),
            lambda b, h, q, k: ((q // 5 + k // 7 + h + b) % 3 != 0) | (k == q % S)]
    mod = mods[int(rng.integers(len(mods)))]
    bm, hm = (B if rng.random() < 0.5 else None), (Hq if rng.random() < 0.5 else None)
    block = int(rng.choice([1, 3, 16, 64])) if rng.random() < 0.6 else (int(rng.choice([2, 64])), int(rng.choice([5, 64])))
    idx = np.ix_(np.arange(bm or 1), np.arange(hm or 1), np.arange(L), np.arange(S))
    return attn.block_mask(mod, bm, hm, L, S, block_size=block), np.broadcast_to(mod(*idx), ((bm or 1), (hm or 1), L, S))


def _options(rng, B, Hq, L, S, block_masks=False):
    """Random options for a [B, Hq, L, S] call: the library's keywords, and the reference's."""
    opts, ref = {}, {}
    if rng.random() < 0.5:
        alignment = str(rng.choice(["top_left", "bottom_right"]))
        opts.update(is_causal=True, causal_alignment=alignment)
        ref.update(is_causal=True, alignment=alignment)
    if rng.random() < 0.3:
        window = (int(rng.choice([-1, 0, 3, 50])), int(rng.choice([-1, 0, 2])))
        opts["window"], ref["window"] = window, window
    if rng.random() < 0.3:
        opts["softcap"] = ref["softcap"] = 5.0
    if rng.random() < 0.25:
        slopes = (0.3 * rng.random((Hq,) if rng.random() < 0.5 else (B, Hq))).astype(np.float32)
        opts["alibi_slopes"] = ref["alibi"] = slopes
    if rng.random() < 0.3:
        opts["scale"] = ref["scale"] = float(rng.uniform(0.05, 0.5))
    if rng.random() < 0.3:
        shape = (int(rng.choice([1, B])), int(rng.choice([1, Hq])), int(rng.choice([1, L])), int(rng.choice([1, S])))
        if rng.random() < 0.5:
            mask = rng.random(shape) < 0.8
        else:
            mask = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        opts["attn_mask"] = ref["mask"] = mask
    if block_masks and rng.random() < 0.3:
        opts["block_mask"], ref["allowed"] = _block_mask(rng, B, Hq, L, S)
    return opts, ref


def _where(case, opts):
    return "seed %d case %d: %r" % (SEED, case, {k: getattr(v, "shape", v) for k, v in opts.items()})


@pytest.mark.parametrize("case", range(100))
def test_sdpa_and_its_backward_in_random_option_combinations(rng, case):
    B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2, 3]))
    Hq = Hkv * int(rng.choice([1, 2, 4]))
    d = int(rng.choice([1, 3, 17, 32, 64, 80, 128]))
    dv = d if rng.random() < 0.7 else int(rng.choice([1, 7, 32]))
    L = int(rng.choice([1, 2, 17, 64, 100]))
    S = L if rng.random() < 0.5 else int(rng.choice([1, 3, 17, 65, 130]))
    dtype = np.float32 if rng.random() < 0.75 else np.float16
    q = (float(rng.choice([0.5, 1.0, 3.0])) * rng.standard_normal((B, Hq, L, d))).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, dv)).astype(dtype)
    g = rng.standard_normal((B, Hq, L, dv)).astype(dtype)
    opts, ref = _options(rng, B, Hq, L, S, block_masks=True)
    where = _where(case, opts)
    out, lse = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **opts)
    wide = [x.astype(np.float64) for x in (q, k, v, g)]  # the reference sees the inputs as rounded
    want, want_lse = reference(*wide[:3], **ref)
    tol = 2e-5 if dtype == np.float32 else 3e-3  # f16: the output's rounding (2^-11 of it)
    assert np.abs(np.asarray(out, np.float64) - want.numpy()).max() <= tol * max(1.0, float(want.abs().max())), where
    assert np.array_equal(np.isfinite(np.asarray(lse)), torch.isfinite(want_lse).numpy()), where
    assert lse_err(lse, want_lse) <= 1e-4, where
    if case % 2:
        return
    grads = attn.attention_backward(g, q, k, v, out, lse, enable_gqa=True, **opts)
    for name, got, w in zip(("dq", "dk", "dv"), grads, reference_grads(*wide, **ref)):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), name + " " + where
        err = np.abs(got - w.numpy()).max() / max(1.0, float(w.abs().max()))
        assert err <= (1e-4 if dtype == np.float32 else 2e-2), "%s %.3g %s" % (name, err, where)


@pytest.mark.parametrize("case", range(100))
def test_kvcache_in_random_option_combinations(rng, case):
    B, Hkv = int(rng.integers(1, 4)), int(rng.choice([1, 2, 3]))
    Hq = Hkv * int(rng.choice([1, 2, 4, 5]))
    d = int(rng.choice([1, 3, 17, 32, 64, 128]))
    dv = d if rng.random() < 0.7 else int(rng.choice([1, 5, 64]))
    Lq = int(rng.choice([1, 1, 2, 5, 17, 40, 130]))  # 40 and 130: chunked prefill, often the tiled route
    Lnew = 0 if rng.random() < 0.5 else int(rng.choice([Lq, 1, 4]))
    lens = rng.integers(0, int(rng.choice([1, 16, 70, 600])) + 1, size=B).astype(np.int32)
    cap = max(1, int(lens.max()) + Lnew + int(rng.integers(0, 5)))
    dtype = np.float32 if rng.random() < 0.75 else np.float16
    # Sometimes queries (and new tokens) of the other dtype: mixed calls, whose chunked
    # prefill reads the cache widened to float32.
    qdtype = dtype if rng.random() < 0.75 else (np.float16 if dtype == np.float32 else np.float32)
    page = None if rng.random() < 0.5 else int(rng.choice([1, 3, 16, 64]))
    rows = B
    block_table = None
    if page is not None:  # pages in random order, a few spare
        blocks = -(-cap // page)
        rows = B * blocks + int(rng.integers(0, 3))
        block_table = rng.permutation(rows)[: B * blocks].reshape(B, blocks).astype(np.int32)
    k_cache = rng.standard_normal((rows, page or cap, Hkv, d)).astype(dtype)
    v_cache = rng.standard_normal((rows, page or cap, Hkv, dv)).astype(dtype)
    q = (float(rng.choice([0.5, 1.0, 3.0])) * rng.standard_normal((B, Lq, Hq, d))).astype(qdtype)
    k_new = rng.standard_normal((B, Lnew, Hkv, d)).astype(qdtype) if Lnew else None
    v_new = rng.standard_normal((B, Lnew, Hkv, dv)).astype(qdtype) if Lnew else None
    total = lens + Lnew
    opts, ref = _options(rng, B, Hq, Lq, max(1, int(total.max())))
    opts.pop("causal_alignment", None)
    ref["alignment"] = "bottom_right"  # the cache's alignment, FlashAttention's
    kv = dict(causal=opts.pop("is_causal", False), softmax_scale=opts.pop("scale", None),
              window_size=opts.pop("window", (-1, -1)), softcap=opts.pop("softcap", 0.0),
              alibi_slopes=opts.pop("alibi_slopes", None), attn_mask=opts.pop("attn_mask", None),
              num_splits=int(rng.choice([0, 0, 1, 2, 7])))
    where = _where(case, dict(kv, page=page, cache=np.dtype(dtype).name, q=np.dtype(qdtype).name))
    out, lse = attn.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                           block_table=block_table, return_softmax_lse=True, **kv)
    tol = 2e-5 if qdtype == np.float32 else 3e-3  # float32 arithmetic, the output rounded to q's dtype
    for b in range(B):
        if total[b] == 0:  # no keys: output 0 and lse -inf, the library's rule for a row that sees none
            assert not np.asarray(out[b]).any() and np.isneginf(np.asarray(lse[b])).all(), where
            continue
        keys = _logical(k_cache, total, b, block_table)  # the appended tokens are in the cache now
        vals = _logical(v_cache, total, b, block_table)
        if Lnew:
            np.testing.assert_array_equal(keys[lens[b]:], k_new[b].astype(dtype), err_msg=where)
        rb = dict(ref)
        if "mask" in rb:  # the mask's columns are cache positions: sequence b reads its first total[b]
            mask = rb["mask"][b % rb["mask"].shape[0]]
            rb["mask"] = mask if mask.shape[-1] == 1 else mask[..., : int(total[b])]
        if "alibi" in rb and rb["alibi"].ndim == 2:
            rb["alibi"] = rb["alibi"][b]
        want, want_lse = reference(q[b].transpose(1, 0, 2).astype(np.float64), keys.transpose(1, 0, 2),
                                   vals.transpose(1, 0, 2), **rb)
        got = np.asarray(out[b], np.float64).transpose(1, 0, 2)
        assert np.abs(got - want.numpy()).max() <= tol * max(1.0, float(want.abs().max())), "b %d %s" % (b, where)
        assert np.array_equal(np.isfinite(np.asarray(lse[b])), torch.isfinite(want_lse).numpy()), where
        assert lse_err(lse[b], want_lse) <= 1e-4, where


def _on_threads(call):
    """call() on 1 thread and on 2, as float32 NumPy arrays (bf16 widened exactly)."""
    before = attn.num_threads()
    results = []
    try:
        for n in (1, 2):
            attn.set_num_threads(n)
            results.append([np.asarray(x.float() if torch.is_tensor(x) else x, np.float32) for x in call()])
    finally:
        attn.set_num_threads(before)
    return results


@pytest.mark.parametrize("case", range(24))
def test_thread_count_changes_no_bit_in_random_combinations(rng, case):
    """Bitwise the same on 1 and 2 threads (the library's promise), for random shapes,
    dtypes (f32, f16, bf16; caches also i8 under both precisions) and options, the
    forward with lse and dropout, its backward, and the KV cache with forced splits."""
    if case % 2:  # scaled_dot_product_attention and its backward
        B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
        Hq = Hkv * int(rng.choice([1, 2, 4]))
        d, L, S = int(rng.choice([3, 17, 64, 128])), int(rng.choice([1, 5, 65, 200])), int(rng.choice([1, 7, 64, 300]))
        x = [rng.standard_normal(shape).astype(np.float32)
             for shape in ((B, Hq, L, d), (B, Hkv, S, d), (B, Hkv, S, d), (B, Hq, L, d))]
        dtype = str(rng.choice(["f32", "f16", "bf16"]))
        if dtype == "f16":
            x = [a.astype(np.float16) for a in x]
        elif dtype == "bf16":
            x = [torch.from_numpy(a).to(torch.bfloat16) for a in x]
        opts, _ = _options(rng, B, Hq, L, S, block_masks=True)
        opts.update(enable_gqa=True, seed=1234, dropout_p=0.1 if rng.random() < 0.25 else 0.0)

        def call():
            out, lse = attn.scaled_dot_product_attention(*x[:3], return_lse=True, **opts)
            return (out, lse) + tuple(attn.attention_backward(x[3], *x[:3], out, lse, **opts))
    else:  # attention_with_kvcache
        B, Hkv = int(rng.integers(1, 4)), int(rng.choice([1, 2, 8]))
        Hq, d, Lq = Hkv * int(rng.choice([1, 4])), int(rng.choice([16, 64, 128])), int(rng.choice([1, 1, 3]))
        lens = rng.integers(0, 3000, size=B).astype(np.int32)
        cap = int(lens.max()) + 1
        q = rng.standard_normal((B, Lq, Hq, d)).astype(np.float32)
        k_cache, v_cache = (rng.standard_normal((B, cap, Hkv, d)).astype(np.float32) for _ in range(2))
        kv = dict(cache_seqlens=lens, causal=bool(rng.random() < 0.5), num_splits=int(rng.choice([0, 1, 3, 16])),
                  return_softmax_lse=True)
        dtype = str(rng.choice(["f32", "bf16", "f16", "i8"]))
        if dtype == "bf16":
            q, k_cache, v_cache = (torch.from_numpy(a).to(torch.bfloat16) for a in (q, k_cache, v_cache))
        elif dtype == "f16":
            q, k_cache, v_cache = (a.astype(np.float16) for a in (q, k_cache, v_cache))
        elif dtype == "i8":
            k_cache, v_cache = (np.clip(np.round(40 * a), -127, 127).astype(np.int8) for a in (k_cache, v_cache))
            kv.update(k_scale=(0.05 * rng.random((B, cap, Hkv))).astype(np.float32),
                      v_scale=(0.05 * rng.random((B, cap, Hkv))).astype(np.float32),
                      precision=str(rng.choice(["f32", "bf16"])))

        def call():
            return attn.attention_with_kvcache(q, k_cache, v_cache, **kv)
    one, two = _on_threads(call)
    for i, (a, b) in enumerate(zip(one, two)):
        assert np.array_equal(a, b, equal_nan=True), "seed %d case %d (%s): result %d differs" % (SEED, case, dtype, i)
