"""PyTorch 2 integration (issue 15): attn's forward and backward as torch.library custom
operators. Runs only under PyTorch >= 2.4 (scripts/test-torch2.sh, with the venv of
bench/peers/setup.sh); under Debian's torch 1.13 it is skipped."""
import numpy as np
import pytest
import torch

import attn
import attn.torch as at

needs_torch2 = pytest.mark.skipif(not hasattr(torch.library, "custom_op"),
                                  reason="needs PyTorch >= 2.4 (torch.library.custom_op); this is %s" % torch.__version__)


def _qkv(rng, b=2, hq=4, hkv=2, lq=17, lk=23, d=16, dtype=torch.float32, grad=True):
    mk = lambda *s: torch.from_numpy(rng.uniform(-1, 1, s).astype(np.float32)).to(dtype).requires_grad_(grad)
    return mk(b, hq, lq, d), mk(b, hkv, lk, d), mk(b, hkv, lk, d)


@needs_torch2
def test_opcheck_forward_and_backward(rng):
    q, k, v = _qkv(rng)
    mask = torch.from_numpy(rng.uniform(-1, 1, (17, 23)).astype(np.float32)).requires_grad_(True)
    args = (q, k, v, mask, None, 0.0, True, None, True, True, 3, 0, 0.0, 0, None, None, 0, 0, "bf16x3")
    torch.library.opcheck(torch.ops.attn.sdpa.default, args)
    out, lse, _ = torch.ops.attn.sdpa(*args)
    g = torch.randn_like(out)
    bargs = (g, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), mask.detach(), None) + args[5:] + (True,)
    torch.library.opcheck(torch.ops.attn.sdpa_backward.default, bargs)


@needs_torch2
def test_gradients_match_pytorch_sdpa(rng):
    q, k, v = _qkv(rng)
    mask = torch.from_numpy(rng.uniform(-1, 1, (17, 23)).astype(np.float32)).requires_grad_(True)
    out = at.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    g = torch.randn_like(out)
    out.backward(g)
    got = [t.grad.clone() for t in (q, k, v, mask)]
    for t in (q, k, v, mask):
        t.grad = None
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref.backward(g)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for a, b in zip(got, (q.grad, k.grad, v.grad, mask.grad)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


@needs_torch2
def test_torch_compile_has_no_graph_break(rng):
    q, k, v = _qkv(rng, grad=False)

    def f(q, k, v):
        return at.scaled_dot_product_attention(q * 2, k, v, is_causal=True, enable_gqa=True).relu()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))
    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons


@needs_torch2
def test_torch_compile_takes_the_float32_matmul_precision(rng):
    # torch.set_float32_matmul_precision("high") at compile time: the compiled graph runs
    # bf16x3, bit for bit the eager call with precision="bf16x3", without a graph break.
    q, k, v = _qkv(rng, lq=40, lk=70, d=64, grad=False)
    want = at.scaled_dot_product_attention(q, k, v, enable_gqa=True, precision="bf16x3")
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        compiled = torch.compile(lambda q, k, v: at.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                 fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(q, k, v), want)
    finally:
        torch.set_float32_matmul_precision(saved)


@needs_torch2
def test_torch_compile_trains_through_the_op(rng):
    q, k, v = _qkv(rng)

    def loss(q, k, v):
        return at.scaled_dot_product_attention(q, k, v, window=(4, 0), enable_gqa=True).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled(q, k, v).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    loss(q, k, v).backward()
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad)


