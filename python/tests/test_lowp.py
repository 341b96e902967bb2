"""float16 and bfloat16 inputs (issue 11): NumPy float16 and torch float16/bfloat16 in,
the same dtype out, equal bit for bit to the float32 computation on the same values
rounded once (NumPy's and torch's own rounding are the oracles), gradients in the input
dtype, and mixed dtypes refused. The bitwise checks force the portable path
(ATTN_ISA=f32); bf16 and f16 on AMX tiles are checked against PyTorch's float32 pipeline."""
import numpy as np
import pytest
import torch

import attn


def _qkv(rng, lq=17, lk=33, hq=4, hkv=2, d=40):
    q = rng.uniform(-2, 2, (2, hq, lq, d)).astype(np.float32)
    k = rng.uniform(-2, 2, (2, hkv, lk, d)).astype(np.float32)
    v = rng.uniform(-1, 1, (2, hkv, lk, d)).astype(np.float32)
    return q, k, v


def test_numpy_float16_in_float16_out(rng, monkeypatch):
    monkeypatch.setenv("ATTN_ISA", "f32")
    q, k, v = (x.astype(np.float16) for x in _qkv(rng))
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == np.float16
    want = attn.scaled_dot_product_attention(*(x.astype(np.float32) for x in (q, k, v)), is_causal=True,
                                             enable_gqa=True).astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    # On AMX tiles (f16 as exact hi + lo bf16 pieces) the same values to f16 rounding.
    if attn.cpu_info()["amx_bf16"]:
        monkeypatch.setenv("ATTN_ISA", "amx")
        tiles = attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert tiles.dtype == np.float16
        np.testing.assert_allclose(tiles.astype(np.float32), want.astype(np.float32), rtol=2 ** -10, atol=2 ** -12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_low_precision_forward_and_backward(rng, dtype, monkeypatch):
    # Bit equality with the f32 kernel holds on the portable path; the bf16 kernels
    # (AMX, AVX512-BF16) are checked against the same pipeline at the end.
    monkeypatch.setenv("ATTN_ISA", "f32")
    q, k, v = (torch.from_numpy(x).to(dtype) for x in _qkv(rng))
    mask = torch.from_numpy(rng.uniform(-1, 1, (17, 33)).astype(np.float32)).to(dtype)
    out, lse = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    q32, k32, v32, m32 = (x.float() for x in (q, k, v, mask))
    out32, lse32 = attn.scaled_dot_product_attention(q32, k32, v32, attn_mask=m32, enable_gqa=True, return_lse=True)
    assert torch.equal(out, out32.to(dtype))  # torch's rounding is round-to-nearest-even too
    assert torch.equal(lse, lse32)
    g = torch.from_numpy(rng.uniform(-1, 1, tuple(out.shape)).astype(np.float32)).to(dtype)
    dq, dk, dv = attn.attention_backward(g, q, k, v, out, lse, attn_mask=mask, enable_gqa=True)
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    dq32, dk32, dv32 = attn.attention_backward(g.float(), q32, k32, v32, out.float(), lse, attn_mask=m32,
                                               enable_gqa=True)
    for got, want in ((dq, dq32), (dk, dk32), (dv, dv32)):
        assert torch.equal(got, want.to(dtype))
    # And close to PyTorch's explicit float32 pipeline on the same values.
    s = (q32 @ k32.repeat_interleave(2, 1).transpose(-1, -2)) / np.sqrt(40) + m32
    ref = torch.softmax(s, -1) @ v32.repeat_interleave(2, 1)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol)
    # Every bf16 kernel path this machine can run (the default first).
    monkeypatch.delenv("ATTN_ISA")
    paths = [None] + [p for p, have in (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16")) if attn.cpu_info()[have]]
    for path in paths:
        if path is not None:
            monkeypatch.setenv("ATTN_ISA", path)
        out_path = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert out_path.dtype == dtype
        assert torch.allclose(out_path.float(), ref, atol=tol, rtol=tol), path


def test_mixed_dtypes_are_refused(rng):
    q, k, v = _qkv(rng, hq=2, hkv=2)
    with pytest.raises(ValueError, match="key must have dtype f16|k must have dtype f16"):
        attn.scaled_dot_product_attention(q.astype(np.float16), k, v)
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
    with pytest.raises(ValueError, match="dtype"):
        attn.scaled_dot_product_attention(qt.to(torch.bfloat16), kt.to(torch.float16), vt.to(torch.bfloat16))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        attn.scaled_dot_product_attention(q.astype(np.float64), k, v)


def _f64_attention(q, k, v, causal):
    """softmax(q·kᵀ/√d)·v in float64 (grouped heads), the oracle for the precision tests."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_precision_options_for_float32_inputs(rng, causal):
    q, k, v = _qkv(rng, lq=130, lk=257, d=64)
    want = _f64_attention(q, k, v, causal)
    err = {}
    for precision in ("f32", "bf16", "bf16x3"):
        out = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, precision=precision)
        assert out.dtype == np.float32
        err[precision] = np.sqrt(np.mean((out - want) ** 2) / np.mean(want ** 2))
    assert err["f32"] < 1e-6
    assert err["bf16"] < 1e-2
    # Two bf16 pieces hold 16 bits: ~1e-5 on AMX tiles, the f32 kernel's error elsewhere.
    assert err["bf16x3"] < 5e-5 and err["bf16x3"] * 50 < err["bf16"], err
    g = rng.uniform(-1, 1, want.shape).astype(np.float32)
    out, lse = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True)
    grads = {p: attn.attention_backward(g, q, k, v, out, lse, is_causal=causal, enable_gqa=True, precision=p)
             for p in ("f32", "bf16x3")}
    for a, b in zip(grads["f32"], grads["bf16x3"]):
        assert a.dtype == b.dtype == np.float32
        assert np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2)) < 5e-5


def test_unknown_precision_is_an_error_that_names_it(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="precision"):
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, precision="tf32")


def _rel(a, b):
    return np.sqrt(np.mean((np.asarray(a, np.float64) - b) ** 2) / np.mean(np.asarray(b, np.float64) ** 2))


@pytest.mark.parametrize("causal", [False, True])
def test_attn_torch_precision_follows_float32_matmul_precision(rng, causal):
    """attn.torch on float32 tensors: precision= picks the arithmetic of the forward and
    the backward; without it, torch.set_float32_matmul_precision does ("highest" f32,
    "high" bf16x3, "medium" bf16), bit for bit the same as the explicit choice; an
    explicit precision wins over torch's setting. Under torch 1.13 this is the
    autograd.Function, under PyTorch 2 the custom operator."""
    import attn.torch as at
    q, k, v = (torch.from_numpy(x).requires_grad_(True) for x in _qkv(rng, lq=130, lk=257, d=64))
    want = _f64_attention(*(t.detach().numpy() for t in (q, k, v)), causal)
    g = torch.from_numpy(rng.uniform(-1, 1, want.shape).astype(np.float32))

    def run(**kw):
        for t in (q, k, v):
            t.grad = None
        out = at.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, **kw)
        out.backward(g)
        return out.detach().numpy(), [t.grad.numpy().copy() for t in (q, k, v)]

    explicit = {p: run(precision=p) for p in ("f32", "bf16", "bf16x3")}
    saved = torch.get_float32_matmul_precision()
    try:
        for torch_name, p in (("highest", "f32"), ("high", "bf16x3"), ("medium", "bf16")):
            torch.set_float32_matmul_precision(torch_name)
            out, grads = run()
            np.testing.assert_array_equal(out, explicit[p][0])
            for a, b in zip(grads, explicit[p][1]):
                np.testing.assert_array_equal(a, b)
        out, _ = run(precision="f32")  # "medium" is still set
        np.testing.assert_array_equal(out, explicit["f32"][0])
    finally:
        torch.set_float32_matmul_precision(saved)
    err = {p: _rel(explicit[p][0], want) for p in explicit}
    assert err["f32"] < 1e-6
    assert err["bf16"] < 1e-2
    assert err["bf16x3"] < 5e-5 and err["bf16x3"] * 50 < err["bf16"], err
    for a, b in zip(explicit["bf16x3"][1], explicit["f32"][1]):
        assert _rel(a, b) < 5e-5
    with pytest.raises(ValueError, match="precision"):
        at.scaled_dot_product_attention(q, k, v, enable_gqa=True, precision="tf32")


def _float64_grads(q, k, v, g, scale, causal):
    """Gradients of softmax(q·kᵀ·scale)·v in float64 (torch autograd), bottom-right causal."""
    q, k, v = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).logical_not(), float("-inf"))
    (torch.softmax(s, -1) @ v).backward(g.double())
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("checked", [False, True])
def test_autograd_takes_d_from_the_float32_output(rng, dtype, checked):
    """attn.torch keeps a 16-bit call's float32 output for its backward's D = rowsum(dO ∘ O):
    on sharply peaked rows dq and dk then stay near the float64 gradient, where D from
    the rounded output (FlashAttention's and PyTorch's way, still attn.attention_backward's
    given the rounded out) errs several times more. The returned output is the 16-bit
    call's, bit for bit. checked: an option (a window) that the lean path does not take."""
    lq, lk, d = 70, 200, 64
    mk = lambda *s: torch.from_numpy(rng.uniform(-2, 2, s).astype(np.float32)).to(dtype)
    q, k, v, g = mk(2, 2, lq, d), mk(2, 2, lk, d), mk(2, 2, lk, d), mk(2, 2, lq, d)
    kw = dict(scale=1.0, is_causal=True, causal_alignment="bottom_right", window=(1000, 0) if checked else None)
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attn.torch.scaled_dot_product_attention(qa, ka, va, **kw)
    out.backward(g)
    plain, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(out.detach(), plain)
    narrow = attn.attention_backward(g, q, k, v, plain, lse, **kw)
    want = _float64_grads(q, k, v, g, 1.0, True)
    rel = lambda x, w: ((x.double() - w).norm() / w.norm()).item()
    for got, old, w in ((qa.grad, narrow[0], want[0]), (ka.grad, narrow[1], want[1])):
        floor = rel(w.to(dtype), w)  # the float64 gradient rounded to the dtype
        assert rel(got, w) <= 3 * floor, (rel(got, w), floor)
        assert rel(old, w) > 1.5 * rel(got, w), (rel(old, w), rel(got, w))
    # attention_backward takes the float32 out too, with the same result.
    wide = attn._forward_fast(q, k, v, None, True, 1.0, False, "bottom_right", None, "f32", False, True)[0]
    assert wide.dtype == torch.float32 and torch.equal(wide.to(dtype), plain)
    grads = attn.attention_backward(g, q, k, v, wide, lse, **kw)
    for got, via in zip((qa.grad, ka.grad, va.grad), grads):
        assert via.dtype == dtype and torch.equal(got, via)


def test_varlen_autograd_takes_d_from_the_float32_output(rng):
    """attn.torch.varlen_attention keeps a bfloat16 call's float32 output for D, as
    scaled_dot_product_attention does: its gradients are varlen_attention_backward's
    given that output, bit for bit, and its output the 16-bit call's."""
    lens = np.array([5, 1, 40, 17])
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    mk = lambda *s: torch.from_numpy(rng.uniform(-2, 2, s).astype(np.float32)).to(torch.bfloat16)
    q, k, v, g = mk(63, 4, 32), mk(63, 2, 32), mk(63, 2, 32), mk(63, 4, 32)
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = attn.torch.varlen_attention(qa, ka, va, cu, cu, causal=True)
    out.backward(g)
    plain, lse = attn.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    assert torch.equal(out.detach(), plain)
    call = attn._varlen_call(q, k, v, cu, cu, None, None, 0.0, None, True, (-1, -1), 0.0, None, None, False)
    wide = torch.from_numpy(attn._run_varlen_forward(call, False, True)[0])
    assert wide.dtype == torch.float32 and torch.equal(wide.to(torch.bfloat16), plain)
    grads = attn.varlen_attention_backward(g, q, k, v, wide, lse, cu, cu, causal=True)
    for got, want in zip((qa.grad, ka.grad, va.grad), grads):
        assert torch.equal(got, want)
    narrow = attn.varlen_attention_backward(g, q, k, v, plain, lse, cu, cu, causal=True)
    assert not torch.equal(narrow[0], grads[0])  # D from the rounded output differs
