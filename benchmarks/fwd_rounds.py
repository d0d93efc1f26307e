"""Forward-only comparison in interleaved rounds: ours against SDPA's cuDNN and FLASH backends.

Single readings of the same kernel move +-3..5% between runs, and an implementation timed right
after a slower one may start on a hotter GPU.  This script times only forwards: per point,
`rounds` rounds, each of which times every implementation once (queued, then graph), in an order
rotated by one from round to round, and it logs the SM clock after each timing.  It reports the
median and range over rounds per implementation and the ratio of the medians to cuDNN's.
(bench_attention.py times its forwards the same way, in fewer rounds by default, next to the
backward and the other implementations.)

Shapes and calls as bench_attention.py (bf16, (B, H, L, d) contiguous, B * L = 16384 tokens,
H * d = 2048); FLOPs 4 * B * H * L^2 * d, halved when causal.

Usage (on a CUDA GPU): python benchmarks/fwd_rounds.py [--dims 64 128 256]
    [--seqlens 1024 2048 4096 8192 16384] [--causal no|yes|both] [--rounds 5] [--out FILE.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import HIDDEN, TOKENS, graph_ms, implementations
from timing import CAUSAL_MODES, queued_ms, rotated

IMPLS = ("ours", "sdpa_cudnn", "sdpa_flash")


def sm_clock_mhz():
    """The current SM clock in MHz (NVML through torch, else nvidia-smi), or None."""
    try:
        return torch.cuda.clock_rate()
    except Exception:  # no pynvml on this machine
        pass
    try:
        query = ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                 "-i", str(torch.cuda.current_device())]
        out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    except Exception:  # no nvidia-smi either
        return None


def time_forward(fn, q, k, v, causal):
    """(queued ms, SM clock after it, graph ms, SM clock after it) of fn(q, k, v, causal)."""
    ms_q = queued_ms(lambda: fn(q, k, v, causal))
    clk_q = sm_clock_mhz()
    ms_g = graph_ms(lambda: fn(q, k, v, causal))
    return ms_q, clk_q, ms_g, sm_clock_mhz()


def summarise(samples):
    """{impl: [tflops per round]} -> {impl: (median, min, max)}."""
    return {k: (statistics.median(v), min(v), max(v)) for k, v in samples.items() if v}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=tuple(CAUSAL_MODES), default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write every reading as JSON here")
    args = parser.parse_args()
    impls = {k: v for k, v in implementations(flex=False).items() if k in IMPLS}
    order = [k for k in IMPLS if k in impls]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}, {args.rounds} interleaved rounds, forward only")
    print(f"{'d':>3} {'L':>6} {'c':>1} {'timing':>6} " + " ".join(f"{k:>22}" for k in order)
          + "  ours/cudnn (of the medians)")
    readings = []
    for d in args.dims:
        for seqlen in args.seqlens:
            batch, heads = max(1, TOKENS // seqlen), HIDDEN // d
            q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            for causal in CAUSAL_MODES[args.causal]:
                flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                tf = {t: {name: [] for name in order} for t in ("queued", "graph")}
                with torch.no_grad():
                    for r in range(args.rounds):
                        for name in rotated(order, r):
                            ms_q, clk_q, ms_g, clk_g = time_forward(impls[name], q, k, v,
                                                                    causal)
                            tf["queued"][name].append(flops / ms_q / 1e9)
                            tf["graph"][name].append(flops / ms_g / 1e9)
                            readings.append(dict(d=d, L=seqlen, causal=causal, round=r,
                                                 impl=name, queued_ms=ms_q, graph_ms=ms_g,
                                                 clock_after_queued=clk_q,
                                                 clock_after_graph=clk_g))
                for timing in ("queued", "graph"):
                    s = summarise(tf[timing])
                    cells = " ".join(f"{s[n][0]:7.1f} ({s[n][1]:5.0f}-{s[n][2]:4.0f})"
                                     for n in order)
                    ratio = s["ours"][0] / s["sdpa_cudnn"][0] if "sdpa_cudnn" in s else float("nan")
                    print(f"{d:3d} {seqlen:6d} {int(causal)} {timing:>6} {cells}  {ratio:.3f}",
                          flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(readings, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
