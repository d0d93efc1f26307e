"""Single-thread CPU forward, ours against PyTorch's SDPA: the minimum of interleaved reps.

On a small shared machine the median of bench_cpu.py moves by +-5-10% between runs; one thread
and the minimum over 25 interleaved reps (ours, torch, ours, ...) moves by about 1%, enough to
compare two builds of a kernel change (run it in each tree in turn, ABAB).  fp32, B = 1, H = 4,
d = 64, inputs (B, H, L, d), under torch.no_grad(): L = 1024 and 2048 non-causal, 1024 causal.

Usage: PYTHONPATH=<tree> python benchmarks/bench_cpu_min.py [--reps 25]
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for seqlen, causal in ((1024, False), (2048, False), (1024, True)):
        inputs = [torch.randn(1, 4, seqlen, 64) for _ in range(3)]
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
