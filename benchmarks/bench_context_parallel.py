"""Context parallelism on two GPUs (issue 28): PyTorch's own context parallelism
(``torch.distributed.tensor.experimental.context_parallel``: sequence-sharded q/k/v, a ring of
flash attention calls merged by their log-sum-exps, head-tail load balancing when causal) with
our kernels as PyTorch's flash attention (``activate_flash_attention_impl("flash_attn_ext")``),
against a single-GPU run of our kernels and PyTorch's own kernels under the same context
parallelism, in one call.

STATUS: the CUDA path (the default, ``--device cuda``, two spawned NCCL processes) has NOT yet
run on two GPUs: no two-GPU machine has been available.  Nothing below about CUDA (the NCCL
timeout, PyTorch's FLASH and cuDNN under CP, the GPU timings, the version fields) has been
seen working.  What has run is ``--device cpu`` (two gloo processes, tiny shapes, our CPU
kernels registered for the aten flash ops under the CPU key), which exercises the same code
except the backend choice (below) and PyTorch's kernels under CP; ``tests/test_benchmarks.py``
runs it, and also a call whose --budget-s skips everything and whose rank 0 then dies without
a last write, and one that the parent's --deadline-s cuts.  Only the public
``context_parallel(mesh, buffers=..., buffer_seq_dims=..., no_restore_buffers=...)`` shards the
training batch and the attention inputs; ``context_parallel_unshard`` and ``set_rotate_method``
come from the experimental module, and the private ``_cp_options.enable_load_balance`` is needed
for not-causal attention (PyTorch's ring refuses load balancing without ``is_causal``): a torch
without them stops with an error naming what is missing.

The one device call (2 x H200, 10 minutes including the ~3-4 minute build; ``dev/gpu/gpu_cp.sh``
does exactly this, with the CUTLASS wheel carried in .whl/ as gpu_env.sh describes):

    export PYTHONPATH=$PWD FLASH_ATTN_EXT_COMMIT=<sha> PYTHONUNBUFFERED=1
    FLASH_ATTN_EXT_CUDA=1 MAX_JOBS=32 python setup.py -q build_ext --inplace
    python benchmarks/bench_context_parallel.py --out-dir $OUT --budget-s $((540 - SECONDS)) \\
        2>&1 | tee $OUT/cp.log

Order (what a call cut short still has): attention at the smallest --seqlens (causal, then
not), then training, then attention at the longer lengths.  Rank 0 prints every row as it is
made and rewrites ``context_parallel_<date>_<commit>.json`` in --out-dir (default $OUT, else
build) after every row; ``meta.complete`` is true only when the call got to its end, and
``meta.ended`` says how it ended otherwise.

1. attention: bf16, (1, 16, L, 128) q, (1, 8, L, 128) k and v (GQA), causal (head-tail load
   balancing) and not, L in --seqlens (default 32k, 64k, 128k), --rotate method.  One
   "attention_run" row per run: under CP (every --impls; on the CPU ours only) and on one GPU
   (rank 0 alone, while the other rank waits: ours, PyTorch's FLASH, and cuDNN where listed),
   each with its GQA mode, its calls into our impls per rank and whether they are the expected
   ones (every ring step of ours: WORLD forwards and backwards per rank; one of each on one
   GPU; none in PyTorch's runs), the active flash impl
   (``torch.nn.attention.current_flash_attention_impl()``), and its time in ms (fwd + bwd, the
   median of --attn-reps calls after the checked one; under CP the slower rank's, including
   the sharding and the unsharding all-gather).  Then, per out / dq / dk / dv, ours under CP
   (unsharded, load balancing undone) and ours on one GPU against a float32 reference
   (PyTorch's memory-efficient kernel in float32 on CUDA, its math kernel on the CPU; k and v
   expanded to the query heads), where "pytorch" is PyTorch's FLASH kernel on one GPU in bf16
   (on the CPU, its CPU bf16 kernel):
     rel:   ||x - ref|| / ||ref|| <= 2 (out) / 3 (dq, dk, dv) x rel(pytorch), no slack;
     max:   max |x - ref| <= the same factor x max |pytorch - ref| + one ulp of max |ref|
            (the earlier rule; the ulp alone can exceed PyTorch's whole error of causal out,
            whose first rows are large, so it no longer decides alone);
     cp-single: max |cp - single| <= K_CP_SINGLE (4) x max |single - ref|: each of the two
            is a few bf16 roundings off the reference, so their difference is at most the
            sum of both errors, about twice the single run's;
   ok when all three hold for both.  The rows print the ratios rel(x) / rel(pytorch) and
   max(x) / max(pytorch), and rel of the peers (PyTorch's FLASH and cuDNN under CP, cuDNN on
   one GPU) next to ours.
2. training: the model of bench_training.py (Llama-style, random weights, 8 layers, hidden 2048,
   16 / 8 heads of dim 128; ``--tiny``: 2 layers, hidden 256), built once per process and
   reloaded from its saved state_dict before every run (identical weights), one batch of
   --train-seqlen tokens, --train-steps AdamW steps (lr --lr), the causal-LM loss as a token
   mean over the whole sequence (labels shifted before sharding; each rank's cross-entropy sum
   divided by the global token count; parameter gradients all-reduced over the CP group in
   float32, in one flat buffer).  Attention through a transformers attention function that
   calls F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) with no mask
   (transformers' masks would see the load-balanced positions as packed sequences), position
   ids sharded with the batch.  Runs: our kernels and PyTorch's FLASH on one GPU (rank 0
   alone), then under CP our kernels, PyTorch's FLASH and cuDNN.  The CP curve of ours
   "equals" the single-GPU one when max_step |CP - single| <= tolerance = max(2 x drift(FLASH
   under CP, FLASH on one GPU), 2 x drift(FLASH on one GPU, ours on one GPU), 0.01), drift
   being the largest per-step loss difference of two runs: how far CP alone, and two exact
   kernels alone, move a bf16 curve.  On the CPU only ours runs under CP, so the first term is
   absent and the rule is max(2 x drift(SDPA's CPU kernel, ours), 0.01) in float32, where both
   drifts are ~1e-6: the floor decides.
3. speed: tokens/s per GPU of each CP training run (the median of the steps after
   --warmup), ours / each of PyTorch's kernels, in the same processes.

Time and failures.  --budget-s: before each attention point and training run, rank 0 decides
whether it fits (elapsed + the last comparable one's time, scaled by L^2 for attention) and
broadcasts the decision, so that every rank skips alike; a skipped one is a row with
``"skipped": "budget"``.  --deadline-s (default: the budget + 45 s): the parent terminates the
ranks past it and marks the JSON.  NCCL's timeout is 3 minutes (a hung collective costs that,
not the call); the waits while rank 0 computes alone, and the per-row decisions, go over a
separate gloo group with an 8-minute timeout.  After every run the ranks exchange their
outcomes (over gloo) before going on, so a refusal on one rank (with load balancing the ranks
pass different shapes after ring step 0) is recorded on both instead of leaving one in a
collective; a refusal that leaves the other rank inside a ring collective still ends at the
NCCL timeout.  Where a kernel refuses native GQA ("No available kernel", or a message about GQA
or head counts) on any rank, every rank retries with k and v expanded to the query heads, and
the row says so.  Out of memory, CUDA and NCCL errors (and gloo's, and a broken communicator)
end the process at once: traceback, the JSON flushed, ``os._exit(1)`` (tearing down a process
group can block).  Any other failure is recorded in its row and the call goes on.

On the CPU, SDPA picks ``aten._scaled_dot_product_flash_attention_for_cpu``, which DTensor
cannot shard, so "ours" calls ``aten._scaled_dot_product_flash_attention`` through a stand-in
for F.scaled_dot_product_attention (installed before CP patches it); PyTorch's FLASH and cuDNN
have no CPU kernels for that op, so the CPU mode runs "ours" only under CP.

Usage: python benchmarks/bench_context_parallel.py [--seqlens 32768 65536 131072]
       [--train-seqlen 32768] [--train-steps 8] [--warmup 3] [--impls ours flash cudnn]
       [--rotate allgather|alltoall] [--tiny] [--attn-reps 3] [--out-dir $OUT]
       [--budget-s S] [--deadline-s S]
       python benchmarks/bench_context_parallel.py --device cpu   (tiny shapes, gloo, about
       ten seconds: the bookkeeping and correctness path on a CPU; its timings mean nothing)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
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
NCCL_TIMEOUT = datetime.timedelta(minutes=3)  # a hung collective costs this, not the call
WAIT_TIMEOUT = datetime.timedelta(minutes=8)  # rank 0 computing the references alone
FACTOR = {"out": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}  # x PyTorch's own error
K_CP_SINGLE = 4.0  # max |cp - single| <= K x max |single - ref| (the docstring says why)
LOSS_FLOOR = 0.01
# The refusals that expanding k and v to the query heads can cure.
GQA_REFUSAL = re.compile(r"no available kernel|gqa|heads|head count", re.IGNORECASE)
# Errors a process cannot go on after (besides the exception types in fatal()).
FATAL_MESSAGES = ("CUDA error", "NCCL", "illegal memory access", "Connection closed by peer")

# This process's rank, rank 0's Record (None elsewhere), the gloo group for waits and decisions.
STATE: dict = {"rank": 0, "record": None, "wait": None}


# ---------------------------------------------------------------------------------------------
# Failures, decisions across ranks, rank 0's record

def fatal(e: BaseException) -> bool:
    """Whether this process must stop at once: out of memory (longer lengths follow, and what
    was freed is unknown), a CUDA error (the context is broken), a communicator error (the
    other rank is gone or stuck)."""
    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None),
                              getattr(torch, "AcceleratorError", None),
                              getattr(dist, "DistBackendError", None)) if k)
    return isinstance(e, kinds) or any(m in str(e) for m in FATAL_MESSAGES)


def die(e: BaseException) -> None:
    """Traceback, rank 0's JSON flushed with the cause, and out at once: destroying a process
    group can block on a collective the other rank never joins."""
    traceback.print_exception(type(e), e, e.__traceback__)
    note = f"rank {STATE['rank']}: {type(e).__name__}: {e}"[:300]
    print(f"bench_context_parallel: {note}: exiting at once", file=sys.stderr, flush=True)
    record = STATE["record"]
    if record is not None:
        record.meta["ended"].append(note)
        with contextlib.suppress(Exception):
            record.flush()
    sys.stdout.flush()
    os._exit(1)


def failure(e: Exception) -> str:
    """A row's error text; dies where the process cannot go on."""
    if fatal(e):
        die(e)
    traceback.print_exception(type(e), e, e.__traceback__)
    return f"{type(e).__name__}: {e}"[:300]


