"""attention_with_kvcache's lean path (attn._kvcache_fast): calls on float caches with
no option beyond a scale, causal, num_splits, precision, lse, a block table, new tokens,
rotary tables, a window and a softcap go to the kernels' positional entry (torch tensors
as DLPack capsules). It must
give bitwise the checked path's output, lse and cache, take the calls it is meant for,
leave every other call to the checked path, and keep the checked path's errors and
messages."""
import numpy as np
import pytest
import torch

import attn
from conftest import count_calls
from test_kvcache import _cache_layout, _check

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@pytest.fixture
def count_checked(monkeypatch):
    """How many calls took the checked path (attn._kvcache_args)."""
    return count_calls(monkeypatch, attn, "_kvcache_args")


def checked(*args, window_size=(-1, -1), **kwargs):
    """The call on the checked path: window_size as a list, the same window, is a form
    the lean path leaves to it."""
    return attn.attention_with_kvcache(*args, window_size=list(window_size), **kwargs)


def cases(rng):
    """Decoding, speculative and chunked-prefill shapes: odd sizes, GQA and MQA, dv != d,
    contiguous and paged caches (pages of 1, 16 and 7), with and without new tokens."""
    for B, Hq, Hkv, d, dv, lq, cap, page in [(1, 1, 1, 1, 1, 1, 3, None), (3, 8, 2, 40, 40, 1, 90, 16),
                                             (2, 6, 3, 17, 33, 3, 50, 7), (1, 32, 8, 128, 128, 1, 300, None),
                                             (2, 4, 1, 64, 64, 17, 70, 1)]:
        append = bool(rng.integers(2))
        yield dict(B=B, Hq=Hq, Hkv=Hkv, d=d, dv=dv, lq=lq, cap=cap, page=page, append=append,
                   causal=bool(rng.integers(2)), scale=None if rng.integers(2) else float(rng.uniform(0.05, 0.5)),
                   num_splits=int(rng.choice([0, 1, 3])), lse=bool(rng.integers(2)),
                   rope=append and d >= 2 and bool(rng.integers(2)), interleaved=bool(rng.integers(2)),
                   window=(-1, -1) if rng.integers(2) else (int(rng.integers(0, 30)), int(rng.integers(-1, 3))),
                   softcap=0.0 if rng.integers(2) else float(rng.uniform(2, 30)))


def make(rng, c, dtype, as_torch):
    shape, table = _cache_layout(rng, c["B"], c["cap"], c["Hkv"], c["d"], c["page"])
    vshape = shape[:3] + (c["dv"],)
    new = c["lq"] if c["append"] else 0
    seqlens = rng.integers(0, c["cap"] - new + 1, c["B"]).astype(np.int32)
    arrays = dict(q=rng.uniform(-1, 1, (c["B"], c["lq"], c["Hq"], c["d"])),
                  k_cache=rng.uniform(-1, 1, shape), v_cache=rng.uniform(-1, 1, vshape),
                  k=rng.uniform(-1, 1, (c["B"], new, c["Hkv"], c["d"])) if new else None,
                  v=rng.uniform(-1, 1, (c["B"], new, c["Hkv"], c["dv"])) if new else None)
    if as_torch:
        t = {n: None if a is None else torch.from_numpy(a).to(TORCH_DTYPES[dtype]) for n, a in arrays.items()}
        return t, torch.from_numpy(seqlens), None if table is None else torch.from_numpy(table)
    np_dtype = {"f32": np.float32, "f16": np.float16}[dtype]
    return {n: None if a is None else a.astype(np_dtype) for n, a in arrays.items()}, seqlens, table


def clone(x):
    return None if x is None else (x.clone() if torch.is_tensor(x) else x.copy())


def same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("dtype,as_torch", [("f32", True), ("bf16", True), ("f16", True), ("f32", False),
                                            ("f16", False)])
