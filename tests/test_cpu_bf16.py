"""bf16 on the CPU: tiles multiplied as bf16 with AVX512-BF16 (csrc/cpu/bf16_dot.cpp) where the
CPU has it, else converted to fp32 tiles for sgemm.  Both paths must meet the error rule against
float64, forward and gradients, at odd sizes, GQA, causal, windows, softcap and a mask; the
path not taken by default on this CPU is reached with FLASH_ATTN_EXT_CPU_BF16_DOT=0 in a
subprocess (the switch is read once per process)."""

import os
import subprocess
import sys

import pytest
import torch

import flash_attn_ext

TESTS = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from reference import assert_error_rule, attention_ref, cancellation_scale
import flash_attn_ext
from flash_attn_ext import _C

_C.set_debug_poison(True)  # outputs start as NaN, as in the test process (conftest.py)
torch.manual_seed(0)
cases = [  # (B, H, H_kv, L, S, D, Dv, flash_attn_func flags)
    (1, 2, 2, 1, 17, 40, 40, {}),
    (2, 4, 2, 113, 113, 59, 59, {"causal": True}),
    (1, 2, 1, 17, 1023, 72, 72, {"window_size": (64, 3)}),
    (1, 2, 2, 1023, 300, 64, 64, {"causal": True, "softcap": 5.0}),
    (1, 1, 1, 129, 257, 256, 256, {}),
    (2, 4, 2, 65, 80, 64, 24, {"alibi_slopes": torch.rand(4)}),
    # decoding with GQA / MQA: a task's rows (a group's heads x L <= 16; the first case above,
    # one row per key head, too) read K in place as S^T = K Q^T (flash_fwd_cpu.cpp,
    # direct_keys), with a mask, softcap and a window; an odd head dim and an odd row stride
    # of K take the packed keys instead
    (2, 8, 2, 1, 300, 64, 64, {"causal": True}),
    (1, 8, 1, 4, 1000, 128, 128, {"softcap": 5.0}),
    (1, 4, 1, 2, 600, 72, 72, {"window_size": (100, 0)}),
    (1, 4, 2, 3, 77, 59, 59, {}),
    (1, 4, 1, 1, 530, 64, 64, {"odd_k_stride": True}),
    (1, 2, 2, 1, 100, 64, 64, {"odd_k_stride": True}),  # one row per key head: fp32 tiles
    # and with an odd key count, a head dim of V past the micro-kernel's 64-column block with
    # a tail, three rows
    (1, 3, 1, 1, 301, 72, 72, {}),
    (2, 4, 4, 1, 257, 64, 200, {"causal": True}),
]
for B, H, Hk, L, S, D, Dv, flags in cases:
    odd_stride = flags.pop("odd_k_stride", False)
    q = torch.randn(B, L, H, D, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, Hk, D, dtype=torch.bfloat16, requires_grad=True)
    if odd_stride:  # head stride D + 1 (k a view of a wider tensor)
        k = torch.randn(B, S, Hk, D + 1, dtype=torch.bfloat16)[..., :D].requires_grad_()
        assert k.stride(2) % 2 == 1
    v = torch.randn(B, S, Hk, Dv, dtype=torch.bfloat16, requires_grad=True)
    wl, wr = flags.get("window_size", (-1, -1))
    kw = dict(causal=flags.get("causal", False), window_left=wl, window_right=wr,
              softcap=flags.get("softcap", 0.0), alibi_slopes=flags.get("alibi_slopes"))
    out = flash_attn_ext.flash_attn_func(q, k, v, **flags)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    true_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    true_out, _ = attention_ref(*true_leaves, **kw)
    true_grads = torch.autograd.grad(true_out, true_leaves, dout.double())
    low_out, _ = attention_ref(q, k, v, compute_dtype=torch.bfloat16, **kw)
    low_grads = torch.autograd.grad(low_out, (q, k, v), dout)
    what = f"{B, H, Hk, L, S, D, flags}"
    assert_error_rule(out, low_out, true_out, 2.0, "out " + what)
    *cancel, score_scale = cancellation_scale(q, k, v, dout, per_element=True, out=out,
                                              true_out=true_out, **kw)
    for name, ours, low, true, c in zip(("dq", "dk", "dv"), grads, low_grads, true_grads, cancel):
        assert_error_rule(ours, low, true, 3.0, name + " " + what, c, score_scale)

# Packed sequences of very different lengths (the forward's packed K is laid out by key row,
# one row per key of the tensor): each sequence equals its own dense call.
lens_q, lens_k = [1] * 40 + [37, 0, 5], [3] * 40 + [700, 4, 1]
cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
              for n in (lens_q, lens_k))
q = torch.randn(int(cu_q[-1]), 4, 64, dtype=torch.bfloat16)
k, v = (torch.randn(int(cu_k[-1]), 2, 64, dtype=torch.bfloat16) for _ in "kv")
out = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 700, causal=True)
for b in (0, 39, 40, 42):
    rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
    dense = flash_attn_ext.flash_attn_func(q[rq][None], k[rk][None], v[rk][None], causal=True)
    assert torch.equal(out[rq], dense[0]), b
