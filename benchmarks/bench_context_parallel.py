"""Context parallelism on two GPUs (issue 28): PyTorch's own context parallelism
(``torch.distributed.tensor.experimental.context_parallel``: sequence-sharded q/k/v, a ring of
flash attention calls merged by their log-sum-exps, head-tail load balancing when causal) with
our kernels as PyTorch's flash attention (``activate_flash_attention_impl("flash_attn_ext")``),
against a single-GPU run of our kernels and PyTorch's own kernels under the same context
parallelism, in one call.

STATUS: the CUDA path (the default, ``--device cuda``, two spawned NCCL processes) has NOT yet
run on two GPUs: no two-GPU machine has been available.  What has run is ``--device cpu`` (two
gloo processes, tiny shapes, our CPU kernels registered for the aten flash ops under the CPU
key), which exercises the same code except the backend choice (below) and PyTorch's kernels;
``tests/test_benchmarks.py`` runs it.  Only the public ``context_parallel(mesh, buffers=...,
buffer_seq_dims=..., no_restore_buffers=...)`` shards the training batch and the attention
inputs; ``context_parallel_unshard`` and ``set_rotate_method`` come from the experimental
module, and the private ``_cp_options.enable_load_balance`` is needed for not-causal attention
(PyTorch's ring refuses load balancing without ``is_causal``): a torch without them stops with
an error naming what is missing.

Parts (rank 0 prints the tables and writes ``context_parallel_<date>_<commit>.json`` to
--out-dir):

1. attention: bf16, (1, 16, L, 128) q, (1, 8, L, 128) k and v (GQA), causal (head-tail load
   balancing) and not, L in --seqlens (default 32k, 64k, 128k), --rotate method.  Out, dq, dk,
   dv of our kernels under CP (unsharded, load balancing undone) and of one call of our kernels
   on one GPU, each against a float32 reference (PyTorch's memory-efficient kernel in float32 on
   CUDA, its math kernel on the CPU; k and v expanded to the query heads), by the error rule:
   error <= 2 (out) / 3 (dq, dk, dv) x the error of PyTorch's own kernel in the same precision
   (SDPA's FLASH on CUDA, its CPU kernel on the CPU) + one ulp of the largest reference value.
   (The tests' rule adds an absolute slack of a few ulps at magnitude 1; at these lengths the
   gradients are far below 1, so the slack here is relative.)  Also max |CP - single|.
2. training: the model of bench_training.py (Llama-style, random weights, 8 layers, hidden 2048,
   16 / 8 heads of dim 128; ``--tiny``: 2 layers, hidden 256), one batch of --train-seqlen
   tokens, --train-steps AdamW steps (lr --lr), the causal-LM loss as a token mean over the
   whole sequence (labels shifted before sharding; each rank's cross-entropy sum divided by the
   global token count, parameter gradients all-reduced over the CP group).  Attention through
   a transformers attention function that calls F.scaled_dot_product_attention(is_causal=True,
   enable_gqa=True) with no mask (transformers' masks would see the load-balanced positions as
   packed sequences), position ids sharded with the batch.  Runs: our kernels on one GPU (the
   curve to match), PyTorch's kernel on one GPU (the yardstick: how far two exact kernels'
   bf16 curves drift apart), and under CP our kernels, PyTorch's FLASH and cuDNN.  The CP curve
   of ours "equals" the single-GPU one when max_step |CP - single| <= max(2 x the yardstick's
   drift, 0.01).
3. speed: tokens/s per GPU of each CP training run (the median of the steps after
   --warmup), ours / each of PyTorch's kernels, in the same processes.

Where a kernel refuses native GQA (enable_gqa) the run retries with k and v expanded to the
query heads and says so in its row; any other failure is recorded in the row and the call goes
on.  On the CPU, SDPA picks ``aten._scaled_dot_product_flash_attention_for_cpu``, which
DTensor cannot shard, so "ours" calls ``aten._scaled_dot_product_flash_attention`` through a
stand-in for F.scaled_dot_product_attention (installed before CP patches it); PyTorch's FLASH
and cuDNN have no CPU kernels, so the CPU mode runs "ours" only under CP.

Usage: python benchmarks/bench_context_parallel.py [--seqlens 32768 65536 131072]
       [--train-seqlen 32768] [--train-steps 8] [--warmup 3] [--impls ours flash cudnn]
       [--rotate allgather|alltoall] [--tiny] [--out-dir build]
       python benchmarks/bench_context_parallel.py --device cpu   (tiny shapes, gloo, about
       ten seconds: the bookkeeping and correctness path on a CPU; its timings mean nothing)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 2
IMPLS = ("ours", "flash", "cudnn")  # ours; PyTorch's FLASH; PyTorch's cuDNN (CUDA only)
ATTN_NAME = "cp_sdpa"  # the transformers attention function registered below


# ---------------------------------------------------------------------------------------------
# PyTorch's context-parallel entry points (experimental: located, or a clear error)

def cp_api():
    """(context_parallel, context_parallel_unshard, set_rotate_method, _cp_options)."""
    from torch.distributed.tensor.experimental import context_parallel
    try:
        from torch.distributed.tensor.experimental._attention import (
            _cp_options,
            context_parallel_unshard,
            set_rotate_method,
        )
    except ImportError as e:
        raise RuntimeError("this torch's context parallelism lacks context_parallel_unshard / "
                           f"set_rotate_method / _cp_options ({e})") from e
    if not hasattr(_cp_options, "enable_load_balance"):
        raise RuntimeError("this torch's _cp_options has no enable_load_balance")
    return context_parallel, context_parallel_unshard, set_rotate_method, _cp_options


@contextlib.contextmanager
def load_balance(enabled: bool):
    """Head-tail load balancing on or off (PyTorch's ring requires it off when not causal)."""
    options = cp_api()[3]
    saved = options.enable_load_balance
    options.enable_load_balance = enabled
    try:
        yield
    finally:
        options.enable_load_balance = saved


def flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """CPU stand-in for F.scaled_dot_product_attention: what SDPA's FLASH backend calls on CUDA,
    aten._scaled_dot_product_flash_attention, on (B, H, L, D) q and (B, H_kv, S, D) k, v."""
    if attn_mask is not None:
        raise RuntimeError("the flash op takes no attn_mask")
    return torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, scale=scale)[0]


