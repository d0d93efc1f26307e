"""GQA/MQA forward on the Hopper kernel with and without packing the query heads of a group into
one tile (flash_attn_ext.kernel_options(sm90_pack_gqa="on"/"off"); the default, "auto", follows
the rule of csrc/kernels/sm90/pack_gqa.h, as explain() reports it), next to SDPA's FLASH and
cuDNN backends (enable_gqa), in one process, CUDA-graph timing (bench_attention.graph_ms),
interleaved over rounds (median).

Shapes: bf16, (B, H, L, d) as SDPA takes them, H = 32 query heads, H_kv = 32 / group, S keys;
decoding-like (L = 1..16) and short prefill.  No mask (SDPA's is_causal is top-left, which for
L < S differs from the bottom-right causal mask of decoding; unmasked is the same work).
Prints microseconds per call, TFLOP/s (4 B H L S d) and the K/V read rate in GB/s (B H_kv S
(d + d) 2 bytes over the time: the memory-bound ceiling for decoding is ~4,800 GB/s on an H200).

Usage (on an sm_90 GPU): python benchmarks/bench_gqa.py [--rounds 3] [--head-dims 64 128]
    [--groups 4 8] [--seqlens-q 1 4 16 64 128 512] [--seqlens-k 1024 8192] [--batch 8]
"""
import argparse
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import graph_ms

import flash_attn_ext

PEERS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seqlens-q", type=int, nargs="+", default=[1, 4, 16, 64, 128, 512])
    parser.add_argument("--seqlens-k", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    heads = 32
    print(f"GQA forward, median of {args.rounds} rounds, CUDA-graph timing; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B={args.batch}, "
          f"H={heads}; us / TFLOP/s / K,V GB/s per implementation")
    for d in args.head_dims:
        for group in args.groups:
            for seqlen_k in args.seqlens_k:
                for seqlen_q in args.seqlens_q:
                    run_point(args, heads, d, group, seqlen_q, seqlen_k)


def run_point(args, heads: int, d: int, group: int, seqlen_q: int, seqlen_k: int) -> None:
    b, heads_kv = args.batch, heads // group
    q = torch.randn(b, heads, seqlen_q, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, heads_kv, seqlen_k, d, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    flops = 4 * b * heads * seqlen_q * seqlen_k * d
    kv_bytes = 2 * b * heads_kv * seqlen_k * d * 2
    ms = {name: [] for name in ("packed", "unpacked", *PEERS)}

    def ours():
        return flash_attn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def peer():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    auto = flash_attn_ext.explain(q, k, v, enable_gqa=True).kernel.endswith("_packgqa")
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, pack in (("packed", "on"), ("unpacked", "off")):
                with flash_attn_ext.kernel_options(sm90_pack_gqa=pack):
                    ms[name].append(graph_ms(ours))
            for name, backend in PEERS.items():
                try:
                    with sdpa_kernel(backend):
                        ms[name].append(graph_ms(peer))
                except RuntimeError:  # the backend does not take this call
                    pass
    cells = []
    for name, times in ms.items():
        if times:
            t = statistics.median(times)
            cells.append(f"{name} {t * 1e3:8.1f} us {flops / t / 1e9:6.1f} "
                         f"{kv_bytes / t / 1e6:6.0f}")
        else:
            cells.append(f"{name} unsupported")
    ratio = statistics.median(ms["unpacked"]) / statistics.median(ms["packed"])
    print(f"d={d:3d} group={group} L={seqlen_q:4d} S={seqlen_k:5d} "
          f"auto={'pack' if auto else 'none'} " + " | ".join(cells)
          + f" | packed speed-up {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
