"""The GPU benchmark's bookkeeping, run on the CPU: bench_attention.bench_point and main() with
CUDA events, synchronisation and graphs replaced by host-side stand-ins, so that a change to
the script is exercised before it costs device time.  The timings themselves mean nothing here."""

import json
import os
import re
import sys
import time

import pytest
import torch

import flash_attn_ext

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba


class HostEvent:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


@pytest.fixture
def cpu_bench(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu stand-in")
    randn, empty = torch.randn, torch.empty
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: randn(*a, **k))
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))
    monkeypatch.setattr(ba, "graph_ms", lambda fn, reps=10: ba.median_ms(fn))
    monkeypatch.setattr(ba, "TOKENS", 64)
    monkeypatch.setattr(ba, "HIDDEN", 64)

    def refuses(q, k, v, causal):
        raise RuntimeError("this backend refuses the shape")

    calls = {"n": 0}

    def fails_later(q, k, v, causal):  # succeeds in the first round's forward timing only
        calls["n"] += 1
        if calls["n"] > 58:  # (3 warm-up calls, 5 groups of 1 + 10)
            raise RuntimeError("out of memory, say")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def no_backward(q, k, v, causal):
        out = torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(),
                                                               v.detach(), is_causal=causal)
        return out  # does not require grad: its backward raises

    impls = {
        "ours": lambda q, k, v, c: flash_attn_ext.scaled_dot_product_attention(q, k, v,
                                                                                is_causal=c),
        "sdpa_cudnn": lambda q, k, v, c: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=c),
        "refuses": refuses,
        "fails_later": fails_later,
        "no_backward": no_backward,
    }
    monkeypatch.setattr(ba, "implementations", lambda flex: dict(impls))
    monkeypatch.setattr(ba, "host_us_per_call", lambda impls: {})
    return impls


def test_bench_point_rows(cpu_bench):
    rows = {r["impl"]: r for r in ba.bench_point(cpu_bench, 32, 32, True, fwd_rounds=3)}
    assert rows["refuses"]["error"].startswith("RuntimeError: this backend refuses")
    # A failure after the first round keeps the rounds that ran; a backward failure keeps the
    # forward's numbers.
    later = rows["fails_later"]
    assert "error" not in later and len(later["fwd_tflops_rounds"]) == 1
    assert later["graph_error"].startswith("RuntimeError: out of memory")
    assert later["fwd_round_errors"][0].startswith("RuntimeError: out of memory")
    assert "fwd_graph_tflops" not in later
    nb = rows["no_backward"]
    assert "error" not in nb and nb["fwd_tflops"] > 0 and "bwd_tflops" not in nb
    assert nb["bwd_error"].startswith("RuntimeError")
    for name in ("ours", "sdpa_cudnn"):
        r = rows[name]
        assert len(r["fwd_tflops_rounds"]) == len(r["fwd_graph_tflops_rounds"]) == 3
        assert len(r["fwd_host_us_rounds"]) == 3 and min(r["fwd_host_us_rounds"]) > 0
        flops = 4 * r["B"] * r["H"] * 32 * 32 * 32 / 2
        assert r["fwd_tflops"] == pytest.approx(flops / r["fwd_ms"] / 1e9)
        assert sorted(r["fwd_tflops_rounds"])[1] == pytest.approx(r["fwd_tflops"])  # median
        assert r["bwd_ms"] > 0 and r["fwdbwd_tflops"] > 0


def test_main_writes_the_table(cpu_bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--dims", "32", "--seqlens", "32",
                                      "--no-flex", "--memory-seqlens", "--fwd-rounds", "2",
                                      "--out-dir", str(tmp_path)])
    assert ba.main() == 0
    out = capsys.readouterr().out
    assert "fwd_tflops" in out and "host" in out and "refuses" in out
    (path,) = tmp_path.glob("gpu_*.json")
    data = json.loads(path.read_text())
    assert data["meta"]["fwd_rounds"] == 2
    assert {(r["impl"], r["causal"]) for r in data["rows"]} == {
        (n, c) for n in cpu_bench for c in (False, True)}


