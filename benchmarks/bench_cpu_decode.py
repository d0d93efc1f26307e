"""Decoding-shaped calls on the CPU (a few query rows against a long cache, GQA / MQA):
flash_attn_func(q, k, v, causal=True) against PyTorch's CPU SDPA with the same bottom-right
causal mask (none at one query row, where it hides nothing; enable_gqa=True), in one process,
median ms of --reps interleaved calls.

For an A/B of two builds or two routes (e.g. FLASH_ATTN_EXT_CPU_BF16_DOT=0), run it in
alternating processes, a few rounds each: this 2-core machine's spread between processes
(+-10%) is larger than within one.

Usage: PYTHONPATH=<tree> python benchmarks/bench_cpu_decode.py [--dtypes bfloat16]
    [--reps 9] [--no-torch]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

import flash_attn_ext

# (batch, seqlen_q, heads_q, heads_kv, seqlen_k, head_dim)
POINTS = [(4, 1, 32, 32, 2048, 128), (1, 1, 32, 8, 4096, 128), (8, 1, 32, 8, 1024, 128),
          (4, 1, 32, 4, 2048, 64), (1, 1, 32, 1, 8192, 128), (1, 4, 32, 8, 4096, 128),
          (1, 16, 32, 8, 4096, 128), (2, 64, 32, 8, 2048, 128)]


def torch_causal_mask(seqlen_q: int, seqlen_k: int) -> torch.Tensor | None:
    """Bottom-right causal (FlashAttention-2's alignment), as a boolean (L, S) mask; None
    where it hides nothing (one query row), so that PyTorch takes its unmasked path."""
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    mask = j <= i + seqlen_k - seqlen_q
    return None if bool(mask.all()) else mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for batch, lq, hq, hk, sk, d in POINTS:
            q = torch.randn(batch, lq, hq, d).to(dtype)
            k, v = (torch.randn(batch, sk, hk, d).to(dtype) for _ in "kv")
            fns = {"ours": functools.partial(flash_attn_ext.flash_attn_func, q, k, v,
                                             causal=True)}
            if not args.no_torch:
                fns["torch"] = functools.partial(
                    F.scaled_dot_product_attention, q.transpose(1, 2), k.transpose(1, 2),
                    v.transpose(1, 2), attn_mask=torch_causal_mask(lq, sk), enable_gqa=True)
            times = {n: [] for n in fns}
            with torch.no_grad():
                for fn in fns.values():
                    fn()
                for _ in range(args.reps):
                    for n, fn in fns.items():
                        t0 = time.perf_counter()
                        fn()
                        times[n].append((time.perf_counter() - t0) * 1e3)
            row = "  ".join(f"{n} {statistics.median(t):6.2f} ms" for n, t in times.items())
            print(f"{name:9s} B={batch} L={lq} H={hq}:{hk} S={sk} d={d}: {row}", flush=True)


if __name__ == "__main__":
    main()
