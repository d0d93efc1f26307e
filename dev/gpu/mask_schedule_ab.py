"""The Hopper forward's tile schedule for a (B, 1, L, S) causal + padding boolean mask: the
kernel rule picks the static schedule for mask calls (their tiles look equal to it), where a
causal flag gets the dynamic, longest-first one.  Forward time of the mask variant under each
schedule (kernel option sm90_schedule), with plain causal attention as the yardstick, in one
process (bf16, B * L = 16k tokens, H * d = 2048, bench_score_mods's causal_padding mask).

    python dev/gpu/mask_schedule_ab.py [--dims 128 64] [--seqlen 4096]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_attention import median_ms
from bench_score_mods import make_case

import flash_attn_ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--seqlen", type=int, default=4096)
    args = parser.parse_args()
    for d in args.dims:
        seqlen, heads = args.seqlen, 2048 // d
        batch = max(1, 16384 // seqlen)
        q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16)
                   for _ in "qkv")
        mask = make_case("causal_padding", batch, seqlen, d)["attn_mask"]
        flops = 4 * batch * heads * seqlen * seqlen * d / 2
        runs = [("causal (flag)", None, True, "auto")] + \
            [(f"causal_padding mask, {s}", mask, False, s) for s in ("auto", "static", "dynamic")]
        for name, m, causal, schedule in runs:
            with flash_attn_ext.kernel_options(sm90_schedule=schedule):
                ms = median_ms(lambda qkv=(q, k, v), m=m, c=causal:
                               flash_attn_ext.scaled_dot_product_attention(*qkv, attn_mask=m,
                                                                           is_causal=c))
            print(f"d={d:3d} L={seqlen} {name:32s} fwd {flops / ms / 1e9:6.1f} TFLOP/s "
                  f"({ms:.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
