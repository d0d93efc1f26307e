"""Single-thread CPU forward, ours against PyTorch's SDPA: the minimum of interleaved reps.

On a small shared machine the median of bench_cpu.py moves by +-5-10% between runs; one thread
and the minimum over 25 interleaved reps (ours, torch, ours, ...) moves by about 1%, enough to
compare two builds of a kernel change (run it in each tree in turn, ABAB).  fp32 (or --dtype),
B = 1, H = 4, d = 64, inputs (B, H, L, d), under torch.no_grad(): each of --seqlens (default
1024 2048) non-causal, the first also causal.  Prints one line per point: both times and
torch / ours.

Usage: PYTHONPATH=<tree> python benchmarks/bench_cpu_min.py [--reps 25] [--seqlens 1024 2048]
    [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

import flash_attn_ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    points = [(seqlen, False) for seqlen in args.seqlens] + [(args.seqlens[0], True)]
    for seqlen, causal in points:
        inputs = [torch.randn(1, 4, seqlen, 64).to(getattr(torch, args.dtype))
                  for _ in range(3)]
        fns = {"ours": functools.partial(flash_attn_ext.scaled_dot_product_attention, *inputs,
                                         is_causal=causal),
               "torch": functools.partial(F.scaled_dot_product_attention, *inputs,
                                          is_causal=causal)}
        best = dict.fromkeys(fns, float("inf"))
        with torch.no_grad():
            for fn in fns.values():
                fn()
            for _ in range(args.reps):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - start)
        print(f"L={seqlen} causal={causal} ours {best['ours'] * 1e3:.2f} ms torch "
              f"{best['torch'] * 1e3:.2f} ms ratio {best['torch'] / best['ours']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