def test_plain_calls_take_the_lean_path_and_match_the_checked_path_bitwise(rng, count_checked, dtype, as_torch):
    for c in cases(rng):
        t, seqlens, table = make(rng, c, dtype, as_torch)
        kw = dict(cache_seqlens=seqlens, block_table=table, softmax_scale=c["scale"], causal=c["causal"],
                  num_splits=c["num_splits"], return_softmax_lse=c["lse"], window_size=c["window"],
                  softcap=c["softcap"])
        if c["rope"]:  # tables over every position, as float32 arrays or tensors like the rest
            angles = rng.uniform(0, 6, (c["cap"], c["d"] // 2))
            tables = [np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]
            if as_torch:
                tables = [torch.from_numpy(x) for x in tables]
            kw.update(rotary_cos=tables[0], rotary_sin=tables[1], rotary_interleaved=c["interleaved"])
        caches = [(clone(t["k_cache"]), clone(t["v_cache"])) for _ in range(2)]
        before = count_checked[0]
        lean = attn.attention_with_kvcache(t["q"], *caches[0], t["k"], t["v"], **kw)
        assert count_checked[0] == before, "a plain call took the checked path: %s" % c
        slow = checked(t["q"], *caches[1], t["k"], t["v"], **kw)
        assert count_checked[0] == before + 1
        lean, slow = (r if c["lse"] else (r,) for r in (lean, slow))
        for x, y in zip(lean, slow):
            assert same(x, y), c
        for x, y in zip(caches[0], caches[1]):  # the appended rows, written the same way
            assert same(x, y), c
        if dtype == "f32":  # and it is attention: the float64 reference
            total = np.asarray(seqlens) + (c["lq"] if c["append"] else 0)
            if c["scale"] is None and c["causal"] and not c["rope"] and c["window"] == (-1, -1) and not c["softcap"]:
                _check(t["q"], lean[0], lean[1] if c["lse"] else None, caches[0][0], caches[0][1], total,
                       None if table is None else np.asarray(table))


def test_an_int_cache_seqlens_takes_the_lean_path(rng, count_checked):
    k_cache = rng.uniform(-1, 1, (2, 20, 2, 8)).astype(np.float32)
    v_cache = rng.uniform(-1, 1, (2, 20, 2, 8)).astype(np.float32)
    q = rng.uniform(-1, 1, (2, 1, 4, 8)).astype(np.float32)
    lean = attn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=13)
    assert count_checked[0] == 0
    assert np.array_equal(lean, checked(q, k_cache, v_cache, cache_seqlens=13))


def test_calls_with_other_options_take_the_checked_path(rng, count_checked):
    B, Hq, Hkv, d, cap = 2, 4, 2, 16, 24
    q = rng.uniform(-1, 1, (B, 1, Hq, d)).astype(np.float32)
    k_cache = rng.uniform(-1, 1, (B, cap, Hkv, d)).astype(np.float32)
    v_cache = rng.uniform(-1, 1, (B, cap, Hkv, d)).astype(np.float32)
    seqlens = np.array([5, 20], np.int32)
    cos = np.cos(rng.uniform(0, 3, (cap, d // 2))).astype(np.float32)
    sin = np.sin(rng.uniform(0, 3, (cap, d // 2))).astype(np.float32)
    new = rng.uniform(-1, 1, (B, 1, Hkv, d)).astype(np.float32)
    others = [dict(window_size=[4, 0]), dict(window_size=(4.0, 0)), dict(softcap=np.float32(30.0)),
              dict(alibi_slopes=np.full(Hq, 0.1, np.float32)), dict(attn_mask=np.ones((1, 21), bool)),
              dict(k=new, v=new, rotary_cos=cos.astype(np.float64), rotary_sin=sin.astype(np.float64)),
              dict(k=new, v=new, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=1),
              dict(cache_seqlens=seqlens.astype(np.int64)), dict(precision="bf16x9")]
    for i, extra in enumerate(others):
        kw = dict(cache_seqlens=seqlens)
        kw.update(extra)
        try:
            attn.attention_with_kvcache(q, k_cache, v_cache, **kw)
        except (TypeError, ValueError):
            pass  # (an int64 cache_seqlens and an unknown precision are errors: the checked path's)
        assert count_checked[0] == i + 1, extra
    k8 = rng.integers(-127, 128, (B, cap, Hkv, d)).astype(np.int8)
    scales = rng.uniform(0.001, 0.01, (B, cap, Hkv)).astype(np.float32)
    attn.attention_with_kvcache(q, k8, k8.copy(), cache_seqlens=seqlens, k_scale=scales, v_scale=scales.copy())
    assert count_checked[0] == len(others) + 1


def test_bad_calls_raise_what_the_checked_path_raises(rng):
    k_cache = rng.uniform(-1, 1, (4, 8, 2, 16)).astype(np.float32)
    v_cache = rng.uniform(-1, 1, (4, 8, 2, 16)).astype(np.float32)
    q = rng.uniform(-1, 1, (2, 1, 4, 16)).astype(np.float32)
    ro = k_cache.copy()
    ro.flags.writeable = False
    tq = torch.from_numpy(q)
    bad = [
        (q, k_cache, v_cache, dict(cache_seqlens=np.array([12, 3], np.int32), block_table=np.array([[0, 0], [1, 2]], np.int32))),
        (q, k_cache, v_cache, dict(cache_seqlens=np.array([17, 3], np.int32), block_table=np.array([[0, 3], [1, 2]], np.int32))),
        (q, k_cache, v_cache, dict(cache_seqlens=np.array([9, 1], np.int32), block_table=np.array([[0, 9], [1, 2]], np.int32))),
        (q, ro, v_cache, dict(cache_seqlens=1, block_table=np.array([[0, 3], [1, 2]], np.int32))),
        (q, k_cache, v_cache.astype(np.float16), dict(cache_seqlens=1, block_table=np.array([[0, 3], [1, 2]], np.int32))),
        (q[0], k_cache, v_cache, dict(cache_seqlens=1)),
        (q, k_cache[..., :8], v_cache, dict(cache_seqlens=1, block_table=np.array([[0, 3], [1, 2]], np.int32))),
        (tq, torch.from_numpy(k_cache), torch.from_numpy(v_cache),
         dict(cache_seqlens=torch.tensor([1, 10], dtype=torch.int32), block_table=torch.tensor([[0, 3], [1, 4]], dtype=torch.int32))),
        (tq, torch.from_numpy(k_cache), torch.from_numpy(v_cache),
         dict(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32), block_table=torch.tensor([[0, 3], [1, 2]], dtype=torch.int32))),
        (q, k_cache, v_cache, dict(cache_seqlens=2**40)),
    ]
    for i, (qq, kc, vc, kw) in enumerate(bad):
        with pytest.raises(Exception) as slow:
            checked(qq, kc.copy() if kc is not ro else ro, vc, **kw)
        with pytest.raises(Exception) as lean:
            attn.attention_with_kvcache(qq, kc.copy() if kc is not ro else ro, vc, **kw)
        assert type(lean.value) is type(slow.value) and str(lean.value) == str(slow.value), i
