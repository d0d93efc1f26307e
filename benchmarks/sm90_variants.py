"""Forward TFLOP/s of the Hopper kernel's schedule and epilogue variants next to cuDNN's, in one
process, interleaved over rounds (the median of the rounds is printed), CUDA-graph timing.

Variants are picked through FLASH_ATTN_EXT_SM90_SCHEDULE (tile, static, dynamic; "auto", the
default, is static without and dynamic with a causal mask) and FLASH_ATTN_EXT_SM90_EPILOGUE
(tma, the default where the kernel has room for it, or direct).  Shapes: bench_attention's, bf16,
B * L = 16k tokens, H * d = 2048.  Usage (on an sm_90 GPU): python benchmarks/sm90_variants.py
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    parser.add_argument("--schedules", nargs="+", default=["tile", "static", "dynamic"])
    parser.add_argument("--epilogues", nargs="+", default=["tma", "direct"])
    args = parser.parse_args()
    variants = [(s, e) for s in args.schedules for e in args.epilogues]
    print(f"forward TFLOP/s, median of {args.rounds} interleaved rounds, CUDA-graph timing; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for d in args.head_dims:
        for seqlen in args.seqlens:
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 2048 // d
                q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda",
                                       dtype=torch.bfloat16) for _ in "qkv")
                flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                rates = {name: [] for name in [f"{s}/{e}" for s, e in variants] + ["cudnn"]}
                for _ in range(args.rounds):
                    with torch.no_grad():
                        for s, e in variants:
                            os.environ["FLASH_ATTN_EXT_SM90_SCHEDULE"] = s
                            os.environ["FLASH_ATTN_EXT_SM90_EPILOGUE"] = e
                            ms = graph_ms(lambda q=q, k=k, v=v, c=causal:
                                          flash_attn_ext.scaled_dot_product_attention(
                                              q, k, v, is_causal=c))
                            rates[f"{s}/{e}"].append(flops / ms / 1e9)
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            ms = graph_ms(lambda q=q, k=k, v=v, c=causal:
                                          torch.nn.functional.scaled_dot_product_attention(
                                              q, k, v, is_causal=c))
                        rates["cudnn"].append(flops / ms / 1e9)
                os.environ.pop("FLASH_ATTN_EXT_SM90_SCHEDULE")
                os.environ.pop("FLASH_ATTN_EXT_SM90_EPILOGUE")
                med = {name: statistics.median(r) for name, r in rates.items()}
                best = max(v for name, v in med.items() if name != "cudnn")
                cells = "  ".join(f"{name} {rate:5.1f}" for name, rate in med.items())
                print(f"d={d:3d} L={seqlen:5d} causal={causal!s:5s} {cells}  "
                      f"best/cudnn {best / med['cudnn']:.2f}", flush=True)


if __name__ == "__main__":
    main()
