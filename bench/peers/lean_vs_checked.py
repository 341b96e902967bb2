"""attn.torch's lean path against its checked path and PyTorch 2.x, forward and backward.

A/B in one process: each round times PyTorch's ``scaled_dot_product_attention``, then
attn.torch on its lean path (a plain call) and on its checked path (the same call with
``window=(-1, -1)``, an unbounded window: the same attention, but an option the lean
path leaves to the checked one), ``out.sum().backward()`` each time on inputs that
require grad. Prints the median µs per call over the rounds and the median of the
per-round speed-ups over PyTorch (with their range), so that a machine whose speed
drifts between rounds still gives ratios measured side by side. B = 1, H = 8, d = 64,
[B, H, N, d], 1 thread.

  bash bench/peers/setup.sh        # once: bench/peers/.venv with torch 2.x from PyPI
  PYTHONPATH=build/release/python bench/peers/.venv/bin/python bench/peers/lean_vs_checked.py \
      [--sizes 1,16,64,256] [--dtypes f32,bf16] [--rounds 12]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attn
import attn.torch
from peer_timing import cpu_model

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,16,64,256")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    attn.set_num_threads(1)
    sdpa = attn.torch.scaled_dot_product_attention
    print("CPU: %s; torch %s, attn %s" % (cpu_model(), torch.__version__, attn.__version__))
    print("| N | dtype | PyTorch µs | lean µs | checked µs | lean speed-up (range) | checked speed-up (range) |")
    print("|---:|---|---:|---:|---:|---|---|")
    for name in args.dtypes.split(","):
        for n in (int(s) for s in args.sizes.split(",")):
            q, k, v = (torch.randn(1, 8, n, 64, dtype=DTYPES[name], requires_grad=True) for _ in range(3))
            variants = {
                "torch": lambda: F.scaled_dot_product_attention(q, k, v).sum().backward(),
                "lean": lambda: sdpa(q, k, v).sum().backward(),
                "checked": lambda: sdpa(q, k, v, window=(-1, -1)).sum().backward(),
            }
            calls = max(20, int(20000 / (n * n / 16 + 100)))
            times = {key: [] for key in variants}
            for _ in range(args.rounds):
                for key, fn in variants.items():
                    for _ in range(5):
                        fn()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times[key].append((time.perf_counter() - t0) / calls * 1e6)
            cells = []
            for key in ("lean", "checked"):
                ratios = [a / b for a, b in zip(times["torch"], times[key])]
                cells.append("%.2f× (%.2f–%.2f)" % (statistics.median(ratios), min(ratios), max(ratios)))
            print("| %d | %s | %.0f | %.0f | %.0f | %s | %s |" % (
                n, name, statistics.median(times["torch"]), statistics.median(times["lean"]),
                statistics.median(times["checked"]), cells[0], cells[1]), flush=True)


if __name__ == "__main__":
    main()
