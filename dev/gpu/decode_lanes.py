"""The decode kernel's load forms at head dim 64 in one process: lanes per 128-byte cache row
of a copy instruction, 2 (the default: 16 rows an instruction), 4 or 8 (the passes unrolled),
through the kernel option decode_row_lanes; graph-replayed K/V TB/s in interleaved rounds,
SDPA's FLASH and cuDNN backends on the same cache, and the device copy rate.  Checks that
every form gives the default's bits (the forms change only which lane copies which chunk).

Usage on the GPU machine: python3 dev/gpu/decode_lanes.py [--rounds 3]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from timing import graph_ms

import flash_attn_ext

# (batch, seqlen, heads_kv): GQA 32:8 and MQA, large and split calls (docs/perf/decode.md).
POINTS = [(64, 8192, 8), (8, 131072, 8), (1, 131072, 8), (8, 32768, 8), (1, 8192, 8),
          (64, 32768, 1), (8, 131072, 1), (1, 131072, 1)]
LANES = [2, 4, 8]
HEADS, D = 32, 64


def point(batch: int, seqlen: int, heads_kv: int, rounds: int) -> str:
    torch.manual_seed(0)  # (drawn on the GPU: a 2 GB cache drawn on the CPU takes seconds)
    q = torch.randn(batch, 1, HEADS, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_kv, D, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    nbytes = 2 * k.numel() * k.element_size()

    def ours():
        return flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    outs, best = {}, {}
    for lanes in LANES:
        with flash_attn_ext.kernel_options(decode_row_lanes=lanes):
            outs[lanes] = ours()
    same = all(torch.equal(outs[lanes], outs[LANES[0]]) for lanes in LANES)
    for _ in range(rounds):  # interleaved: A B C A B C ...
        for lanes in LANES:
            with flash_attn_ext.kernel_options(decode_row_lanes=lanes):
                ms = graph_ms(ours, reps=10, groups=3)
            best[lanes] = min(best.get(lanes, ms), ms)
    row = [f"B={batch:3d} S={seqlen:6d} H_kv={heads_kv} d={D}"]
    row += [f"lanes {lanes}: {nbytes / best[lanes] / 1e9:5.2f} TB/s" for lanes in LANES]
    qs, ks, vs = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def peer(b=backend):
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        try:
            row.append(f"{name} {nbytes / graph_ms(peer, reps=10, groups=3) / 1e9:5.2f}")
        except RuntimeError as e:
            row.append(f"{name} refused ({str(e).splitlines()[0][:30]})")
    src = torch.cat([k.flatten(), v.flatten()])
    dst = torch.empty_like(src)
    copy_ms = graph_ms(lambda: dst.copy_(src), reps=10, groups=3)
    row.append(f"copy {2 * nbytes / copy_ms / 1e9:5.2f}")  # (read + write)
    row.append("bits equal" if same else "BITS DIFFER")
    return "  ".join(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for batch, seqlen, heads_kv in POINTS:
        print(point(batch, seqlen, heads_kv, args.rounds), flush=True)


if __name__ == "__main__":
    main()
