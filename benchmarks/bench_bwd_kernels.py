"""Where the CUDA backward's time goes: ours, SDPA's FLASH and cuDNN backends, kernel by kernel.

For each (d, L, causal): backward TFLOP/s of ours (flash_attn_func) and of SDPA's FLASH and
cuDNN backends measured in the same process (CUDA events, queued calls, median; FLOPs the
FlashAttention way: 2.5 x 4 * B * H * L^2 * d, halved when causal), then each kernel's GPU time
in one backward (torch.profiler), in microseconds and as TFLOP/s-equivalents of the whole
backward's FLOPs.  --sm90-bwd auto off: ours under each value of the kernel option sm90_bwd in
turn, in the same process (rows "ours" for auto, "ours-off", "ours-on"): the Hopper backward
against the portable one.  --deterministic: also ours with deterministic=True ("ours-det").
--section-pairs 1 ...: also ours under each value of the kernel option sm90_section_pairs (rows
"ours-s<N>"; for a causal call, the (batch, KV head) pairs per section of the Hopper backward's
launch order, 1: the key block fastest over the whole launch).  --direct-epilogue: also ours
with kernel_options(sm90_direct_epilogue=True) (row "ours-direct": dK and dV stored from
registers instead of through shared memory).
bf16, B * L = 16384 tokens, H * d = 2048, inputs (B, L, H, d).

--sm80-forward: also time the portable (sm80) forward (kernel_options(force_portable=True)) and SDPA
FLASH's forward, no autograd.
--ncu: run each backward exactly once between cudaProfilerStart/Stop (after warm-up), for
`ncu --profile-from-start off`; no timing.

Usage: python benchmarks/bench_bwd_kernels.py [--dims 64 128] [--seqlens 4096 16384] [--ncu]
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F
from bench_attention import median_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext


def backward_fns(d: int, seqlen: int, causal: bool, sm90_bwd: tuple = ("auto",),
                 deterministic: bool = False, section_pairs: tuple = (),
                 direct_epilogue: bool = False):
    """name -> zero-argument backward of a fixed forward graph (retain_graph): ours (under each
    value of the kernel option sm90_bwd; with ``deterministic`` also "ours-det", the default
    choice with deterministic=True; "ours-s<N>" under sm90_section_pairs=N for each N of
    ``section_pairs``; with ``direct_epilogue`` "ours-direct"), SDPA's FLASH and cuDNN
    backends."""
    batch, heads = max(1, 16384 // seqlen), 2048 // d
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in "qkv")
    dout = torch.randn_like(q)

    def ours(choice, det=False, pairs=0, direct=False):
        options = {"sm90_bwd": choice, "sm90_section_pairs": pairs,
                   "sm90_direct_epilogue": direct}
        with flash_attn_ext.kernel_options(**options):
            out = flash_attn_ext.flash_attn_func(q, k, v, causal=causal, deterministic=det)

        def backward():
            with flash_attn_ext.kernel_options(**options):
                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return backward
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out_flash = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_cudnn = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dout_t = dout.transpose(1, 2)
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)

    return flops, {
        **{"ours" if c == "auto" else f"ours-{c}": ours(c) for c in sm90_bwd},
        **({"ours-det": ours("auto", True)} if deterministic else {}),
        **{f"ours-s{n}": ours("auto", pairs=n) for n in section_pairs},
        **({"ours-direct": ours("auto", direct=True)} if direct_epilogue else {}),
        "flash": lambda: torch.autograd.grad(out_flash, (qt, kt, vt), dout_t,
                                             retain_graph=True),
        "cudnn": lambda: torch.autograd.grad(out_cudnn, (qt, kt, vt), dout_t,
                                             retain_graph=True),
    }


def forward_ms(d: int, seqlen: int, causal: bool):
    """Median ms of the portable forward (no autograd) and of SDPA FLASH's at the shape."""
    batch, heads = max(1, 16384 // seqlen), 2048 // d
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
               for _ in "qkv")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    with flash_attn_ext.kernel_options(force_portable=True):
        ours = median_ms(lambda: flash_attn_ext.flash_attn_func(q, k, v, causal=causal))
    return ours, flash


def kernel_times(fn) -> collections.Counter[str]:
    """GPU microseconds per kernel name in one call of fn."""
    times: collections.Counter = collections.Counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("<")[0].split("(")[0].replace("void ", "")
            times[name[-48:]] += e.device_time
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--sm80-forward", action="store_true")
    parser.add_argument("--sm90-bwd", choices=["auto", "on", "off"], nargs="+",
                        default=["auto"], help="values of the kernel option sm90_bwd to time ours "
                        "under, in turn (off: the portable backward)")
    parser.add_argument("--deterministic", action="store_true",
                        help="also time ours with deterministic=True (row ours-det)")
    parser.add_argument("--section-pairs", type=int, nargs="+", default=[],
                        help="also time ours under each value of the kernel option "
                        "sm90_section_pairs (rows ours-s<N>)")
    parser.add_argument("--direct-epilogue", action="store_true",
                        help="also time ours with sm90_direct_epilogue=True (row ours-direct)")
    args = parser.parse_args()
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    for d in args.dims:
        for seqlen in args.seqlens:
            for causal in causals:
                flops, fns = backward_fns(d, seqlen, causal, tuple(args.sm90_bwd),
                                          args.deterministic, tuple(args.section_pairs),
                                          args.direct_epilogue)
                if args.sm80_forward and not args.ncu:
                    ours_ms, flash_ms = forward_ms(d, seqlen, causal)
                    print(f"d={d:3d} L={seqlen:5d} causal={causal!s:5} sm80  fwd "
                          f"{flops / 2.5 / ours_ms / 1e9:6.1f} TFLOP/s  (flash fwd "
                          f"{flops / 2.5 / flash_ms / 1e9:6.1f})", flush=True)
                for name, fn in fns.items():
                    if args.ncu:
                        fn()
                        torch.cuda.synchronize()
                        torch.cuda.profiler.start()
                        fn()
                        torch.cuda.synchronize()
                        torch.cuda.profiler.stop()
                        continue
                    ms = median_ms(fn)
                    split = kernel_times(fn)
                    parts = "; ".join(f"{k} {t:.0f} us ({flops / t / 1e6:.0f})"
                                      for k, t in split.most_common(4))
                    print(f"d={d:3d} L={seqlen:5d} causal={causal!s:5} {name:8s} "
                          f"bwd {flops / ms / 1e9:6.1f} TFLOP/s  [{parts}]", flush=True)


if __name__ == "__main__":
    main()
