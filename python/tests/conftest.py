"""Shared helpers: a seeded generator (fresh per run, ATTN_TEST_SEED reproduces) and the
float64 reference, written as PyTorch's explicit matmul/softmax pipeline (Debian's torch
1.13 has no public scaled_dot_product_attention)."""
import os
import random
import zlib

import numpy as np
import pytest
import torch

SEED = int(os.environ.get("ATTN_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return "attn python tests: ATTN_TEST_SEED=%d" % SEED


def pytest_terminal_summary(terminalreporter, exitstatus):
    # Again at the end: under -q (CI's runs) pytest leaves the header out, and a failure
    # is reproduced with this seed.
    if exitstatus != 0:
        terminalreporter.write_line("attn python tests: rerun with ATTN_TEST_SEED=%d" % SEED)


@pytest.fixture
def rng(request):
    # Per test, derived from the run's seed and the test's name: reproducible one by one
    # (crc32, not hash(): str hashes change from process to process).
    return np.random.default_rng([SEED, zlib.crc32(request.node.name.encode())])


def _t(x):
    """A torch view of x; tensors pass through (keeping autograd)."""
    return x if torch.is_tensor(x) else torch.as_tensor(np.asarray(x))


def reference(q, k, v, mask=None, is_causal=False, scale=None, alignment="top_left", window=None, softcap=None,
              alibi=None, allowed=None, dtype=torch.float64):
    """float64 torch tensors [..., H, L, d] → (out, lse), fully masked rows → 0 and -inf.
    allowed: a boolean mask applied besides `mask` (a block mask's positions, say).
    With dtype=torch.float32, the same pipeline in f32: the "plain f32 implementation"
    whose error FlashAttention's rule compares with."""
    q, k, v = (_t(x).to(dtype) for x in (q, k, v))
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=-3)
        v = v.repeat_interleave(hq // hkv, dim=-3)
    L, S, d = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-1, -2)) * (1.0 / np.sqrt(d) if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    ip = i + S - L
    if alibi is not None:
        slopes = _t(alibi).to(dtype)
        s = s - slopes[..., None, None] * (ip - j).abs()
    visible = torch.ones(L, S, dtype=torch.bool)
    if mask is not None:
        m = _t(mask)
        if m.dtype == torch.bool:
            visible = visible & m
        else:
            s = s + m.to(dtype)
    if allowed is not None:
        visible = visible & _t(allowed)
    if is_causal:
        visible = visible & ((j <= i) if alignment == "top_left" else (j <= ip))
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (j >= ip - left)
        if right >= 0:
            visible = visible & (j <= ip + right)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v, lse


def lse_err(got, want):
    """Largest |got − want| / max(1, |want|) over the finite entries of want (lse near 0
    has no meaningful relative error; the C++ harness divides the same way)."""
    got = torch.as_tensor(np.asarray(got), dtype=torch.float64)
    want = torch.as_tensor(np.asarray(want), dtype=torch.float64)
    finite = torch.isfinite(want)
    if not bool(finite.any()):
        return 0.0
    return float(((got - want).abs() / want.abs().clamp(min=1.0))[finite].max())


def rel_err(got, want):
    got = torch.as_tensor(np.asarray(got), dtype=torch.float64)
    want = torch.as_tensor(np.asarray(want), dtype=torch.float64)
    return float((got - want).norm() / max(float(want.norm()), 1e-300))


def count_calls(monkeypatch, owner, name):
    """How many times owner.name is called from now on: a one-element list, counted by a
    wrapper that monkeypatch removes after the test (the lean-path tests count the calls
    that took the checked path)."""
    calls = [0]
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls
