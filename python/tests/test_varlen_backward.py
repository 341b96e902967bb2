"""Gradients of packed variable-length attention: attn.varlen_attention_backward and the
differentiable attn.torch.varlen_attention, against PyTorch autograd of the explicit
float64 pipeline run on each sequence alone."""
import numpy as np
import pytest
import torch

import attn
import attn.torch
from conftest import reference, rel_err


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def packed_problem(rng, lens_q, lens_k, hq, hkv, d, dv=None):
    """q [total_q, hq, d], k/v [total_k, hkv, d|dv], grad_out like out, and the int32
    prefix sums."""
    dv = d if dv is None else dv
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = rand(rng, cq[-1], hq, d), rand(rng, ck[-1], hkv, d), rand(rng, ck[-1], hkv, dv)
    g = rand(rng, cq[-1], hq, dv)
    return q, k, v, g, cq, ck


def per_sequence_grads(q, k, v, g, cq, ck, causal=False, window=None, softcap=None, alibi=None, scale=None):
    """dq, dk, dv by float64 autograd through `reference`, one sequence at a time
    (bottom-right causal and windows, as FlashAttention's varlen)."""
    dq, dk, dv = (np.zeros(x.shape, np.float64) for x in (q, k, v))
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        leaves = [torch.tensor(x[s].transpose(1, 0, 2), dtype=torch.float64, requires_grad=True)
                  for x, s in ((q, sq), (k, sk), (v, sk))]
        slopes = None if alibi is None else (alibi[b] if alibi.ndim == 2 else alibi)
        out, _ = reference(*leaves, is_causal=causal, alignment="bottom_right", window=window, softcap=softcap,
                           alibi=slopes, scale=scale)
        (out * torch.tensor(g[sq].transpose(1, 0, 2), dtype=torch.float64)).sum().backward()
        for dst, leaf, s in ((dq, leaves[0], sq), (dk, leaves[1], sk), (dv, leaves[2], sk)):
            dst[s] = leaf.grad.numpy().transpose(1, 0, 2)
    return dq, dk, dv


@pytest.mark.parametrize("case", range(12))
def test_gradients_match_float64_autograd_per_sequence(rng, case):
    n = int(rng.choice([1, 2, 3]))
    sizes = [1, 3, 17, 40, 67]
    lens_q = [int(rng.choice(sizes)) for _ in range(n)]
    lens_k = [int(rng.choice(sizes)) for _ in range(n)]
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 3]))
    d = int(rng.choice([5, 16, 33, 64]))
    dv = int(rng.choice([d, 8]))
    q, k, v, g, cq, ck = packed_problem(rng, lens_q, lens_k, hq, hkv, d, dv)
    causal = bool(case % 2)
    window = (int(rng.integers(0, 20)), int(rng.integers(0, 5))) if case % 3 == 0 else None
    softcap = float(rng.uniform(2, 20)) if case % 4 == 1 else None
    alibi = rng.uniform(0.01, 0.5, (n, hq) if case % 5 == 2 else hq).astype(np.float32) if case % 5 in (2, 3) else None
    scale = float(rng.uniform(0.05, 0.5)) if case % 6 == 4 else None
    opts = dict(causal=causal, window_size=window or (-1, -1), softcap=softcap or 0.0, alibi_slopes=alibi,
                softmax_scale=scale)
    out, lse = attn.varlen_attention(q, k, v, cq, ck, return_lse=True, **opts)
    dq, dk, dv_ = attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, **opts)
    assert dq.shape == q.shape and dk.shape == k.shape and dv_.shape == v.shape
    assert dq.dtype == dk.dtype == dv_.dtype == np.float32
    want = per_sequence_grads(q, k, v, g, cq, ck, causal, window, softcap, alibi, scale)
    for name, got, w in (("dq", dq, want[0]), ("dk", dk, want[1]), ("dv", dv_, want[2])):
        assert np.isfinite(got).all(), name
        assert rel_err(got, w) <= 2e-5, (name, rel_err(got, w), lens_q, lens_k, hq, hkv, d, dv, opts)
    # The float64 reference's backward, on the same call: the same gradients, one rounding.
    ref = attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, reference=True, **opts)
    for got, w in zip(ref, want):
        assert rel_err(got, w) <= 2e-5


def test_sequences_without_keys_or_queries(rng):
    # A sequence with no keys: its queries see nothing (out 0, lse -inf) and get zero
    # gradients; one with no queries gives its keys zero gradients.
    q, k, v, g, cq, ck = packed_problem(rng, [3, 0, 5], [0, 4, 6], 2, 2, 8)
    out, lse = attn.varlen_attention(q, k, v, cq, ck, return_lse=True)
    assert (out[:3] == 0).all() and np.isneginf(lse[:, :3]).all()
    dq, dk, dv = attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck)
    assert (dq[:3] == 0).all() and (dk[:4] == 0).all() and (dv[:4] == 0).all()
    want = per_sequence_grads(q, k, v, g, cq, ck)
    for got, w in zip((dq, dk, dv), want):
        assert rel_err(got, w) <= 2e-5