def gather(obj) -> list:
    """Every rank's obj on every rank, over the gloo group: decisions never ride on NCCL,
    whose communicator a failed run may have left unusable."""
    out = [None] * WORLD
    dist.all_gather_object(out, obj, group=STATE["wait"])
    return out


def broadcast(obj):
    """Rank 0's obj on every rank (over gloo)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=STATE["wait"])
    return box[0]


def barrier() -> None:
    """The other ranks wait here while rank 0 computes alone (gloo, WAIT_TIMEOUT)."""
    dist.barrier(group=STATE["wait"])


class Record:
    """Rank 0's rows: each printed as made and the JSON rewritten after it (atomically), so a
    call cut short leaves everything done so far."""

    def __init__(self, path: str, meta: dict, fail_after):
        self.path, self.meta, self.rows, self.fail_after = path, meta, [], fail_after
        self.flush()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(format_row(row), flush=True)
        self.flush()
        if self.fail_after is not None and len(self.rows) >= self.fail_after:
            # (--fail-after-rows, for the tests: rank 0 gone as a killed process would be, with
            # no last write; the rows so far must already be in the JSON)
            print(f"rank 0: exiting after {len(self.rows)} rows (--fail-after-rows)",
                  flush=True)
            os._exit(1)

    def flush(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(meta=self.meta, rows=self.rows), f, indent=1, default=str)
        os.replace(tmp, self.path)


def record(row: dict) -> None:
    if STATE["record"] is not None:
        STATE["record"].add(row)


class Clock:
    """--budget-s: rank 0 decides before each attention point and training run whether it fits
    (elapsed + the last comparable one's time, attention scaled by L^2); broadcast so that every
    rank skips alike, and recorded as a row when skipped."""

    def __init__(self, args):
        self.t0, self.budget = args.t0, args.budget_s
        self.took: dict = {}  # kind -> (L, seconds): the longest at the largest L so far

    def go(self, row: dict, kind: str, seqlen: int, collective: bool = True) -> bool:
        decision = None
        if STATE["rank"] == 0:
            elapsed = time.time() - self.t0
            done_l, seconds = self.took.get(kind, (seqlen, 0.0))
            estimate = seconds * (seqlen / done_l) ** 2 if kind == "attention" else seconds
            fits = self.budget is None or elapsed + estimate <= self.budget
            decision = (fits, round(elapsed, 1), round(estimate, 1))
        if collective:
            decision = broadcast(decision)
        fits, elapsed, estimate = decision
        if not fits:
            record(dict(row, skipped="budget", elapsed_s=elapsed, estimate_s=estimate,
                        budget_s=self.budget))
        return fits

    def done(self, kind: str, seqlen: int, seconds: float) -> None:
        done_l, longest = self.took.get(kind, (seqlen, 0.0))
        self.took[kind] = (seqlen, max(seconds, longest if done_l == seqlen else 0.0))


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


def current_impl():
    """The flash impl PyTorch's FLASH backend dispatches to now (None: PyTorch's own), or "n/a"
    where this torch has no registry; stored in every run's row as a check on backend()."""
    get = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return get() if get is not None else "n/a"