def test_main_refuses_zero_rounds(cpu_bench, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--fwd-rounds", "0"])
    with pytest.raises(SystemExit):
        ba.main()


def test_bench_training_runs_on_the_cpu(tmp_path, monkeypatch):
    # The training-step benchmark's bookkeeping with its --tiny model: both implementations,
    # both paddings, finite losses, the JSON it writes (in strict mode: ours fused throughout).
    pytest.importorskip("transformers")
    import bench_training
    # (main turns strict mode on for the process: restored after the test)
    monkeypatch.setattr(flash_attn_ext.policy, "_strict_override",
                        flash_attn_ext.policy._strict_override)
    monkeypatch.setattr(sys, "argv", ["bench_training.py", "--tiny", "--seqlens", "64",
                                      "--tokens", "128", "--steps", "1", "--warmup", "0",
                                      "--out-dir", str(tmp_path)])
    assert bench_training.main() == 0
    (path,) = tmp_path.glob("training_*.json")
    with open(path) as f:
        rows = json.load(f)["rows"]
    assert [(r["impl"], r["padding"]) for r in rows] == [
        ("flash_attn_ext", "none"), ("sdpa", "none"), ("flash_attn_ext", "right"),
        ("sdpa", "right")]
    assert all(r["step_ms"] > 0 and torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[0]["vs_sdpa"] > 0 and rows[2]["vs_sdpa"] > 0


def test_bench_cpu_min_prints_each_point(monkeypatch, capsys):
    # The one-thread ABAB benchmark (benchmarks/bench_cpu_min.py) at a tiny size: a line per
    # point with both times and a positive ratio; the thread count is restored afterwards.
    import bench_cpu_min
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["bench_cpu_min.py", "--reps", "2", "--seqlens", "64",
                                      "96"])
    try:
        bench_cpu_min.main()
    finally:
        torch.set_num_threads(threads)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("L=")]
    assert [ln.split()[:2] for ln in lines] == [["L=64", "causal=False"],
                                                ["L=96", "causal=False"],
                                                ["L=64", "causal=True"]]
    for ln in lines:
        assert float(ln.rsplit(" ", 1)[1]) > 0


def test_bench_packed_times_both_routes(cpu_bench):
    import bench_packed

    lens = bench_packed.lengths(200, 3, torch.Generator().manual_seed(0))
    assert sum(lens) == 200 and min(lens) >= 16
    line = bench_packed.time_point(16, 200, lens, heads=4, heads_kv=2, device="cpu")
    assert "seqs=  3" in line and line.count("TFLOP/s") == 3
    assert "varlen_first" in line


def test_bench_varlen_times_packed_and_dense(cpu_bench):
    import bench_varlen

    equal = bench_varlen.time_point(16, [40, 40], True, heads=4, heads_kv=2, device="cpu",
                                    reps=1)
    assert set(equal) == {"varlen", "varlen_sm80", "dense"}
    assert all(fwd > 0 and both > 0 for fwd, both in equal.values())
    uneven = bench_varlen.time_point(16, [30, 50], False, heads=4, heads_kv=2, device="cpu",
                                     reps=1)
    assert set(uneven) == {"varlen", "varlen_sm80"}  # no dense batch holds uneven lengths
    capped = bench_varlen.time_point(16, [40, 40], True, heads=4, heads_kv=2, device="cpu",
                                     reps=1, softcap=5.0)
    assert set(capped) == {"varlen", "varlen_sm80", "dense"}
    assert all(fwd > 0 and both > 0 for fwd, both in capped.values())
    for mods in (dict(alibi=True), dict(dropout_p=0.1)):
        res = bench_varlen.time_point(16, [40, 40], True, heads=4, heads_kv=2, device="cpu",
                                      reps=1, **mods)
        assert set(res) == {"varlen", "varlen_sm80", "dense"}, mods
        assert all(fwd > 0 and both > 0 for fwd, both in res.values()), mods
    assert bench_varlen.flops([30, 50], 16, 4, True) == (30**2 + 50**2) * 4 * 4 * 16 / 2


