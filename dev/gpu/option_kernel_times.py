"""GPU time per kernel (torch.profiler) of one bench_score_mods case under each value of one
kernel option, forward alone and forward + backward, the values alternating over rounds in one
process: which kernel an option's A/B moves, where bench_score_mods's (fwd+bwd) - fwd reading
mixes them (bf16, B * L = 16k tokens, H * d = 2048, SDPA's (B, H, L, d) layout).

    python dev/gpu/option_kernel_times.py --case alibi --dim 64 --seqlen 4096 \
        --option sm90_per_score_consumers --values 2 3 [--rounds 2] [--iters 10] [--packed]

--packed runs the same batch as packed sequences of equal length (flash_attn_varlen_func, the
offsets on the CPU: no synchronisation), for the cases without a mask: the varlen kernels'
times under the option (e.g. sm90_schedule static / dynamic), to set beside the dense call's.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_score_mods import CASES, implementations, make_case
from mask_kernel_times import kernel_times

import flash_attn_ext


def parse_value(text: str):
    """An option value from the command line: JSON where it parses (3, true, "auto"), else the
    word itself (auto, tile)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def packed_call(spec: dict, batch: int, seqlen: int):
    """f(q, k, v, spec) running the (batch, H, seqlen, d) call as `batch` packed sequences of
    `seqlen` rows (flash_attn_varlen_func, offsets on the CPU), out back in (batch, H, seqlen,
    d); the cases without a mask."""
    if "attn_mask" in spec:
        raise ValueError("--packed takes the cases without a mask")
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32)

    def call(q, k, v, spec):
        def packed(x):  # (batch, H, L, d) -> (batch * L, H, d)
            return x.transpose(1, 2).reshape(batch * seqlen, x.shape[1], x.shape[3])
        out = flash_attn_ext.flash_attn_varlen_func(
            packed(q), packed(k), packed(v), cu, cu, seqlen, seqlen, causal=spec["causal"],
            softcap=spec.get("softcap", 0.0), alibi_slopes=spec.get("alibi_slopes"),
            dropout_p=spec.get("dropout_p", 0.0))
        return out.reshape(batch, seqlen, out.shape[1], out.shape[2]).transpose(1, 2)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, default="alibi")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--option", required=True)
    parser.add_argument("--values", nargs="+", required=True,
                        help="option values (JSON: 3, true, \"auto\")")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--packed", action="store_true",
                        help="the batch as packed sequences (flash_attn_varlen_func)")
    args = parser.parse_args()
    d, seqlen = args.dim, args.seqlen
    batch, heads = max(1, 16384 // seqlen), 2048 // d
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in "qkv")
    dout = torch.randn_like(q)
    spec = make_case(args.case, batch, seqlen, d)
    ours = packed_call(spec, batch, seqlen) if args.packed else \
        implementations(args.case, False, d)["ours"]
    values = [parse_value(v) for v in args.values]
    for r in range(args.rounds):
        for value in values:
            with flash_attn_ext.kernel_options(**{args.option: value}):
                def fwd():
                    with torch.no_grad():
                        ours(q, k, v, spec)

                def fwd_bwd():
                    out = ours(q, k, v, spec)
                    torch.autograd.grad(out, (q, k, v), dout)

                for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    times = kernel_times(fn, args.iters)
                    parts = ", ".join(f"{n} {t:.0f}" for n, t in
                                      sorted(times.items(), key=lambda x: -x[1]))
                    print(f"round {r} {args.case}{' packed' if args.packed else ''} d={d} "
                          f"L={seqlen} {args.option}={value!r:6} "
                          f"{what:8s} {sum(times.values()):8.0f} us: {parts}", flush=True)


if __name__ == "__main__":
    main()
