"""merge_attention_states and cpu_info from Python (issue 12's combine step): attention
over two halves of the keys, merged, equals attention over all keys, for NumPy and torch
(float32 and bfloat16), with batch dimensions; fully masked halves drop out."""
import os

import numpy as np
import pytest
import torch

import attn


def test_merging_two_halves_of_the_keys_gives_the_whole_attention(rng):
    q = rng.uniform(-1, 1, (2, 3, 17, 24)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 3, 41, 24)).astype(np.float32)
    v = rng.uniform(-1, 1, (2, 3, 41, 16)).astype(np.float32)
    whole, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    oa, la = attn.scaled_dot_product_attention(q, k[..., :20, :], v[..., :20, :], return_lse=True)
    ob, lb = attn.scaled_dot_product_attention(q, k[..., 20:, :], v[..., 20:, :], return_lse=True)
    out, merged = attn.merge_attention_states(oa, la, ob, lb)
    assert out.shape == whole.shape and merged.shape == lse.shape
    np.testing.assert_allclose(out, whole, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(merged, lse, rtol=2e-6, atol=2e-6)


def test_a_half_that_saw_no_key_drops_out(rng):
    q = rng.uniform(-1, 1, (1, 2, 5, 8)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, 2, 6, 8)).astype(np.float32)
    v = rng.uniform(-1, 1, (1, 2, 6, 8)).astype(np.float32)
    oa, la = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    none = np.zeros((5, 6), dtype=bool)
    ob, lb = attn.scaled_dot_product_attention(q, k, v, attn_mask=none, return_lse=True)
    assert np.all(lb == -np.inf)
    out, lse = attn.merge_attention_states(oa, la, ob, lb)
    np.testing.assert_array_equal(out, oa)
    np.testing.assert_array_equal(lse, la)


def test_torch_bfloat16_in_bfloat16_out(rng):
    q, k, v = (torch.from_numpy(rng.uniform(-1, 1, (1, 2, 9, 32)).astype(np.float32)).bfloat16() for _ in range(3))
    oa, la = attn.scaled_dot_product_attention(q, k[:, :, :4], v[:, :, :4], return_lse=True)
    ob, lb = attn.scaled_dot_product_attention(q, k[:, :, 4:], v[:, :, 4:], return_lse=True)
    out, lse = attn.merge_attention_states(oa, la, ob, lb)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    whole = attn.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out.float(), whole.float(), atol=2e-2, rtol=2e-2)


def test_shape_errors_name_the_argument(rng):
    o = np.zeros((1, 2, 3, 4), np.float32)
    l = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match="out_b must have out_a's shape"):
        attn.merge_attention_states(o, l, np.zeros((1, 2, 3, 5), np.float32), l)
    with pytest.raises(ValueError, match="lse_b must have shape"):
        attn.merge_attention_states(o, l, o, np.zeros((1, 3, 2), np.float32))


def test_cpu_info_names_the_paths(monkeypatch):
    info = attn.cpu_info()
    assert info["bf16_path"] in ("amx", "avx512bf16", "f32")
    intel = "GenuineIntel" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else False
    if info["amx_bf16"]:
        assert info["bf16_path"] == "amx"
    elif info["avx512_bf16"] and not intel:
        assert info["bf16_path"] == "avx512bf16"  # AMD Zen 4/5: vdpbf16ps at full rate
    else:
        assert info["bf16_path"] == "f32"  # no bf16 instructions, or Intel's half-rate vdpbf16ps
    if info["avx512_bf16"]:
        monkeypatch.setenv("ATTN_ISA", "avx512bf16")
        assert attn.cpu_info()["bf16_path"] == "avx512bf16"
    monkeypatch.setenv("ATTN_ISA", "f32")
    assert attn.cpu_info()["bf16_path"] == "f32"
    monkeypatch.setenv("ATTN_ISA", "nonsense")
    with pytest.raises(ValueError, match="ATTN_ISA must be amx, avx512bf16 or f32"):
        attn.cpu_info()
