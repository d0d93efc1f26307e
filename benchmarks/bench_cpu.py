"""CPU benchmark: flash_attn_ext vs torch.nn.functional.scaled_dot_product_attention.

What is measured
----------------
fp32 (``--dtype bfloat16 / float16`` for the others), B=2, H=8, head dim d=64, L = S in 512, 1024,
2048, 4096 (``--quick``: 512, 1024;
``--seqlens`` overrides), causal and not, two passes:

* ``fwd``:     inference forward (inputs do not require grad, under ``torch.no_grad()``).
* ``fwd+bwd``: forward, then ``out.backward(grad)`` with a fixed random ``grad``; the inputs'
  ``.grad`` are set to None before every rep so nothing accumulates.

Both sides get the same SDPA-layout inputs (B, H, L, d), fresh ``torch.randn`` (fixed seed, never
zeros): ours through ``flash_attn_ext.scaled_dot_product_attention(..., strict=True)`` (strict so
that a silent fallback to torch would raise instead of being timed), torch through
``torch.nn.functional.scaled_dot_product_attention``, which on CPU picks its own backend; the
backend it picked is recorded (``torch._fused_sdp_choice`` and the aten ops seen by
``torch.profiler``), as is the kernel ours planned (``flash_attn_ext.explain``).

Timing
------
``time.perf_counter`` around one call (fwd) or one forward+backward (fwd+bwd). Per config and
implementation: ``--warmup`` untimed runs (at full size when L <= 1024, at L=1024 above that: the
warm-up is for one-time costs such as thread-pool start and first-touch of code, which do not
depend on L, and a full-size warm-up of the slow configs would take minutes), then reps until
``--budget`` seconds have been spent, at least ``--min-reps`` and at most ``--max-reps``. Reps of
ours and torch are interleaved (ABBA order) so drift affects both alike. The median is reported.
Threads: torch's default unless ``--threads`` (``torch.get_num_threads()`` and the OMP_/MKL_
environment are recorded); both sides use ATen's pool.

Wall time is only meaningful on otherwise idle CPUs. Before each config the busy fraction of the
CPUs is sampled from ``/proc/stat`` (``cpu_busy_before``; ``--wait-idle`` waits for it to drop),
a warning is printed when other processes are using them, and rows where that or a low CPU
utilisation shows that other processes took CPU time are marked ``[contended]``. Per rep the
process CPU time is also recorded (``*_cpu_ms_per_thread`` = median CPU time / threads, less
sensitive to other processes
than wall time, and ``*_cpu_util`` = CPU time / (wall time * threads), near 1 when uncontended).

FLOPs are counted the FlashAttention way: forward 4*B*H*L*S*d, halved when causal; backward is 2.5x
the forward, so fwd+bwd is 3.5x the forward. GFLOP/s = FLOPs / median time.

Memory
------
Measured apart from the timing, in a fresh subprocess per L (``--mem-worker``), so that the
allocator setting it needs does not change the timed runs. Peak extra memory of one call = the
process's peak resident set size during the call (``VmHWM``, reset just before it by writing 5 to
``/proc/self/clear_refs``) minus the resident set size just before it (``VmRSS``). It includes
everything the call allocates, kept or freed: the output, the gradients dq, dk, dv (fwd+bwd), saved
statistics and scratch; ``outputs_mib`` in the JSON is the size of those unavoidable results (out,
plus dq, dk, dv for fwd+bwd) for comparison. So that freed memory leaves the resident set (and a
call's peak is not hidden in memory glibc kept from an earlier call), the subprocess fixes glibc's
mmap threshold at 128 KiB with ``mallopt`` (which also turns off its dynamic threshold); that
costs page faults (about 10% on torch's time at L=1024), which is why the timing runs elsewhere.
Each impl / pass / causal gets the same warm-up as in the timing, then one measured call. The
growth with L is summarised as the exponent of a log-log fit of peak vs L (about 1 for O(L)
memory, about 2 for O(L^2)). ``--no-mem`` skips it.

Output: a table on stdout, and JSON (metadata and every row) in
``benchmarks/results/cpu_<yyyymmdd>_<shortcommit>.json`` unless ``--out`` is given.

Run: ``cd <repo> && PYTHONPATH=. python benchmarks/bench_cpu.py [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
BATCH, HEADS, HEAD_DIM = 2, 8, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE = torch.float32  # (set from --dtype in main)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096)
QUICK_SEQLENS = (512, 1024)
PASSES = ("fwd", "fwd+bwd")
IMPLS = ("ours", "torch")
MIB = 1024.0 * 1024.0
MMAP_THRESHOLD = 128 * 1024

Attn = Callable[..., torch.Tensor]
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def import_ext() -> ModuleType:
    """Imports flash_attn_ext, from the repository root when it is not on the path."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import flash_attn_ext

    return flash_attn_ext


