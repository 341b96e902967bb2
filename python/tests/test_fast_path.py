"""The lean path (attn._forward_fast, attn._backward_fast): plain eager calls on 4-D
inputs skip the Python-side checks and go to the kernels' positional entries (torch
tensors as DLPack capsules), with or without a gradient. It must give bitwise the result of the checked path, take the calls it is
meant for, leave every other call and every error to the checked path, and keep the
checked path's messages."""
import numpy as np
import pytest
import torch

import attn
import attn.torch
from conftest import count_calls, reference, rel_err

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def checked(fn, *args, **kwargs):
    """fn on the checked path: window=(-1, -1) (unbounded both ways, so the same
    attention) is an option the lean path does not take."""
    return fn(*args, window=(-1, -1), **kwargs)


@pytest.fixture
def count_checked(monkeypatch):
    """How many calls took the checked path (attn._prepare_call)."""
    return count_calls(monkeypatch, attn, "_prepare_call")


def cases(rng):
    """Shapes and options of plain calls: odd sizes, GQA, cross-attention, dv != d."""
    for b, hq, hkv, lq, lk, d, dv in [(1, 1, 1, 1, 1, 1, 1), (2, 8, 8, 1, 17, 64, 64), (1, 6, 2, 3, 1000, 32, 48),
                                      (3, 4, 1, 17, 17, 128, 128), (1, 2, 2, 65, 33, 80, 80)]:
        causal = bool(rng.integers(2))
        yield dict(shape=(b, hq, hkv, lq, lk, d, dv), is_causal=causal,
                   causal_alignment=str(rng.choice(["top_left", "bottom_right"])),
                   scale=None if rng.integers(2) else float(rng.uniform(0.05, 0.5)), enable_gqa=hq != hkv)


def inputs(rng, shape):
    b, hq, hkv, lq, lk, d, dv = shape
    return rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, dv)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_torch_calls_take_the_lean_path_and_match_the_checked_path_bitwise(rng, count_checked, dtype):
    for case in cases(rng):
        shape = case.pop("shape")
        q, k, v = (torch.from_numpy(x).to(TORCH_DTYPES[dtype]) for x in inputs(rng, shape))
        before = count_checked[0]
        lean = attn.torch.scaled_dot_product_attention(q, k, v, **case)
        assert count_checked[0] == before, "a plain call took the checked path"
        slow = checked(attn.torch.scaled_dot_product_attention, q, k, v, **case)
        assert count_checked[0] == before + 1
        assert lean.dtype == q.dtype and lean.shape == slow.shape
        assert torch.equal(lean, slow), case
        # And it is attention: the float64 reference, within the dtype's rounding.
        ref, _ = reference(q.double(), k.double(), v.double(), is_causal=case["is_causal"], scale=case["scale"],
                           alignment=case["causal_alignment"])
        assert rel_err(lean.double(), ref) < {"f32": 1e-5, "bf16": 2e-2, "f16": 4e-3}[dtype], case


def test_numpy_calls_with_lse_and_masks_match_the_checked_path_bitwise(rng, count_checked):
    for case in cases(rng):
        shape = case.pop("shape")
        b, hq, hkv, lq, lk, d, dv = shape
        q, k, v = inputs(rng, shape)
        for mask in (None, rng.random((lq, lk)) < 0.7, rand(rng, b, 1, lq, lk), rng.random((1, hq, 1, lk)) < 0.5):
            before = count_checked[0]
            out, lse = attn.scaled_dot_product_attention(q, k, v, mask, return_lse=True, **case)
            assert count_checked[0] == before
            out2, lse2 = checked(attn.scaled_dot_product_attention, q, k, v, mask, return_lse=True, **case)
            assert np.array_equal(out, out2) and np.array_equal(lse, lse2)


def test_strided_and_grad_requiring_tensors(rng, count_checked):
    # [B, L, H, d] memory seen as [B, H, L, d] (what nn.MultiheadAttention hands over), and
    # tensors that require grad under no_grad.
    q = torch.from_numpy(rand(rng, 2, 7, 4, 32)).transpose(1, 2)
    k = torch.from_numpy(rand(rng, 2, 9, 4, 32)).transpose(1, 2).requires_grad_()
    v = torch.from_numpy(rand(rng, 2, 9, 4, 32)).transpose(1, 2)
    with torch.no_grad():
        lean = attn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
        slow = checked(attn.torch.scaled_dot_product_attention, q, k, v, is_causal=True)
    assert count_checked[0] == 1 and torch.equal(lean, slow)
    assert lean.is_contiguous()


