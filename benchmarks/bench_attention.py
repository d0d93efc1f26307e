"""GPU attention benchmark: flash_attn_ext against PyTorch's SDPA backends and FlexAttention.

All implementations run in one process on the same inputs: ours (flash_attn_ext.flash_attn_func),
SDPA with the FLASH, CUDNN and EFFICIENT backends forced, and FlexAttention compiled.  bf16,
B * L = 16384 tokens, H * d = 2048, d in {64, 128, 256}, L in {512 ... 16384}, causal and not.

FLOPs are counted the FlashAttention way: forward 4 * B * H * L * S * d (halved when causal),
backward 2.5x forward.  Times are medians of CUDA-event-timed repetitions after warm-up, with
fresh random inputs (never zeros); --timing queued (default) times back-to-back calls, single
times one call from an idle stream (see median_ms); fwd_graph times the forward (no autograd)
replayed from a CUDA graph, the GPU time without any host work.  Per point, the forwards of all
implementations are timed first, in --fwd-rounds interleaved rounds (order rotated by one per
round; the median over rounds is reported, the per-round values are in the JSON), then each
implementation's forward+backward.  Writes a table to stdout and JSON (rewritten after every
point, so a run cut short keeps what it measured) + PNG to --out-dir.
(fwd_rounds.py times the forwards alone in more rounds and logs the SM clock.)

Also measures peak extra memory of forward+backward at long L (B=1, H=16, d=128) for ours and
the math path (which materialises L x L scores; OOM is reported as such).

Usage: python benchmarks/bench_attention.py [--dims 64 128 256] [--seqlens ...] [--no-flex]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from timing import graph_ms, queued_ms, rotated
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext

TOKENS = 16384
HIDDEN = 2048


TIMING = "queued"  # set from --timing in main()


def median_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 10, groups: int = 5,
              host_us: Optional[list] = None) -> float:
    """Median milliseconds per call of fn.

    "queued" (default): events around `reps` back-to-back calls, no synchronisation between
    them, so the host prepares the next call while the GPU runs this one, as in a training
    step; median over `groups` such runs of the per-call mean.  This is the GPU time of a call
    when the host keeps up (host time per call is printed separately by --host-overhead).
    "single": events around each call started from an idle, synchronised stream, so the host
    time spent before the first kernel launch is in the number (the timing used before
    2026-11-29).  host_us (queued only): see timing.queued_ms.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    if TIMING == "single":
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]
    return queued_ms(fn, warmup=0, reps=reps, groups=groups, host_us=host_us)


def backward_reading(fwd: Callable[[], object], fwd_bwd: Callable[[], object],
                     flops_fwd: float) -> dict:
    """The backward's time as (fwd+bwd) - fwd, so that no implementation has to support
    retain_graph, with a forward reading taken right before, so that a drift of the GPU's clock
    since earlier readings does not land in the backward; FLOPs 2.5x the forward's."""
    fwd_ms = median_ms(fwd)
    total_ms = median_ms(fwd_bwd)
    bwd_ms = max(total_ms - fwd_ms, 1e-6)
    return dict(bwd_ms=bwd_ms, bwd_tflops=2.5 * flops_fwd / bwd_ms / 1e9,
                fwdbwd_tflops=3.5 * flops_fwd / total_ms / 1e9)


def options_of(fn: Callable) -> contextlib.AbstractContextManager:
    """The kernel options an implementation runs under (its ``options`` attribute), so that its
    backward runs under them too; a null context for one without."""
    options = getattr(fn, "options", None)
    return flash_attn_ext.kernel_options(**options) if options else contextlib.nullcontext()


