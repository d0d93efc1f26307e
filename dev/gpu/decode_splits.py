"""K/V bandwidth of flash_attn_with_kvcache against num_splits (graph-replayed, bf16, 32 query
heads, one query token, a full contiguous cache), to check the split heuristic
(csrc/cuda/kvcache_cuda.cu: heuristic_splits, at most kMaxDecodeSplits) where MQA and small
batches leave the GPU's slots half empty.  num_splits 0 is the heuristic; counts above
kMaxDecodeSplits run as kMaxDecodeSplits.

Usage on the GPU machine: python3 dev/gpu/decode_splits.py [--splits 0 64 128 192 256]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from timing import graph_ms

import flash_attn_ext

POINTS = [(1, 32768, 1, 128), (1, 131072, 1, 128), (1, 131072, 1, 64), (8, 131072, 1, 128),
          (1, 8192, 8, 128), (1, 131072, 8, 128), (64, 8192, 8, 64)]
SPLITS = [0, 16, 32, 64, 96, 128]


def point(batch: int, seqlen: int, heads_kv: int, d: int, splits_list: list[int]) -> str:
    q = torch.randn(batch, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_kv, d, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    nbytes = 2 * k.numel() * k.element_size()
    row = []
    for splits in splits_list:
        def fn(s=splits):
            return flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens,
                                                          num_splits=s)
        ms = graph_ms(fn, reps=10, groups=3)
        row.append(f"{splits or 'h'}:{nbytes / ms / 1e9:.2f}")
    return " ".join(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", type=int, nargs="+", default=SPLITS,
                        help="num_splits values to time (0: the heuristic)")
    args = parser.parse_args()
    for batch, seqlen, heads_kv, d in POINTS:
        print(f"B={batch} S={seqlen} Hkv={heads_kv} d={d} TB/s by num_splits:",
              point(batch, seqlen, heads_kv, d, args.splits), flush=True)


if __name__ == "__main__":
    main()