def grads_of(fn, q, k, v, grad, **options):
    """(out, dq, dk, dv) of fn on fresh leaves made from q, k, v; grad None: out.sum()'s
    gradient (all-zero strides), else out.backward(grad)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **options)
    if grad is None:
        out.sum().backward()
    else:
        out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_gradients_on_the_lean_path_match_the_checked_path_bitwise(rng, count_checked, dtype):
    for n, case in enumerate(cases(rng)):
        b, hq, hkv, lq, lk, d, dv = case.pop("shape")
        q, k, v = (torch.from_numpy(x).to(TORCH_DTYPES[dtype]) for x in inputs(rng, (b, hq, hkv, lq, lk, d, dv)))
        masks = [None, torch.from_numpy(rng.random((lq, lk)) < 0.7),
                 torch.from_numpy(rand(rng, b, 1, lq, lk)).to(q.dtype if n % 2 else torch.float32)]
        for mask in masks:
            # grad_out: out.sum()'s (strides 0), or random and strided ([B, L, H, dv] memory).
            grad = None if n % 2 else torch.from_numpy(rand(rng, b, lq, hq, dv)).to(q.dtype).transpose(1, 2)
            before = count_checked[0]
            lean = grads_of(attn.torch.scaled_dot_product_attention, q, k, v, grad, attn_mask=mask, **case)
            assert count_checked[0] == before, "a plain call that wants a gradient took the checked path"
            slow = grads_of(lambda *a, **o: checked(attn.torch.scaled_dot_product_attention, *a, **o), q, k, v, grad,
                            attn_mask=mask, **case)
            for x, y in zip(lean, slow):
                assert x.dtype == q.dtype and x.shape == y.shape and torch.equal(x, y), case
        # And they are attention's gradients: float64 autograd through the reference.
        g = torch.from_numpy(rand(rng, b, hq, lq, dv))
        got = grads_of(attn.torch.scaled_dot_product_attention, q, k, v, g.to(q.dtype), **case)
        want = grads_of(lambda *a, **o: reference(*a, is_causal=o["is_causal"], scale=o["scale"],
                                                  alignment=o["causal_alignment"])[0],
                        q.double(), k.double(), v.double(), g.double(), **case)
        for x, y in zip(got[1:], want[1:]):
            assert rel_err(x.double(), y) < {"f32": 1e-4, "bf16": 5e-2, "f16": 1e-2}[dtype], case


def test_lean_gradients_survive_a_rejected_backward(rng, monkeypatch):
    # Should the kernels' positional backward reject a call, the checked backward runs.
    q, k, v = (torch.from_numpy(rand(rng, 1, 2, 5, 16)) for _ in range(3))
    want = grads_of(attn.torch.scaled_dot_product_attention, q, k, v, None, is_causal=True)
    monkeypatch.setattr(attn, "_backward_fast", lambda *args: None)
    got = grads_of(attn.torch.scaled_dot_product_attention, q, k, v, None, is_causal=True)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_other_calls_take_the_checked_path(rng, count_checked):
    q, k, v = (torch.from_numpy(rand(rng, 1, 2, 5, 16)) for _ in range(3))
    calls = [dict(dropout_p=0.1, seed=3), dict(softcap=5.0), dict(alibi_slopes=np.ones(2, np.float32)),
             dict(block_mask=attn.block_mask(lambda b, h, i, j: j <= i, None, None, 5, 5, block_size=(4, 4)))]
    for n, options in enumerate(calls, 1):
        attn.torch.scaled_dot_product_attention(q, k, v, **options)
        assert count_checked[0] == n, options
    # Not 4-D: one batch dimension too many, none at all.
    attn.scaled_dot_product_attention(rand(rng, 2, 1, 2, 5, 16), rand(rng, 2, 1, 2, 5, 16), rand(rng, 2, 1, 2, 5, 16))
    attn.scaled_dot_product_attention(rand(rng, 2, 5, 16), rand(rng, 2, 5, 16), rand(rng, 2, 5, 16))
    assert count_checked[0] == len(calls) + 2
    # A float mask that wants its own gradient: the checked path's dbias.
    q.requires_grad_()
    mask = torch.from_numpy(rand(rng, 5, 5)).requires_grad_()
    attn.torch.scaled_dot_product_attention(q, k, v, mask).sum().backward()
    assert count_checked[0] == len(calls) + 3 and q.grad is not None and mask.grad is not None


def error_of(fn):
    with pytest.raises(Exception) as e:
        fn()
    return type(e.value), str(e.value)


def test_bad_calls_raise_the_checked_paths_errors(rng):
    q, k, v = rand(rng, 1, 4, 3, 16), rand(rng, 1, 2, 5, 16), rand(rng, 1, 2, 5, 16)
    bad = [
        (q, k, v, {}),  # GQA without enable_gqa
        (rand(rng, 1, 3, 3, 16), k, v, dict(enable_gqa=True)),  # 2 kv heads do not divide 3
        (q, rand(rng, 1, 2, 5, 8), v, dict(enable_gqa=True)),  # d differs
        (q, k, rand(rng, 1, 2, 4, 16), dict(enable_gqa=True)),  # key and value lengths differ
        (q.astype(np.float64), k, v, dict(enable_gqa=True)),  # a dtype the kernels do not take
        (q, k.astype(np.float16), v, dict(enable_gqa=True)),  # mixed dtypes
        (q, k, v, dict(enable_gqa=True, attn_mask=np.ones((2, 4, 3, 5), bool))),  # mask enlarges the batch
        (q, k, v, dict(enable_gqa=True, attn_mask=np.ones((3, 4), bool))),  # mask does not broadcast
        (q, k, v, dict(enable_gqa=True, attn_mask=np.ones((3, 5), np.int32))),  # mask dtype
        (q, k, v, dict(enable_gqa=True, causal_alignment="middle", is_causal=True)),
        (q, k, v, dict(enable_gqa=True, precision="fp8")),
        (q, k, v, dict(enable_gqa=True, scale=float("nan"))),
    ]
    for qq, kk, vv, options in bad:
        lean = error_of(lambda: attn.scaled_dot_product_attention(qq, kk, vv, **options))
        slow = error_of(lambda: checked(attn.scaled_dot_product_attention, qq, kk, vv, **options))
        assert lean == slow, options
        tq, tk, tv = (torch.from_numpy(x) for x in (qq, kk, vv))
        topts = {n: torch.from_numpy(o) if isinstance(o, np.ndarray) else o for n, o in options.items()}
        if not any(x.dtype == torch.float64 for x in (tq, tk, tv)) and "precision" not in options:
            assert error_of(lambda: attn.torch.scaled_dot_product_attention(tq, tk, tv, **topts))[0] is lean[0]


def test_seed_is_remembered(rng):
    q = rand(rng, 1, 2, 3, 8)
    attn.scaled_dot_product_attention(q, q, q, seed=1234)
    assert attn.last_dropout_seed() == 1234
    attn.scaled_dot_product_attention(q, q, q)
    assert attn.last_dropout_seed() == 0


def test_dlpack_capsules_at_the_positional_entry(rng):
    # The compiled entry reads DLPack capsules in place; other element types are a
    # TypeError naming the argument (the Python layer then takes the checked path).
    from torch.utils.dlpack import to_dlpack
    q = torch.from_numpy(rand(rng, 1, 2, 3, 8))
    out = torch.empty(1, 2, 3, 8)
    attn._attn.forward_heads_major(to_dlpack(q), to_dlpack(q), to_dlpack(q), to_dlpack(out), None, None, None, 0,
                                   False, 0)
    assert torch.equal(out, attn.scaled_dot_product_attention(q, q, q))
    with pytest.raises(TypeError, match="key: unsupported element type"):
        attn._attn.forward_heads_major(to_dlpack(q), to_dlpack(q.double()), to_dlpack(q), to_dlpack(out), None, None,
                                       None, 0, False, 0)


def test_empty_lengths_match_the_checked_path(rng, count_checked):
    for lq, lk in [(0, 5), (3, 0), (0, 0)]:
        q, k, v = (torch.from_numpy(rand(rng, 1, 2, n, 8)) for n in (lq, lk, lk))
        out, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
        out2, lse2 = checked(attn.scaled_dot_product_attention, q, k, v, return_lse=True)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        assert not out.isnan().any() and (lk > 0 or bool((lse == -float("inf")).all()))
    assert count_checked[0] == 3