def implementations(flex: bool) -> Dict[str, Callable]:
    """name -> f(q, k, v, causal) on (B, H, L, d) tensors."""

    def ours(q, k, v, causal):
        return flash_attn_ext.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    def ours_sm80(q, k, v, causal):  # the portable kernels, where the Hopper ones serve "ours"
        with flash_attn_ext.kernel_options(**ours_sm80.options):
            return ours(q, k, v, causal)
    # (kernel options an implementation runs under: its backward too, see fwd_bwd)
    ours_sm80.options = dict(force_portable=True)

    sample = torch.empty(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16)
    impls = {"ours": ours}
    if flash_attn_ext.explain(sample, sample, sample).kernel.startswith("sm90"):
        impls["ours_sm80"] = ours_sm80
    impls.update({"sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
             "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
             "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)})
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        torch._dynamo.config.recompile_limit = 64  # one compile per benchmarked shape
        compiled = torch.compile(flex_attention)
        masks: dict = {}

        def flex_run(q, k, v, causal):
            if not causal:
                return compiled(q, k, v)
            key = (q.shape[-2], k.shape[-2])
            if key not in masks:
                masks[key] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None,
                                               q.shape[-2], k.shape[-2], device="cuda")
            return compiled(q, k, v, block_mask=masks[key])

        impls["flex"] = flex_run
    return impls


def bench_point(impls, d: int, seqlen: int, causal: bool, flex_dims=(),
                fwd_rounds: int = 3) -> List[dict]:
    batch, heads = max(1, TOKENS // seqlen), HIDDEN // d
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16)
    flops_fwd = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
    names = [n for n in impls if n != "flex" or d in flex_dims]
    rows = {n: dict(impl=n, d=d, L=seqlen, B=batch, H=heads, causal=causal) for n in names}
    # Forwards first, in `fwd_rounds` interleaved rounds whose order rotates by one per round;
    # each round times every implementation's forward with autograd recording (as in training)
    # and then its forward alone (no autograd) replayed from a CUDA graph, the GPU time without
    # host work.  The reported forward is the median over rounds: one reading of a kernel moves
    # +-3..5% with the GPU's clock and temperature, and the implementation timed right after a
    # slower one may start on a hotter GPU (docs/perf/measuring.md;
    # benchmarks/results/fwd_rounds_20261130_742aafb.txt).
    fwd = {n: [] for n in names}
    fwd_host = {n: [] for n in names}  # host us per call while queueing the timed forwards
    graph = {n: [] for n in names}
    for r in range(fwd_rounds):
        for name in rotated(names, r):
            row, fn = rows[name], impls[name]
            if "error" in row:
                continue
            try:
                fwd[name].append(median_ms(lambda fn=fn: fn(q, k, v, causal),
                                           host_us=fwd_host[name]))
            except Exception as e:
                if not fwd[name]:  # a backend that refuses a shape is recorded, not fatal
                    row.update(error=_error(e))
                else:  # a later round failed (e.g. out of memory): the earlier ones stand
                    row.setdefault("fwd_round_errors", []).append(_error(e))
                continue
            if name == "flex" or "graph_error" in row:
                continue
            try:
                with torch.no_grad():
                    graph[name].append(graph_ms(lambda fn=fn: fn(q, k, v, causal)))
            except Exception as e:
                row.update(graph_error=_error(e))
    for name in names:
        row, fn = rows[name], impls[name]
        if "error" in row:
            continue
        fwd_ms = statistics.median(fwd[name])
        row.update(fwd_ms=fwd_ms, fwd_tflops=flops_fwd / fwd_ms / 1e9,
                   fwd_tflops_rounds=[flops_fwd / ms / 1e9 for ms in fwd[name]],
                   fwd_host_us_rounds=fwd_host[name])
        if graph[name] and "graph_error" not in row:
            ms = statistics.median(graph[name])
            row.update(fwd_graph_ms=ms, fwd_graph_tflops=flops_fwd / ms / 1e9,
                       fwd_graph_tflops_rounds=[flops_fwd / t / 1e9 for t in graph[name]])
        try:
            def fwd_bwd(fn=fn):  # (backward_reading says how the backward is timed)
                q.grad = k.grad = v.grad = None
                with options_of(fn):
                    fn(q, k, v, causal).backward(dout)

            row.update(backward_reading(lambda fn=fn: fn(q, k, v, causal), fwd_bwd, flops_fwd))
        except Exception as e:
            row.update(bwd_error=_error(e))
        torch.cuda.empty_cache()
    return list(rows.values())


def _error(e: Exception) -> str:
    """An exception as a row records it: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def host_us_per_call(impls, calls: int = 200) -> Dict[str, float]:
    """Host microseconds per forward call (autograd recording) at a tiny shape (B=1, H=16,
    L=128, d=128), where the GPU work is short and the loop is bound by the host."""
    import time
    q, k, v = (torch.randn(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = {}
    for name, fn in impls.items():
        if name == "flex":
            continue
        for _ in range(10):
            fn(q, k, v, False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(q, k, v, False)
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return out


def peak_memory(seqlen: int, impl: str) -> Optional[float]:
    """Peak extra GiB of forward+backward at (B=1, H=16, L, d=128); None on OOM."""
    torch.cuda.empty_cache()
    q, k, v = (torch.randn(1, 16, seqlen, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        if impl == "ours":
            out = flash_attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            with sdpa_kernel(SDPBackend.MATH):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30
    except torch.OutOfMemoryError:
        return None
    finally:
        del q, k, v
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+",
                        default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--flex-dims", type=int, nargs="*", default=[64, 128, 256],
                        help="head dims at which FlexAttention runs (each shape compiles)")
    parser.add_argument("--memory-seqlens", type=int, nargs="*", default=[8192, 32768, 131072])
    parser.add_argument("--timing", choices=("queued", "single"), default="queued",
                        help="queued: back-to-back calls (GPU time per call); single: one call "
                             "from an idle stream (adds the host time before the launch)")
    parser.add_argument("--fwd-rounds", type=int, default=3,
                        help="interleaved rounds of forward timings per point (median reported)")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.fwd_rounds < 1:
        parser.error(f"--fwd-rounds must be at least 1, got {args.fwd_rounds}")
    global TIMING
    TIMING = args.timing

    commit = os.environ.get("FLASH_ATTN_EXT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        check=False).stdout.strip() or "unknown"
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), commit=commit,
                timing=args.timing, fwd_rounds=args.fwd_rounds,
                plan=str(flash_attn_ext.explain(*(torch.empty(1, 16, 128, 128, device="cuda",
                                                              dtype=torch.bfloat16),) * 3)))
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"gpu_{datetime.date.today():%Y%m%d}_{commit}")
    rows, memory = [], []

    def save():  # after every point, so that a run cut short keeps what it measured
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows, memory=memory, host_us_per_call=host_us), f,
                      indent=1)

    impls = implementations(not args.no_flex)
    host_us = host_us_per_call(impls)
    print("host us per forward call (tiny shape): "
          + ", ".join(f"{n} {t:.1f}" for n, t in host_us.items()), flush=True)
    for d in args.dims:
        for seqlen in args.seqlens:
            for causal in (False, True):
                point = bench_point(impls, d, seqlen, causal, args.flex_dims, args.fwd_rounds)
                rows += point
                save()
                for r in point:
                    where = f"d={d:3d} L={seqlen:5d} causal={causal!s:5s} {r['impl']:14s}"
                    if "error" in r:
                        print(f"{where} {r['error']}", flush=True)
                        continue
                    # host: us per call spent queueing the timed forwards (median over rounds)
                    # against the GPU's us per forward: near it, host-bound (--timing single:
                    # none)
                    host = (f"  host {statistics.median(r['fwd_host_us_rounds']):5.0f} us/"
                            f"{r['fwd_ms'] * 1e3:6.0f} us per fwd"
                            if r["fwd_host_us_rounds"] else "")
                    bwd = (f"bwd {r['bwd_tflops']:6.1f}  fwd+bwd {r['fwdbwd_tflops']:6.1f}"
                           if "bwd_error" not in r else f"bwd {r['bwd_error']}")
                    print(f"{where} fwd {r['fwd_tflops']:6.1f}  {bwd} TFLOP/s{host}",
                          flush=True)
    for seqlen in args.memory_seqlens:
        entry = dict(L=seqlen, ours_gib=peak_memory(seqlen, "ours"),
                     math_gib=peak_memory(seqlen, "math") if seqlen <= 32768 else None)
        memory.append(entry)
        print(f"peak extra memory fwd+bwd L={seqlen}: ours {entry['ours_gib']} GiB, "
              f"math {entry['math_gib']} GiB (None = OOM or skipped)", flush=True)
    save()
    print(f"wrote {stem}.json")
    print_table(rows)
    try:
        plot(rows, stem + ".png")
        print(f"wrote {stem}.png")
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


def print_table(rows: List[dict]) -> None:
    names = sorted({r["impl"] for r in rows}, key=lambda n: (n != "ours", n))
    keys = sorted({(r["d"], r["L"], r["causal"]) for r in rows})
    for metric in ("fwd_tflops", "fwd_graph_tflops", "bwd_tflops"):
        print(f"\n{metric}")
        print(f"{'d':>4s} {'L':>6s} {'causal':>6s} " + " ".join(f"{n:>14s}" for n in names)
              + "  ours/cudnn  ours/flash")
        for key in keys:
            vals = {r["impl"]: r.get(metric) for r in rows if (r["d"], r["L"], r["causal"]) == key}
            cells = " ".join(f"{vals[n]:14.1f}" if vals.get(n) else f"{'-':>14s}" for n in names)
            ratios = "".join(
                f"  {vals['ours'] / vals[peer]:10.2f}" if vals.get("ours") and vals.get(peer)
                else f"  {'-':>10s}" for peer in ("sdpa_cudnn", "sdpa_flash"))
            print(f"{key[0]:4d} {key[1]:6d} {key[2]!s:>6s} {cells}{ratios}")


def plot(rows: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dims = sorted({r["d"] for r in rows})
    names = sorted({r["impl"] for r in rows})
    colors = {name: f"C{i}" for i, name in enumerate(names)}  # same colour in every panel
    fig, axes = plt.subplots(2, len(dims), figsize=(5 * len(dims), 8), squeeze=False)
    for col, d in enumerate(dims):
        for row_i, causal in enumerate((False, True)):
            ax = axes[row_i][col]
            for name in names:
                pts = [(r["L"], r["fwd_tflops"]) for r in rows if r["impl"] == name
                       and r["d"] == d and r["causal"] == causal and "fwd_tflops" in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name, color=colors[name])
            ax.set_xscale("log", base=2)
            ax.set_title(f"forward, d={d}, causal={causal}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
