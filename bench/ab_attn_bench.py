#!/usr/bin/env python3
"""Same-run A/B of two builds of the `attn` tool: alternates `attn bench ARGS` between them.

On a shared, noisy machine one run of each build cannot tell a 5% change from the host's
drift, so the two binaries take turns (old, new; then new, old; ...) and every round gives
one new/old time ratio per table row. Prints, per row, the median of those ratios (below 1:
the new build is faster), the ratios themselves, and each build's median GFLOP/s.

  cp build/release/tools/attn/attn /tmp/attn_old      # before the change
  ...rebuild...
  python3 bench/ab_attn_bench.py /tmp/attn_old build/release/tools/attn/attn 6 \\
      --sizes 2048 --dims 64 128 --threads 1 --no-baseline

Works for the forward and backward tables (`--backward`); not for `--decode`.
"""
import re
import statistics
import subprocess
import sys

ROW = re.compile(r"^\s+(\S+)\s+\((\S+)\) N=(\d+)\s+d=(\d+)\s+(\S+)\s+threads=(\d+)\s+"
                 r"attn\s+([\d.]+) ms\s+([\d.]+) GFLOP/s")


def run(binary, args):
    """{row key: (ms, GFLOP/s)} of one `attn bench` run."""
    out = subprocess.run([binary, "bench"] + args, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1, 2, 3, 4, 5, 6)] = (float(m.group(7)), float(m.group(8)))
    return rows


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    old, new, rounds, args = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    ratios, rates = {}, {}
    for i in range(rounds):
        order = [("old", old), ("new", new)] if i % 2 == 0 else [("new", new), ("old", old)]
        got = {}
        for tag, binary in order:
            got[tag] = run(binary, args)
            for key, (_, gflops) in got[tag].items():
                rates.setdefault((key, tag), []).append(gflops)
        for key in got["new"].keys() & got["old"].keys():
            ratios.setdefault(key, []).append(got["new"][key][0] / got["old"][key][0])
        print(f"round {i + 1}/{rounds} done", file=sys.stderr, flush=True)
    for key in sorted(ratios):
        r = ratios[key]
        print(f"{' '.join(key)}: new/old time median {statistics.median(r):.3f} "
              f"({' '.join(f'{x:.3f}' for x in r)}); GFLOP/s old {statistics.median(rates[(key, 'old')]):.1f} "
              f"new {statistics.median(rates[(key, 'new')]):.1f}")


if __name__ == "__main__":
    main()
