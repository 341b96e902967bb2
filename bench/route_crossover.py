"""Where attention()'s few-queries route should end: the decode kernel against the tiled
kernels on the same calls, per query count.

attention() sends calls with a few queries per sequence to the decode kernel
(src/kvcache/few_queries.hpp). ATTN_FEW_QUERIES=64 forces that route for up to 64
queries and ATTN_FEW_QUERIES=0 turns it off; this times both, alternately (two rounds
each, the faster median kept), over query counts, kv groups and key counts, with no mask:
on SDPA's [B, H, L, d] tensors (``attn.scaled_dot_product_attention``, enable_gqa) or
FlashAttention's [L, H, d] ones (``attn.varlen_attention``, one sequence, bottom-right
causal). B = 1, d = 128, fresh random inputs. Prints decode/tiled time ratios: below 1 the
decode kernel is faster.

  PYTHONPATH=build/release/python python3 bench/route_crossover.py [--threads 1] \
      [--layout sdpa|varlen] [--lqs 8,12,16,24,32] [--dtypes bf16,f32]
"""
import argparse
import os
import statistics
import time

import torch

import attn

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def median_s(fn, calls=5):
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layout", choices=("sdpa", "varlen"), default="sdpa")
    ap.add_argument("--lqs", default="8,12,16,24,32")
    ap.add_argument("--dtypes", default="bf16,f32")
    args = ap.parse_args()
    attn.set_num_threads(args.threads)
    torch.manual_seed(0)
    d = 128
    print(f"route_crossover: {args.layout} layout, {args.threads} thread(s), d = {d}, CPU {attn.cpu_info()}")
    print("| dtype | Hq | Hkv | keys | Lq | decode ms | tiled ms | decode / tiled |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        for hq, hkv in ((32, 8), (8, 8), (32, 4)):
            for keys in (512, 4096):
                for lq in (int(x) for x in args.lqs.split(",")):
                    if args.layout == "sdpa":
                        q = torch.randn(1, hq, lq, d).to(dt)
                        k, v = torch.randn(1, hkv, keys, d).to(dt), torch.randn(1, hkv, keys, d).to(dt)
                        call = lambda: attn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    else:
                        q = torch.randn(lq, hq, d).to(dt)
                        k, v = torch.randn(keys, hkv, d).to(dt), torch.randn(keys, hkv, d).to(dt)
                        cq = torch.tensor([0, lq], dtype=torch.int32)
                        ck = torch.tensor([0, keys], dtype=torch.int32)
                        call = lambda: attn.varlen_attention(q, k, v, cq, ck, causal=True)
                    times = {"64": [], "0": []}
                    for _ in range(2):
                        for limit in ("64", "0"):
                            os.environ["ATTN_FEW_QUERIES"] = limit
                            times[limit].append(median_s(call))
                    os.environ.pop("ATTN_FEW_QUERIES")
                    dec, til = min(times["64"]), min(times["0"])
                    print(f"| {name} | {hq} | {hkv} | {keys} | {lq} | {dec * 1e3:.3f} | {til * 1e3:.3f} | {dec / til:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