flash_sdpa.__name__ = "scaled_dot_product_attention"  # (CP patches F by the function's name)


@contextlib.contextmanager
def backend(impl: str, device: str):
    """The kernel F.scaled_dot_product_attention runs while active: "ours" (CUDA: our kernels
    as PyTorch's flash impl, SDPA limited to FLASH; CPU: our kernels registered for the aten
    flash ops under the CPU key, reached through flash_sdpa), "flash" / "cudnn" (PyTorch's
    FLASH / cuDNN; on the CPU "flash" is SDPA's own CPU kernel), "reference" (float32:
    memory-efficient on CUDA, math on the CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if impl == "ours" and device == "cpu":
        from flash_attn_ext.integrations import torch_flash
        lib = torch_flash.register_kernels("CPU")
        real = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = flash_sdpa
        try:
            yield
        finally:
            F.scaled_dot_product_attention = real
            lib._destroy()
        return
    if device == "cpu":
        if impl == "cudnn":
            raise RuntimeError("PyTorch has no cuDNN attention on the CPU")
        with sdpa_kernel([SDPBackend.MATH if impl == "reference" else SDPBackend.FLASH_ATTENTION]):
            yield
        return
    choice = {"ours": SDPBackend.FLASH_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION,
              "reference": SDPBackend.EFFICIENT_ATTENTION}[impl]
    if impl == "ours":
        from flash_attn_ext.integrations import torch_flash
        torch.nn.attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        with sdpa_kernel([choice]):
            yield
    finally:
        if impl == "ours":
            torch.nn.attention.restore_flash_attention_impl()


def sdpa(q, k, v, causal: bool, repeat_kv: bool, scale=None):
    """F.scaled_dot_product_attention on (B, H, L, D) q and (B, H_kv, S, D) k, v: GQA native
    (enable_gqa) or with k, v expanded to the query heads."""
    group = q.shape[1] // k.shape[1]
    if repeat_kv and group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=group > 1 and not repeat_kv)


def with_gqa_fallback(fn, row: dict):
    """fn(repeat_kv) with native GQA, or, where that raises, with k and v expanded (noted in
    row["gqa"])."""
    try:
        result = fn(False)
        row["gqa"] = "native"
        return result
    except RuntimeError as e:
        row["gqa"] = f"repeat_kv (native: {str(e).splitlines()[0][:160]})"
        return fn(True)


CALLS = {"fwd": 0, "bwd": 0}


def count_our_calls() -> None:
    """Counts the calls into our impls of aten._scaled_dot_product_flash_attention and its
    backward (wrapped before anything registers them): each row's ``ours_calls`` shows which
    runs our kernels served (every ring step of ours, none of PyTorch's)."""
    from flash_attn_ext.integrations import torch_flash
    forward, backward = torch_flash._sdpa_forward, torch_flash._sdpa_backward

    def sdpa_forward(*args, **kwargs):
        CALLS["fwd"] += 1
        return forward(*args, **kwargs)

    def sdpa_backward(*args, **kwargs):
        CALLS["bwd"] += 1
        return backward(*args, **kwargs)

    torch_flash._sdpa_forward, torch_flash._sdpa_backward = sdpa_forward, sdpa_backward


@contextlib.contextmanager
def counted(row: dict):
    """Puts the calls into our impls while active in row["ours_calls"] ([fwd, bwd])."""
    before = dict(CALLS)
    try:
        yield
    finally:
        row["ours_calls"] = [CALLS["fwd"] - before["fwd"], CALLS["bwd"] - before["bwd"]]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Part 1: attention, out and gradients, CP vs one GPU vs the float32 reference

def make_inputs(seqlen: int, heads: int, heads_kv: int, head_dim: int, dtype, device):
    """q (1, heads, L, D), k, v (1, heads_kv, L, D), dout like q; the same on every rank."""
    g = torch.Generator(device=device).manual_seed(seqlen)
    shapes = [(1, heads, seqlen, head_dim), (1, heads_kv, seqlen, head_dim),
              (1, heads_kv, seqlen, head_dim), (1, heads, seqlen, head_dim)]
    return [torch.randn(*s, generator=g, device=device, dtype=dtype) for s in shapes]


def attention_grads(inputs, causal: bool, repeat_kv: bool, dtype=None):
    """(out, dq, dk, dv) of F.scaled_dot_product_attention under the active backend (in
    ``dtype`` if given: the reference's float32)."""
    q, k, v, dout = (t if dtype is None else t.to(dtype) for t in inputs)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = sdpa(*leaves, causal, repeat_kv)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def cp_attention_grads(mesh, inputs, causal: bool, repeat_kv: bool):
    """(out, dq, dk, dv) of PyTorch's context parallelism over ``mesh`` under the active
    backend: the inputs sharded by context_parallel (sequence dim 2; head-tail load balancing
    when causal), the results unsharded in sequence order."""
    context_parallel, unshard, _, _ = cp_api()
    with load_balance(causal):
        buffers = [t.clone() for t in inputs]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
                              no_restore_buffers=set(buffers)):
            leaves = [t.detach().clone().requires_grad_() for t in buffers[:3]]
            out = sdpa(*leaves, causal, repeat_kv)
            out.backward(buffers[3])
            local = [out.detach()] + [t.grad for t in leaves]
        return unshard(mesh, local, [2] * 4)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def attention_rows(rank, mesh, args, device) -> list:
    """Part 1's rows (on rank 0; the others return [])."""
    dtype = torch.bfloat16
    eps = torch.finfo(dtype).eps
    rows = []
    for seqlen in args.seqlens:
        for causal in (True, False):
            point = dict(part="attention", L=seqlen, causal=causal, rotate=args.rotate)
            try:
                inputs = make_inputs(seqlen, args.heads, args.heads_kv, args.head_dim, dtype,
                                     device)
                with backend("ours", device), counted(point):
                    cp = with_gqa_fallback(
                        lambda r, x=inputs, c=causal: cp_attention_grads(mesh, x, c, r), point)
                    sync(device)
                if rank == 0:
                    with backend("ours", device):
                        single = attention_grads(inputs, causal, point["gqa"] != "native")
                    yard = {}
                    with backend("flash", device):
                        theirs = with_gqa_fallback(
                            lambda r, x=inputs, c=causal: attention_grads(x, c, r), yard)
                    with backend("reference", device):
                        ref = attention_grads(inputs, causal, True, torch.float32)
                    for i, what in enumerate(("out", "dq", "dk", "dv")):
                        factor = 2.0 if what == "out" else 3.0
                        err_pt = max_abs(theirs[i], ref[i])
                        bound = factor * err_pt + eps * ref[i].abs().max().item()
                        err_cp, err_single = max_abs(cp[i], ref[i]), max_abs(single[i], ref[i])
                        rows.append(dict(point, what=what, err_cp=err_cp, err_single=err_single,
                                         err_pytorch=err_pt, pytorch_gqa=yard["gqa"],
                                         cp_vs_single=max_abs(cp[i], single[i]), bound=bound,
                                         ok=err_cp <= bound and err_single <= bound))
                    single = theirs = ref = None
                inputs = cp = None  # (freed before the next point's inputs)
            except Exception as e:  # (recorded; the call goes on)
                traceback.print_exc()
                if rank == 0:
                    rows.append(dict(point, error=f"{type(e).__name__}: {e}"[:300]))
            free(device)
            dist.barrier()
    return rows


