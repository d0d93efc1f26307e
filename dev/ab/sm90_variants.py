"""Forward TFLOP/s of the Hopper kernel's schedule and epilogue variants next to cuDNN's, in one
process, interleaved over rounds in a rotated order (the median of the rounds is printed),
CUDA-graph timing.

Variants are picked through flash_attn_ext.kernel_options: sm90_schedule (tile, static, dynamic;
"auto", the default, is static without and dynamic with a causal mask), sm90_direct_epilogue
(tma, the default where the kernel has room for it, or direct) and sm90_section_pairs
((batch, head) pairs per section of the tile order; 0: the launcher's choice).  Shapes:
bench_attention's, bf16, B * L = 16k tokens, H * d = 2048.  Usage (on an sm_90 GPU):
python dev/ab/sm90_variants.py [--sections 0 1 8 ...] [--causal no|yes|both]
"""
import argparse
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# timing.py, bench_attention.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../benchmarks"))
from bench_attention import graph_ms
from timing import CAUSAL_MODES, rotated

import flash_attn_ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    parser.add_argument("--schedules", nargs="+", default=["tile", "static", "dynamic"])
    parser.add_argument("--epilogues", nargs="+", default=["tma", "direct"])
    parser.add_argument("--sections", type=int, nargs="+", default=[0])
    parser.add_argument("--causal", choices=tuple(CAUSAL_MODES), default="both")
    args = parser.parse_args()
    variants = [(s, e, n) for s in args.schedules for e in args.epilogues for n in args.sections]
    names = {v: "/".join(v[:2]) + (f"/sec{v[2]}" if v[2] else "") for v in variants}
    print(f"forward TFLOP/s, median of {args.rounds} interleaved rounds, CUDA-graph timing; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for d in args.head_dims:
        for seqlen in args.seqlens:
            for causal in CAUSAL_MODES[args.causal]:
                batch, heads = 16384 // seqlen, 2048 // d
                q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda",
                                       dtype=torch.bfloat16) for _ in "qkv")
                flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                rates = {name: [] for name in list(names.values()) + ["cudnn"]}
                for r in range(args.rounds):
                    with torch.no_grad():
                        for s, e, n in rotated(variants, r):
                            with flash_attn_ext.kernel_options(
                                    sm90_schedule=s, sm90_direct_epilogue=e == "direct",
                                    sm90_section_pairs=n):
                                ms = graph_ms(lambda q=q, k=k, v=v, c=causal:
                                              flash_attn_ext.scaled_dot_product_attention(
                                                  q, k, v, is_causal=c))
                            rates[names[(s, e, n)]].append(flops / ms / 1e9)
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            ms = graph_ms(lambda q=q, k=k, v=v, c=causal:
                                          torch.nn.functional.scaled_dot_product_attention(
                                              q, k, v, is_causal=c))
                        rates["cudnn"].append(flops / ms / 1e9)
                med = {name: statistics.median(r) for name, r in rates.items()}
                best = max(v for name, v in med.items() if name != "cudnn")
                cells = "  ".join(f"{name} {rate:5.1f}" for name, rate in med.items())
                print(f"d={d:3d} L={seqlen:5d} causal={causal!s:5s} {cells}  "
                      f"best/cudnn {best / med['cudnn']:.2f}", flush=True)


if __name__ == "__main__":
    main()
