"""attn vs PyTorch 2.x's CPU scaled_dot_product_attention (its fused flash kernel), one run.

Same shapes for both (B=1, H=8, [B, H, N, d] tensors, PyTorch's layout, which attn reads in
place), f32 and bf16 (and f16 with --dtypes), none/causal, 1 and 2 threads; medians of repeated calls after a
warm-up, each implementation in its own phase (OpenMP pools spin for a while after a
parallel region). Prints GFLOP/s (4·N²·d·H, halved for causal) and attn's speed-up, and
which path attn's bf16 took (cpu_info). With --flex, also FlexAttention
(``torch.compile(flex_attention)``, causal through ``create_block_mask``) where it runs on
this CPU; a configuration it cannot run prints why and shows "—". With --backward, the
backward instead: PyTorch's autograd through its fused kernel (``torch.autograd.grad`` on
a retained graph, so only the backward is timed) against ``attn.attention_backward``
given the forward's out and lse; GFLOP/s count 2.5× the forward's flops. With
--matmul-precision high|medium, float32 rows run under
``torch.set_float32_matmul_precision`` for both: PyTorch as that setting makes it, attn
with the precision it maps to in ``attn.torch`` ("high" → bf16x3, "medium" → bf16).

  bash bench/peers/setup.sh        # once: bench/peers/.venv with torch 2.x from PyPI
  PYTHONPATH=build/release/python bench/peers/.venv/bin/python bench/peers/torch2_sdpa.py \
      [--sizes 2048] [--dims 64,128] [--threads 1,2] [--dtypes f32,bf16,f16] [--flex | --backward]
      [--matmul-precision highest|high|medium] [--markdown FILE]
"""
import argparse
import time

import torch
import torch.nn.functional as F

import attn
import attn.torch
from peer_timing import cpu_model, median_time


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def backward_runs(q, k, v, causal, g, precision):
    """The two backward calls for one configuration: PyTorch's (autograd through its
    fused SDPA, graph retained) and attn's (attention_backward on the forward's out, lse)."""
    dout = torch.rand(q.shape, generator=g).mul_(2).sub_(1).to(q.dtype)
    tq, tk, tv = (x.clone().requires_grad_(True) for x in (q, k, v))
    t_out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    out, lse = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True, precision=precision)

    def run_torch():
        return torch.autograd.grad(t_out, (tq, tk, tv), dout, retain_graph=True)

    def run_attn():
        return attn.attention_backward(dout, q, k, v, out, lse, is_causal=causal, precision=precision)

    return run_torch, run_attn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2048")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="f32,bf16", help="comma-separated: f32, bf16, f16")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    ap.add_argument("--markdown", default="")
    ap.add_argument("--flex", action="store_true", help="also time compiled FlexAttention")
    ap.add_argument("--backward", action="store_true", help="time the backward instead of the forward")
    ap.add_argument("--matmul-precision", default="highest", choices=("highest", "high", "medium"),
                    help="torch.set_float32_matmul_precision for the float32 rows (attn: the precision it maps to)")
    args = ap.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    f32_precision = attn.torch.TORCH_PRECISIONS[args.matmul_precision]
    if args.flex and args.backward:
        ap.error("--flex times the forward only")
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    info = attn.cpu_info()
    print("CPU: %s; torch %s; attn bf16 path: %s; f32 SIMD target: %s; float32 matmul precision %s (attn: %s)"
          % (cpu_model(), torch.__version__, info["bf16_path"], info["simd_target"], args.matmul_precision,
             f32_precision))
    rows = []
    flex = create = None
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask as create, flex_attention
        # One compile per (dtype, d, mask, thread count): past dynamo's default limit of
        # 8 recompiles it silently falls back to the unfused, materialising
        # implementation, which would time something else.
        from torch._dynamo import config as dynamo_config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, 64)
        flex = torch.compile(flex_attention)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        attn.set_num_threads(threads)
        for name in args.dtypes.split(","):
            for n in (int(s) for s in args.sizes.split(",")):
                for d in (int(x) for x in args.dims.split(",")):
                    g = torch.Generator().manual_seed(n + d)
                    q, k, v = (torch.rand(1, args.heads, n, d, generator=g).mul_(2).sub_(1).to(dtypes[name])
                               for _ in range(3))
                    precision = f32_precision if name == "f32" else "f32"
                    label = name if precision == "f32" else "%s (%s)" % (name, args.matmul_precision)
                    for causal in (False, True):
                        if args.backward:
                            run_torch, run_attn = backward_runs(q, k, v, causal, g, precision)
                        else:
                            def run_torch():
                                with torch.no_grad():
                                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                            def run_attn():
                                return attn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                         precision=precision)

                        diff = max((a.float() - b.float()).abs().max().item()
                                   for a, b in zip(as_tuple(run_torch()), as_tuple(run_attn())))
                        time.sleep(0.3)
                        t_torch = median_time(run_torch, args.repeats, args.min_seconds)
                        time.sleep(0.3)
                        t_attn = median_time(run_attn, args.repeats, args.min_seconds)
                        fl = 4.0 * n * n * d * args.heads * (0.5 if causal else 1.0) * (2.5 if args.backward else 1.0)
                        row = (label, n, d, "causal" if causal else "none", threads, t_torch * 1e3, fl / t_torch * 1e-9,
                               t_attn * 1e3, fl / t_attn * 1e-9, t_torch / t_attn, diff)
                        t_flex = None
                        if flex is not None:
                            try:
                                bm = (create(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device="cpu")
                                      if causal else None)

                                def run_flex():
                                    with torch.no_grad():
                                        return flex(q, k, v, block_mask=bm)

                                run_flex()
                                time.sleep(0.3)
                                t_flex = median_time(run_flex, args.repeats, args.min_seconds)
                            except Exception as e:  # noqa: BLE001 (reported, the row goes on)
                                print("  FlexAttention did not run: %s" % str(e).splitlines()[0][:120])
                        row += (t_flex,)
                        rows.append(row)
                        print("  %-4s N=%-5d d=%-3d %-6s threads=%d  torch %8.2f ms %7.1f GFLOP/s  attn %8.2f ms "
                              "%7.1f GFLOP/s  attn/torch %.2fx  max|diff| %.1e" % row[:11], flush=True)
                        if t_flex is not None:
                            print("      flex %8.2f ms %7.1f GFLOP/s  attn/flex %.2fx"
                                  % (t_flex * 1e3, fl / t_flex * 1e-9, t_flex / t_attn), flush=True)
    head = "| dtype | N | d | mask | threads | torch ms | torch GFLOP/s | attn ms | attn GFLOP/s | attn speed-up |"
    rule = "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"
    if flex is not None:
        head += " flex ms | flex GFLOP/s | attn vs flex |"
        rule += "---:|---:|---:|"
    table = [head, rule]
    for r in rows:
        line = "| %s | %d | %d | %s | %d | %.2f | %.1f | %.2f | %.1f | %.2f× |" % r[:10]
        if flex is not None:
            t_flex, t_attn = r[11], r[7] * 1e-3
            fl = 4.0 * r[1] * r[1] * r[2] * args.heads * (0.5 if r[3] == "causal" else 1.0)
            line += (" — | — | — |" if t_flex is None else
                     " %.2f | %.1f | %.2f× |" % (t_flex * 1e3, fl / t_flex * 1e-9, t_flex / t_attn))
        table.append(line)
    text = "\n".join(table) + "\n"
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