def sdpa(q, k, v, causal: bool, repeat_kv: bool, scale=None):
    """F.scaled_dot_product_attention on (B, H, L, D) q and (B, H_kv, S, D) k, v: GQA native
    (enable_gqa) or with k, v expanded to the query heads."""
    group = q.shape[1] // k.shape[1]
    if repeat_kv and group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=group > 1 and not repeat_kv)


def with_gqa_fallback(fn, row: dict, restart=None, collective: bool = False):
    """fn(repeat_kv) with native GQA; where a kernel refuses it (GQA_REFUSAL) on any rank, again
    with k and v expanded on every rank (noted in row["gqa"]; ``restart`` resets the call
    count so that the refused attempt is not counted).  Fatal errors are raised at once.  With
    ``collective`` (under CP) the ranks exchange their outcomes after each attempt, so that all
    retry, or all raise, alike."""
    def attempt(repeat_kv: bool):
        try:
            return fn(repeat_kv), None
        except Exception as e:  # (outcome exchanged below; fatal ones raised at once)
            if fatal(e):
                raise
            return None, e

    def outcomes(error):
        text = None if error is None else f"{type(error).__name__}: {error}"
        return gather(text) if collective else [text]

    def raise_first(error, texts):
        if error is not None:
            raise error
        rank, text = next((i, t) for i, t in enumerate(texts) if t)
        raise RuntimeError(f"rank {rank} failed: {text}"[:300])

    result, error = attempt(False)
    texts = outcomes(error)
    if not any(texts):
        row["gqa"] = "native"
        return result
    if not all(GQA_REFUSAL.search(t) for t in texts if t):
        raise_first(error, texts)
    refusal = next(t for t in texts if t)
    row["gqa"] = f"repeat_kv (native: {refusal.splitlines()[0][:160]})"
    result = error = None
    if restart is not None:
        restart()
    result, error = attempt(True)
    texts = outcomes(error)
    if any(texts):
        raise_first(error, texts)
    return result


