"""Where a decode call's device time goes: each kernel's mean duration and the gap between
the attention kernel and the combine, from torch.profiler, for a few small and large
flash_attn_with_kvcache calls (bf16, 32 query heads, one query token, a full cache).

Usage on the GPU machine: python3 dev/gpu/decode_split.py [B S H_kv d ...]
"""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import flash_attn_ext


def split(batch: int, seqlen: int, heads_kv: int, d: int, reps: int = 30) -> str:
    q = torch.randn(batch, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_kv, d, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    for _ in range(3):
        flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)
    durations, gaps = defaultdict(list), []
    for i, e in enumerate(events):
        durations[e.name.split("<")[0].split("::")[-1]].append(e.time_range.elapsed_us())
        if "combine" in e.name and i > 0:
            gaps.append(e.time_range.start - events[i - 1].time_range.end)
    parts = [f"{name} {sum(ts) / len(ts):7.1f} us" for name, ts in durations.items()]
    gap = f"gap before combine {sum(gaps) / len(gaps):5.1f} us" if gaps else "no combine"
    return f"B={batch} S={seqlen} H_kv={heads_kv} d={d}: " + "; ".join(parts) + "; " + gap


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] or [1, 8192, 8, 128, 8, 1024, 8, 128, 1, 32768, 1, 128,
                                              8, 32768, 8, 128, 64, 8192, 8, 64]
    for i in range(0, len(args), 4):
        print(split(*args[i:i + 4]), flush=True)