@needs_torch2
def test_patch_sdpa_runs_a_stock_transformer_encoder_on_attn(rng):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.from_numpy(rng.uniform(-1, 1, (3, 11, 32)).astype(np.float32))
    pad = torch.zeros(3, 11, dtype=torch.bool)
    pad[1, 8:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(11)
    for train in (False, True):
        model.train(train)
        want = model(x, mask=causal, src_key_padding_mask=pad, is_causal=True)
        with at.patch_sdpa() as patch:
            got = model(x, mask=causal, src_key_padding_mask=pad, is_causal=True)
        assert patch.calls == 2, "each layer's attention must run on attn"
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # Training: gradients through attn equal PyTorch's.
    model.train()
    want_grads = torch.autograd.grad(model(x, src_key_padding_mask=pad).square().sum(), list(model.parameters()))
    with at.patch_sdpa() as patch:
        got_grads = torch.autograd.grad(model(x, src_key_padding_mask=pad).square().sum(), list(model.parameters()))
    assert patch.calls == 2
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
    assert torch.nn.functional.scaled_dot_product_attention is not patch._sdpa, "the patch must be undone"


@needs_torch2
def test_patch_sdpa_runs_multihead_attention_on_attn(rng):
    torch.manual_seed(1)
    mha = torch.nn.MultiheadAttention(embed_dim=24, num_heads=3, batch_first=True)
    q = torch.from_numpy(rng.uniform(-1, 1, (2, 5, 24)).astype(np.float32))
    kv = torch.from_numpy(rng.uniform(-1, 1, (2, 9, 24)).astype(np.float32))
    mask = torch.from_numpy(rng.random((5, 9)) < 0.2)  # True = not allowed (PyTorch's MHA rule)
    want, _ = mha(q, kv, kv, attn_mask=mask, need_weights=False)
    with at.patch_sdpa() as patch:
        got, _ = mha(q, kv, kv, attn_mask=mask, need_weights=False)
    assert patch.calls == 1
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(hasattr(torch.nn.functional, "scaled_dot_product_attention"), reason="PyTorch 1.x only")
def test_patch_sdpa_says_it_needs_pytorch_2():
    with pytest.raises(RuntimeError, match="needs PyTorch 2.x"):
        with at.patch_sdpa():
            pass


@needs_torch2
@pytest.mark.parametrize("variant", ["bool_mask", "float_mask", "is_causal", "gqa_scale", "causal_gqa_lq_lt_lk"])
def test_parity_with_pytorch2_sdpa(rng, variant):
    lq, lk, hkv = (9, 21, 2) if variant == "causal_gqa_lq_lt_lk" else (13, 13, 4 if variant != "gqa_scale" else 1)
    q, k, v = _qkv(rng, hq=4, hkv=hkv, lq=lq, lk=lk)
    kw = dict(enable_gqa=hkv != 4)
    if variant == "bool_mask":
        kw["attn_mask"] = torch.from_numpy(rng.random((2, 1, lq, lk)) < 0.8)
    elif variant == "float_mask":
        kw["attn_mask"] = torch.from_numpy(rng.uniform(-2, 2, (lq, lk)).astype(np.float32))
    elif variant == "gqa_scale":
        kw["scale"] = 0.3
    else:
        kw["is_causal"] = True
    out = at.scaled_dot_product_attention(q, k, v, **kw)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    want = torch.autograd.grad(ref, (q, k, v), g)
    if variant == "bool_mask":  # PyTorch gives NaN for rows with no allowed key, attn 0
        keep = ~torch.isnan(ref)
        torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=2e-5)
        return
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


@needs_torch2
def test_dropout_statistics_match_pytorch2(rng):
    q, k, v = _qkv(rng, b=1, hq=2, hkv=2, lq=8, lk=8, d=8, grad=False)
    p, n = 0.3, 400
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ours = torch.stack([at.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=s) for s in range(n)])
    theirs = torch.stack([torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p) for _ in range(n)])
    # Both are unbiased: the mean over seeds converges to the no-dropout output ...
    for samples in (ours, theirs):
        err = (samples.mean(0) - plain).abs().max().item()
        assert err < 6 * samples.std(0).max().item() / n ** 0.5, err
    # ... and they spread alike (Bernoulli(1 - p) on P, scaled by 1/(1 - p)).
    ratio = (ours.var(0).mean() / theirs.var(0).mean()).item()
    assert 0.8 < ratio < 1.25, ratio


@needs_torch2
def test_block_mask_through_the_custom_op_and_compile(rng):
    q, k, v = _qkv(rng, lq=70, lk=90)
    docs = np.repeat(np.arange(5), 20)
    bm = attn.block_mask(lambda b, h, i, j: (docs[i] == docs[j]) & (j <= i + 20), None, None, 70, 90, block_size=16)
    table, tiles = torch.from_numpy(bm.blocks), torch.from_numpy(bm.tiles)
    args = (q, k, v, None, None, 0.0, False, None, True, False, -1, -1, 0.0, 0, table, tiles, 16, 16, "f32")
    torch.library.opcheck(torch.ops.attn.sdpa.default, args)
    dense = torch.from_numpy(bm.to_dense()[0, 0])

    def grads(fn):
        for t in (q, k, v):
            t.grad = None
        out = fn()
        out.backward(torch.ones_like(out))
        return [out.detach().clone()] + [t.grad.clone() for t in (q, k, v)]

    want = grads(lambda: at.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True))
    got = grads(lambda: at.scaled_dot_product_attention(q, k, v, enable_gqa=True, block_mask=bm))
    compiled = torch.compile(lambda: at.scaled_dot_product_attention(q, k, v, enable_gqa=True, block_mask=bm),
                             fullgraph=True)
    got_compiled = grads(compiled)
    for a, b, c in zip(want, got, got_compiled):
        assert torch.equal(a, b) and torch.equal(a, c)


