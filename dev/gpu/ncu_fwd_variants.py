"""One Hopper forward call per variant, inside a profiler range, for ncu: the plain kernel, the
general variant and the mask variant on the same shape (bf16, B=4, H=16, L=S=4096, d=128, as
benchmarks/bench_score_mods.py), to see what a variant costs beyond its modifier.
Launch order (= ncu's report order): plain, plain causal, softcap, ALiBi causal, a bias of
zeros (read everywhere: sm90_bias_blocks off), then the mask variant with its block summary: a
(B, 1, 1, S) boolean mask hiding nothing (every tile in the visible run: the variant's cost
with no walk at all) and a (B, 1, L, S) causal mask (against "plain causal").

    ncu --profile-from-start off --kernel-name regex:flash_fwd_sm90 \
        python dev/gpu/ncu_fwd_variants.py [--dim 64]
"""

import sys

import torch

import flash_attn_ext
from flash_attn_ext import ops


def main() -> None:
    torch.manual_seed(0)
    # `--dim D` (64, 128, 256): the head dim, with H = 2048 / D heads as bench_score_mods.py
    d = int(sys.argv[sys.argv.index("--dim") + 1]) if "--dim" in sys.argv else 128
    b, h, n = 4, 2048 // d, 4096
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
    zeros = torch.zeros(1, 1, 1, n, device="cuda")
    all_true = torch.ones(b, 1, 1, n, device="cuda", dtype=torch.bool)
    tril = torch.ones(n, n, device="cuda", dtype=torch.bool).tril().expand(b, 1, n, n)
    no_summary = dict(sm90_bias_blocks=False)
    calls = [("plain", dict(), no_summary), ("plain causal", dict(causal=True), no_summary),
             ("softcap 30", dict(softcap=30.0), no_summary),
             ("alibi causal", dict(causal=True, alibi_slopes=slopes), no_summary),
             ("bias of zeros, read", dict(attn_bias=zeros), no_summary),
             ("mask hiding nothing", dict(attn_bias=all_true), dict()),
             ("(B,1,L,S) causal mask", dict(attn_bias=tril), dict())]
    for _, kw, options in calls:  # warm up (and load every kernel) outside the profiled range
        with flash_attn_ext.kernel_options(**options):
            ops.fwd(q, k, v, **kw)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, kw, options in calls:
        with flash_attn_ext.kernel_options(**options):
            ops.fwd(q, k, v, **kw)
        print("launched:", name)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
