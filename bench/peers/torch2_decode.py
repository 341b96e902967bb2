"""attn's decode path vs PyTorch 2.x's CPU scaled_dot_product_attention with Lq = 1, one run.

One decoding step per call, no append on either side: q [B, 1, Hq, d] against a cache of
L tokens, Hq=32, Hkv=8 (GQA), d=128 — the shapes of `attn bench --decode`. Each library reads
its own natural layout: PyTorch [B, Hkv, L, d] with enable_gqa=True (its SDPA wants heads
before positions), attn [B, L, Hkv, d] (FlashAttention's cache layout) through
attn.attention_with_kvcache. A third column is what a PyTorch model gets from attn
without a cache API: attn.torch.scaled_dot_product_attention on PyTorch's own tensors
(the call attn.torch.patch_sdpa makes; attention() with one query runs on the decode
kernel, reading k and v through their strides). Same dtype (f32 or bf16), same threads;
medians of repeated calls after a warm-up, each in its own phase. Prints ms per step,
GB/s of cache read (K and V bytes / time) and attn's speed-ups.

  bash bench/peers/setup.sh        # once: bench/peers/.venv with torch 2.x from PyPI
  PYTHONPATH=build/release/python bench/peers/.venv/bin/python bench/peers/torch2_decode.py \
      [--sizes 8192,32768] [--batches 1,8] [--threads 1,2] [--dtypes f32,bf16] [--markdown FILE]
"""
import argparse

import torch
import torch.nn.functional as F

import attn
import attn.torch
from peer_timing import cpu_model, median_time

HQ, HKV, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--markdown", default="")
    args = ap.parse_args()
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    print("attn %s vs torch %s on %s" % (attn.__version__, torch.__version__, cpu_model()))
    rows = []
    for name in args.dtypes.split(","):
        dt = dtypes[name]
        for B in (int(b) for b in args.batches.split(",")):
            for L in (int(s) for s in args.sizes.split(",")):
                gen = torch.Generator().manual_seed(L * 31 + B)
                q = torch.randn(B, 1, HQ, D, generator=gen).to(dt)
                k_attn = torch.randn(B, L, HKV, D, generator=gen).to(dt)
                v_attn = torch.randn(B, L, HKV, D, generator=gen).to(dt)
                # The same numbers in PyTorch's layout, made contiguous once (not timed).
                q_t = q.transpose(1, 2).contiguous()
                k_t = k_attn.transpose(1, 2).contiguous()
                v_t = v_attn.transpose(1, 2).contiguous()
                seqlens = torch.full((B,), L, dtype=torch.int32)
                cache_bytes = 2 * B * L * HKV * D * k_attn.element_size()
                for threads in (int(t) for t in args.threads.split(",")):
                    torch.set_num_threads(threads)
                    attn.set_num_threads(threads)
                    with torch.no_grad():
                        def run_torch():
                            return F.scaled_dot_product_attention(q_t, k_t, v_t, enable_gqa=True)

                        def run_attn():
                            return attn.attention_with_kvcache(q, k_attn, v_attn, cache_seqlens=seqlens)

                        def run_attn_sdpa():
                            return attn.torch.scaled_dot_product_attention(q_t, k_t, v_t, enable_gqa=True)

                        ref = run_torch().transpose(1, 2).float()
                        got = run_attn().float()
                        got_sdpa = run_attn_sdpa().transpose(1, 2).float()
                        scale = max(ref.abs().max().item(), 1e-30)
                        err = max((got - ref).abs().max().item(), (got_sdpa - ref).abs().max().item()) / scale
                        t_torch = median_time(run_torch, 7, 1.0, max_calls=200)
                        t_attn = median_time(run_attn, 7, 1.0, max_calls=200)
                        t_sdpa = median_time(run_attn_sdpa, 7, 1.0, max_calls=200)
                    row = (name, B, L, threads, t_torch * 1e3, cache_bytes / t_torch * 1e-9, t_attn * 1e3,
                           cache_bytes / t_attn * 1e-9, t_torch / t_attn, t_sdpa * 1e3, t_torch / t_sdpa, err)
                    rows.append(row)
                    print("  %-4s B=%d L=%-6d threads=%d  torch %8.3f ms %6.1f GB/s  attn %8.3f ms %6.1f GB/s  "
                          "attn %.2fx  attn.torch sdpa %8.3f ms %.2fx  (max rel diff %.1e)" % row)
    table = ["| cache | B | L | threads | torch ms | torch GB/s | attn ms | attn GB/s | attn speed-up "
             "| attn.torch SDPA ms | its speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append("| %s | %d | %d | %d | %.3f | %.1f | %.3f | %.1f | %.2f× | %.3f | %.2f× |" % r[:11])
    print("\n" + "\n".join(table))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