@needs_torch2
def test_eager_calls_match_the_custom_operator(rng):
    # Eager calls on CPU tensors skip the operator's dispatch (attn.torch._traced): their
    # outputs and gradients must be the operator's, bit for bit, with and without autograd.
    q, k, v = _qkv(rng)
    mask = torch.from_numpy(rng.uniform(-1, 1, (17, 23)).astype(np.float32)).requires_grad_(True)
    assert not at._traced(q, k, v, mask, None)

    def grads(fn):
        for t in (q, k, v, mask):
            t.grad = None
        out = fn()
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        return [out.detach().clone()] + [t.grad.clone() for t in (q, k, v, mask)]

    eager = grads(lambda: at.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True,
                                                          precision="f32"))
    args = (q, k, v, mask, None, 0.0, True, None, True, False, -1, -1, 0.0, 0, None, None, 0, 0, "f32")
    op = grads(lambda: torch.ops.attn.sdpa(*args)[0])
    for a, b in zip(eager, op):
        assert torch.equal(a, b)
    with torch.no_grad():
        out = at.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True,
                                              precision="f32")
    assert torch.equal(out, op[0])


@needs_torch2
def test_fake_tensors_take_the_custom_operator():
    # Under a FakeTensorMode (what torch.compile and export trace with) the call must go
    # through the operator's fake implementation, which gives shapes without data.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = torch.empty(2, 4, 17, 16), torch.empty(2, 2, 23, 16), torch.empty(2, 2, 23, 8)
        assert at._traced(q, k, v, None, None)
        out = at.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert out.shape == (2, 4, 17, 8)


def _packed(rng, lens_q=(5, 1, 12), lens_k=(7, 3, 12), hq=4, hkv=2, d=16, grad=True):
    mk = lambda *s: torch.from_numpy(rng.uniform(-1, 1, s).astype(np.float32)).requires_grad_(grad)
    cu = lambda lens: torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    return mk(sum(lens_q), hq, d), mk(sum(lens_k), hkv, d), mk(sum(lens_k), hkv, d), cu(lens_q), cu(lens_k)


@needs_torch2
def test_varlen_opcheck_forward_and_backward(rng):
    q, k, v, cq, ck = _packed(rng)
    args = (q, k, v, cq, ck, 12, None, None, 0.0, None, True, 4, 0, 5.0, 0, "bf16x3")
    torch.library.opcheck(torch.ops.attn.varlen.default, args)
    out, lse, _ = torch.ops.attn.varlen(*args)
    assert out.shape == (18, 4, 16) and lse.shape == (4, 18)
    g = torch.randn_like(out)
    bargs = (g, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach()) + args[3:]
    torch.library.opcheck(torch.ops.attn.varlen_backward.default, bargs)


@needs_torch2
def test_varlen_under_torch_compile_has_no_graph_break_and_eager_gradients(rng):
    q, k, v, cq, ck = _packed(rng)

    def f(q, k, v):
        return at.varlen_attention(q * 2, k, v, cq, ck, causal=True, window_size=(6, 0), dropout_p=0.25,
                                   seed=99).relu()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    g = torch.from_numpy(rng.uniform(-1, 1, (18, 4, 16)).astype(np.float32))
    out = compiled(q, k, v)
    out.backward(g)
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = f(q, k, v)  # eager: attn.torch's autograd.Function, the same kernels
    want.backward(g)
    assert torch.equal(out, want)
    for a, t in zip(got, (q, k, v)):
        assert torch.equal(a, t.grad)
    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons


@needs_torch2
def test_custom_op_keeps_the_float32_output_of_16_bit_calls(rng):
    """attn::sdpa's third output is a bfloat16/float16 CPU call's float32 output before its
    rounding (empty otherwise), which its autograd formula hands the backward for D, as
    the eager path does: the two give the same gradients, bit for bit."""
    q, k, v = _qkv(rng, lq=40, lk=50, d=32, dtype=torch.bfloat16)
    args = (q, k, v, None, None, 0.0, True, 1.0, True, True, -1, -1, 0.0, 0, None, None, 0, 0, "f32")
    torch.library.opcheck(torch.ops.attn.sdpa.default, args)
    out, lse, wide = torch.ops.attn.sdpa(*args)
    assert wide.dtype == torch.float32 and wide.shape == out.shape and torch.equal(wide.to(torch.bfloat16), out)
    g = torch.from_numpy(rng.uniform(-1, 1, tuple(out.shape)).astype(np.float32)).to(torch.bfloat16)
    out.backward(g)
    via_op = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    attn.torch.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, enable_gqa=True,
                                            causal_alignment="bottom_right").backward(g)
    for a, b in zip(via_op, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)
    q32, k32, v32 = _qkv(rng, lq=4, lk=5, d=8)
    assert torch.ops.attn.sdpa(q32, k32, v32, *args[3:])[2].numel() == 0


@needs_torch2
def test_varlen_custom_op_keeps_the_float32_output_of_16_bit_calls(rng):
    """attn::varlen's third output as attn::sdpa's: the gradients through the operator
    equal the eager path's, bit for bit."""
    q, k, v, cq, ck = _packed(rng, grad=False)
    q, k, v = (t.to(torch.bfloat16).requires_grad_(True) for t in (q, k, v))
    args = (q, k, v, cq, ck, 12, None, None, 0.0, None, True, -1, -1, 0.0, 0, "f32")
    torch.library.opcheck(torch.ops.attn.varlen.default, args)
    out, lse, wide = torch.ops.attn.varlen(*args)
    assert wide.dtype == torch.float32 and torch.equal(wide.to(torch.bfloat16), out)
    g = torch.from_numpy(rng.uniform(-1, 1, tuple(out.shape)).astype(np.float32)).to(torch.bfloat16)
    out.backward(g)
    via_op = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    at.varlen_attention(q, k, v, cq, ck, causal=True).backward(g)
    for a, b in zip(via_op, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)


@needs_torch2
def test_custom_ops_take_any_layout(rng):
    # A traced graph hands the operators whatever layout its tensors have; as PyTorch's
    # SDPA, they read a column-major or stepped view through a contiguous copy.
    q, k, v = _qkv(rng, grad=False)
    q = q.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(True)
    k = torch.cat([k, k], -1)[..., ::2].detach().requires_grad_(True)
    v.requires_grad_(True)
    mask = torch.from_numpy(rng.uniform(-1, 1, (23, 17)).astype(np.float32)).t().requires_grad_(True)
    args = (q, k, v, mask, None, 0.0, False, None, True, False, -1, -1, 0.0, 0, None, None, 0, 0, "f32")
    torch.library.opcheck(torch.ops.attn.sdpa.default, args)
    out, lse, _ = torch.ops.attn.sdpa(*args)
    g = torch.randn_like(out)
    bargs = ((g, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), mask.detach(), None) + args[5:]
             + (True,))
    torch.library.opcheck(torch.ops.attn.sdpa_backward.default, bargs)

    def f(q, k, v, mask):
        return at.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, precision="f32")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for t in (q, k, v, mask):
        t.grad = None  # (opcheck's own runs leave gradients behind)
    got = compiled(q, k, v, mask)
    (got * g).sum().backward()
    leaves = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v, mask)]
    want = f(*leaves)
    (want * g).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), (q, k, v, mask), leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


@needs_torch2
def test_inductor_trains_a_model_whose_heads_are_transposed_views(rng):
    # What nn.MultiheadAttention and most model code hand SDPA: q, k, v as [B, L, H, d]
    # projections seen as [B, H, L, d]. Under the default backend (inductor) each
    # operator's real outputs must have its fake outputs' strides, which inductor asserts:
    # the backward's gradients once had the inputs' strides in the fake and contiguous
    # ones in fact, and training failed there.
    torch.manual_seed(int(rng.integers(2**31)))
    B, L, H, d = 2, 16, 4, 16
    x = torch.randn(B, L, 3 * H * d)
    w = torch.randn(3 * H * d, 3 * H * d) * 0.05
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)

    def loss(x, w):
        qkv = (x @ w).view(B, L, 3, H, d)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        o = at.scaled_dot_product_attention(q, k, v, is_causal=True, precision="f32")
        packed = qkv[0].transpose(0, 1)  # [3, L, H, d]: varlen's [total, H, d] rows
        ov = at.varlen_attention(packed[0], packed[1], packed[2], cu, cu, causal=True, precision="f32")
        return o.transpose(1, 2).square().sum() + ov.square().sum()

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, w)]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    torch._dynamo.reset()
    for got, want in zip(grads(torch.compile(loss, fullgraph=True)), grads(loss)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
