"""attn.scaled_dot_product_attention against the float64 reference: random shapes and
options, strided and transposed views, NumPy and torch inputs, batch dims, varlen."""
import numpy as np
import pytest
import torch

import attn
from conftest import SEED, lse_err, reference, rel_err


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def random_case(rng):
    B = int(rng.choice([1, 2, 3]))
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2, 3]))
    L = int(rng.choice([1, 3, 17, 64, 100]))
    S = int(rng.choice([1, 5, 17, 64, 131])) if rng.random() < 0.5 else L
    d = int(rng.choice([1, 7, 32, 64, 80]))
    dv = d if rng.random() < 0.7 else int(rng.choice([3, 16, 96]))
    opts = {}
    if rng.random() < 0.4:
        opts["is_causal"] = True
        opts["causal_alignment"] = "top_left" if rng.random() < 0.5 else "bottom_right"
    if rng.random() < 0.3:
        opts["window"] = (int(rng.integers(-1, 20)), int(rng.integers(-1, 20)))
    if rng.random() < 0.2:
        opts["softcap"] = float(rng.uniform(2, 20))
    if rng.random() < 0.2:
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, size=(hq,)).astype(np.float32)
    if rng.random() < 0.4:
        shape = [(B, hq, L, S), (L, S), (B, 1, 1, S), (hq, L, S)][int(rng.integers(4))]
        opts["attn_mask"] = (rng.random(shape) < 0.8) if rng.random() < 0.5 else rand(rng, *shape)
    if rng.random() < 0.3:
        opts["scale"] = float(rng.uniform(0.05, 1.0))
    return B, hq, hkv, L, S, d, dv, opts


def layouts(rng, x):
    """The same values as a contiguous array, a BSHD buffer seen as BHSD, or a padded slice."""
    kind = int(rng.integers(3))
    if kind == 0:
        return x
    if kind == 1:
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # strides of BSHD
    padded = np.zeros(x.shape[:-1] + (x.shape[-1] + 5,), np.float32)
    padded[..., 2:2 + x.shape[-1]] = x
    return padded[..., 2:2 + x.shape[-1]]  # row stride larger than d


@pytest.mark.parametrize("case", range(40))
def test_random_options_match_float64(rng, case):
    B, hq, hkv, L, S, d, dv, opts = random_case(rng)
    q, k, v = rand(rng, B, hq, L, d), rand(rng, B, hkv, S, d), rand(rng, B, hkv, S, dv)
    use_torch = case % 2 == 1
    args = [layouts(rng, t) for t in (q, k, v)]
    if use_torch:
        args = [torch.from_numpy(a) for a in args]
        if isinstance(opts.get("attn_mask"), np.ndarray):
            opts["attn_mask"] = torch.from_numpy(opts["attn_mask"])
    out, lse = attn.scaled_dot_product_attention(*args, enable_gqa=True, return_lse=True, **opts)
    assert isinstance(out, torch.Tensor) == use_torch
    ref_opts = dict(opts)
    mask = ref_opts.pop("attn_mask", None)
    ref_kw = dict(mask=None if mask is None else np.asarray(mask), is_causal=ref_opts.get("is_causal", False),
                  scale=ref_opts.get("scale"), alignment=ref_opts.get("causal_alignment", "top_left"),
                  window=ref_opts.get("window"), softcap=ref_opts.get("softcap"), alibi=ref_opts.get("alibi_slopes"))
    want, want_lse = reference(q, k, v, **ref_kw)
    plain, plain_lse = reference(q, k, v, dtype=torch.float32, **ref_kw)
    assert out.shape == (B, hq, L, dv)
    # The 1e-6 bar, except where f32 arithmetic itself cannot meet it (large logits from
    # ALiBi, masks or the scale, one short row): then 10x the plain f32 pipeline's error,
    # the C++ harness's per-case screen.
    why = "seed %d case %s" % (SEED, (B, hq, hkv, L, S, d, dv, opts.keys()))
    assert rel_err(out, want) <= max(1e-6, 10 * rel_err(plain, want)), why
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(torch.as_tensor(np.asarray(lse))), finite)
    assert lse_err(lse, want_lse) <= max(1e-6, 10 * lse_err(plain_lse, want_lse)), why


def test_batch_dims_none_and_several(rng):
    q, k, v = rand(rng, 3, 9, 16), rand(rng, 3, 11, 16), rand(rng, 3, 11, 8)
    assert rel_err(attn.scaled_dot_product_attention(q, k, v), reference(q, k, v)[0]) <= 1e-6
    q5, k5, v5 = rand(rng, 2, 3, 2, 9, 16), rand(rng, 2, 3, 2, 11, 16), rand(rng, 2, 3, 2, 11, 8)
    mask = rng.random((3, 1, 9, 11)) < 0.7
    out = attn.scaled_dot_product_attention(q5, k5, v5, attn_mask=mask)
    assert out.shape == (2, 3, 2, 9, 8)
    assert rel_err(out, reference(q5, k5, v5, mask=mask)[0]) <= 1e-6


def test_fully_masked_rows_are_zero_not_nan(rng):
    q, k, v = rand(rng, 1, 2, 4, 8), rand(rng, 1, 2, 5, 8), rand(rng, 1, 2, 5, 8)
    mask = np.ones((4, 5), bool)
    mask[2] = False
    out, lse = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert np.all(out[:, :, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))
    assert np.all(np.isfinite(out))


def test_varlen_matches_each_sequence(rng):
    lens_q, lens_k = [5, 1, 17], [7, 3, 17]
    H, hkv, d = 4, 2, 32
    q, k, v = rand(rng, sum(lens_q), H, d), rand(rng, sum(lens_k), hkv, d), rand(rng, sum(lens_k), hkv, d)
    cu_q = np.cumsum([0] + lens_q).astype(np.int32)
    cu_k = np.cumsum([0] + lens_k).astype(np.int32)
    out, lse = attn.varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True)
    assert out.shape == (sum(lens_q), H, d) and lse.shape == (H, sum(lens_q))
    for b in range(3):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2)
        ks = k[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2)
        vs = v[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2)
        want, want_lse = reference(qs, ks, vs, is_causal=True, alignment="bottom_right")
        assert rel_err(out[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2), want) <= 1e-6
        assert rel_err(lse[:, cu_q[b]:cu_q[b + 1]], want_lse) <= 1e-6
    with pytest.raises(ValueError, match="max_seqlen_q"):
        attn.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=3)


def test_results_do_not_depend_on_threads(rng):
    q, k, v = rand(rng, 2, 4, 200, 64), rand(rng, 2, 4, 300, 64), rand(rng, 2, 4, 300, 64)
    before = attn.num_threads()
    try:
        attn.set_num_threads(1)
        one = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn.set_num_threads(2)
        two = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        attn.set_num_threads(before)
    assert np.array_equal(one, two)


def test_help_and_stubs():
    import os
    doc = attn.scaled_dot_product_attention.__doc__
    assert "attn_mask" in doc and "is_causal" in doc and "window" in doc
    assert os.path.exists(os.path.join(os.path.dirname(attn.__file__), "__init__.pyi"))
    assert os.path.exists(os.path.join(os.path.dirname(attn.__file__), "py.typed"))
