"""Gradient error of attn's bfloat16/float16 backward against float64 autograd, with the
backward's D = rowsum(dO ∘ O) taken from the float32 output before its rounding (what
attn.torch does) and from the rounded output (FlashAttention's and PyTorch's way), next
to a plain pipeline's (float32 math on the same 16-bit inputs, gradients rounded once).

    PYTHONPATH=build/release/python python3 bench/lowp_grad_error.py [--cases 200] [--lq 128 300]

Random shapes (Lk 1 … 300, d 16 … 128, causal or not, bf16 or f16), two sets: the default
scale 1/sqrt(d), and "peaked" rows (scale 0.3–0.6 on unit normals: a few keys take
most of each row's softmax, where dO·v_j − D is a small difference of large terms).
Prints, per set, each way's pooled relative error ‖g − g64‖ / ‖g64‖ over the cases, the
worst case's error divided by the plain pipeline's (plus 1e-3·‖g64‖), and where the exact
gradient is 0 (every row sees one key), the largest element returned. Also times
attn.torch's forward + backward both ways (bf16, B = 1, H = 8, causal, 1 thread)."""
import argparse
import time

import numpy as np
import torch

import attn
import attn.torch as at


def float64_grads(q, k, v, g, scale, causal):
    q, k, v = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:  # bottom-right aligned
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).logical_not(), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no key: output 0, as attn
    (p @ v).backward(g.double())
    return q.grad, k.grad, v.grad


def plain_grads(q, k, v, g, scale, causal):
    """float32 math on the 16-bit values, gradients rounded once to their dtype."""
    q32, k32, v32 = (t.float().detach().requires_grad_(True) for t in (q, k, v))
    s = (q32 @ k32.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).logical_not(), float("-inf"))
    (torch.softmax(s, -1).nan_to_num(0.0) @ v32).backward(g.float())
    return tuple(t.grad.to(q.dtype) for t in (q32, k32, v32))


def attn_grads(q, k, v, g, scale, causal, wide):
    at._NARROW = (torch.bfloat16, torch.float16) if wide else ()
    try:
        qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
        at.scaled_dot_product_attention(qa, ka, va, scale=scale, is_causal=causal,
                                        causal_alignment="bottom_right").backward(g)
        return qa.grad, ka.grad, va.grad
    finally:
        at._NARROW = (torch.bfloat16, torch.float16)


def errors(args):
    ways = ("from the rounded out", "from the f32 out", "plain pipeline")
    for peaked in (False, True):
        sq = {w: np.zeros((3, 2)) for w in ways}
        worst = {w: np.zeros(3) for w in ways[:2]}
        zero = {w: np.zeros(3) for w in ways[:2]}
        for n in range(args.cases):
            rng = np.random.default_rng(1000 * peaked + n)
            lq, lk, d = int(rng.choice(args.lq)), int(rng.choice([1, 2, 3, 17, 64, 300])), int(rng.choice([16, 64, 128]))
            dtype = torch.bfloat16 if rng.random() < 0.5 else torch.float16
            causal = bool(rng.random() < 0.5)
            scale = float(rng.uniform(0.3, 0.6)) if peaked else 1.0 / np.sqrt(d)
            q, k, v, g = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(dtype)
                          for s in ((1, 2, lq, d), (1, 2, lk, d), (1, 2, lk, d), (1, 2, lq, d)))
            want = float64_grads(q, k, v, g, scale, causal)
            got = {ways[0]: attn_grads(q, k, v, g, scale, causal, False),
                   ways[1]: attn_grads(q, k, v, g, scale, causal, True), ways[2]: plain_grads(q, k, v, g, scale, causal)}
            for w in ways:
                for i in range(3):
                    e = (got[w][i].double() - want[i]).norm().item()
                    sq[w][i] += (e * e, want[i].norm().item() ** 2)
                    if w in worst and want[i].norm().item() > 0:
                        pe = (got[ways[2]][i].double() - want[i]).norm().item()
                        worst[w][i] = max(worst[w][i], e / (pe + 1e-3 * want[i].norm().item()))
                    elif w in worst:  # an exact gradient of 0 (e.g. every row sees one key)
                        zero[w][i] = max(zero[w][i], got[w][i].double().abs().max().item())
        print("%s rows, %d cases, Lq in %s:" % ("peaked" if peaked else "default-scale", args.cases, args.lq))
        label = {ways[0]: "D " + ways[0], ways[1]: "D " + ways[1], ways[2]: ways[2]}
        for w in ways:
            print("  %-24s pooled error  dq %.2e  dk %.2e  dv %.2e" % ((label[w],) + tuple(np.sqrt(sq[w][:, 0] / sq[w][:, 1]))))
        for w in ways[:2]:
            print("  %-24s worst / plain  dq %.1f  dk %.1f  dv %.1f" % ((label[w],) + tuple(worst[w])))
        for w in ways[:2]:
            print("  %-24s where the exact gradient is 0, largest |g|:  dq %.1e  dk %.1e" % ((label[w],) + tuple(zero[w][:2])))


def timing(rounds=5):
    torch.set_num_threads(1)
    for n, d, reps in ((2048, 64, 3), (2048, 128, 2), (256, 64, 30)):
        rng = np.random.default_rng(n + d)
        q, k, v, g = (torch.from_numpy(rng.standard_normal((1, 8, n, d)).astype(np.float32)).bfloat16()
                      for _ in range(4))
        ms = {False: [], True: []}
        for _ in range(rounds):
            for wide in (False, True):
                at._NARROW = (torch.bfloat16, torch.float16) if wide else ()
                qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
                t0 = time.perf_counter()
                for _ in range(reps):
                    at.scaled_dot_product_attention(qa, ka, va, is_causal=True).backward(g)
                ms[wide].append((time.perf_counter() - t0) / reps * 1e3)
        at._NARROW = (torch.bfloat16, torch.float16)
        a, b = np.median(ms[False]), np.median(ms[True])
        print("N=%d d=%d bf16 causal forward+backward: D from the rounded out %.2f ms, from the f32 out %.2f ms (%.3fx)"
              % (n, d, a, b, b / a))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--lq", type=int, nargs="+", default=[1, 17, 64, 128, 300])
    ap.add_argument("--no-timing", action="store_true")
    a = ap.parse_args()
    errors(a)
    if not a.no_timing:
        timing()
