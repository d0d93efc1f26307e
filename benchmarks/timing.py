"""CUDA-event timing shared by the benchmark scripts (needs only PyTorch)."""
import statistics
import time
from typing import Callable, Optional

import torch


def queued_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 10, groups: int = 5,
              host_us: Optional[list] = None) -> float:
    """Median milliseconds per call of fn: events around `reps` back-to-back calls, no
    synchronisation between them (the host prepares the next call while the GPU runs this one,
    as in a training step); the median over `groups` such runs of the per-call mean.

    host_us: if a list, the median over groups of the host's microseconds per call while it
    queued the timed calls is appended to it.  Near the GPU time per call, the reading is bound
    by the host, not by the kernel."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(groups):
        fn()  # one call ahead so the queue is not empty when the timed calls start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host.append((time.perf_counter() - t0) / reps * 1e6)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    if host_us is not None:
        host_us.append(statistics.median(host))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn: Callable[[], object], reps: int = 10, groups: int = 5) -> float:
    """Milliseconds per call of fn replayed from a captured CUDA graph: the GPU time alone, with
    no host work between the kernels (what a caller that captures its step, as inference
    servers capture their decode step, sees); the median of `groups` groups of `reps` replays.
    Raises RuntimeError where fn cannot be captured (a synchronising call)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(groups):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    times.sort()
    return times[len(times) // 2]


# The causal modes a benchmark's --causal option names.
CAUSAL_MODES = {"no": [False], "yes": [True], "both": [False, True]}


def rotated(items, round_index: int):
    """items in round round_index's order: rotated by one per round, so that no item is always
    timed first (interleaved rounds)."""
    shift = round_index % len(items)
    return items[shift:] + items[:shift]
