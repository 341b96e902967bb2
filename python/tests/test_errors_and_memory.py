"""Errors become TypeError / ValueError with a message naming the argument; inputs are
read in place (no copies, checked by the wrapper's counter and by tracemalloc); the GIL
is released while the kernel runs."""
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

import attn
from conftest import reference, rel_err


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_errors_name_the_argument(rng):
    q, k, v = rand(rng, 1, 2, 4, 8), rand(rng, 1, 2, 5, 8), rand(rng, 1, 2, 5, 8)
    with pytest.raises(TypeError, match="query: expected dtype float32, float16 or bfloat16, got float64"):
        attn.scaled_dot_product_attention(q.astype(np.float64), k, v)
    with pytest.raises(ValueError, match="mixed dtypes are an error"):
        attn.scaled_dot_product_attention(torch.from_numpy(q).bfloat16(), torch.from_numpy(k), torch.from_numpy(v))
    with pytest.raises(ValueError, match="same head dimension"):
        attn.scaled_dot_product_attention(q, rand(rng, 1, 2, 5, 4), v)
    with pytest.raises(ValueError, match="enable_gqa"):
        attn.scaled_dot_product_attention(rand(rng, 1, 4, 4, 8), k, v)
    with pytest.raises(ValueError, match="must divide"):
        attn.scaled_dot_product_attention(rand(rng, 1, 3, 4, 8), k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="contiguous"):  # from the C++ checks (attn.Error is a ValueError)
        attn.scaled_dot_product_attention(rand(rng, 1, 2, 4, 16)[..., ::2], k, v)
    with pytest.raises(ValueError, match="negative"):
        attn.scaled_dot_product_attention(q[:, :, ::-1], k, v)
    with pytest.raises(ValueError, match="does not broadcast"):
        attn.scaled_dot_product_attention(q, k, v, attn_mask=np.ones((3, 5), bool))
    with pytest.raises(TypeError, match="attn_mask: expected dtype float32, float16 or bfloat16 or bool"):
        attn.scaled_dot_product_attention(q, k, v, attn_mask=np.ones((4, 5), np.int64))
    with pytest.raises(ValueError, match="causal_alignment"):
        attn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="middle")
    with pytest.raises(attn.Error, match="dropout_p"):
        attn.scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="softcap"):
        attn.scaled_dot_product_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"\[..., H, L, d\]"):
        attn.scaled_dot_product_attention(q[0, 0], k, v)
    assert issubclass(attn.Error, ValueError)


def test_strided_views_are_read_in_place(rng):
    B, H, L, d = 2, 4, 33, 16
    # Storage in BSHD order, seen as PyTorch's BHLD: strides, not copies.
    qs, ks, vs = rand(rng, B, L, H, d), rand(rng, B, L, H, d), rand(rng, B, L, H, d)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (qs, ks, vs))
    sliced = rand(rng, B, H, 2 * L, d)[:, :, ::2]  # every other position
    before = attn.copies_made()
    out = attn.scaled_dot_product_attention(q, k, v)
    out2 = attn.scaled_dot_product_attention(sliced, k, v)
    tq = torch.from_numpy(qs).transpose(1, 2)  # a non-contiguous torch view
    out3 = attn.scaled_dot_product_attention(tq, torch.from_numpy(ks).transpose(1, 2), torch.from_numpy(vs).transpose(1, 2))
    assert attn.copies_made() == before
    assert rel_err(out, reference(q, k, v)[0]) <= 1e-6
    assert rel_err(out2, reference(sliced, k, v)[0]) <= 1e-6
    assert rel_err(out3, out) == 0.0


def test_no_hidden_allocation_of_input_size(rng):
    # Inputs of 3 × 8 MB and an output of 8 MB: the call may allocate the output, not copies.
    q, k, v = (rand(rng, 1, 8, 1024, 256).transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3) for _ in range(3))
    tracemalloc.start()
    out = attn.scaled_dot_product_attention(q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < out.nbytes + (1 << 20), "peak %d bytes for an output of %d" % (peak, out.nbytes)


def test_copies_are_counted_when_batch_dims_cannot_merge(rng):
    q = rand(rng, 3, 2, 2, 5, 8).transpose(1, 0, 2, 3, 4)  # batch dims (2, 3) not mergeable
    k, v = rand(rng, 2, 3, 2, 5, 8), rand(rng, 2, 3, 2, 5, 8)
    before = attn.copies_made()
    out = attn.scaled_dot_product_attention(q, k, v)
    assert attn.copies_made() == before + 1
    assert rel_err(out, reference(q, k, v)[0]) <= 1e-6


def test_the_gil_is_released(rng):
    # A Python thread spins while the kernel runs on one thread. With the GIL released it
    # keeps its own speed; with the GIL held it would get at most a few 5 ms switch slots.
    q, k, v = rand(rng, 1, 8, 2048, 64), rand(rng, 1, 8, 2048, 64), rand(rng, 1, 8, 2048, 64)
    before = attn.num_threads()
    attn.set_num_threads(1)
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        c0, t0 = count[0], time.perf_counter()
        time.sleep(0.1)
        rate = (count[0] - c0) / (time.perf_counter() - t0)  # spins per second, alone
        c0, t0 = count[0], time.perf_counter()
        while time.perf_counter() - t0 < 0.3:  # calls of ~0.1 s each
            attn.scaled_dot_product_attention(q, k, v)
        share = (count[0] - c0) / (rate * (time.perf_counter() - t0))
    finally:
        stop[0] = True
        t.join()
        attn.set_num_threads(before)
    assert share > 0.3, "the spinning thread ran at %.0f%% of its speed during the calls" % (100 * share)
