"""Forward TFLOP/s of SDPA's cuDNN and FLASH backends timed the way dev/ab/kernel_ab.cu
times our kernels, so that a kernel_ab run on the GPU machine has its peers from the same call
without building the extension (this script needs only PyTorch).

Shapes as kernel_ab: bf16, q, k, v of shape (B, L, H, d) contiguous, passed to SDPA as the
(B, H, L, d) views (--layout bhsd: (B, H, L, d) contiguous); B * L = 16384 tokens,
H * d = 2048.  Timing: timing.queued_ms, `reps` back-to-back calls between CUDA events, the
median of 7 such groups, after 3 warm-up calls.  TFLOP/s the FlashAttention way: 4 B H L^2 d,
halved when causal.

Usage (on a CUDA GPU): python dev/ab/peers_fwd.py [--dims 64 128 256]
    [--seqlens 1024 2048 4096 16384] [--causal no|yes|both] [--reps 10] [--layout bshd|bhsd]
"""
import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# timing.py, bench_attention.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../benchmarks"))
from timing import queued_ms

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd")
    args = parser.parse_args()
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    print(f"peers: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, bf16, B*L = 16384, H*d = 2048, "
          f"{args.layout.upper()} layout")
    for d in args.dims:
        for seqlen in args.seqlens:
            batch, heads = max(1, 16384 // seqlen), 2048 // d
            shape = ((batch, seqlen, heads, d) if args.layout == "bshd"
                     else (batch, heads, seqlen, d))
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
            if args.layout == "bshd":
                q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            for causal in causals:
                flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                for name, backend in BACKENDS.items():
                    with torch.no_grad(), sdpa_kernel(backend):
                        ms = queued_ms(
                            lambda q=q, k=k, v=v, c=causal:
                            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c),
                            reps=args.reps, groups=7)
                    print(f"{name} d={d:3d} L={seqlen:5d} causal={int(causal)} fwd {ms:7.3f} ms "
                          f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
