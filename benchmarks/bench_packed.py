"""Packed sequences on CUDA, the two routes of the transformers integration: sequences packed
into one row (batch 1, ``cu_seq_lens_q/k``, as models hand FlashAttention-named
implementations) computed as one call with a (L, L) boolean block-diagonal causal mask (on
an H200 the Hopper kernels' mask variant, fully masked tiles skipped; the integration's CUDA
route for a single sequence) against the packed-sequence kernels (``flash_attn_varlen_func``:
on an H200 the Hopper varlen forward and backward, which read and check the offsets on the
host; the route for several sequences).  Each route's time includes what the integration does
per call (the mask built from the offsets; the offsets' copy to the host: "varlen_first" makes
it every call, as the first layer of a forward pass does, "varlen" reuses it, as the other
layers do, since they get the same cu_seq_lens tensors), forward + backward,
bf16, 16 query / 8 key-value heads, the longest lengths passed as ``max_length_q/k`` as
transformers' data collator passes them; TFLOP/s count only the visible (per-sequence causal)
work.

Usage: python benchmarks/bench_packed.py [--dims 128] [--total 8192] [--seqs 1 4 16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import queued_ms

import flash_attn_ext
from flash_attn_ext.integrations import transformers as integration


def lengths(total: int, seqs: int, generator: torch.Generator) -> list:
    """`seqs` lengths summing to `total`, uneven (a Dirichlet-like split, at least 16 each)."""
    weights = torch.rand(seqs, generator=generator) + 0.5
    raw = (weights / weights.sum() * (total - 16 * seqs)).floor().long() + 16
    raw[-1] += total - int(raw.sum())
    return raw.tolist()


def time_point(d: int, total: int, lens: list, heads: int = 16, heads_kv: int = 8,
               device: str = "cuda") -> str:
    """One line: both routes' time and TFLOP/s for sequences of `lens` packed into `total` rows
    (device "cpu": the bookkeeping only, for the tests)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    q = torch.randn(1, heads, total, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, heads_kv, total, d, device=device, dtype=dtype, requires_grad=True)
            for _ in "kv")
    dout = torch.randn(1, total, heads, d, device=device, dtype=dtype)
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens),
                  max_length_k=max(lens))
    flops = sum(2 * 2 * heads * n * n * d for n in lens) / 2 * 3.5  # fwd + bwd, causal

    def mask_route():
        mask = integration._packed_sequence_mask(q, k, kwargs, True)
        qb, kb, vb = flash_attn_ext.to_bshd(q, k, v, enable_gqa=True)
        integration.attend(qb, kb, vb, q, k, mask, 0.0, False, None, 0.0, None).backward(dout)

    def varlen_route():
        integration._varlen_forward(q, k, v, kwargs, 0.0, None, True).backward(dout)

    def varlen_first():
        integration._host_offsets_cache.clear()
        varlen_route()

    row = [f"d={d:3d} total={total} seqs={len(lens):3d}"]
    for name, fn in (("mask", mask_route), ("varlen_first", varlen_first),
                     ("varlen", varlen_route)):
        ms = queued_ms(fn, warmup=2, reps=5, groups=3)
        row.append(f"{name} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s")
    return "  ".join(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--total", type=int, default=8192)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    for d in args.dims:
        for seqs in args.seqs:
            print(time_point(d, args.total, lengths(args.total, seqs, g)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