CALLS = {"fwd": 0, "bwd": 0}


def count_our_calls() -> None:
    """Counts the calls into our impls of the aten flash ops (wrapped before anything registers
    them; counted when they return, so a refused call does not count): each run's row shows per
    rank which calls our kernels served (every ring step of ours, none of PyTorch's)."""
    from flash_attn_ext.integrations import torch_flash

    def wrap(name: str, kind: str) -> None:
        impl = getattr(torch_flash, name)

        def counting(*args, **kwargs):
            result = impl(*args, **kwargs)
            CALLS[kind] += 1
            return result
        setattr(torch_flash, name, counting)

    for name in ("_sdpa_forward", "_flash_forward", "_flash_forward_inplace"):
        wrap(name, "fwd")
    for name in ("_sdpa_backward", "_flash_backward"):
        wrap(name, "bwd")


@contextlib.contextmanager
def counted(row: dict):
    """Puts this process's calls into our impls while active in row["ours_calls"] ([fwd, bwd]);
    yields a function that restarts the count (after a refused attempt)."""
    start = dict(CALLS)
    try:
        yield lambda: start.update(CALLS)
    finally:
        row["ours_calls"] = [CALLS["fwd"] - start["fwd"], CALLS["bwd"] - start["bwd"]]


def settle(row: dict, error, expected_calls: list, collective: bool) -> bool:
    """After a run: every rank's error, calls into our impls and time gathered (over gloo) so
    that all ranks go on alike; rank 0 records the row, flagging calls that differ from the
    expectation.  True where every rank succeeded."""
    mine = dict(error=error, calls=row.get("ours_calls"), ms=row.get("ms"))
    ranks = gather(mine) if collective else [mine]
    errors = [f"rank {i}: {r['error']}" if collective else r["error"]
              for i, r in enumerate(ranks) if r["error"]]
    row["ours_calls"] = [r["calls"] for r in ranks]
    row["calls_expected"] = expected_calls
    if errors:
        row["error"] = "; ".join(errors)[:600]
    else:
        row["calls_ok"] = row["ours_calls"] == expected_calls
        if row.get("ms") is not None:
            row["ms_per_rank"] = [r["ms"] for r in ranks]
            row["ms"] = max(row["ms_per_rank"])  # (the slower rank bounds the step)
    record(row)
    return not errors


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def timed_ms(fn, reps: int, device: str) -> float:
    """Median ms of ``reps`` calls of fn.  No barrier between them: under CP the ring's own
    collectives keep the ranks together, and a barrier on gloo after a one-sided failure would
    pair with the other rank's outcome exchange."""
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||: the error of the whole tensor, which no few large entries (causal
    out's first rows) can hide behind."""
    ref = ref.float()
    return (torch.linalg.vector_norm(x.float() - ref) / torch.linalg.vector_norm(ref)).item()


def ratio(a: float, b: float):
    return a / b if b else None


def attention_point(mesh, args, device, clock: Clock, seqlen: int, causal: bool) -> None:
    """One (L, causal) point on every rank: the CP runs, then rank 0 alone compares."""
    point = dict(part="attention", L=seqlen, causal=causal, rotate=args.rotate)
    if not clock.go(point, "attention", seqlen):
        return
    start = time.time()
    inputs = make_inputs(seqlen, args.heads, args.heads_kv, args.head_dim, torch.bfloat16,
                         device)
    cp_results = {}
    for impl in args.cp_impls:
        result = attention_run(
            args, device, point, impl,
            lambda r: cp_attention_grads(mesh, inputs, point["causal"], r), mesh)
        if result is not None and STATE["rank"] == 0:
            cp_results[impl] = result
        result = None
        free(device)
    if STATE["rank"] == 0:
        try:  # (apart from the CP runs: a failure here is rank 0's alone)
            compare(point, inputs, cp_results, args, device)
        except Exception as e:  # (recorded; the call goes on)
            record(dict(point, error=failure(e)))
    cp_results = inputs = None
    free(device)
    barrier()
    clock.done("attention", seqlen, time.time() - start)


def attention_run(args, device, point: dict, impl: str, grads, mesh=None):
    """One implementation's attention, forward and backward, timed: under CP on every rank
    (``mesh``; its row recorded by rank 0), or on rank 0's GPU alone (``mesh`` None).
    ``grads(repeat_kv)`` returns (out, dq, dk, dv) (unsharded under CP); returned where every
    rank that ran succeeded, else None."""
    cp = mesh is not None
    row = dict(point, part="attention_run", impl=impl, cp=cp, gpus=WORLD if cp else 1)
    result, error = None, None
    try:
        with backend(impl, device):
            with counted(row) as restart:
                row["flash_impl"] = current_impl()
                result = with_gqa_fallback(grads, row, restart, collective=cp)
                sync(device)
            repeat = row["gqa"] != "native"
            row["ms"] = timed_ms(lambda: grads(repeat), args.attn_reps, device)
    except Exception as e:  # (recorded; under CP on every rank's behalf by settle)
        error = failure(e)
    # Our impls' calls per rank: a ring step each (WORLD) under CP, one alone; PyTorch's none.
    calls = (WORLD if cp else 1) if impl == "ours" else 0
    ok = settle(row, error, [[calls, calls]] * (WORLD if cp else 1), collective=cp)
    return result if ok else None


def compare(point: dict, inputs, cp_results: dict, args, device) -> None:
    """Rank 0 alone: the single-GPU runs, the float32 reference, and per out / dq / dk / dv the
    criteria rows of ours under CP and on one GPU (the docstring's rules)."""
    singles = {}
    for impl in args.single_impls:
        result = attention_run(args, device, point, impl,
                               lambda r: attention_grads(inputs, point["causal"], r))
        if result is not None:
            singles[impl] = result
        result = None
        free(device)
    missing = [name for name, got in (("ours under CP", cp_results.get("ours")),
                                      ("ours on one GPU", singles.get("ours")),
                                      ("PyTorch's FLASH on one GPU", singles.get("flash")))
               if got is None]
    if missing:
        record(dict(point, error=f"no criteria: no result of {', '.join(missing)}"))
        return
    with backend("reference", device):
        ref = attention_grads(inputs, point["causal"], True, torch.float32)
    cp, single, pytorch = cp_results["ours"], singles["ours"], singles["flash"]
    peers = {f"cp {impl}": res for impl, res in cp_results.items() if impl != "ours"}
    peers.update({f"single {impl}": res for impl, res in singles.items()
                  if impl not in ("ours", "flash")})
    eps = torch.finfo(torch.bfloat16).eps
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        factor = FACTOR[what]
        err = {name: max_abs(x[i], ref[i])
               for name, x in (("cp", cp), ("single", single), ("pytorch", pytorch))}
        rel = {name: rel_l2(x[i], ref[i])
               for name, x in (("cp", cp), ("single", single), ("pytorch", pytorch))}
        bound = factor * err["pytorch"] + eps * ref[i].abs().max().item()
        rel_bound = factor * rel["pytorch"]
        cp_vs_single = max_abs(cp[i], single[i])
        cp_single_bound = K_CP_SINGLE * err["single"]
        checks = dict(
            ok_rel=rel["cp"] <= rel_bound and rel["single"] <= rel_bound,
            ok_max=err["cp"] <= bound and err["single"] <= bound,
            ok_cp_single=cp_vs_single <= cp_single_bound)
        record(dict(point, what=what,
                    err_cp=err["cp"], err_single=err["single"], err_pytorch=err["pytorch"],
                    bound=bound, max_ratio_cp=ratio(err["cp"], err["pytorch"]),
                    max_ratio_single=ratio(err["single"], err["pytorch"]),
                    rel_cp=rel["cp"], rel_single=rel["single"], rel_pytorch=rel["pytorch"],
                    rel_bound=rel_bound, rel_ratio_cp=ratio(rel["cp"], rel["pytorch"]),
                    rel_ratio_single=ratio(rel["single"], rel["pytorch"]),
                    cp_vs_single=cp_vs_single, cp_vs_single_bound=cp_single_bound,
                    k_cp_single=K_CP_SINGLE,
                    rel_peers={name: rel_l2(x[i], ref[i]) for name, x in peers.items()},
                    **checks, ok=all(checks.values())))


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


def all_reduce_grads(model) -> None:
    """Sums the parameter gradients over the CP group in float32, in one flat buffer: one
    collective, and no bf16 rounding of the sum."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def train_run(row: dict, impl: str, use_cp: bool, mesh, args, device, model, cfg) -> None:
    """--train-steps AdamW steps of ``model`` on one batch, under CP over ``mesh`` or on this
    rank alone; fills ``row``: losses (the token mean over the whole sequence), median step
    time, tokens/s per GPU."""
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
            all_reduce_grads(model)
            dist.all_reduce(total)
        opt.step()
        return total.item() / n_tokens

    losses, times = [], []
    context_parallel = cp_api()[0]
    with backend(impl, device), load_balance(True), counted(row) as restart:
        row["flash_impl"] = current_impl()
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
                    losses.append(with_gqa_fallback(first, row, restart, collective=use_cp)
                                  if i == 0 else step())
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


def drift(a, b):
    """The largest per-step loss difference of two runs (None where either has no curve)."""
    if not a or not b or "losses" not in a or "losses" not in b:
        return None
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def training_part(mesh, args, device, clock: Clock) -> None:
    """Parts 2 and 3: the single-GPU runs on rank 0 while the others wait, then each
    implementation under CP on all ranks; then rank 0's loss and speed verdicts."""
    import bench_training
    built: dict = {}

    def model_and_config():
        """The model, built once per process at the first run that needs it (skipped runs
        build nothing), reloaded from its saved state_dict: every run starts from the same
        weights."""
        if not built:
            dtype = torch.float32 if device == "cpu" else torch.bfloat16
            model, cfg = bench_training.make_model(ATTN_NAME, args.tiny, device, dtype)
            built.update(model=model, cfg=cfg, state={k: v.detach().clone()
                                                      for k, v in model.state_dict().items()})
        built["model"].load_state_dict(built["state"])
        return built["model"], built["cfg"]

    def run(impl: str, use_cp: bool):
        row = dict(part="training", impl=impl, cp=use_cp, L=args.train_seqlen,
                   gpus=WORLD if use_cp else 1)
        if not clock.go(row, "training", args.train_seqlen, collective=use_cp):
            return None
        start, error = time.time(), None
        try:
            train_run(row, impl, use_cp, mesh, args, device, *model_and_config())
        except Exception as e:  # (recorded; the call goes on)
            error = failure(e)
        layers = built["cfg"].num_hidden_layers if built else 0
        calls = layers * args.train_steps * (WORLD if use_cp else 1) if impl == "ours" else 0
        settle(row, error, [[calls, calls]] * (WORLD if use_cp else 1), collective=use_cp)
        free(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        clock.done("training", args.train_seqlen, time.time() - start)
        return row

    rows = []
    if STATE["rank"] == 0:
        rows += [run("ours", False), run("flash", False)]
    barrier()
    for impl in args.cp_impls:
        rows.append(run(impl, True))
    built.clear()
    free(device)
    if STATE["rank"] == 0:
        loss_verdicts([r for r in rows if r is not None])


def loss_verdicts(rows: list) -> None:
    """Rank 0: each CP run's loss curve against ours on one GPU, by the docstring's tolerance,
    and ours' tokens/s per GPU over each peer's; added to the CP rows (the JSON rewritten)."""
    by = {(r["impl"], r["cp"]): r for r in rows if "error" not in r and "losses" in r}
    terms = {}
    for name, a, b in (("2 x drift(flash cp, flash single)", ("flash", True), ("flash", False)),
                       ("2 x drift(flash single, ours single)", ("flash", False),
                        ("ours", False))):
        d = drift(by.get(a), by.get(b))
        if d is not None:
            terms[name] = 2 * d
    terms["floor"] = LOSS_FLOOR
    tolerance = max(terms.values())
    single, ours_cp = by.get(("ours", False)), by.get(("ours", True))
    for (impl, use_cp), r in by.items():
        if not use_cp:
            continue
        if single is not None:
            r.update(vs_single_ours=drift(r, single), loss_tolerance=tolerance,
                     tolerance_terms=terms)
            r["loss_equal"] = r["vs_single_ours"] <= tolerance
        if impl != "ours" and ours_cp is not None:
            r["ours_over_this"] = ours_cp["tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"]
        print(format_row(r), flush=True)
    if STATE["record"] is not None:
        STATE["record"].flush()


# ---------------------------------------------------------------------------------------------
# Rows as text

def _num(x, fmt: str = ".2e") -> str:
    return "-" if x is None else format(x, fmt)


def format_row(r: dict) -> str:
    part = r["part"]
    if part == "attention_run":
        run = f"cp x{r['gpus']}" if r["cp"] else "single"
        head = f"attention L={r['L']:6d} causal={r['causal']!s:5s} {run:6s} {r['impl']:5s}"
    elif part == "attention":
        head = f"attention L={r['L']:6d} causal={r['causal']!s:5s} {r.get('what', ''):3s}"
    else:
        run = f"cp x{r.get('gpus', WORLD)}" if r["cp"] else "single"
        head = f"training {r['impl']:6s} {run:6s} L={r['L']:6d}"
    if "skipped" in r:
        return (f"{head} skipped ({r['skipped']}: {r['elapsed_s']} s elapsed + "
                f"{r['estimate_s']} s estimated > {r['budget_s']} s)")
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    if part == "attention_run":
        flag = "" if r["calls_ok"] else f" CALLS (expected {r['calls_expected']})"
        return (f"{head} {r['ms']:9.2f} ms  gqa {r['gqa']}  ours_calls {r['ours_calls']}"
                f"{flag}  flash_impl {r['flash_impl']}")
    if part == "attention":
        peers = "  ".join(f"{k} {_num(v)}" for k, v in r["rel_peers"].items())
        return (f"{head} rel: cp {_num(r['rel_cp'])} ({_num(r['rel_ratio_cp'], '.2f')}x) "
                f"single {_num(r['rel_single'])} ({_num(r['rel_ratio_single'], '.2f')}x) "
                f"pytorch {_num(r['rel_pytorch'])} bound {_num(r['rel_bound'])}"
                f"{'' if r['ok_rel'] else ' FAIL'} | max: cp {_num(r['err_cp'])} "
                f"({_num(r['max_ratio_cp'], '.2f')}x) single {_num(r['err_single'])} "
                f"({_num(r['max_ratio_single'], '.2f')}x) pytorch {_num(r['err_pytorch'])} "
                f"bound {_num(r['bound'])}{'' if r['ok_max'] else ' FAIL'} | |cp-single| "
                f"{_num(r['cp_vs_single'])} <= {r['k_cp_single']:g}x single "
                f"{'' if r['ok_cp_single'] else 'FAIL '}| {'ok' if r['ok'] else 'FAIL'}"
                + (f" | rel peers: {peers}" if peers else ""))
    line = (f"{head} step {r['step_ms']:9.1f} ms  {r['tokens_per_s_per_gpu']:9.0f} "
            f"tokens/s/GPU  losses " + " ".join(f"{x:.4f}" for x in r["losses"]))
    if r.get("vs_single_ours") is not None:
        line += f"  max|vs single ours| {r['vs_single_ours']:.2e}"
    if "loss_equal" in r:
        line += (f" (tolerance {r['loss_tolerance']:.4f}: "
                 f"{'equal' if r['loss_equal'] else 'DIFFERENT'})")
    if "ours_over_this" in r:
        line += f"  ours/this {r['ours_over_this']:.3f}x"
    flag = "" if r["calls_ok"] else f" CALLS (expected {r['calls_expected']})"
    return line + f"  gqa {r['gqa']}  ours_calls {r['ours_calls']}{flag}"


def print_tables(rows: list) -> None:
    print("summary; attention: rel = ||x - ref|| / ||ref||, max = max |x - ref| (float32 "
          "reference), (..x) = over PyTorch's FLASH on one GPU; training: loss per step, "
          "tokens/s per GPU (median after warm-up)")
    for r in rows:
        print(format_row(r))


# ---------------------------------------------------------------------------------------------

def _worker(rank: int, args, port: int, path: str) -> None:
    STATE["rank"] = rank
    device = args.device
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank,
                                world_size=WORLD, timeout=NCCL_TIMEOUT)
        STATE["wait"] = dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT)
        if device == "cpu":
            torch.set_num_threads(1)
        import flash_attn_ext  # noqa: F401 (registers the provider "flash_attn_ext")
        count_our_calls()
        from torch.distributed.device_mesh import init_device_mesh
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        mesh = init_device_mesh(device, (WORLD,))
        cp_api()[2](args.rotate)
        register_attention()
        if rank == 0:
            STATE["record"] = Record(path, dict(args.meta), args.fail_after_rows)
        clock = Clock(args)
        seqlens = sorted(args.seqlens)

        def part(name: str, run) -> None:
            start = time.time()
            run()
            if STATE["record"] is not None:
                STATE["record"].meta["wall_s"][name] = round(time.time() - start, 1)
                STATE["record"].flush()

        def attention(seqlen: int) -> None:
            for causal in (True, False):
                attention_point(mesh, args, device, clock, seqlen, causal)

        part(f"attention L={seqlens[0]}", lambda: attention(seqlens[0]))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        part("training", lambda: training_part(mesh, args, device, clock))
        for seqlen in seqlens[1:]:
            part(f"attention L={seqlen}", lambda n=seqlen: attention(n))
        record_ = STATE["record"]
        if record_ is not None:
            record_.meta["complete"] = True
            record_.flush()
            print_tables(record_.rows)
            print(f"wrote {path}", flush=True)
        barrier()
    except BaseException as e:  # (anything escaping: out at once, never a blocking teardown)
        die(e)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commit() -> str:
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False).stdout.strip()
    except OSError:  # (no git on the machine)
        git = ""
    return os.environ.get("FLASH_ATTN_EXT_COMMIT") or git or "unknown"