# ---------------------------------------------------------------------------------------------
# Parts 2 and 3: training under CP, loss curve and tokens/s per GPU

_REPEAT_KV = {"on": False}


def cp_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         **kwargs):
    """transformers attention function: causal SDPA with no mask (query (B, H, L, D), key and
    value (B, H_kv, L, D)); returns (B, L, H, D) and no weights."""
    if attention_mask is not None:
        raise RuntimeError(f"{ATTN_NAME}: no mask expected")
    out = sdpa(query, key, value, True, _REPEAT_KV["on"], scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, cp_attention_forward)


def make_batch(vocab: int, seqlen: int, device: str):
    """input_ids, position_ids, shift_labels (1, L) int64, the same on every rank; the labels
    shifted before any sharding (the last position has none: -100)."""
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, vocab, (1, seqlen), generator=g, device=device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    positions = torch.arange(seqlen, device=device).unsqueeze(0)
    return ids, positions, labels


def train_run(impl: str, use_cp: bool, mesh, args, device) -> dict:
    """--train-steps AdamW steps of the model on one batch, under CP over ``mesh`` or on this
    rank alone; losses (the token mean over the whole sequence), median step time."""
    import bench_training
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, cfg = bench_training.make_model(ATTN_NAME, args.tiny, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ids, positions, labels = make_batch(cfg.vocab_size, args.train_seqlen, device)
    n_tokens = int((labels != -100).sum())

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                   ignore_index=-100, reduction="sum")
        (loss_sum / n_tokens).backward()
        total = loss_sum.detach()
        if use_cp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            dist.all_reduce(total)
        opt.step()
        return total.item() / n_tokens

    row = dict(part="training", impl=impl, cp=use_cp, L=args.train_seqlen,
               gpus=WORLD if use_cp else 1)
    losses, times = [], []
    context_parallel = cp_api()[0]
    with backend(impl, device), load_balance(True), counted(row):
        cp_context = context_parallel(mesh, buffers=[ids, positions, labels],
                                      buffer_seq_dims=[1, 1, 1],
                                      no_restore_buffers={ids, positions, labels}) \
            if use_cp else contextlib.nullcontext()
        with cp_context:
            local_tokens = ids.shape[1]

            def first(repeat_kv):
                _REPEAT_KV["on"] = repeat_kv
                return step()
            try:
                for i in range(args.train_steps):
                    sync(device)
                    t0 = time.perf_counter()
                    losses.append(with_gqa_fallback(first, row) if i == 0 else step())
                    sync(device)
                    times.append(time.perf_counter() - t0)
            finally:
                _REPEAT_KV["on"] = False
    timed = times[args.warmup:] or times[-1:]
    ms = statistics.median(timed) * 1e3
    row.update(losses=losses, step_ms=ms, local_tokens=local_tokens,
               tokens_per_s_per_gpu=local_tokens / ms * 1e3)
    if device == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def training_rows(rank, mesh, args, device) -> list:
    """Parts 2 and 3 (rows on rank 0): the single-GPU runs on rank 0 while the others wait,
    then each implementation under CP on all ranks."""
    rows = []
    impls = args.impls if device == "cuda" else ["ours"]

    def attempt(impl, use_cp):
        try:
            row = train_run(impl, use_cp, mesh, args, device)
        except Exception as e:  # (recorded; the call goes on)
            traceback.print_exc()
            row = dict(part="training", impl=impl, cp=use_cp, L=args.train_seqlen,
                       error=f"{type(e).__name__}: {e}"[:300])
        free(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        return row

    if rank == 0:
        rows += [attempt("ours", False), attempt("flash", False)]
    dist.barrier()
    for impl in impls:
        row = attempt(impl, True)
        dist.barrier()
        rows.append(row)
    if rank != 0:
        return []
    by = {(r["impl"], r["cp"]): r for r in rows}
    single, yard = by[("ours", False)], by[("flash", False)]

    def drift(a, b):
        if "losses" not in a or "losses" not in b:
            return None
        return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))

    tolerance = None
    if drift(yard, single) is not None:
        tolerance = max(2 * drift(yard, single), 0.01)
    for r in rows:
        r["vs_single_ours"] = drift(r, single)
        if r["cp"] and r["vs_single_ours"] is not None and tolerance is not None:
            r["loss_tolerance"] = tolerance
            r["loss_equal"] = r["vs_single_ours"] <= tolerance
    ours_cp = by.get(("ours", True), {})
    for r in rows:
        if r["cp"] and r is not ours_cp and "tokens_per_s_per_gpu" in r \
                and "tokens_per_s_per_gpu" in ours_cp:
            r["ours_over_this"] = ours_cp["tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"]
    return rows


