"""Where the time of a masked call goes: GPU time per kernel (torch.profiler) of the forward and
of forward + backward through `flash_attn_ext.scaled_dot_product_attention`, for boolean masks
against the unmasked calls they should match (bf16, B * L = 16k tokens, H * d = 2048, L = S):

    plain            no mask
    causal           is_causal=True
    padding          bench_score_mods's (B, 1, 1, S) padding mask (7/8 of plain's work)
    keys_all_true    a (B, 1, 1, S) mask that hides nothing (plain's work through the mask variant)
    causal_padding   bench_score_mods's (B, 1, L, S) causal + padding mask
    tril             a (B, 1, L, S) causal mask without padding (causal's work)

    python dev/gpu/mask_kernel_times.py [--dims 128 64] [--seqlen 4096] [--iters 10]
"""

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_score_mods import make_case

import flash_attn_ext


def kernel_times(fn, iters: int) -> dict:
    """Microseconds per call of each CUDA kernel that fn launches (mean over iters calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:60]] += event.device_time / iters
    return dict(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    for d in args.dims:
        seqlen, heads = args.seqlen, 2048 // d
        batch = max(1, 16384 // seqlen)
        q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in "qkv")
        dout = torch.randn_like(q)
        ones = torch.ones(batch, 1, 1, seqlen, dtype=torch.bool, device="cuda")
        tril = torch.ones(seqlen, seqlen, dtype=torch.bool, device="cuda").tril()
        cases = {
            "plain": dict(),
            "causal": dict(is_causal=True),
            "padding": dict(attn_mask=make_case("padding", batch, seqlen, d)["attn_mask"]),
            "keys_all_true": dict(attn_mask=ones),
            "causal_padding": dict(
                attn_mask=make_case("causal_padding", batch, seqlen, d)["attn_mask"]),
            "tril": dict(attn_mask=tril.expand(batch, 1, seqlen, seqlen).contiguous()),
        }
        for name, kwargs in cases.items():
            def fwd(kw=kwargs, qkv=(q, k, v)):
                with torch.no_grad():
                    flash_attn_ext.scaled_dot_product_attention(*qkv, **kw)

            def fwd_bwd(kw=kwargs, qkv=(q, k, v), dout=dout):
                out = flash_attn_ext.scaled_dot_product_attention(*qkv, **kw)
                torch.autograd.grad(out, qkv, dout)

            for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                times = kernel_times(fn, args.iters)
                total = sum(times.values())
                parts = ", ".join(f"{n} {t:.0f}" for n, t in
                                  sorted(times.items(), key=lambda x: -x[1]))
                print(f"d={d:3d} L={seqlen} {name:15s} {what:8s} {total:8.0f} us: {parts}",
                      flush=True)


if __name__ == "__main__":
    main()
