"""PyTorch's scaled_dot_product_attention on the GPU, forward and backward (autograd), the
shapes of bench/cuda/cuda_attention_bench.cpp (B·N = 16k tokens, H·d = 2048, bf16), timed
the same way (CUDA events, median of repeats after warm-ups, random inputs). PyTorch picks its
fastest backend (FlashAttention-2 or cuDNN on Hopper); the line above the table says
which version ran. Run on the GPU machine, beside cuda_attention_bench, in one command.

    python3 bench/peers/cuda_sdpa.py [repeats]
"""
import sys

import torch
import torch.nn.functional as F


def median_ms(repeats, run):
    """Median milliseconds of `repeats` timed calls (CUDA events) after three warm-ups."""
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    if not torch.cuda.is_available():
        print("cuda_sdpa: no GPU", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}")
    print(f"| pass | d | N | B | H | causal | ms (median of {repeats}) | TFLOP/s |\n|---|---|---|---|---|---|---|---|")
    tokens, width = 16384, 2048
    for d in (64, 128):
        H = width // d
        for N in (512, 1024, 2048, 4096, 8192, 16384):
            B = tokens // N
            # SDPA's layout is [B, H, N, d]; attn's is [B, N, H, d]: transposed views of the same data.
            q, k, v = (torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).detach().requires_grad_()
                       for _ in range(3))
            grad = torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
            for causal in (False, True):
                flops = 4.0 * N * N * d * H * B * (0.5 if causal else 1.0)
                with torch.no_grad():
                    fwd = median_ms(repeats, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                bwd = median_ms(repeats, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
                for name, ms, f in (("forward", fwd, flops), ("backward", bwd, 2.5 * flops)):
                    print(f"| {name} | {d} | {N} | {B} | {H} | {'yes' if causal else 'no'} | {ms:.3f} | "
                          f"{f / (ms * 1e-3) / 1e12:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