# ---------------------------------------------------------------------------------------------

def print_tables(rows: list) -> None:
    print("attention (bf16; max |x - float32 reference|; bound = 2x/3x PyTorch's + 1 ulp)")
    for r in (r for r in rows if r["part"] == "attention"):
        head = f"L={r['L']:6d} causal={r['causal']!s:5s} {r.get('what', ''):3s}"
        if "error" in r:
            print(f"{head} ERROR {r['error']}")
            continue
        print(f"{head} cp {r['err_cp']:.3e}  single {r['err_single']:.3e}  "
              f"pytorch {r['err_pytorch']:.3e}  bound {r['bound']:.3e}  "
              f"|cp-single| {r['cp_vs_single']:.3e}  {'ok' if r['ok'] else 'FAIL'}  "
              f"gqa {r['gqa']}  ours_calls {r['ours_calls']}")
    print("training (loss per step; tokens/s per GPU: median after warm-up)")
    for r in (r for r in rows if r["part"] == "training"):
        run = f"cp x{WORLD}" if r["cp"] else "single"
        head = f"{r['impl']:6s} {run:6s} L={r['L']:6d}"
        if "error" in r:
            print(f"{head} ERROR {r['error']}")
            continue
        line = (f"{head} step {r['step_ms']:9.1f} ms  {r['tokens_per_s_per_gpu']:9.0f} "
                f"tokens/s/GPU  losses " + " ".join(f"{x:.4f}" for x in r["losses"]))
        if r.get("vs_single_ours") is not None:
            line += f"  max|vs single ours| {r['vs_single_ours']:.2e}"
        if "loss_equal" in r:
            line += (f" (tolerance {r['loss_tolerance']:.4f}: "
                     f"{'equal' if r['loss_equal'] else 'DIFFERENT'})")
        if "ours_over_this" in r:
            line += f"  ours/this {r['ours_over_this']:.3f}x"
        print(line + f"  gqa {r['gqa']}  ours_calls {r['ours_calls']}")


