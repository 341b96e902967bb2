"""CUDA torch tensors (issue 13, item 4): attn's GPU kernels behind the same functions.

The first tests run everywhere: the DeviceTensor descriptor, cuda_status, and the
errors a call on CUDA memory gets where the build or the machine cannot run it (the
memory is never touched: the checks fail first). The rest need a GPU that both PyTorch
and attn can use, and skip otherwise: parity with PyTorch's own SDPA and its autograd,
on the current stream, without copies.
"""

import math

import numpy as np
import pytest

import attn
from attn import _attn

torch = pytest.importorskip("torch")


def _gpu_reason():
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    why = attn.cuda_status(0)["unusable"]
    return "attn cannot use cuda:0: " + why if why else ""


needs_gpu = pytest.mark.skipif(_gpu_reason() != "", reason=_gpu_reason() or "GPU present")


def test_cuda_status_reports_the_build_and_the_device():
    s = attn.cuda_status()
    assert set(s) == {"built", "unusable"}
    assert isinstance(s["built"], bool)
    if not s["built"]:
        assert "no CUDA backend" in s["unusable"]
    assert attn.cuda_status(1000)["unusable"] != ""  # no machine has that device


def test_device_tensor_checks_its_description():
    t = _attn.DeviceTensor(0x1000, "bfloat16", [2, 3, 4, 64], [768, 256, 64, 1], 0)
    assert "bf16[2, 3, 4, 64] on cuda:0" in repr(t)
    with pytest.raises(TypeError, match="dtype must be"):
        _attn.DeviceTensor(0x1000, "float64", [2], [1], 0)
    with pytest.raises(ValueError, match="strides"):
        _attn.DeviceTensor(0x1000, "float16", [2, 3], [1], 0)
    with pytest.raises(ValueError, match="CUDA ordinal"):
        _attn.DeviceTensor(0x1000, "float16", [2], [1], -1)


@pytest.mark.skipif(_gpu_reason() == "", reason="a usable GPU is present")
def test_device_memory_without_a_usable_gpu_is_a_clear_error():
    shape, strides = [1, 5, 2, 64], [640, 128, 64, 1]
    q = _attn.DeviceTensor(0x1000, "bfloat16", shape, strides, 0)
    with pytest.raises(attn.Error, match="q is on cuda:0, but "):
        _attn.forward(q, q, q, q)
    lse = _attn.DeviceTensor(0x1000, "float32", [1, 2, 5], [10, 5, 1], 0)
    with pytest.raises(attn.Error, match="q is on cuda:0, but "):
        _attn.backward(q, q, q, q, lse, q, q, q, q)


def test_host_and_device_tensors_never_mix():
    q = np.random.default_rng(0).standard_normal((1, 5, 2, 64)).astype(np.float32)
    dev = _attn.DeviceTensor(0x1000, "float32", [1, 5, 2, 64], [640, 128, 64, 1], 0)
    with pytest.raises(attn.Error, match="key is on cuda:0 but q is on cpu|k is on cuda:0 but q is on cpu"):
        _attn.forward(q, dev, q, np.empty_like(q))


# --- on a GPU ---------------------------------------------------------------------

def _inputs(dtype, B=2, H=4, Hkv=4, L=300, S=333, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, L, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, S, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, S, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _f64_sdpa(q, k, v, causal=False, bottom_right=False):
    """The float64 reference on the GPU: explicit scores, exact softmax."""
    q, k, v = (t.double() for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        L, S = s.shape[-2:]
        shift = S - L if bottom_right else 0
        keep = torch.ones(L, S, dtype=torch.bool, device=s.device).tril(shift)
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ v


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_the_reference_as_well_as_pytorch(dtype, causal):
    dt = getattr(torch, dtype)
    q, k, v = _inputs(dt)
    ours = attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref = _f64_sdpa(q, k, v, causal)
    assert ours.device == q.device and ours.dtype == dt and ours.shape == theirs.shape
    assert _rel_err(ours, ref) <= 2 * _rel_err(theirs, ref) + 1e-6


@needs_gpu
def test_gqa_bottom_right_and_lse():
    q, k, v = _inputs(torch.bfloat16, H=8, Hkv=2, L=17, S=1000, d=64)
    out, lse = attn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                                 enable_gqa=True, return_lse=True)
    ref = _f64_sdpa(q, k, v, causal=True, bottom_right=True)
    assert _rel_err(out, ref) < 1e-2
    assert lse.dtype == torch.float32 and lse.shape == (2, 8, 17) and lse.device == q.device


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autograd_matches_pytorch(dtype):
    import attn.torch as at
    dt = getattr(torch, dtype)
    q, k, v = (t.requires_grad_() for t in _inputs(dt, L=257, S=257, d=64))
    grad = torch.randn(2, 4, 257, 64, device="cuda", dtype=dt)
    at.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    # The float64 reference's gradients, and PyTorch's own kernel's, for the yardstick.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    _f64_sdpa(q64, k64, v64, causal=True).backward(grad.double())
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    for mine, theirs, ref in zip(ours, (q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        assert mine.dtype == dt and mine.device == q.device
        assert _rel_err(mine, ref) <= 2 * _rel_err(theirs, ref) + 1e-6


@needs_gpu
def test_runs_on_the_current_stream_and_makes_no_copy_of_contiguous_inputs():
    q, k, v = _inputs(torch.float16, L=1000, S=1000)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = attn.scaled_dot_product_attention(q, k, v)
    stream.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@needs_gpu
def test_gpu_errors_name_the_argument():
    q, k, v = _inputs(torch.bfloat16, d=80)
    with pytest.raises(attn.Error, match="head dim d = 80"):
        attn.scaled_dot_product_attention(q, k, v)
    q, k, v = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="key is on cpu but query is on cuda"):
        attn.scaled_dot_product_attention(q, k.cpu(), v)
    with pytest.raises(ValueError, match="return_mask_grad=True needs a float32 attn_mask"):
        attn.attention_backward(q, q, k, v, q, torch.zeros(2, 4, 300, device="cuda"), return_mask_grad=True)


@needs_gpu
def test_a_float_mask_gets_its_gradient_through_autograd():
    import attn.torch as at
    q, k, v = (t.requires_grad_() for t in _inputs(torch.bfloat16, L=65, S=80, d=64))
    bias = torch.randn(65, 80, device="cuda", requires_grad=True)
    at.scaled_dot_product_attention(q, k, v, attn_mask=bias).float().square().sum().backward()
    ours = bias.grad.clone()
    bias.grad = None
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    b64 = bias.detach().double().requires_grad_()
    s = q64 @ k64.transpose(-1, -2) / 8.0 + b64
    (torch.softmax(s, -1) @ v64).square().sum().backward()
    assert _rel_err(ours, b64.grad) < 3e-2


@needs_gpu
def test_block_mask_matches_the_dense_mask():
    q, k, v = _inputs(torch.bfloat16, L=300, S=333, d=64)
    bm = attn.block_mask(lambda b, h, i, j: (i // 50) == (j // 50), None, None, 300, 333)
    dense = (torch.arange(300)[:, None] // 50 == torch.arange(333)[None, :] // 50).cuda()
    sparse = attn.scaled_dot_product_attention(q, k, v, block_mask=bm)
    masked = attn.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    assert (sparse.float() - masked.float()).abs().max().item() < 2e-2