print(flash_attn_ext.ops.build_info()["cpu_bf16_amx"])
print(flash_attn_ext.ops.build_info()["cpu_bf16_dot"])
"""

@pytest.mark.parametrize("switch", [None, "no_amx", "0"],
                         ids=["default", "avx512_bf16", "fp32_tiles"])
def test_bf16_cpu_paths_meet_the_error_rule(switch):
    # Three paths where the CPU has them: AMX tiles (bf16_amx.h), the AVX512-BF16 micro-kernel
    # (FLASH_ATTN_EXT_CPU_BF16_AMX=0 where AMX is there), fp32 tiles (..._DOT=0).
    env = dict(os.environ)
    env.pop("FLASH_ATTN_EXT_CPU_BF16_DOT", None)
    env.pop("FLASH_ATTN_EXT_CPU_BF16_AMX", None)
    if switch == "no_amx":
        env["FLASH_ATTN_EXT_CPU_BF16_AMX"] = "0"
    elif switch is not None:
        env["FLASH_ATTN_EXT_CPU_BF16_DOT"] = switch
    run = subprocess.run([sys.executable, "-c", SCRIPT, TESTS], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    amx, taken = run.stdout.strip().splitlines()[-2:]
    if switch in ("0", "no_amx"):
        assert amx == "False"
    if switch == "0":
        assert taken == "False"
    elif os.path.exists("/proc/cpuinfo"):  # (Linux: the flag the run-time check reads)
        with open("/proc/cpuinfo") as f:
            has = " avx512_bf16" in f.read()
        assert taken == str(has), "the bf16 path's run-time check disagrees with /proc/cpuinfo"
    if switch is None and taken == "False":
        pytest.skip("this CPU has no AVX512-BF16: only the fp32-tile path was exercised")


def test_bf16_dot_switch_takes_the_strict_values_and_refuses_others():
    # FLASH_ATTN_EXT_CPU_BF16_DOT is read once, when flash_attn_ext is imported (build_info),
    # with FLASH_ATTN_EXT_STRICT's values: any value but "0" used to leave the bf16 path on, so
    # "off" or a typo silently did nothing.
    def taken(value):
        env = dict(os.environ)
        env.pop("FLASH_ATTN_EXT_CPU_BF16_DOT", None)
        if value is not None:
            env["FLASH_ATTN_EXT_CPU_BF16_DOT"] = value
        code = "import flash_attn_ext; print(flash_attn_ext.ops.build_info()['cpu_bf16_dot'])"
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)

    default = taken(None)
    assert default.returncode == 0, default.stderr[-3000:]
    on = default.stdout.strip()  # (the CPU's answer)
    for value, expected in (("off", "False"), (" No ", "False"), ("TRUE", on), ("", on)):
        run = taken(value)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip() == expected, value
    run = taken("bogus")
    assert run.returncode != 0
    assert ("ValueError: FLASH_ATTN_EXT_CPU_BF16_DOT must be 1, true, yes or on, or 0, false, "
            "no or off (unset: on), got 'bogus'") in run.stderr, run.stderr[-3000:]


def test_bf16_cpu_masked_keys_past_an_odd_tile_never_leak():
    # The bf16 path packs two keys per word: a tile with an odd number of keys pads with zero,
    # never with the next key, whose NaN would otherwise reach every row (0 * NaN).  Rows 0-2
    # of a top-left causal (L = 3, S = 8) call see keys 0-2 only; keys 3-7 are NaN.
    torch.manual_seed(0)
    q = torch.randn(1, 2, 3, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 8, 64, dtype=torch.bfloat16) for _ in "kv")
    k[:, :, 3:] = float("nan")
    v[:, :, 3:] = float("nan")
    out = flash_attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k[:, :, :3].double(), v[:, :, :3].double(), is_causal=True)
    assert not torch.isnan(out).any()
    assert (out.double() - ref).abs().max().item() < 2e-2


def test_bf16_cpu_a_scale_that_is_zero_in_float_gives_the_uniform_average():
    # A positive softmax_scale below ~7e-46 is 0 as a float: folded into the softmax (on AMX)
    # it met the mask's -inf first (0 * -inf = NaN rows; a reviewer's finding).  The answer
    # is every visible key's weight equal: out = the mean of the visible v rows.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 37, 2, 64, dtype=torch.bfloat16) for _ in "qkv")
    mean = v.double().cumsum(1) / torch.arange(1, 38, dtype=torch.float64)[None, :, None, None]
    for scale in (1e-50, 1e-46):
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=True, softmax_scale=scale)
        assert not torch.isnan(out).any()
        assert (out.double() - mean).abs().max().item() < 1e-2


GUARD_SCRIPT = r"""
import ctypes, mmap, sys
import torch
import flash_attn_ext
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
page = mmap.PAGESIZE
keep = []
def at_page_end(t):
    # a copy of t whose last byte is followed by a page that may not be read
    nbytes = t.numel() * t.element_size()
    pages = (nbytes + page - 1) // page + 1
    mm = mmap.mmap(-1, pages * page)
    buf = (ctypes.c_char * (pages * page)).from_buffer(mm)
    assert libc.mprotect(ctypes.addressof(buf) + (pages - 1) * page, page, 0) == 0
    g = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(),
                         offset=(pages - 1) * page - nbytes).view(t.shape)
    g.copy_(t)
    keep.append((mm, buf))
    return g
torch.manual_seed(0)
for d in (3, 59):
    for seqlen_k in (16, 33):
        q = torch.randn(1, 2, 1, d, dtype=torch.bfloat16)
        k, v = (torch.randn(1, seqlen_k, 1, d, dtype=torch.bfloat16) for _ in "kv")
        want = flash_attn_ext.flash_attn_func(q, k, v)
        got = flash_attn_ext.flash_attn_func(q, at_page_end(k), at_page_end(v))
        assert torch.equal(got, want), (d, seqlen_k)
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through libc")
def test_bf16_cpu_odd_head_dims_read_nothing_past_k():
    # The packing of K for an odd head dim gathered 4 bytes at its last element, reading the
    # element after each row's last: past the tensor for its last row (SIGSEGV with k's end
    # at an unreadable page, head dims 3 and 59 with 16 keys; a reviewer's guard-page test).
    run = subprocess.run([sys.executable, "-c", GUARD_SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode,
                                                                       run.stderr[-2000:])
