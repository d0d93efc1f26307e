"""What the CUDA exact passes on every call cost calls that flag no row
(csrc/cuda/exact_rows.h; kernel option exact_rows_always): the forward and the backward, each
timed with the option on and off in turn, in one process, plain and causal, at the benchmark's
shapes (bf16, B * L = 16k tokens, H * d = 2048), and a small call where the passes' launches
weigh most.

    python dev/gpu/exact_rows_cost.py [--dims 128 64] [--seqlens 1024 4096] [--rounds 3]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_attention import median_ms

import flash_attn_ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shapes = [(max(1, 16384 // s), s, 2048 // d, d) for d in args.dims for s in args.seqlens]
    shapes.append((1, 256, 8, 128))  # (a small call: the pass's fixed cost at its largest)
    for batch, seqlen, heads, d in shapes:
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in "qkv")
        for causal in (False, True):
            out = flash_attn_ext.flash_attn_func(q, k, v, causal=causal)
            dout = torch.randn_like(out)
            flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
            plain = tuple(t.detach() for t in (q, k, v))
            passes = {
                "forward": (lambda c=causal, t=plain: flash_attn_ext.ops.fwd(*t, None, c), 1.0),
                "backward": (lambda o=out, leaves=(q, k, v), g=dout:
                             torch.autograd.grad(o, leaves, g, retain_graph=True), 2.5)}
            for name, (fn, factor) in passes.items():
                times = {True: [], False: []}
                for _ in range(args.rounds):  # (alternating: the GPU's speed drifts)
                    for always in (True, False):
                        with flash_attn_ext.kernel_options(exact_rows_always=always):
                            times[always].append(median_ms(fn))
                on, off = (sorted(times[a])[len(times[a]) // 2] for a in (True, False))
                print(f"B={batch:2d} L={seqlen:5d} H={heads:2d} d={d:3d} causal={causal!s:5s} "
                      f"{name:8s} {off * 1e3:8.1f} us without the pass, {on * 1e3:8.1f} us "
                      f"with it ({(on / off - 1) * 100:+.1f}%; "
                      f"{factor * flops / on / 1e9:.1f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