# ---------------------------------------------------------------------------------------------
# Memory: peak resident set size of the process around one call.
# ---------------------------------------------------------------------------------------------


def fix_malloc_mmap_threshold() -> bool:
    """Makes glibc return freed blocks >= 128 KiB to the OS at once; False if not possible."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD) == 1
        ok = ok and libc.mallopt(m_trim_threshold, MMAP_THRESHOLD) == 1
        return bool(ok)
    except OSError:
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return int(m.group(1))


def reset_peak_rss() -> bool:
    """Resets the process's VmHWM to its current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def peak_rss() -> Iterator[list[float]]:
    """Yields a list that, after the block, holds its peak RSS minus the RSS before it (MiB).

    The list stays empty where the peak cannot be reset (no ``/proc/self/clear_refs``).
    """
    result: list[float] = []
    ok = reset_peak_rss()
    base = _status_kib("VmRSS") if ok else 0
    yield result
    if ok:
        result.append(max(0, _status_kib("VmHWM") - base) / 1024.0)


def busy_fraction(interval: float = 0.5) -> float:
    """Fraction of all CPUs' time spent busy over ``interval`` seconds (from /proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle
    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except OSError:
        return float("nan")
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_for_idle(max_wait: float, threshold: float = 0.15) -> float:
    """Waits (up to ``max_wait`` s) until other processes leave the CPUs; returns busy fraction."""
    deadline = time.monotonic() + max_wait
    busy = busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction(2.0)
    return busy


# ---------------------------------------------------------------------------------------------
# The two implementations and one step of each pass.
# ---------------------------------------------------------------------------------------------


def make_attn(impl: str, fa: ModuleType) -> Attn:
    if impl == "ours":
        def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
            return fa.scaled_dot_product_attention(q, k, v, is_causal=causal, strict=True)
        return ours

    def ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return ref


def make_inputs(seqlen: int, requires_grad: bool, seed: int) -> Inputs:
    """q, k, v in (B, H, L, d) and the fixed upstream gradient, all torch.randn."""
    gen = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, seqlen, HEAD_DIM)
    q, k, v, grad = (torch.randn(shape, generator=gen, dtype=DTYPE) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, grad


def run_step(attn: Attn, pass_: str, inputs: Inputs, causal: bool) -> list[torch.Tensor]:
    """One forward (no grad) or one forward+backward; returns what it produced.

    Clears the inputs' ``.grad`` first; callers that measure memory clear them beforehand too, so
    that freeing the previous rep's gradients does not happen inside the measured region.
    """
    q, k, v, grad = inputs
    if pass_ == "fwd":
        with torch.no_grad():
            return [attn(q, k, v, causal)]
    clear_grads(inputs)
    out = attn(q, k, v, causal)
    out.backward(grad)
    return [q.grad, k.grad, v.grad]


def clear_grads(inputs: Inputs) -> None:
    for t in inputs[:3]:
        t.grad = None


def attention_flops(seqlen: int, causal: bool, pass_: str) -> float:
    fwd = 4.0 * BATCH * HEADS * seqlen * seqlen * HEAD_DIM
    if causal:
        fwd /= 2.0
    return fwd * (3.5 if pass_ == "fwd+bwd" else 1.0)


# ---------------------------------------------------------------------------------------------
# One config: warm-up, interleaved timed reps, and a correctness check.
# ---------------------------------------------------------------------------------------------


def warm_up(attn: Attn, seqlen: int, causal: bool, pass_: str, n: int, seed: int) -> None:
    """``n`` untimed runs, at L = min(seqlen, 1024) (one-time costs do not depend on L)."""
    warm_inputs = make_inputs(min(seqlen, 1024), pass_ == "fwd+bwd", seed)
    for _ in range(n):
        run_step(attn, pass_, warm_inputs, causal)


def bench_config(attns: dict[str, Attn], seqlen: int, causal: bool, pass_: str,
                 args: argparse.Namespace, seed: int) -> dict[str, Any]:
    for impl in IMPLS:
        warm_up(attns[impl], seqlen, causal, pass_, args.warmup, seed + 1)
    inputs = make_inputs(seqlen, pass_ == "fwd+bwd", seed)
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    cpu_times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    results: dict[str, list[torch.Tensor]] = {}
    target_reps = args.max_reps
    rep = 0
    while rep < target_reps:
        order = IMPLS if rep % 2 == 0 else IMPLS[::-1]
        for impl in order:
            clear_grads(inputs)
            c0, t0 = time.process_time(), time.perf_counter()
            produced = run_step(attns[impl], pass_, inputs, causal)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            times[impl].append(elapsed)
            cpu_times[impl].append(cpu)
            if rep == 0:
                results[impl] = [t.detach().clone() for t in produced]
            del produced
        if rep == 0:
            slowest = max(times[impl][0] for impl in IMPLS)
            target_reps = max(args.min_reps, min(args.max_reps, math.ceil(args.budget / slowest)))
        rep += 1

    max_abs_diff = max(float((a - b).abs().max()) for a, b in zip(results["ours"],
                                                                   results["torch"]))
    flops = attention_flops(seqlen, causal, pass_)
    n_outputs = 1 if pass_ == "fwd" else 3
    if pass_ == "fwd+bwd":
        n_outputs += 1  # the forward output is alive during backward
    outputs_mib = n_outputs * BATCH * HEADS * seqlen * HEAD_DIM * DTYPE.itemsize / MIB
    row: dict[str, Any] = {"dtype": str(DTYPE).replace("torch.", ""),
                           "threads": torch.get_num_threads(),
                           "L": seqlen, "S": seqlen, "causal": causal, "pass": pass_,
                           "reps": rep, "flops": flops, "outputs_mib": outputs_mib,
                           "max_abs_diff": max_abs_diff}
    for impl in IMPLS:
        med = statistics.median(times[impl])
        row[f"{impl}_ms"] = med * 1e3
        row[f"{impl}_ms_min"] = min(times[impl]) * 1e3
        row[f"{impl}_ms_all"] = [t * 1e3 for t in times[impl]]
        cpu_med = statistics.median(cpu_times[impl])
        row[f"{impl}_cpu_ms_per_thread"] = cpu_med * 1e3 / torch.get_num_threads()
        row[f"{impl}_cpu_util"] = cpu_med / (med * torch.get_num_threads())
        row[f"{impl}_gflops"] = flops / med / 1e9
    row["ratio"] = row["torch_ms"] / row["ours_ms"]
    return row


# ---------------------------------------------------------------------------------------------
# Peak memory, in a subprocess per L.
# ---------------------------------------------------------------------------------------------


def memory_worker(args: argparse.Namespace) -> int:
    """Prints one JSON line per (impl, pass, causal) at L = args.seqlens[0]: the peak extra MiB."""
    fixed = fix_malloc_mmap_threshold()
    fa = import_ext()
    seqlen = args.seqlens[0]
    for causal in (False, True):
        for j, pass_ in enumerate(PASSES):
            seed = args.seed + 10 * int(causal) + j
            inputs = make_inputs(seqlen, pass_ == "fwd+bwd", seed)
            for impl in IMPLS:
                attn = make_attn(impl, fa)
                warm_up(attn, seqlen, causal, pass_, args.warmup, seed + 1)
                clear_grads(inputs)
                gc.collect()
                with peak_rss() as mem:
                    produced = run_step(attn, pass_, inputs, causal)
                del produced
                clear_grads(inputs)
                print(json.dumps({"impl": impl, "pass": pass_, "causal": causal,
                                  "peak_mib": mem[0] if mem else None,
                                  "malloc_fixed": fixed}), flush=True)
    return 0


def measure_memory(seqlen: int, args: argparse.Namespace) -> dict[tuple[str, str, bool], Any]:
    """Runs :func:`memory_worker` for one L in a fresh interpreter; {(impl, pass, causal): MiB}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mem-worker", "--seqlens",
           str(seqlen), "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--dtype", args.dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        print(f"# memory worker failed at L={seqlen}: {proc.stderr.strip()[-500:]}", flush=True)
        return {}
    result: dict[tuple[str, str, bool], Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            result[(rec["impl"], rec["pass"], rec["causal"])] = rec
    return result


# ---------------------------------------------------------------------------------------------
# Metadata: machine, versions, commit, and which kernels each side runs.
# ---------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str | None:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return None


def git_commit() -> str:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Process-level stderr (file descriptor 2) to /dev/null: the profiler's C++ library
    (Kineto) writes a line per start and stop there, which no logging setting silences."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiled_ops(attn: Attn, pass_: str, causal: bool) -> list[str]:
    """Names of the attention-related ops that a small call of ``attn`` runs."""
    inputs = make_inputs(128, pass_ == "fwd+bwd", seed=7)
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(attn, pass_, inputs, causal)
    keys = ("attention", "flash", "sdpa", "softmax", "bmm")
    return sorted({e.name for e in prof.events() if any(k in e.name.lower() for k in keys)})


def backends(fa: ModuleType, attns: dict[str, Attn]) -> dict[str, Any]:
    q, k, v, _ = make_inputs(512, True, seed=3)
    info: dict[str, Any] = {}
    try:
        from torch.nn.attention import SDPBackend

        choice = int(torch._fused_sdp_choice(q, k, v, is_causal=False))
        info["torch_sdp_choice"] = SDPBackend(choice).name
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:  # private API
        info["torch_sdp_choice"] = f"unavailable ({exc.__class__.__name__})"
    info["ours_plan"] = str(fa.explain(q, k, v))
    for impl in IMPLS:
        info[f"{impl}_ops"] = {p: profiled_ops(attns[impl], p, causal=True) for p in PASSES}
    return info


def metadata(fa: ModuleType, attns: dict[str, Attn], args: argparse.Namespace) -> dict[str, Any]:
    parallel = torch.__config__.parallel_info()
    m = re.search(r"ATen parallel backend: (.+)", parallel)
    return {
        "loadavg_start": loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "aten_parallel_backend": m.group(1).strip() if m else None,
        "thread_env": {k: v for k, v in os.environ.items()
                       if k.startswith(("OMP_", "MKL_", "GOMP_", "KMP_"))},
        "flash_attn_ext_version": getattr(fa, "__version__", None),
        "git_commit": git_commit(),
        "dtype": str(DTYPE).replace("torch.", ""),
        "batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM,
        "layout": "(B, H, L, d) for both (SDPA layout)",
        "flops_convention": "fwd 4*B*H*L*S*d (/2 causal); bwd 2.5x fwd; fwd+bwd 3.5x fwd",
        "timing": {"clock": "time.perf_counter", "statistic": "median",
                   "warmup": args.warmup, "warmup_len": "L if L <= 1024 else 1024",
                   "budget_s": args.budget, "min_reps": args.min_reps,
                   "max_reps": args.max_reps, "order": "ours/torch interleaved, ABBA"},
        "memory": None if args.no_mem else {
            "method": "subprocess per L; VmHWM after clear_refs=5 minus VmRSS before one call",
            "malloc": f"mallopt M_MMAP_THRESHOLD = M_TRIM_THRESHOLD = {MMAP_THRESHOLD}",
            "warmup": "same as timing"},
        "backends": backends(fa, attns),
    }


# ---------------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------------

HEADER = (f"{'dtype':>8} {'thr':>3} {'L':>5} {'causal':>6} {'pass':>7} {'ours ms':>10} "
          f"{'torch ms':>10} {'ratio':>6} "
          f"{'ours GF/s':>9} {'torch GF/s':>10} {'peak MiB ours/torch':>20}")


def fmt_row(r: dict[str, Any]) -> str:
    def mib(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f}"
    peak = f"{mib(r['ours_peak_mib'])} / {mib(r['torch_peak_mib'])}"
    flag = "  <0.8x" if r["ratio"] < 0.8 else ""
    if r.get("contended"):
        flag += "  [contended]"
    return (f"{r['dtype']:>8} {r['threads']:>3} {r['L']:>5} {r['causal']!s:>6} {r['pass']:>7} "
            f"{r['ours_ms']:>10.2f} "
            f"{r['torch_ms']:>10.2f} {r['ratio']:>6.2f} {r['ours_gflops']:>9.1f} "
            f"{r['torch_gflops']:>10.1f} {peak:>20}{flag}")


def memory_exponents(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Least-squares slope of log(peak MiB) vs log(L) per impl / pass / causal."""
    out: dict[str, float | None] = {}
    for impl in IMPLS:
        for pass_ in PASSES:
            for causal in (False, True):
                pts = [(math.log(r["L"]), math.log(r[f"{impl}_peak_mib"])) for r in rows
                       if r["pass"] == pass_ and r["causal"] == causal
                       and r[f"{impl}_peak_mib"]]
                key = f"{impl} {pass_} causal={causal}"
                if len(pts) < 2:
                    out[key] = None
                    continue
                mx = sum(x for x, _ in pts) / len(pts)
                my = sum(y for _, y in pts) / len(pts)
                sxx = sum((x - mx) ** 2 for x, _ in pts)
                out[key] = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return out


def default_out_path(meta: dict[str, Any]) -> Path:
    day = datetime.datetime.now().strftime("%Y%m%d")
    return REPO / "benchmarks" / "results" / f"cpu_{day}_{meta['git_commit']}.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only L = 512, 1024")
    p.add_argument("--seqlens", type=int, nargs="+", help="sequence lengths (overrides --quick)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/cpu_...json)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per impl and config")
    p.add_argument("--budget", type=float, default=1.5,
                   help="timed seconds per impl and config (slower impl sets the rep count)")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=20)
    p.add_argument("--no-mem", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--mem-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype of q, k, v and the gradient (both implementations)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each config, wait up to this long for the CPUs to be idle")
    args = p.parse_args(argv)
    if args.seqlens is None:
        args.seqlens = list(QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    if args.min_reps < 1 or args.max_reps < args.min_reps:
        p.error("need 1 <= --min-reps <= --max-reps")
    return args


def main(argv: list[str] | None = None) -> int:
    global DTYPE
    args = parse_args(argv)
    DTYPE = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mem_worker:
        return memory_worker(args)
    fa = import_ext()
    attns = {impl: make_attn(impl, fa) for impl in IMPLS}
    meta = metadata(fa, attns, args)
    b = meta["backends"]
    print(f"# {meta['cpu_model']}, {meta['cpu_count']} cores, torch {meta['torch_version']}, "
          f"{meta['torch_num_threads']} threads ({meta['aten_parallel_backend']}), "
          f"{meta['cpu_capability']}, commit {meta['git_commit']}")
    print(f"# {args.dtype} B={BATCH} H={HEADS} d={HEAD_DIM}, (B, H, L, d) inputs for both; ratio = "
          "torch ms / ours ms (>1: ours faster)")
    print(f"# torch SDPA backend on CPU: {b['torch_sdp_choice']}; ops "
          f"{b['torch_ops']['fwd'] + b['torch_ops']['fwd+bwd']}")
    print(f"# ours: {b['ours_plan']}; ops {b['ours_ops']['fwd'] + b['ours_ops']['fwd+bwd']}")
    print(HEADER, flush=True)

    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for i, seqlen in enumerate(args.seqlens):
        mem = {} if args.no_mem else measure_memory(seqlen, args)
        for causal in (False, True):
            for j, pass_ in enumerate(PASSES):
                seed = args.seed + 1000 * i + 10 * int(causal) + j
                busy = wait_for_idle(args.wait_idle)
                row = bench_config(attns, seqlen, causal, pass_, args, seed)
                row["cpu_busy_before"] = busy
                for impl in IMPLS:
                    rec = mem.get((impl, pass_, causal))
                    row[f"{impl}_peak_mib"] = rec["peak_mib"] if rec else None
                row["contended"] = bool(busy > 0.15 or min(row["ours_cpu_util"],
                                                          row["torch_cpu_util"]) < 0.85)
                if busy > 0.15:
                    print(f"# warning: CPUs {busy:.0%} busy before the next row (other processes)",
                          flush=True)
                rows.append(row)
                print(fmt_row(row), flush=True)
    wall = time.perf_counter() - t_start

    exps = memory_exponents(rows)
    slow = [r for r in rows if r["ratio"] < 0.8]
    contended = [r for r in rows if r["contended"]]
    print(f"\n# {len(rows)} configs in {wall:.0f} s; {len(slow)} below 0.8x torch; "
          f"{len(contended)} [contended] (other processes took CPU: rerun those on idle CPUs)")
    print("# peak-memory growth exponent (log-log fit vs L; ~1 = O(L), ~2 = O(L^2)):")
    for key, e in exps.items():
        print(f"#   {key:<28} {'n/a' if e is None else f'{e:.2f}'}")
    worst = max(r["max_abs_diff"] for r in rows)
    print(f"# max |ours - torch| over outputs/grads: {worst:.2e}")

    out = args.out or default_out_path(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta["wall_s"] = wall
    meta["loadavg_end"] = loadavg()
    payload = {"meta": meta, "rows": rows, "memory_exponents": exps}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
