"""Host (CPU) time per attention call on a GPU, and where it goes.

At short sequence lengths a forward takes 50-100 us on the GPU, about what the host spends
preparing it; a call whose host part is longer than its GPU part leaves the GPU idle even when
calls are queued back to back.  This script times host microseconds per call at a tiny shape
(B=1, H=16, L=128, d=128, bf16: the GPU part is a few us, so the loop is host-bound) for:
our public call, the op without autograd, and SDPA's backends; then prints torch.profiler's
CPU-side breakdown (CUDA runtime calls included) of our call.

Usage (on a GPU machine): python benchmarks/host_overhead.py [--calls 500]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext


def host_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def _causal(backend, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    q, k, v = (torch.randn(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    qg, kg, vg = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    cases = {
        "ours sdpa (grad)": lambda: flash_attn_ext.scaled_dot_product_attention(q, k, v),
        "ours sdpa causal (grad)": lambda: flash_attn_ext.scaled_dot_product_attention(
            q, k, v, is_causal=True),
        "ours sdpa (no grad)": lambda: flash_attn_ext.scaled_dot_product_attention(qd, kd, vd),
        "ours flash_attn_func (grad)": lambda: flash_attn_ext.flash_attn_func(qg, kg, vg),
        "ours op fwd (grad)": lambda: torch.ops.flash_attn_ext.fwd(qg, kg, vg),
        "ours op fwd causal (grad)": lambda: torch.ops.flash_attn_ext.fwd(qg, kg, vg, causal=True),
        "ours op fwd (no grad)": lambda: torch.ops.flash_attn_ext.fwd(qt, kt, vt),
        "transpose x4 (grad)": lambda: (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        q.transpose(1, 2)),
        "torch.empty x3": lambda: (torch.empty_like(qd), torch.empty_like(qd),
                                   torch.empty_like(qd)),
    }
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend, grad=True):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v) if grad else \
                    F.scaled_dot_product_attention(qd, kd, vd)
        cases[f"sdpa {name} (grad)"] = run
        cases[f"sdpa {name} (no grad)"] = lambda run=run: run(grad=False)
        cases[f"sdpa {name} causal (grad)"] = lambda backend=backend: _causal(backend, q, k, v)
    for name, fn in cases.items():
        print(f"{name:30s} {host_us(fn, args.calls):7.1f} us/call", flush=True)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(100):
            flash_attn_ext.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                    max_name_column_width=48))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
