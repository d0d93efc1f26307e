"""One Hopper forward call per variant, inside a profiler range, for ncu: the plain kernel and
the general variant on the same shape (bf16, B=4, H=16, L=S=4096, d=128, as
benchmarks/bench_score_mods.py), to see what the general variant costs beyond its modifier.
Launch order (= ncu's report order): plain, plain causal, softcap, ALiBi causal, a bias of
zeros (read everywhere: sm90_bias_blocks off).

    ncu --profile-from-start off --kernel-name regex:flash_fwd_sm90 \
        python dev/gpu/ncu_fwd_variants.py
"""

import torch

import flash_attn_ext
from flash_attn_ext import ops


def main() -> None:
    torch.manual_seed(0)
    b, h, n, d = 4, 16, 4096, 128
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
    zeros = torch.zeros(1, 1, 1, n, device="cuda")
    calls = [("plain", dict()), ("plain causal", dict(causal=True)),
             ("softcap 30", dict(softcap=30.0)),
             ("alibi causal", dict(causal=True, alibi_slopes=slopes)),
             ("bias of zeros, read", dict(attn_bias=zeros))]
    for _, kw in calls:  # warm up (and load every kernel) outside the profiled range
        ops.fwd(q, k, v, **kw)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, kw in calls:
        with flash_attn_ext.kernel_options(sm90_bias_blocks=False):
            ops.fwd(q, k, v, **kw)
        print("launched:", name)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