def test_bench_decode_times_every_implementation(cpu_bench):
    import bench_decode

    line = bench_decode.time_point(2, 512, 2, 16, 128, device="cpu")
    for name in ("ours ", "ours_paged", "sdpa_flash", "sdpa_cudnn", "copy"):
        assert name in line, line
    assert line.count("TB/s") >= 4  # ours, paged, SDPA's FLASH (the CPU's), copy
    # The paged cache is the contiguous one in shuffled pages: the same answer.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 32, 16)
    k, v = torch.randn(2, 512, 2, 16), torch.randn(2, 512, 2, 16)
    kp, vp, table = bench_decode.paged(k, v, 128, g)
    lens = torch.full((2,), 512, dtype=torch.int32)
    assert torch.equal(flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens),
                       flash_attn_ext.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                              block_table=table))


def test_bench_context_parallel_cpu_mode(tmp_path, monkeypatch, capfd):
    # bench_context_parallel's --device cpu mode: two gloo processes, PyTorch's context
    # parallelism over our CPU kernels (registered for the aten flash ops).  Attention (bf16,
    # GQA, causal with head-tail load balancing and not) within all three error rules (relative
    # L2 without slack, max |x - ref| with one ulp, |cp - single|), CP and single run; the tiny
    # model's loss curve under CP equal to the single-process one while it moves; our impls
    # served exactly the ring steps, per rank (2 per attention call, forward and backward), and
    # none of PyTorch's runs.  Then the ways a call ends early: --budget-s skipping every point
    # and run alike on both ranks, rank 0 gone without a last write (the rows so far are in the
    # JSON, written after each one), and the parent's --deadline-s.
    pytest.importorskip("transformers")
    import bench_context_parallel as bcp

    # Which errors end a process at once; which refusals retry with k and v expanded.
    assert bcp.fatal(torch.OutOfMemoryError("CUDA out of memory"))
    assert bcp.fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert bcp.fatal(RuntimeError("NCCL communicator was aborted"))
    assert not bcp.fatal(RuntimeError("No available kernel. Aborting execution."))
    tried = []

    def refusing(repeat_kv):
        tried.append(repeat_kv)
        if not repeat_kv:
            raise RuntimeError("No available kernel. Aborting execution.")
        return "expanded"
    row = {}
    assert bcp.with_gqa_fallback(refusing, row) == "expanded" and tried == [False, True]
    assert row["gqa"].startswith("repeat_kv (native: RuntimeError: No available kernel")
    for error in (torch.OutOfMemoryError("CUDA out of memory"),
                  RuntimeError("head_dim 512 is not supported")):
        def failing(repeat_kv, error=error):
            tried.append(repeat_kv)
            raise error
        tried.clear()
        with pytest.raises(type(error)):
            bcp.with_gqa_fallback(failing, {})
        assert tried == [False]  # (no retry)

    def run(name, *extra):
        out = tmp_path / name
        monkeypatch.setattr(sys, "argv", ["bench_context_parallel.py", "--device", "cpu",
                                          "--train-steps", "3", "--warmup", "1",
                                          "--out-dir", str(out), *extra])
        rc = bcp.main()
        (path,) = out.glob("context_parallel_*_cpu.json")
        return rc, path, json.loads(path.read_text()), capfd.readouterr().out

    rc, path, data, printed = run("full", "--budget-s", "600")
    assert rc == 0 and f"wrote {path}" in printed  # (rank 0's summary, then this)
    meta, rows = data["meta"], data["rows"]
    assert meta["device"] == "cpu" and meta["world"] == 2 and meta["complete"]
    assert meta["ended"] == [] and list(meta["wall_s"]) == ["attention L=48", "training"]
    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["transformers"]
    assert meta["versions"]["flash_attn_ext"]["cpu"]
    # Every row printed as it was made, before the summary (its final form for the CP run,
    # whose loss verdict comes after the other runs).
    before = printed.split("summary;")[0]
    assert all(bcp.format_row(r) in before for r in rows)
    assert not any("skipped" in r or "error" in r for r in rows)
    runs = [r for r in rows if r["part"] == "attention_run"]
    assert [(r["causal"], r["cp"], r["impl"]) for r in runs] == [
        (c, cp, impl) for c in (True, False)
        for cp, impl in ((True, "ours"), (False, "ours"), (False, "flash"))]
    for r in runs:
        assert r["gqa"] == "native" and r["calls_ok"] and r["ms"] > 0, r
        assert "flash_impl" in r  # (None on the CPU: ours is registered, not activated)
    assert [r["ours_calls"] for r in runs[:3]] == [[[2, 2], [2, 2]], [[1, 1]], [[0, 0]]]
    attention = [r for r in rows if r["part"] == "attention"]
    assert [(r["causal"], r["what"]) for r in attention] == [
        (c, w) for c in (True, False) for w in ("out", "dq", "dk", "dv")]
    for r in attention:
        assert r["ok"] and r["ok_rel"] and r["ok_max"] and r["ok_cp_single"], r
        factor = 2.0 if r["what"] == "out" else 3.0
        assert r["rel_bound"] == pytest.approx(factor * r["rel_pytorch"])
        assert 0 < r["rel_cp"] <= r["rel_bound"] and 0 < r["err_cp"] <= r["bound"]
        assert r["rel_ratio_cp"] == pytest.approx(r["rel_cp"] / r["rel_pytorch"])
        assert r["cp_vs_single"] <= r["k_cp_single"] * r["err_single"]
    training = {(r["impl"], r["cp"]): r for r in rows if r["part"] == "training"}
    assert set(training) == {("ours", False), ("flash", False), ("ours", True)}
    cp, single = training[("ours", True)], training[("ours", False)]
    assert all(r["tokens_per_s_per_gpu"] > 0 and r["calls_ok"] for r in training.values())
    assert cp["loss_equal"] and len(cp["losses"]) == 3
    # (on the CPU only ours runs under CP: the yardstick is the two kernels' drift, or 0.01)
    assert set(cp["tolerance_terms"]) == {"2 x drift(flash single, ours single)", "floor"}
    assert cp["loss_tolerance"] == max(cp["tolerance_terms"].values())
    assert single["losses"][-1] < single["losses"][0] - 0.5  # (the curve moves)
    layers, steps, ring = 2, 3, 2
    assert cp["ours_calls"] == [[layers * steps * ring] * 2] * 2
    assert single["ours_calls"] == [[layers * steps] * 2]
    assert training[("flash", False)]["ours_calls"] == [[0, 0]]
    assert cp["local_tokens"] == single["local_tokens"] // 2

    # No time left: every point and run skipped, on both ranks alike (a rank that ran alone
    # would hang in the ring); rank 0 then exits after 4 rows, as a killed process would.
    rc, path, data, printed = run("budget", "--budget-s", "0", "--fail-after-rows", "4")
    assert rc == 1 and not data["meta"]["complete"]
    assert [(r["part"], r["skipped"]) for r in data["rows"]] == [
        ("attention", "budget")] * 2 + [("training", "budget")] * 2
    assert re.search(r"process [01] terminated with exit code 1", data["meta"]["ended"][-1])

    rc, path, data, printed = run("deadline", "--deadline-s", "1")
    assert rc == 1 and not data["meta"]["complete"]
    assert data["meta"]["ended"][-1].startswith("deadline: the parent stopped the ranks")