def test_dropout_backward_replays_the_forward_decisions(rng):
    q, k, v, g, cq, ck = packed_problem(rng, [9, 30], [12, 41], 4, 2, 16)
    out, lse, seed = attn.varlen_attention(q, k, v, cq, ck, dropout_p=0.3, causal=True, return_lse=True,
                                           return_seed=True)
    grads = attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, dropout_p=0.3, causal=True, seed=seed)
    # The float64 reference with the same seed draws the same decisions.
    ref_out = attn.varlen_attention(q, k, v, cq, ck, dropout_p=0.3, causal=True, seed=seed, reference=True)
    assert rel_err(out, ref_out) <= 1e-5
    ref = attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, dropout_p=0.3, causal=True, seed=seed,
                                         reference=True)
    for got, w in zip(grads, ref):
        assert rel_err(got, w) <= 2e-5
    # Another seed gives other gradients: the seed is used, not ignored.
    other = attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, dropout_p=0.3, causal=True, seed=seed + 1)
    assert rel_err(other[2], grads[2]) > 1e-2
    with pytest.raises(ValueError, match="seed"):
        attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, dropout_p=0.3, causal=True)


def test_backward_is_identical_for_any_thread_count(rng):
    q, k, v, g, cq, ck = packed_problem(rng, [70, 1, 133], [90, 17, 140], 4, 1, 32)
    out, lse = attn.varlen_attention(q, k, v, cq, ck, causal=True, return_lse=True)
    saved = attn.num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            attn.set_num_threads(threads)
            results.append(attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, causal=True))
    finally:
        attn.set_num_threads(saved)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert np.array_equal(a, b)


def test_bad_saved_tensors_are_named(rng):
    q, k, v, g, cq, ck = packed_problem(rng, [4, 5], [6, 7], 2, 2, 8)
    out, lse = attn.varlen_attention(q, k, v, cq, ck, return_lse=True)
    with pytest.raises(ValueError, match="lse: expected shape \\(2, 9\\)"):
        attn.varlen_attention_backward(g, q, k, v, out, lse.T.copy(), cq, ck)
    with pytest.raises(ValueError, match="grad_out: expected shape"):
        attn.varlen_attention_backward(g[:5], q, k, v, out, lse, cq, ck)
    with pytest.raises(ValueError, match="out: expected shape"):
        attn.varlen_attention_backward(g, q, k, v, out[:, :1], lse, cq, ck)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck + 1)
    with pytest.raises(TypeError, match="softmax_scale: expected a number"):
        attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, softmax_scale="big")


def test_torch_autograd_gives_the_backward_function_gradients(rng):
    q, k, v, g, cq, ck = packed_problem(rng, [5, 23, 1], [7, 31, 2], 6, 2, 24)
    leaves = [torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v)]
    opts = dict(causal=True, window_size=(9, 0), softcap=7.5, dropout_p=0.2, seed=12345)
    out = attn.torch.varlen_attention(*leaves, torch.from_numpy(cq), torch.from_numpy(ck), **opts)
    assert out.grad_fn is not None
    (out * torch.from_numpy(g)).sum().backward()
    o, lse = attn.varlen_attention(q, k, v, cq, ck, return_lse=True, **opts)
    assert np.array_equal(out.detach().numpy(), o)
    want = attn.varlen_attention_backward(g, q, k, v, o, lse, cq, ck, **opts)
    for leaf, w in zip(leaves, want):
        assert np.array_equal(leaf.grad.numpy(), w)


def test_generic_function_on_tensors_that_require_grad_is_differentiable(rng):
    q, k, v, g, cq, ck = packed_problem(rng, [3, 4], [5, 9], 2, 1, 8)
    leaves = [torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v)]
    out = attn.varlen_attention(*leaves, cq, ck, causal=True)
    assert out.requires_grad
    (out * torch.from_numpy(g)).sum().backward()
    for leaf, w in zip(leaves, per_sequence_grads(q, k, v, g, cq, ck, causal=True)):
        assert rel_err(leaf.grad, w) <= 2e-5
    # Dropout without a seed: the forward draws one and the backward replays it.
    for leaf in leaves:
        leaf.grad = None
    out = attn.varlen_attention(*leaves, cq, ck, dropout_p=0.5)
    seed = attn.last_dropout_seed()
    (out * torch.from_numpy(g)).sum().backward()
    o, lse = attn.varlen_attention(q, k, v, cq, ck, dropout_p=0.5, seed=seed, return_lse=True)
    assert np.array_equal(out.detach().numpy(), o)
    want = attn.varlen_attention_backward(g, q, k, v, o, lse, cq, ck, dropout_p=0.5, seed=seed)
    for leaf, w in zip(leaves, want):
        assert np.array_equal(leaf.grad.numpy(), w)
    with torch.no_grad():
        assert not attn.varlen_attention(*leaves, cq, ck).requires_grad
    with pytest.warns(UserWarning, match="records no gradient"):
        out, lse = attn.varlen_attention(*leaves, cq, ck, return_lse=True)
    assert not out.requires_grad


