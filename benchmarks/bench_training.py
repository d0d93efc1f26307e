"""Training-step benchmark: a Llama-style transformers model with attn_implementation
"flash_attn_ext" against "sdpa" (PyTorch's choice of backend: cuDNN or FLASH on an H200), in one
process, with and without right padding.

The model (random weights, no download): 8 layers, hidden 2048, 16 query / 8 key-value heads
(head dim 128), MLP 5632, vocabulary 32000, bf16 weights, AdamW.  A step is forward, the
causal-LM loss, backward and the optimizer step, on B * L = --tokens tokens.  "right" padding: a
quarter of each sequence padded in half the batch (the attention mask transformers then builds
is a (B, 1, L, S) causal + padding mask; padded positions get label -100).  Every step of an
implementation runs on the same weights and batch; the median of --steps timed steps after
--warmup is reported, with tokens per second and ours / sdpa.  Ours runs in strict mode: a call
that no fused kernel serves raises instead of timing the fallback.  --impls sdpa+provider adds
"sdpa" with our kernels behind SDPA's FLASH backend (PyTorch's flash-impl registry; unpadded
batches only).

Usage: python benchmarks/bench_training.py [--seqlens 2048 8192] [--padding none right]
       [--impls flash_attn_ext sdpa sdpa+provider]
       [--tiny]  (--tiny: a 2-layer hidden-256 model, to check the script on a CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import time
from typing import List

import torch

import flash_attn_ext

# "sdpa+provider": attn_implementation="sdpa" with our kernels behind SDPA's FLASH backend
# (activate_flash_attention_impl + sdpa_kernel([FLASH_ATTENTION])); unpadded batches only
# (SDPA's FLASH backend takes no mask).
IMPLS = ("flash_attn_ext", "sdpa", "sdpa+provider")


def make_model(impl: str, tiny: bool, device: str, dtype: torch.dtype):
    import transformers
    if tiny:
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=65536)
    else:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048,
                                       intermediate_size=5632, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=8,
                                       max_position_embeddings=65536)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl)
    return model.to(device=device, dtype=dtype).train(), cfg


def make_batch(cfg, batch: int, seqlen: int, padding: str, device: str):
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seqlen), device=device)
    mask = torch.ones(batch, seqlen, dtype=torch.long, device=device)
    if padding == "right":
        mask[: max(1, batch // 2), seqlen - seqlen // 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, (None if padding == "none" else mask), labels


@contextlib.contextmanager
def provider_active(active: bool):
    """Our kernels behind SDPA's FLASH backend, and SDPA restricted to it, while active."""
    if not active:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_attn_ext.integrations import torch_flash
    torch.nn.attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            yield
    finally:
        torch.nn.attention.restore_flash_attention_impl()


def time_steps(impl: str, args, seqlen: int, padding: str, device: str) -> dict:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, cfg = make_model(impl.split("+")[0], args.tiny, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = max(1, args.tokens // seqlen)
    ids, mask, labels = make_batch(cfg, batch, seqlen, padding, device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    with provider_active(impl == "sdpa+provider"):
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    row = dict(impl=impl, L=seqlen, B=batch, padding=padding, step_ms=ms,
               tokens_per_s=batch * seqlen / ms * 1e3, loss=float(loss.detach()))
    if device == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--padding", nargs="+", choices=("none", "right"),
                        default=["none", "right"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS[:2]),
                        help="the first is compared with the others (ours/this)")
    parser.add_argument("--out-dir", default="build")
    args = parser.parse_args()
    if args.impls[0] == "sdpa+provider":  # (the baseline must run at every padding)
        parser.error("--impls: sdpa+provider cannot be the first (it runs unpadded batches only)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flash_attn_ext.register_transformers()
    flash_attn_ext.policy.set_strict(True)  # (sdpa never calls ours: strict touches only ours)
    commit = os.environ.get("FLASH_ATTN_EXT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        check=False).stdout.strip() or "unknown"
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=device,
                gpu=torch.cuda.get_device_name() if device == "cuda" else None,
                torch=torch.__version__, commit=commit, tiny=args.tiny)
    rows: List[dict] = []
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"training_{datetime.date.today():%Y%m%d}_{commit}.json")
    for seqlen in args.seqlens:
        for padding in args.padding:
            point = []
            for impl in args.impls:
                if impl == "sdpa+provider" and padding != "none":
                    continue
                point.append(time_steps(impl, args, seqlen, padding, device))
                if device == "cuda":  # (the model and optimizer of the last one are gone)
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
            first = point[0]
            for r in point[1:]:  # (the first's speed-up over each: "vs_sdpa" etc.)
                first["vs_" + r["impl"]] = r["step_ms"] / first["step_ms"]
            for r in point:
                print(f"L={seqlen:5d} B={r['B']:2d} padding={padding:5s} {r['impl']:15s} "
                      f"step {r['step_ms']:8.1f} ms  {r['tokens_per_s']:9.0f} tokens/s"
                      + (f"  {first['impl']}/this {first['vs_' + r['impl']]:.3f}x"
                         if r is not first else ""))
            rows += point
            with open(path, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
