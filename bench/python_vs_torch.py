#!/usr/bin/python3
"""attn vs PyTorch 1.13 attention on the CPU, from Python, on the shapes of the C++ table
(B=1, H=8, N in {512, 2048, 8192}, d in {64, 128}, none/causal), 1 thread by default.

PyTorch is measured in the configurations it offers here, each in a child process with its
own environment, and the best is the baseline:
  explicit   softmax(q·kᵀ·scale + mask)·v with torch.matmul / torch.softmax
  in-place   the same with preallocated buffers (matmul(out=…)) and an in-place softmax:
             fresh 134 MB score tensors cost more in page faults than in arithmetic
  sdpa       torch.nn.functional._scaled_dot_product_attention (1.13's private fused entry)
each "out of the box" (this image's environment: OPENBLAS_CORETYPE as set, ATen's default
AVX2 kernels) and "tuned" (OPENBLAS_CORETYPE=SkylakeX, ATEN_CPU_CAPABILITY=avx512, where
the CPU has AVX-512). Times are medians of --repeats runs after a warm-up.

  /usr/bin/python3 bench/python_vs_torch.py [--sizes 512,2048] [--dims 64,128] [--threads 1]
         [--repeats 5] [--markdown FILE]
Needs the built package on PYTHONPATH (build/release/python) or installed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = ["explicit", "in-place", "sdpa"]


def flops(n, d, causal, heads):
    f = 4.0 * n * n * d * heads
    return f / 2 if causal else f


def time_call(fn, repeats):
    fn()  # warm-up (first touches, thread start)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_torch(config, sizes, dims, threads, repeats, heads):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    results = {}
    for n in sizes:
        for d in dims:
            g = torch.Generator().manual_seed(n * 1000 + d)
            q, k, v = (torch.randn(1, heads, n, d, generator=g) for _ in range(3))
            for causal in (False, True):
                mask = torch.triu(torch.full((n, n), float("-inf")), 1) if causal else None
                if config == "explicit":

                    def fn():
                        with torch.no_grad():
                            s = torch.matmul(q, k.transpose(-1, -2)) * (d ** -0.5)
                            if mask is not None:
                                s = s + mask
                            return torch.matmul(torch.softmax(s, dim=-1), v)
                elif config == "in-place":
                    s = torch.empty(1, heads, n, n)
                    o = torch.empty(1, heads, n, d)
                    qs = q * (d ** -0.5)
                    kt = k.transpose(-1, -2)

                    def fn():
                        with torch.no_grad():
                            torch.matmul(qs, kt, out=s)
                            if mask is not None:
                                s.add_(mask)
                            s.sub_(s.amax(-1, keepdim=True)).exp_()
                            s.div_(s.sum(-1, keepdim=True))
                            return torch.matmul(s, v, out=o)
                else:
                    def fn():
                        with torch.no_grad():
                            return F._scaled_dot_product_attention(q, k, v, None, 0.0, False, causal)[0]
                results["%d,%d,%d" % (n, d, causal)] = time_call(fn, repeats)
    return results


def measure_attn(sizes, dims, threads, repeats, heads):
    import numpy as np
    import attn
    attn.set_num_threads(threads)
    results = {}
    for n in sizes:
        for d in dims:
            rng = np.random.default_rng(n * 1000 + d)
            q, k, v = (rng.standard_normal((1, heads, n, d)).astype(np.float32) for _ in range(3))
            for causal in (False, True):
                results["%d,%d,%d" % (n, d, causal)] = time_call(
                    lambda: attn.scaled_dot_product_attention(q, k, v, is_causal=causal), repeats)
    return results


def child(args):
    """Runs one configuration and prints its times as JSON (used by the parent)."""
    if args.child == "attn":
        res = measure_attn(args.sizes, args.dims, args.threads, args.repeats, args.heads)
    else:
        res = measure_torch(args.child, args.sizes, args.dims, args.threads, args.repeats, args.heads)
    print(json.dumps(res))


def has_avx512():
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


def run_child(name, env_extra, args):
    env = dict(os.environ, **env_extra)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["OPENBLAS_NUM_THREADS"] = str(args.threads)  # OpenBLAS's own pool ignores torch.set_num_threads
    cmd = [sys.executable, __file__, "--child", name, "--sizes", ",".join(map(str, args.sizes)), "--dims",
           ",".join(map(str, args.dims)), "--threads", str(args.threads), "--repeats", str(args.repeats),
           "--heads", str(args.heads)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    time.sleep(1.0)  # let the previous process's threads and pages go before the next one
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="512,2048,8192")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--markdown", default=None, help="also write the table to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = [int(x) for x in str(args.sizes).split(",")]
    args.dims = [int(x) for x in str(args.dims).split(",")]
    if args.child:
        return child(args)

    envs = {"out of the box": {}}
    if has_avx512():
        envs["tuned"] = {"OPENBLAS_CORETYPE": "SkylakeX", "ATEN_CPU_CAPABILITY": "avx512"}
    torch_runs = {}
    for env_name, env in envs.items():
        for config in CONFIGS:
            torch_runs["%s, %s" % (config, env_name)] = run_child(config, env, args)
    attn_times = run_child("attn", {}, args)

    lines = ["| N | d | mask | attn ms | attn GFLOP/s | " +
             " | ".join("torch %s GFLOP/s" % name for name in torch_runs) + " | best torch | attn / best |",
             "|---:|---:|---|---:|---:|" + "---:|" * len(torch_runs) + "---|---:|"]
    for n in args.sizes:
        for d in args.dims:
            for causal in (False, True):
                key = "%d,%d,%d" % (n, d, causal)
                f = flops(n, d, causal, args.heads)
                rates = {name: f / run[key] / 1e9 for name, run in torch_runs.items()}
                best = max(rates, key=rates.get)
                a = f / attn_times[key] / 1e9
                lines.append("| %d | %d | %s | %.2f | %.1f | %s | %s | %.2f× |" % (
                    n, d, "causal" if causal else "none", attn_times[key] * 1e3, a,
                    " | ".join("%.1f" % rates[name] for name in torch_runs), best, a / rates[best]))
    table = "\n".join(lines)
    print("threads=%d, heads=%d, median of %d (python %s)" % (args.threads, args.heads, args.repeats,
                                                              sys.version.split()[0]))
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