def _worker(rank: int, args, port: int, path: str) -> None:
    device = args.device
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(minutes=10))
    try:
        if device == "cpu":
            torch.set_num_threads(1)
        import flash_attn_ext  # noqa: F401 (registers the provider "flash_attn_ext")
        count_our_calls()
        from torch.distributed.device_mesh import init_device_mesh
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        mesh = init_device_mesh(device, (WORLD,))
        cp_api()[2](args.rotate)
        register_attention()
        rows = attention_rows(rank, mesh, args, device)
        rows += training_rows(rank, mesh, args, device)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(dict(meta=args.meta, rows=rows), f, indent=1)
            print_tables(rows)
            print(f"wrote {path}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seqlens", type=int, nargs="+")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather")
    parser.add_argument("--train-seqlen", type=int)
    parser.add_argument("--train-steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tiny", action="store_true", help="bench_training's 2-layer model")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--out-dir", default="build")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    # (CPU: shapes a 2-core machine runs in seconds; 48 = 4 * 12 for head-tail balancing)
    args.seqlens = args.seqlens or ([48] if cpu else [32768, 65536, 131072])
    args.head_dim = args.head_dim or (32 if cpu else 128)
    args.train_seqlen = args.train_seqlen or (64 if cpu else 32768)
    args.tiny = args.tiny or cpu
    if args.impls[0] != "ours":
        parser.error("--impls: ours comes first (the others are compared with it)")
    for n in args.seqlens + [args.train_seqlen]:
        if n % (2 * WORLD):
            parser.error(f"sequence length {n}: a multiple of {2 * WORLD} (equal shards of "
                         "two head-tail chunks each)")
    if not cpu and torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs, found {torch.cuda.device_count()} (--device cpu: the "
              "CPU mode)")
        return 2
    cp_api()  # (fails here, once, where this torch lacks what the script uses)
    commit = os.environ.get("FLASH_ATTN_EXT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        check=False).stdout.strip() or "unknown"
    args.meta = dict(vars(args), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                     world=WORLD, torch=torch.__version__, commit=commit,
                     gpu=None if cpu else torch.cuda.get_device_name())
    del args.meta["out_dir"]
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"context_parallel_{datetime.date.today():%Y%m%d}_"
                        f"{commit}{'_cpu' if cpu else ''}.json")
    mp.spawn(_worker, args=(args, _free_port(), path), nprocs=WORLD)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
