"""Decoding against a KV cache: flash_attn_with_kvcache (contiguous and paged cache) next to
SDPA's FLASH and cuDNN backends on the same cache, and the device's copy bandwidth, in one
process.

One new query token per sequence (q (B, 1, H, d), H = 32 query heads), a full cache of S keys per
sequence, GQA 32:8 or MQA 32:1, bf16, no mask (one query against all of its sequence's keys: the
same work causal or not).  The cache is (B, S, H_kv, d) as flash_attn_with_kvcache takes it;
SDPA gets it as its (B, H_kv, S, d) view (enable_gqa=True, no copy).  Paged: pages of --page
keys in a shuffled block_table (SDPA has no paged form: its rows are the contiguous ones).
Decoding is memory-bound, so the figure of merit is the K/V read rate: 2 * B * S * H_kv * d * 2
bytes over the time per call (TB/s), against the copy rate of a tensor of the cache's size
(bytes read + written over the time of dst.copy_(src)), the device's practical ceiling.
Each implementation is timed twice: calls queued back to back from Python (host overhead
included: what an eager decode loop sees) and the same calls captured in a CUDA graph and
replayed (device time only: what a server that captures its decode step sees).

Usage (on a CUDA GPU): python benchmarks/bench_decode.py [--batch 1 8 64]
    [--seqlens 1024 8192 32768 131072] [--heads-kv 8 1] [--dims 64 128] [--page 256]
    [--max-gib 16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_ms, queued_ms

import flash_attn_ext

HEADS = 32
PEERS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def cache_bytes(batch: int, seqlen: int, heads_kv: int, d: int) -> int:
    """Bytes of K and V together (bf16)."""
    return 2 * batch * seqlen * heads_kv * d * 2


def paged(k_cache: torch.Tensor, v_cache: torch.Tensor, page: int, generator: torch.Generator):
    """The same cache as pages of `page` keys in a shuffled order: (k_pages, v_pages,
    block_table (B, S / page) int32)."""
    batch, seqlen, heads_kv, d = k_cache.shape
    per_seq = seqlen // page
    order = torch.randperm(batch * per_seq, generator=generator)
    block_table = order.view(batch, per_seq).to(torch.int32).to(k_cache.device)
    pages = []
    for cache in (k_cache, v_cache):
        flat = cache.reshape(batch * per_seq, page, heads_kv, d)
        out = torch.empty_like(flat)
        out[order.to(cache.device)] = flat
        pages.append(out)
    return pages[0], pages[1], block_table


def time_point(batch: int, seqlen: int, heads_kv: int, d: int, page: int,
               device: str = "cuda") -> str:
    """One line: microseconds and K/V TB/s of ours (contiguous, paged) and of each peer, and
    the copy rate (device "cpu": the bookkeeping only, for the tests)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, HEADS, d, generator=g).to(device, dtype)
    k_cache, v_cache = (torch.randn(batch, seqlen, heads_kv, d, generator=g).to(device, dtype)
                        for _ in "kv")
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
    k_pages, v_pages, block_table = paged(k_cache, v_cache, page, g)
    nbytes = cache_bytes(batch, seqlen, heads_kv, d)
    qs, ks, vs = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        return call

    impls = {
        "ours": lambda: flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                               cache_seqlens=lens),
        "ours_paged": lambda: flash_attn_ext.flash_attn_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=lens, block_table=block_table),
        **{name: sdpa(backend) for name, backend in PEERS.items()},
    }
    row = [f"B={batch:3d} S={seqlen:6d} H_kv={heads_kv} d={d:3d}"]
    for name, fn in impls.items():
        try:
            ms = queued_ms(fn, warmup=2, reps=10, groups=3)
            row.append(f"{name} {ms * 1e3:8.1f} us {nbytes / ms / 1e9:5.2f} TB/s")
        except RuntimeError as e:  # a backend that refuses the shape
            row.append(f"{name} refused ({str(e).splitlines()[0][:40]})")
            continue
        if device == "cuda":
            try:
                ms = graph_ms(fn, reps=10, groups=3)
                row.append(f"graph {ms * 1e3:8.1f} us {nbytes / ms / 1e9:5.2f} TB/s")
            except RuntimeError as e:  # not capturable
                row.append(f"graph refused ({str(e).splitlines()[0][:30]})")
    src = torch.cat([k_cache.flatten(), v_cache.flatten()])
    dst = torch.empty_like(src)
    ms = queued_ms(lambda: dst.copy_(src), warmup=2, reps=10, groups=3)
    row.append(f"copy {2 * nbytes / ms / 1e9:5.2f} TB/s")
    return "  ".join(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--heads-kv", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--page", type=int, default=256)
    parser.add_argument("--max-gib", type=float, default=16.0,
                        help="skip points whose K/V cache is larger")
    args = parser.parse_args()
    print(f"# decode, {torch.cuda.get_device_name()}, torch {torch.__version__}, H={HEADS}, "
          f"bf16, page {args.page}; per implementation: us per call and K/V read TB/s")
    for d in args.dims:
        for heads_kv in args.heads_kv:
            for batch in args.batch:
                for seqlen in args.seqlens:
                    if cache_bytes(batch, seqlen, heads_kv, d) > args.max_gib * 2**30 or \
                            seqlen % args.page:
                        continue
                    print(time_point(batch, seqlen, heads_kv, d, args.page), flush=True)
                    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
