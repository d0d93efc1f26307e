"""GPU benchmark of attention with score modifiers: masks, softcap, dropout, against the peers
that take the same call, in one process.

Cases (bf16, B * L = 16384 tokens, H = 2048 / d heads, SDPA's (B, H, L, d) layout):
  plain           no modifier (our own yardstick for the others)
  causal          a causal mask only (the yardstick for the causal cases: alibi, dropout)
  padding         a boolean (B, 1, 1, S) key-padding mask, half the batch with its last
                  quarter of keys padded (as transformers passes right-padded batches)
  causal_padding  the same as one (B, 1, L, S) boolean causal + padding mask
  softcap         softcap = 30 (Gemma-2), ours and FlexAttention (score_mod) only
  alibi           ALiBi, causal (BLOOM, MPT): ours with alibi_slopes, FlexAttention with a
                  score_mod, SDPA with ALiBi and the causal mask as one (1, H, L, S) bf16 bias
  dropout         dropout_p = 0.1 causal: ours and SDPA's FLASH backend
Implementations: ours (flash_attn_ext.scaled_dot_product_attention, default kernels: a boolean
mask alone runs the Hopper kernels' mask variant), ours_sm80 (the portable kernels),
ours_fma_exp2_0 / _4 (softcap: the kernel option sm90_fma_exp2, none or 4 of every 8 columns'
exp2s on the FMA pipe at d = 64, where the default takes 2; builds that have the option),
ours_2_consumers / ours_3_consumers (alibi / dropout at d <= 64: the kernel option
sm90_per_score_consumers, two consumer warpgroups with 128-key tiles or three with 96, the
other of the variant's default: ALiBi three, dropout two), ours_no_fold (alibi at d <= 64: the
kernel option sm90_alibi_fold off, the term per score instead of in the Q Kᵀ GEMM),
ours_narrow_tiles (softcap / alibi at d <= 64: the kernel option sm90_narrow_tiles, 96-key
tiles instead of 128), ours_long_steps (dropout at d <= 64: the kernel option
sm90_bwd_short_steps off, the Hopper backward's 128-row steps instead of 64),
ours_no_blocks (masks: the Hopper kernels without the bias's block summary, reading it
everywhere), ours_mask_bytes (masks: the kernel options sm90_mask_rows and sm90_mask_cols off,
the forward and the backward reading the mask's bytes in mixed blocks where a row's keys, or a
key's rows, are an interval), ours_as_bias (masks: the
same mask as a 0 / -inf fp32 bias, which the general variant reads), SDPA with the CUDNN,
FLASH (no mask) and EFFICIENT backends forced, and FlexAttention compiled (block mask or
score_mod for the same function).  A backend that refuses a call is recorded with its error.

FLOPs as bench_attention.py counts them (4 B H L S d, halved for the causal cases; masked-out
keys are counted: every implementation gets the same count, so ratios are ratios of time).
Forward timed alone (median of rounds, order rotated), backward as (fwd+bwd) - fwd.

Usage: python benchmarks/bench_score_mods.py [--dims 128] [--seqlens 2048 4096]
       [--cases padding causal_padding softcap dropout] [--no-flex] [--skip ours_sm80 ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from bench_attention import HIDDEN, TOKENS, _error, backward_reading, median_ms, options_of
from timing import rotated
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext

CASES = ("plain", "causal", "padding", "causal_padding", "softcap", "alibi", "dropout")
SOFTCAP = 30.0
DROPOUT = 0.1


def make_case(case: str, batch: int, seqlen: int, d: int) -> dict:
    """The call's keyword arguments beyond q, k, v (SDPA's names; softcap as ours takes it)
    plus what the FlexAttention run needs."""
    if case in ("padding", "causal_padding"):
        lengths = torch.full((batch,), seqlen, device="cuda")
        lengths[: batch // 2 if batch > 1 else 0] = seqlen - seqlen // 4
        if batch == 1:
            lengths[0] = seqlen - seqlen // 4
        keys = torch.arange(seqlen, device="cuda")
        mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
        if case == "causal_padding":
            mask = mask & torch.ones(seqlen, seqlen, dtype=torch.bool, device="cuda").tril()
        return dict(attn_mask=mask, lengths=lengths, causal=case == "causal_padding")
    if case == "softcap":
        return dict(softcap=SOFTCAP, causal=False)
    if case == "alibi":
        heads = HIDDEN // d
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)],
                              device="cuda")
        i = torch.arange(seqlen, device="cuda")
        dist = (i[:, None] - i[None, :]).float()
        bias = (-slopes[:, None, None] * dist.abs()).masked_fill(dist < 0, float("-inf"))
        return dict(alibi_slopes=slopes, sdpa_mask=bias[None].to(torch.bfloat16), causal=True)
    if case == "dropout":
        return dict(dropout_p=DROPOUT, causal=True)
    return dict(causal=case == "causal")


def implementations(case: str, flex: bool, d: int) -> Dict[str, Callable]:
    """name -> f(q, k, v, spec) for the implementations that take `case`."""

    def ours(q, k, v, spec):
        if "softcap" in spec or "alibi_slopes" in spec:  # (not SDPA arguments: flash_attn_func
            # on (B, L, H, d) views)
            return flash_attn_ext.flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=spec["causal"],
                softcap=spec.get("softcap", 0.0),
                alibi_slopes=spec.get("alibi_slopes")).transpose(1, 2)
        return flash_attn_ext.scaled_dot_product_attention(
            q, k, v, attn_mask=spec.get("attn_mask"), dropout_p=spec.get("dropout_p", 0.0),
            is_causal=spec["causal"] and "attn_mask" not in spec)

    def ours_sm80(q, k, v, spec):
        with flash_attn_ext.kernel_options(**ours_sm80.options):
            return ours(q, k, v, spec)
    # (kernel options its backward must run under too: see fwd_bwd)
    ours_sm80.options = dict(force_portable=True)

    def sdpa(backend):
        def run(q, k, v, spec):
            with sdpa_kernel(backend):
                mask = spec.get("attn_mask", spec.get("sdpa_mask"))
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=spec.get("dropout_p", 0.0),
                    is_causal=spec["causal"] and mask is None)
        return run

    def ours_no_blocks(q, k, v, spec):  # the bias read everywhere: no block summary
        with flash_attn_ext.kernel_options(**ours_no_blocks.options):
            return ours(q, k, v, spec)
    ours_no_blocks.options = dict(sm90_bias_blocks=False)

    def ours_as_bias(q, k, v, spec):  # the mask as 0 / -inf in fp32: the general variant
        mask = spec["attn_mask"]
        bias = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        return ours(q, k, v, dict(spec, attn_mask=bias))

    def with_options(fn, **options):  # fn under kernel options (its backward too: fwd_bwd)
        def run(q, k, v, spec):
            with flash_attn_ext.kernel_options(**run.options):
                return fn(q, k, v, spec)
        run.options = options
        return run

    def ours_fma_exp2(n):  # the softcap variant's exp2 split (d = 64), another of its A/B forms
        return with_options(ours, sm90_fma_exp2=n)

    impls: Dict[str, Callable] = {"ours": ours, "ours_sm80": ours_sm80}
    if case in ("alibi", "dropout") and d <= 64 and \
            "sm90_per_score_consumers" in flash_attn_ext.ops._C.kernel_options():
        other = 2 if case == "alibi" else 3
        impls[f"ours_{other}_consumers"] = with_options(ours, sm90_per_score_consumers=other)
    if case == "alibi" and d <= 64 and "sm90_alibi_fold" in flash_attn_ext.ops._C.kernel_options():
        impls["ours_no_fold"] = with_options(ours, sm90_alibi_fold=False)
    if case in ("alibi", "softcap") and d <= 64 and \
            "sm90_narrow_tiles" in flash_attn_ext.ops._C.kernel_options():
        impls["ours_narrow_tiles"] = with_options(ours, sm90_narrow_tiles=True)
    if case == "dropout" and d <= 64 and \
            "sm90_bwd_short_steps" in flash_attn_ext.ops._C.kernel_options():
        impls["ours_long_steps"] = with_options(ours, sm90_bwd_short_steps=False)
    if case == "softcap" and "sm90_fma_exp2" in flash_attn_ext.ops._C.kernel_options():
        impls["ours_fma_exp2_0"] = ours_fma_exp2(0)
        impls["ours_fma_exp2_4"] = ours_fma_exp2(4)
    if case in ("padding", "causal_padding"):
        impls["ours_no_blocks"] = ours_no_blocks
        impls["ours_as_bias"] = ours_as_bias
        options = flash_attn_ext.ops._C.kernel_options()
        bytes_everywhere = {o: False for o in ("sm90_mask_rows", "sm90_mask_cols") if o in options}
        if bytes_everywhere:
            impls["ours_mask_bytes"] = with_options(ours, **bytes_everywhere)
    if case != "softcap":
        impls["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        impls["sdpa_efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
    if case in ("plain", "causal", "dropout"):
        impls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    if flex and case != "dropout":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        torch._dynamo.config.recompile_limit = 64
        compiled = torch.compile(flex_attention)
        cache: dict = {}

        def flex_run(q, k, v, spec):
            key = (case, q.shape[0], q.shape[-2])
            if key not in cache:
                lengths, causal = spec.get("lengths"), spec["causal"]

                def mask_mod(b, h, qi, ki):
                    visible = ki < lengths[b] if lengths is not None else ki >= 0
                    return visible & (qi >= ki) if causal else visible
                cache[key] = create_block_mask(mask_mod, q.shape[0], None, q.shape[-2],
                                               k.shape[-2], device="cuda")
            score_mod = None
            if "softcap" in spec:
                def score_mod(score, b, h, qi, ki):
                    return SOFTCAP * torch.tanh(score / SOFTCAP)
            if "alibi_slopes" in spec:
                slopes = spec["alibi_slopes"]

                def score_mod(score, b, h, qi, ki):
                    return score - slopes[h] * (qi - ki).abs()
            return compiled(q, k, v, block_mask=cache[key], score_mod=score_mod)
        impls["flex"] = flex_run
    return impls


def bench_case(case: str, d: int, seqlen: int, flex: bool, rounds: int,
               skip: tuple = ()) -> List[dict]:
    batch, heads = max(1, TOKENS // seqlen), HIDDEN // d
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16)
    spec = make_case(case, batch, seqlen, d)
    flops_fwd = 4 * batch * heads * seqlen * seqlen * d / (2 if spec["causal"] else 1)
    impls = {n: f for n, f in implementations(case, flex, d).items()
             if n == "ours" or n not in skip}
    if "softcap" in spec or "alibi_slopes" in spec:
        sample = flash_attn_ext.explain(*(t.transpose(1, 2) for t in (q, k, v)), layout="blhd",
                                        softcap=spec.get("softcap", 0.0), causal=spec["causal"],
                                        alibi_slopes=spec.get("alibi_slopes"))
    else:
        sample = flash_attn_ext.explain(q, k, v, attn_mask=spec.get("attn_mask"),
                                        dropout_p=spec.get("dropout_p", 0.0),
                                        is_causal=spec["causal"] and "attn_mask" not in spec)
    rows = {n: dict(impl=n, case=case, d=d, L=seqlen, B=batch, H=heads) for n in impls}
    rows["ours"]["kernels"] = f"{sample.kernel} / {sample.backward_kernel}"
    times: Dict[str, list] = {n: [] for n in impls}
    for r in range(rounds):
        for name in rotated(list(impls), r):
            if "error" in rows[name]:
                continue
            try:
                with torch.no_grad():
                    times[name].append(median_ms(lambda fn=impls[name]: fn(q, k, v, spec)))
            except Exception as e:  # a backend that refuses the call is recorded
                rows[name]["error"] = _error(e)
    for name, fn in impls.items():
        row = rows[name]
        if "error" in row:
            continue
        fwd_ms = statistics.median(times[name])
        row.update(fwd_ms=fwd_ms, fwd_tflops=flops_fwd / fwd_ms / 1e9)

        def fwd_bwd(fn=fn):
            q.grad = k.grad = v.grad = None
            with options_of(fn):
                fn(q, k, v, spec).backward(dout)
        try:
            row.update(backward_reading(lambda fn=fn: fn(q, k, v, spec), fwd_bwd, flops_fwd))
        except Exception as e:
            row["bwd_error"] = _error(e)
    torch.cuda.empty_cache()
    return list(rows.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", default="build")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="implementations to leave out (ours always runs)")
    args = parser.parse_args()
    commit = os.environ.get("FLASH_ATTN_EXT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        check=False).stdout.strip() or "unknown"
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version(), commit=commit)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"score_mods_{datetime.date.today():%Y%m%d}_{commit}.json")
    rows: List[dict] = []
    for d in args.dims:
        for seqlen in args.seqlens:
            for case in args.cases:
                point = bench_case(case, d, seqlen, not args.no_flex, args.rounds,
                                   tuple(args.skip))
                rows += point
                with open(path, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)
                print_point(point)
    print(f"wrote {path}")
    return 0


def print_point(point: List[dict]) -> None:
    ours: Optional[dict] = next((r for r in point if r["impl"] == "ours"), None)
    for r in point:
        where = f"{r['case']:15s} d={r['d']:3d} L={r['L']:5d} {r['impl']:15s}"
        if "error" in r:
            print(f"{where} {r['error']}", flush=True)
            continue
        rel = ""
        if ours is not None and r is not ours and "fwd_tflops" in ours:
            rel = f"  ours/this fwd {ours['fwd_tflops'] / r['fwd_tflops']:.2f}"
            if "bwd_tflops" in ours and "bwd_tflops" in r:
                rel += f" bwd {ours['bwd_tflops'] / r['bwd_tflops']:.2f}"
        bwd = (f"bwd {r['bwd_tflops']:6.1f}  fwd+bwd {r['fwdbwd_tflops']:6.1f}"
               if "bwd_tflops" in r else f"bwd {r.get('bwd_error', '-')}")
        print(f"{where} fwd {r['fwd_tflops']:6.1f}  {bwd} TFLOP/s{rel}"
              + (f"  [{r['kernels']}]" if "kernels" in r else ""), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
