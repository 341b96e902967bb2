"""attn vs PyTorch 2.x's CPU scaled_dot_product_attention on short sequences, per call.

Where torch2_sdpa.py measures the kernels at N = 2048 (milliseconds a call), this measures
what a call costs at N = 1 … 512, where the fixed work around a kernel (argument checks,
packing, the Python layer, the autograd machinery) is most of the time: a model with short
sequences, or one token at a time without a KV cache, sees exactly this. Both are called as
a user calls them, through Python on torch tensors: ``torch.nn.functional.
scaled_dot_product_attention`` against ``attn.torch.scaled_dot_product_attention``, B = 1,
H = 8, d = 64, [B, H, N, d], not causal; "fwd" is one forward, "fwd+bwd" a forward and
``.backward()`` on inputs that require grad. Each figure is the median over 7 batches of
many calls (microseconds per call), after a warm-up batch.

  bash bench/peers/setup.sh        # once: bench/peers/.venv with torch 2.x from PyPI
  PYTHONPATH=build/release/python bench/peers/.venv/bin/python bench/peers/torch2_short.py \
      [--sizes 1,16,64,128,256,512] [--dtypes f32,bf16] [--threads 1] [--markdown FILE]
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


def per_call_us(fn, calls):
    """Median over 7 batches of `calls` calls, in µs per call, after one warm-up batch."""
    batches = []
    for batch in range(8):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if batch > 0:
            batches.append((time.perf_counter() - t0) / calls)
    return statistics.median(batches) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,16,64,128,256,512")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    lines = ["| threads | N | dtype | call | torch µs | attn µs | attn speed-up |",
             "|---|---:|---|---|---:|---:|---:|"]
    print("CPU: %s; torch %s, attn %s" % (cpu_model(), torch.__version__, attn.__version__))
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        attn.set_num_threads(threads)
        for n in (int(s) for s in args.sizes.split(",")):
            calls = max(10, 10000 // n)
            for name in args.dtypes.split(","):
                dt = DTYPES[name]
                for grad in (False, True):
                    shape = (1, args.heads, n, args.dim)
                    q, k, v = (torch.rand(shape, generator=g).mul_(2).sub_(1).to(dt).requires_grad_(grad)
                               for _ in range(3))
                    dout = torch.rand(shape, generator=g).to(dt)
                    if grad:
                        t_torch = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v).backward(dout), calls)
                        t_attn = per_call_us(
                            lambda: attn.torch.scaled_dot_product_attention(q, k, v).backward(dout), calls)
                    else:
                        t_torch = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v), calls)
                        t_attn = per_call_us(lambda: attn.torch.scaled_dot_product_attention(q, k, v), calls)
                    line = "| %d | %d | %s | %s | %.1f | %.1f | %.2f× |" % (
                        threads, n, name, "fwd+bwd" if grad else "fwd", t_torch, t_attn, t_torch / t_attn)
                    lines.append(line)
                    print(line, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