def _versions(cpu: bool) -> dict:
    """What the numbers depend on: torch, CUDA, cuDNN, NCCL, transformers, our build."""
    from flash_attn_ext import ops
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    nccl = None
    if not cpu:
        with contextlib.suppress(Exception):
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    return dict(torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), nccl=nccl,
                transformers=transformers_version, flash_attn_ext=ops.build_info())


def _mark_ended(path: str, meta: dict, note: str) -> None:
    """The parent's word on a call that did not end by itself, added to the JSON rank 0 left
    (or to an empty one where it left none)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = dict(meta=meta, rows=[])
    data["meta"].setdefault("ended", []).append(note)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def _stop(ctx) -> None:
    """Terminates the ranks still alive (SIGTERM, then SIGKILL after 10 s)."""
    for process in ctx.processes:
        if process.is_alive():
            process.terminate()
    for process in ctx.processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def main() -> int:
    t0 = time.time()
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
    parser.add_argument("--attn-reps", type=int,
                        help="timed attention calls per run (default 3; CPU 1)")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "build"))
    parser.add_argument("--budget-s", type=float,
                        help="seconds from the start: nothing starts that would not fit")
    parser.add_argument("--deadline-s", type=float,
                        help="seconds from the start: the ranks are stopped (default: the "
                             "budget + 45)")
    parser.add_argument("--fail-after-rows", type=int, help=argparse.SUPPRESS)  # (the tests)
    args = parser.parse_args()
    args.t0 = t0
    cpu = args.device == "cpu"
    # (CPU: shapes a 2-core machine runs in seconds; 48 = 4 * 12 for head-tail balancing)
    args.seqlens = args.seqlens or ([48] if cpu else [32768, 65536, 131072])
    args.head_dim = args.head_dim or (32 if cpu else 128)
    args.train_seqlen = args.train_seqlen or (64 if cpu else 32768)
    args.tiny = args.tiny or cpu
    args.attn_reps = args.attn_reps or (1 if cpu else 3)
    if args.deadline_s is None and args.budget_s is not None:
        args.deadline_s = args.budget_s + 45
    if args.impls[0] != "ours":
        parser.error("--impls: ours comes first (the others are compared with it)")
    # Under CP: every listed impl (the CPU has only ours).  On one GPU: ours and PyTorch's
    # FLASH always (the criteria's yardstick), cuDNN where listed.
    args.cp_impls = ["ours"] if cpu else list(args.impls)
    args.single_impls = ["ours", "flash"] + [i for i in args.cp_impls if i not in ("ours",
                                                                                   "flash")]
    for n in args.seqlens + [args.train_seqlen]:
        if n % (2 * WORLD):
            parser.error(f"sequence length {n}: a multiple of {2 * WORLD} (equal shards of "
                         "two head-tail chunks each)")
    if not cpu and torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs, found {torch.cuda.device_count()} (--device cpu: the "
              "CPU mode)")
        return 2
    cp_api()  # (fails here, once, where this torch lacks what the script uses)
    commit = _commit()
    args.meta = dict(vars(args), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                     world=WORLD, commit=commit, versions=_versions(cpu),
                     gpu=None if cpu else torch.cuda.get_device_name(), complete=False,
                     ended=[], wall_s={}, criteria=dict(factor=FACTOR, k_cp_single=K_CP_SINGLE,
                                                        loss_floor=LOSS_FLOOR))
    for key in ("out_dir", "t0", "fail_after_rows"):
        del args.meta[key]
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"context_parallel_{datetime.date.today():%Y%m%d}_"
                        f"{commit}{'_cpu' if cpu else ''}.json")
    ctx = mp.spawn(_worker, args=(args, _free_port(), path), nprocs=WORLD, join=False)
    ended = None
    try:
        while not ctx.join(timeout=1, grace_period=3):
            if args.deadline_s is not None and time.time() - t0 > args.deadline_s:
                ended = f"deadline: the parent stopped the ranks at {args.deadline_s:g} s"
                break
    except Exception as e:  # (a rank failed; join has stopped the others)
        lines = [line for line in str(e).splitlines() if line.strip()]
        ended = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
    if ended is None:
        return 0
    _stop(ctx)
    _mark_ended(path, args.meta, ended)
    print(f"bench_context_parallel: {ended}; the rows so far are in {path}", flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