def test_torch_autograd_refuses_a_second_derivative_and_in_place_changes(rng):
    q, k, v, g, cq, ck = packed_problem(rng, [4], [6], 1, 1, 8)
    leaves = [torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v)]
    out = attn.torch.varlen_attention(*leaves, cq, ck)
    (dq,) = torch.autograd.grad(out.sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()
    out = attn.torch.varlen_attention(*leaves, cq, ck)
    with torch.no_grad():
        leaves[1].mul_(2)  # the saved key changed under the graph
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients(rng, dtype, monkeypatch):
    # On the portable path the 16-bit backward is the f32 one on the widened values,
    # rounded once; every 16-bit kernel this CPU has stays close to float64 autograd.
    q, k, v, g, cq, ck = packed_problem(rng, [17, 6], [33, 9], 4, 2, 40)
    tq, tk, tv, tg = (torch.from_numpy(x).to(dtype) for x in (q, k, v, g))
    w32 = [t.float().numpy() for t in (tq, tk, tv, tg)]
    monkeypatch.setenv("ATTN_ISA", "f32")
    out, lse = attn.varlen_attention(tq, tk, tv, cq, ck, causal=True, return_lse=True)
    grads = attn.varlen_attention_backward(tg, tq, tk, tv, out, lse, cq, ck, causal=True)
    assert all(x.dtype == dtype for x in grads)
    o32 = out.float().numpy()
    want32 = attn.varlen_attention_backward(w32[3], *w32[:3], o32, lse.numpy(), cq, ck, causal=True)
    for got, want in zip(grads, want32):
        assert torch.equal(got, torch.from_numpy(want).to(dtype))
    exact = per_sequence_grads(*w32, cq, ck, causal=True)
    monkeypatch.delenv("ATTN_ISA")
    paths = [None] + [p for p, have in (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16")) if attn.cpu_info()[have]]
    for path in paths:
        if path is not None:
            monkeypatch.setenv("ATTN_ISA", path)
        out, lse = attn.varlen_attention(tq, tk, tv, cq, ck, causal=True, return_lse=True)
        grads = attn.varlen_attention_backward(tg, tq, tk, tv, out, lse, cq, ck, causal=True)
        for got, want in zip(grads, exact):
            assert rel_err(got.float(), want) <= (3e-2 if dtype == torch.bfloat16 else 5e-3), path


def _bf16_rounded(x):
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def test_precision_bf16_for_float32_inputs(rng):
    # precision="bf16" rounds q, k, v to bfloat16 inside: the float64 reference of the
    # call equals the reference on inputs rounded beforehand, and the kernels' forward
    # and backward stay within bfloat16's error of it.
    q, k, v, g, cq, ck = packed_problem(rng, [17, 40], [33, 61], 4, 2, 64)
    rq, rk, rv = (_bf16_rounded(x) for x in (q, k, v))
    opts = dict(causal=True)
    ref = attn.varlen_attention(q, k, v, cq, ck, precision="bf16", reference=True, **opts)
    assert np.array_equal(ref, attn.varlen_attention(rq, rk, rv, cq, ck, reference=True, **opts))
    assert not np.array_equal(ref, attn.varlen_attention(q, k, v, cq, ck, reference=True, **opts))
    out, lse = attn.varlen_attention(q, k, v, cq, ck, precision="bf16", return_lse=True, **opts)
    assert out.dtype == np.float32 and rel_err(out, ref) <= 1e-2
    grads = attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, precision="bf16", **opts)
    want = per_sequence_grads(rq, rk, rv, g, cq, ck, causal=True)
    for got, w in zip(grads, want):
        assert got.dtype == np.float32 and rel_err(got, w) <= 3e-2
    with pytest.raises(ValueError, match="precision must be one of"):
        attn.varlen_attention(q, k, v, cq, ck, precision="fp8")
    with pytest.raises(ValueError, match="precision must be one of"):
        attn.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, precision="half")


def test_torch_function_follows_float32_matmul_precision(rng):
    q, k, v, g, cq, ck = packed_problem(rng, [9, 30], [12, 41], 4, 2, 32)
    want = attn.varlen_attention(q, k, v, cq, ck, precision="bf16")
    leaves = [torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v)]
    get = getattr(torch, "get_float32_matmul_precision", None)
    if get is None:
        pytest.skip("this torch has no float32 matmul precision setting")
    saved = get()
    try:
        torch.set_float32_matmul_precision("medium")
        out = attn.torch.varlen_attention(*leaves, cq, ck)
    finally:
        torch.set_float32_matmul_precision(saved)
    assert np.array_equal(out.detach().numpy(), want)
    assert np.array_equal(attn.torch.varlen_attention(*leaves, cq, ck, precision="bf16").detach().numpy(), want)
    (out * torch.from_numpy(g)).sum().backward()  # the backward takes the forward's precision
    o, lse = attn.varlen_attention(q, k, v, cq, ck, precision="bf16", return_lse=True)
    for leaf, w in zip(leaves, attn.varlen_attention_backward(g, q, k, v, o, lse, cq, ck, precision="bf16")):
        assert np.array_equal(leaf.grad.numpy(), w)
