"""attn.block_mask: how long building one takes, and attention with it against the dense
boolean mask it stands for (attn itself; PyTorch 2's SDPA and FlexAttention where the
interpreter has them). Document masking and a sliding window with global tokens.

    PYTHONPATH=build/release/python python3 bench/peers/block_mask.py [--length 8192] [--build-length 32768]
        [--heads 8] [--dim 64] [--threads 1 2] [--dtype f32 bf16]

Prints one table row per measurement: medians of --repeats runs. GFLOP/s counts the work
the mask leaves (4·d per visible (query, key) pair per head), so a faster row skips more.
"""
import argparse
import os

import numpy as np

import attn
from peer_timing import cpu_model, median_time


def patterns(length, rng):
    """name -> predicate; documents of random lengths (mean ~length/20), and a window of
    256 keys each side plus 16 global tokens."""
    cuts = np.sort(rng.choice(np.arange(1, length), size=19, replace=False))
    ids = np.zeros(length, np.int64)
    ids[cuts] = 1
    doc = np.cumsum(ids)
    return {
        "documents (20)": lambda b, h, q, k: doc[q] == doc[k],
        "window 256 + 16 global": lambda b, h, q, k: (np.abs(q - k) <= 256) | (q < 16) | (k < 16),
    }


def torch_peers():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None, None
    if not hasattr(F, "scaled_dot_product_attention"):
        return torch, None, None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = (torch.compile(flex_attention), create_block_mask)
    except Exception:  # noqa: BLE001 (any failure: FlexAttention not available here)
        flex = None
    return torch, F.scaled_dot_product_attention, flex


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--build-length", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-peers", action="store_true", help="skip PyTorch's SDPA and FlexAttention")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("CPU: %s; attn %s; bf16 path %s" % (cpu_model(), attn.__version__, attn.cpu_info()["bf16_path"]))

    print("\n## Building the mask, %d x %d, blocks of 64 (1 thread, median of %d)\n" %
          (args.build_length, args.build_length, args.repeats))
    print("| pattern | probe | ms | empty | full | partial |")
    print("|---|---|---:|---:|---:|---:|")
    for name, mod in patterns(args.build_length, rng).items():
        for probe in ("border", "full"):
            bm = attn.block_mask(mod, None, None, args.build_length, args.build_length, probe=probe)
            t = median_time(lambda: attn.block_mask(mod, None, None, args.build_length, args.build_length,
                                                    probe=probe), max(1, args.repeats // 2), 0.0)
            c = bm.counts()
            print("| %s | %s | %.1f | %d | %d | %d |" % (name, probe, 1e3 * t, c["empty"], c["full"], c["partial"]))

    torch, sdpa, flex = (None, None, None) if args.no_peers else torch_peers()
    L, H, d = args.length, args.heads, args.dim
    print("\n## Attention, B = 1, H = %d, L = %d, d = %d (median of %d)\n" % (H, L, d, args.repeats))
    print("| pattern | dtype | threads | visible | impl | ms | GFLOP/s (visible work) | time / block_mask time |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    q = rng.standard_normal((1, H, L, d)).astype(np.float32)
    k = rng.standard_normal((1, H, L, d)).astype(np.float32)
    v = rng.standard_normal((1, H, L, d)).astype(np.float32)
    for name, mod in patterns(L, rng).items():
        bm = attn.block_mask(mod, None, None, L, L, probe="border")
        dense = bm.to_dense()[0, 0]
        flops = 4.0 * d * H * float(dense.sum())
        for dtype in args.dtype:
            if dtype == "bf16":
                if torch is None:
                    continue
                tq, tk, tv = (torch.from_numpy(x).bfloat16() for x in (q, k, v))
            else:
                tq, tk, tv = q, k, v
            for threads in args.threads:
                attn.set_num_threads(threads)
                rows = [("attn block_mask", lambda: attn.scaled_dot_product_attention(tq, tk, tv, block_mask=bm)),
                        ("attn dense bool mask", lambda: attn.scaled_dot_product_attention(tq, tk, tv, attn_mask=dense))]
                if sdpa is not None:
                    torch.set_num_threads(threads)
                    pq, pk, pv = (torch.as_tensor(x) for x in (tq, tk, tv))
                    pm = torch.from_numpy(dense)
                    rows.append(("torch SDPA dense bool mask", lambda: sdpa(pq, pk, pv, attn_mask=pm)))
                    if flex is not None:
                        flex_fn, create = flex
                        tmod = lambda b, h, qi, ki, _m=pm: _m[qi, ki]
                        try:
                            fbm = create(tmod, None, None, L, L, device="cpu")
                            flex_fn(pq, pk, pv, block_mask=fbm)
                            rows.append(("torch FlexAttention (compiled)", lambda: flex_fn(pq, pk, pv, block_mask=fbm)))
                        except Exception as e:  # noqa: BLE001
                            print("| %s | %s | %d | | FlexAttention did not run: %s | | | |"
                                  % (name, dtype, threads, str(e).splitlines()[0][:80]))
                base = None
                for impl, fn in rows:
                    t = median_time(fn, args.repeats, 0.0)
                    base = t if base is None else base
                    print("| %s | %s | %d | %.1f%% | %s | %.2f | %.1f | %.2fx |" %
                          (name, dtype, threads, 100.0 * dense.mean(), impl, 1e3 * t, flops / t / 1e9, t / base))


if __name__ == "__main__":
    os.environ.setdefault("OMP_PROC_BIND", "false")
    main()
