"""Small decode calls for ncu, one launch each inside a profiler range (bf16, 32 query heads, one
query token, a full contiguous cache): flash_attn_with_kvcache's attention and combine kernels,
then SDPA's cuDNN backend on the same cache, for where a small call's time goes
(docs/perf/decode.md, "Where a small call's time goes").

    ncu --profile-from-start off --clock-control none --set full --import-source no \
        python dev/gpu/ncu_decode.py [B S H_kv d ...]
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext


def main() -> None:
    args = [int(a) for a in sys.argv[1:]] or [1, 8192, 8, 128, 1, 32768, 1, 128]
    cases = []
    for i in range(0, len(args), 4):
        batch, seqlen, heads_kv, d = args[i:i + 4]
        q = torch.randn(batch, 1, 32, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen, heads_kv, d, device="cuda", dtype=torch.bfloat16)
                for _ in "kv")
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        cases.append((f"B={batch} S={seqlen} H_kv={heads_kv} d={d}", q, k, v, lens))
    for _, q, k, v, lens in cases:  # first launches outside the range
        flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), enable_gqa=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, q, k, v, lens in cases:
        flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), enable_gqa=True)
        print("launched:", name, flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
