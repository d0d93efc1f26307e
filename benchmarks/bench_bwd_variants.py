"""The CUDA backward's two dQ paths side by side, with a per-kernel time split.

deterministic=False: dQ added with fp32 atomics inside the dK/dV kernel (+ a conversion copy);
deterministic=True: a separate atomic-free dQ kernel.  bf16, B * L = 16384 tokens, H * d = 2048,
non-causal and causal; backward TFLOP/s counted the FlashAttention way (2.5 x 4 * B * H * L^2 * d,
halved when causal) and each kernel's share of the backward's GPU time (torch.profiler).

Usage: python benchmarks/bench_bwd_variants.py [--dims 64 128 256] [--seqlens 4096 16384]
"""

from __future__ import annotations

import argparse
import collections

import torch
from bench_attention import median_ms

import flash_attn_ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    for d in args.dims:
        for seqlen in args.seqlens:
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 2048 // d
                q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda",
                                       dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
                flops = 2.5 * 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                for det in (False, True):
                    out = flash_attn_ext.flash_attn_func(q, k, v, causal=causal,
                                                         deterministic=det)
                    dout = torch.randn_like(out)

                    def bwd(out=out, dout=dout, inputs=(q, k, v)):
                        torch.autograd.grad(out, inputs, dout, retain_graph=True)

                    ms = median_ms(bwd)
                    with torch.profiler.profile(
                            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        bwd()
                        torch.cuda.synchronize()
                    share = collections.Counter()
                    for e in prof.events():
                        if e.device_type == torch.autograd.DeviceType.CUDA:
                            name = e.name
                            for key in ("dkdv", "dq_kernel", "delta", "copy", "fill"):
                                if key in name.lower():
                                    name = key
                                    break
                            share[name[:24]] += e.device_time
                    total = sum(share.values()) or 1.0
                    split = ", ".join(f"{n} {100 * t / total:.0f}%"
                                      for n, t in share.most_common(5))
                    print(f"d={d:3d} L={seqlen:5d} causal={causal!s:5} deterministic={det!s:5} "
                          f"bwd {flops / ms / 1e9:6.1f} TFLOP/s  [{split}]", flush=True)


if __name__ == "__main__":
    main()
