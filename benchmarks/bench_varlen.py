"""Packed sequences (flash_attn_varlen_func) against the dense kernels on the same work, forward
and forward + backward, in one process on CUDA: `total` tokens in `seqs` sequences, 16 query /
8 key-value heads, bf16, causal or not.

Rows, per (head dim, sequences, lengths, causal):
  varlen        flash_attn_varlen_func as the dispatcher runs it (sm_90: the Hopper varlen
                forward and backward at every head dim), offsets on the GPU: copied to the
                host once per call (one synchronisation, included in its time)
  varlen_host   the same with the offsets given on the CPU (no synchronisation: what a model
                whose layers share one host copy pays per layer)
  varlen_det    varlen_host with deterministic=True (sm_90: the Hopper varlen backward, dQ
                added in a fixed order)
  varlen_sm80   the same with the portable kernels forced (force_portable)
  dense         flash_attn_func on a (seqs, total / seqs) batch (equal lengths only): the
                unpacked kernel the packed one should match
  cudnn, flash  PyTorch's SDPA CUDNN and FLASH backends on that dense batch (equal lengths only;
                not with --softcap or --alibi, which they lack; with --dropout, theirs)
With --softcap, --alibi (slopes 2^(-8 (h + 1) / H), FlashAttention-2's ALiBi) or --dropout P
every call of ours takes that modifier (sm_90: the Hopper varlen instantiation for it alone;
two together run on the portable kernels).
Equal lengths are total / seqs; uneven ones a fixed-seed split (bench_packed.lengths) that no
dense call can run.  TFLOP/s count each sequence's own work (4 * H * L^2 * d forward, halved
when causal; the backward 2.5x).

Usage: python benchmarks/bench_varlen.py [--dims 64 128 256] [--total 16384]
       [--seqs 1 4 16 64] [--softcap 30 | --alibi | --dropout 0.1] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_packed import lengths
from timing import queued_ms

import flash_attn_ext
from flash_attn_ext import flash_attn_func, flash_attn_varlen_func


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, backend))


def time_point(d: int, lens: list, causal: bool, heads: int = 16, heads_kv: int = 8,
               device: str = "cuda", reps: int = 10, softcap: float = 0.0,
               alibi: bool = False, dropout_p: float = 0.0) -> dict:
    """{row: (forward ms, forward + backward ms)} for sequences of `lens` (device "cpu": float32,
    no SDPA peers; for the tests), each call of ours with `softcap`, ALiBi (`alibi`) and
    `dropout_p` (no SDPA peers with softcap or ALiBi)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    slopes = (2.0 ** (-8.0 * (torch.arange(heads, dtype=torch.float32) + 1) / heads)).to(device) \
        if alibi else None
    mods = dict(softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p)
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    q = torch.randn(total, heads, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(total, heads_kv, d, device=device, dtype=dtype, requires_grad=True)
            for _ in "kv")
    dout = torch.randn(total, heads, d, device=device, dtype=dtype)
    packed = (q, k, v, cu, cu, max(lens), max(lens))
    on_host = (q, k, v, cu.cpu(), cu.cpu(), max(lens), max(lens))
    calls = {}

    # (gradients by autograd.grad: backward() would add into .grad, an extra kernel per input
    # and call)
    def varlen(forward_only, args=packed, deterministic=False):
        out = flash_attn_varlen_func(*args, causal=causal, deterministic=deterministic, **mods)
        if not forward_only:
            torch.autograd.grad(out, (q, k, v), dout)
    calls["varlen"] = varlen
    if device == "cuda":
        calls["varlen_host"] = lambda forward_only: varlen(forward_only, on_host)
        calls["varlen_det"] = lambda forward_only: varlen(forward_only, on_host, True)

    def varlen_sm80(forward_only):
        with flash_attn_ext.kernel_options(force_portable=True):
            varlen(forward_only)
    calls["varlen_sm80"] = varlen_sm80
    if len(set(lens)) == 1:  # equal lengths: the same work as one dense batch
        b, n = len(lens), lens[0]
        qd = q.detach().view(b, n, heads, d).requires_grad_()
        kd, vd = (t.detach().view(b, n, heads_kv, d).requires_grad_() for t in (k, v))
        doutd = dout.view(b, n, heads, d)

        def dense(forward_only):
            out = flash_attn_func(qd, kd, vd, causal=causal, **mods)
            if not forward_only:
                torch.autograd.grad(out, (qd, kd, vd), doutd)
        calls["dense"] = dense
        if device == "cuda" and softcap == 0.0 and not alibi:
            qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (qd, kd, vd))
            douts = doutd.transpose(1, 2)
            for name, backend in (("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION")):
                def peer(forward_only, backend=backend):
                    with _sdpa(backend):
                        out = torch.nn.functional.scaled_dot_product_attention(
                            qs, ks, vs, is_causal=causal, dropout_p=dropout_p,
                            enable_gqa=True)
                    if not forward_only:
                        torch.autograd.grad(out, (qs, ks, vs), douts)
                calls[name] = peer
    result = {}
    for name, fn in calls.items():
        try:
            fwd = queued_ms(lambda fn=fn: fn(True), warmup=min(3, reps), reps=reps)
            both = queued_ms(lambda fn=fn: fn(False), warmup=min(2, reps), reps=reps)
            result[name] = (fwd, both)
        except RuntimeError as e:  # a peer that refuses the call
            print(f"  {name}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
    return result


def flops(lens: list, d: int, heads: int, causal: bool) -> float:
    """Forward FLOPs of each sequence's own attention."""
    return sum(4 * heads * n * n * d for n in lens) / (2 if causal else 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--total", type=int, default=16384)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--softcap", type=float, default=0.0,
                        help="softcap of every call of ours (no SDPA peers then)")
    parser.add_argument("--alibi", action="store_true",
                        help="ALiBi on every call of ours (no SDPA peers then)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout_p of every call, SDPA's too")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    records = []
    for d in args.dims:
        for seqs in args.seqs:
            for uneven in (False, True):
                if uneven and seqs == 1:
                    continue
                lens = lengths(args.total, seqs, g) if uneven else [args.total // seqs] * seqs
                for causal in (False, True):
                    res = time_point(d, lens, causal, softcap=args.softcap, alibi=args.alibi,
                                     dropout_p=args.dropout)
                    f = flops(lens, d, 16, causal)
                    cells = [f"{name} {f / ms[0] / 1e9:6.1f} / {3.5 * f / ms[1] / 1e9:6.1f}"
                             for name, ms in res.items()]
                    print(f"d={d:3d} seqs={seqs:3d} {'uneven' if uneven else 'equal '} "
                          f"{'causal' if causal else 'full  '}  " + "  ".join(cells)
                          + "  (TFLOP/s fwd / fwd+bwd)", flush=True)
                    records.append(dict(d=d, seqs=seqs, lens=lens, causal=causal,
                                        softcap=args.softcap, alibi=args.alibi,
                                        dropout_p=args.dropout,
                                        ms={k: list(v) for k, v in res.items()}))
    if args.out_dir:
        commit = os.environ.get("FLASH_ATTN_EXT_COMMIT", "unknown")
        kind = "varlen" + "".join(f"_{name}" for name, on in (
            ("softcap", args.softcap > 0), ("alibi", args.alibi), ("dropout", args.dropout > 0))
            if on)
        path = os.path.join(args.out_dir,
                            f"{kind}_{time.strftime('%Y%m%d')}_{commit[:7]}.json")
        with open(path, "w") as fh:
            json.dump(dict(commit=commit, device=torch.cuda.get_device_name(), records=records),
                      fh, indent=1)
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
