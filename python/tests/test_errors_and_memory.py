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
    # a strided last dimension, said in the caller's terms (not the kernels' [B, L, H, d] view)
    with pytest.raises(ValueError, match=r"query: the last dimension must be contiguous \(stride 1\), got a stride of 2"):
        attn.scaled_dot_product_attention(rand(rng, 1, 2, 4, 16)[..., ::2], k, v)
    with pytest.raises(ValueError, match="value: the last dimension must be contiguous"):
        attn.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(rand(rng, 1, 2, 5, 24))[..., ::3])
    with pytest.raises(TypeError, match="scale: expected a number, got 'x'"):
        attn.scaled_dot_product_attention(q, k, v, scale="x")
    with pytest.raises(TypeError, match="softcap: expected a number"):
        attn.scaled_dot_product_attention(q, k, v, softcap=[1.0])
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
    # A Python thread spins while the kernel runs on one thread, noting every pause of
    # more than 5 ms in its loop. With the GIL held, its longest pause would span the
    # whole call. With it released, pauses come from the OS scheduler only. (A test
    # of the spinner's speed during the calls failed on a loaded 2-core machine:
    # other tests' processes slowed the spinner too.) The best of three calls counts,
    # which a held GIL would fail every time.
    q, k, v = rand(rng, 1, 8, 2048, 64), rand(rng, 1, 8, 2048, 64), rand(rng, 1, 8, 2048, 64)
    before = attn.num_threads()
    attn.set_num_threads(1)
    pauses, stop = [], [False]

    def spin():
        last = time.perf_counter()
        while not stop[0]:
            now = time.perf_counter()
            if now - last > 0.005:
                pauses.append((last, now))
            last = now

    t = threading.Thread(target=spin)
    t.start()
    shares = []
    try:
        for _ in range(3):
            time.sleep(0.01)
            t0 = time.perf_counter()
            attn.scaled_dot_product_attention(q, k, v)
            t1 = time.perf_counter()
            time.sleep(0.01)  # the spinner notes the pause that ends after the call
            overlap = [min(end, t1) - max(start, t0) for start, end in list(pauses)]
            shares.append(max(overlap, default=0.0) / (t1 - t0))
            if shares[-1] < 0.5:
                break
    finally:
        stop[0] = True
        t.join()
        attn.set_num_threads(before)
    assert min(shares) < 0.5, "the spinning thread paused for %s of each call" % ", ".join(
        "%.0f%%" % (100 * x) for x in shares)
