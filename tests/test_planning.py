"""Planning (which kernel serves a call: the C++ rule of csrc/kernel_select.h, asked from
Python), explain(), strict mode, warn-once and counters (the no-silent-fallback rule).  The CUDA
rule is exercised here without a GPU: the GPU's answers (capability, shared memory) and the
build are stood in."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import FallbackError, explain, flash_attn_func, ops, planning, policy, unfused
from reference import assert_lse_infinities, attention_ref

pytestmark = pytest.mark.usefixtures("clean_policy")


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                        (torch.float16, "fp16"), (torch.float64, "fp64")])
def test_cpu_calls_are_fused(dtype, name):
    q = torch.randn(1, 2, 5, 8, dtype=dtype)
    p = explain(q, q, q)
    assert p.fused and p.kernel == f"cpu_flash_fwd_{name}" and p.reasons == ()
    assert p.backward_kernel == f"cpu_flash_bwd_{name}"
    flash_attn_ext.scaled_dot_product_attention(q, q, q)
    assert flash_attn_ext.last_plan() == p
    assert flash_attn_ext.fallback_counts() == {}


def test_explain_layouts_and_errors():
    q = torch.randn(1, 5, 2, 8)
    assert explain(q, q, q, layout="blhd").fused
    with pytest.raises(ValueError, match="layout"):
        explain(q, q, q, layout="xyz")
    with pytest.raises(TypeError, match=r"\['is_casual'\]$"):
        explain(q, q, q, is_casual=True)
    # Packed-sequence and KV-cache arguments: not planned here; the error says where to look.
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for layout in ("bhld", "blhd"):
        with pytest.raises(TypeError, match=r"\['cu_seqlens_q'\] belong to "
                                            r"flash_attn_varlen_func.*last_plan\(\)"):
            explain(q, q, q, layout=layout, cu_seqlens_q=cu, causal_typo=1)


def _mixed_autocast():
    return torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8).bfloat16(), \
        torch.randn(1, 2, 5, 8).bfloat16()


# (layout, q/k/v shapes or a maker, call keywords, under autocast): explain() against the call.
_AS_THE_CALL = {
    "bhld head dim 300": ("bhld", ((1, 2, 5, 300),) * 3, {}, False),
    "bhld head dim 300, Ev 8": ("bhld", ((1, 2, 5, 300), (1, 2, 5, 300), (1, 2, 5, 8)), {},
                                False),
    "bhld 5-D": ("bhld", ((2, 3, 4, 16, 8),) * 3, dict(is_causal=True), False),
    "bhld 6-D": ("bhld", ((2, 1, 3, 4, 16, 8),) * 3, {}, False),
    "bhld 5-D head dim 300": ("bhld", ((2, 3, 2, 5, 300),) * 3, {}, False),
    "bhld 5-D mask": ("bhld", ((2, 3, 4, 16, 8),) * 3,
                      dict(attn_mask=torch.ones(2, 1, 4, 16, 16, dtype=torch.bool)), False),
    "bhld 5-D bad mask": ("bhld", ((2, 3, 4, 16, 8),) * 3,
                          dict(attn_mask=torch.ones(5, 16, 16, dtype=torch.bool)), False),
    "bhld 5-D key mismatch": ("bhld", ((2, 3, 4, 16, 8), (2, 4, 4, 16, 8), (2, 3, 4, 16, 8)),
                              {}, False),
    "bhld 5-D key not a tensor": ("bhld", ((2, 3, 4, 16, 8), None, (2, 3, 4, 16, 8)), {},
                                  False),
    "bhld 2-D": ("bhld", ((16, 8),) * 3, {}, False),
    "bhld enable_gqa a string": ("bhld", ((1, 2, 5, 8),) * 3, dict(enable_gqa="no"), False),
    "bhld mixed dtypes under autocast": ("bhld", _mixed_autocast, {}, True),
    "blhd head dim 300": ("blhd", ((1, 5, 2, 300),) * 3, {}, False),
    "blhd head dim 300 causal": ("blhd", ((1, 5, 2, 300),) * 3, dict(causal=True), False),
    "blhd head dim 0": ("blhd", ((1, 5, 2, 0),) * 3, {}, False),
    "blhd head dim_v 300": ("blhd", ((1, 5, 2, 8), (1, 5, 2, 8), (1, 5, 2, 300)), {}, False),
    "blhd k of head dim 300": ("blhd", ((1, 5, 2, 8), (1, 5, 2, 300), (1, 5, 2, 300)), {},
                               False),
    "blhd 5-D": ("blhd", ((2, 3, 4, 16, 8),) * 3, {}, False),
    "blhd 3-D": ("blhd", ((5, 2, 8),) * 3, {}, False),
    "blhd q not a tensor": ("blhd", (None, (1, 5, 2, 8), (1, 5, 2, 8)), {}, False),
    "blhd k not a tensor": ("blhd", ((1, 5, 2, 8), None, (1, 5, 2, 8)), {}, False),
    "blhd int32": ("blhd", ((1, 5, 2, 8),) * 3, dict(dtype=torch.int32), False),
    "blhd mixed dtypes under autocast": ("blhd", _mixed_autocast, {}, True),
}


# Bad values of each layout's keywords; explain() must raise what the call raises first.
_BAD_ARGUMENTS = {
    "bhld": dict(strict="yes", scale="x", dropout_p=2.0, is_causal="no"),
    "blhd": dict(strict="yes", dropout_p=2.0, softmax_scale="x", causal=3,
                 return_softmax_lse="y", return_attn_probs=2, deterministic="z",
                 window_size=(1,), softcap=-1.0),
}


def _outcome(f, *args, **kw):
    """None where f(*args, **kw) returns, else the (type, message) of its ValueError or
    TypeError: what explain() must reproduce of a call."""
    try:
        f(*args, **kw)
        return None
    except (ValueError, TypeError) as error:
        return type(error), str(error)


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_explain_raises_the_calls_first_error(layout):
    # One or two bad arguments at a time: explain() raises the call's error, the same one when
    # two are bad (new-user trial: explain() did not check strict= nor the return flags, and
    # in the SDPA layout checked dropout_p and is_causal before scale, the call after).
    import itertools
    bad = _BAD_ARGUMENTS[layout]
    t = torch.randn(2, 4, 16, 32)
    call = flash_attn_ext.scaled_dot_product_attention if layout == "bhld" else flash_attn_func

    def outcome(f, **kw):
        return _outcome(f, t, t, t, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for combo in itertools.chain(itertools.combinations(bad, 1),
                                     itertools.combinations(bad, 2)):
            kw = {name: bad[name] for name in combo}
            want = outcome(call, **kw)
            got = outcome(explain, layout=layout, **kw)
            assert got == want, (combo, got, want)
            if "strict" in combo or any(n.startswith("return_") for n in combo):
                assert want is not None, combo  # (each of these is refused)


@pytest.mark.parametrize("tensors", ["int64", "mixed_dtypes"])
def test_explain_raises_the_calls_error_for_bad_sdpa_tensors(tensors):
    # Tensors the SDPA drop-in refuses (not floating; dtypes differ) with one more bad argument
    # or a bad mask: explain() raises the call's error, which checks its own tensor rules
    # before the mask's, strict's and the kernels' (new-user trial: explain() named the mask
    # or the kernels' q instead).
    t = torch.randn(2, 4, 16, 32)
    q, k, v = ((t.long(), t.long(), t.long()) if tensors == "int64"
               else (t.double(), t, t))
    masks = [None, torch.zeros(3, 3), torch.zeros(1, 1, 16, 16, dtype=torch.int32)]

    def outcome(f, **kw):
        return _outcome(f, q, k, v, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mask in masks:
            for name, value in [(None, None), *_BAD_ARGUMENTS["bhld"].items()]:
                kw = {} if name is None else {name: value}
                want = outcome(flash_attn_ext.scaled_dot_product_attention, attn_mask=mask, **kw)
                assert want is not None, (tensors, name)
                assert outcome(explain, attn_mask=mask, **kw) == want, (tensors, name, mask)


@pytest.mark.parametrize("case", list(_AS_THE_CALL))
def test_explain_answers_as_the_call(case):
    # explain() gives the plan the call records, or raises the call's own error (type and
    # message); never an internal error nor a plan for a call that raises (new-user trial:
    # head dim 300 with layout="blhd" named the unfused fallback where flash_attn_func raises;
    # 5-D SDPA inputs, which the drop-in takes, were refused; a list for q raised
    # AttributeError; mixed dtypes under autocast raised where the call runs).
    import contextlib
    layout, shapes, kwargs, under_autocast = _AS_THE_CALL[case]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", torch.float32)
    if callable(shapes):
        tensors = shapes()
    else:
        tensors = [[1.0] if s is None else torch.ones(s, dtype=dtype) if dtype == torch.int32
                   else torch.randn(s) for s in shapes]
    call = flash_attn_ext.scaled_dot_product_attention if layout == "bhld" else flash_attn_func
    context = torch.autocast("cpu", dtype=torch.bfloat16) if under_autocast else \
        contextlib.nullcontext()
    with context, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = explain(*tensors, layout=layout, **kwargs)
        except (ValueError, TypeError) as error:
            with pytest.raises(type(error)) as raised:
                call(*tensors, **kwargs)
            assert str(raised.value) == str(error)
            return
        call(*tensors, **kwargs)
    assert flash_attn_ext.last_plan() == plan


def test_deterministic_backward_note(monkeypatch):
    # deterministic on sm_90: the Hopper backward adds dQ in a fixed order (a note says so);
    # where the 8-warp portable backward serves the call (head dim 256) its dQ moves to the
    # separate dQ kernel (a note); none where the 4-warp kernels serve it (they have no other).
    _pretend_hopper(monkeypatch)
    q = _CudaLike((2, 100, 4, 128))
    plain = planning.plan(q, q, q)
    assert plain.notes == () and plain.backward_kernel == "sm90_bwd_hdim128_bf16"
    noted = planning.plan(q, q, q, deterministic=True)
    assert noted.backward_kernel == "sm90_bwd_hdim128_bf16" and len(noted.notes) == 1
    assert "fixed order of key blocks" in noted.notes[0]
    q256 = _CudaLike((2, 100, 4, 256))
    assert planning.plan(q256, q256, q256).backward_kernel == "sm90_bwd_hdim256_bf16"
    ordered = planning.plan(q256, q256, q256, deterministic=True)
    assert ordered.backward_kernel == "sm90_bwd_hdim256_bf16"
    assert "fixed order of key blocks" in ordered.notes[0]
    dropped = planning.plan(q256, q256, q256, mods=planning.DROPOUT, deterministic=True)
    assert dropped.backward_kernel == "sm90_bwd_hdim256_bf16_dropout"
    assert "fixed order of key blocks" in dropped.notes[0]
    portable = planning.plan(q256, q256, q256, mods=planning.DROPOUT | planning.SOFTCAP,
                             deterministic=True)
    assert portable.backward_kernel == "sm80_bwd_hdim256_bf16"
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert planning.plan(q, q, q).notes == noted.notes
    finally:
        torch.use_deterministic_algorithms(old)
    general = planning.plan(q, q, q, mods=planning.DROPOUT, deterministic=True)
    assert not any("separate dQ kernel" in n for n in general.notes)
    cpu = torch.randn(1, 5, 2, 8)
    assert explain(cpu, cpu, cpu, layout="blhd", deterministic=True).notes == ()
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        explain(cpu, cpu, cpu, layout="blhd", deterministic="yes")


def test_call_path_plans_with_the_call_flags(monkeypatch):
    # The recorded plan is what explain() gives: the call path passes deterministic, the mask
    # window and the score modifiers to the same plan().
    seen = []
    real = planning.plan

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(planning, "plan", spy)
    q = torch.randn(1, 5, 2, 8)
    flash_attn_ext.flash_attn_func(q, q, q, deterministic=True, causal=True)
    flash_attn_ext.flash_attn_func(q, q, q, window_size=(3, -1), softcap=2.0)
    assert seen[0]["deterministic"] and seen[0]["unequal_tiles"]
    assert not seen[1]["deterministic"] and seen[1]["unequal_tiles"]
    assert flash_attn_ext.last_plan() == real(q, q, q)


def test_fallback_reasons_warn_once_count_and_strict():
    q = torch.empty(1, 4, 2, 8, device="meta")
    p = planning.plan(q, q, q)
    assert not p.fused and p.kernel == planning.FALLBACK
    assert any("'meta'" in r for r in p.reasons)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy.record(p, strict=False)
        policy.record(p, strict=False)
    assert len([w for w in caught if "falling back" in str(w.message)]) == 1
    assert sum(flash_attn_ext.fallback_counts().values()) == 2
    with pytest.raises(FallbackError, match="strict mode.*'meta'"):
        policy.record(p, strict=True)
    policy.set_strict(True)
    with pytest.raises(FallbackError):
        policy.record(p, strict=None)
    policy.record(p, strict=False)  # the call's own argument wins


def test_fallback_warning_names_the_callers_line():
    # The warning pointed at a line inside flash_attn_ext (a fixed stacklevel, right for one
    # path only; new-user trial): it names the line that called the attention, on each path.
    q = torch.empty(2, 7, 4, 16, device="meta")
    calls = {
        "flash_attn_func": lambda: flash_attn_func(q, q, q, causal=True),
        "sdpa": lambda: flash_attn_ext.scaled_dot_product_attention(
            q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2)),
    }
    for name, call in calls.items():
        policy.reset_fallback_counts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        mine = [w for w in caught if "falling back" in str(w.message)]
        assert len(mine) == 1 and mine[0].filename == __file__, (name, [
            (w.filename, w.lineno) for w in mine])
    policy.reset_fallback_counts()


def test_fallback_warning_says_what_turned_strict_mode_off(monkeypatch):
    # With FLASH_ATTN_EXT_STRICT=1 set and a call's strict=False, the warning said "Set
    # FLASH_ATTN_EXT_STRICT=1 to make this an error" (a new-user finding): it names what
    # turned strict mode off.
    q = torch.empty(1, 4, 2, 8, device="meta")

    def message(strict):
        policy.reset_fallback_counts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            policy.record(planning.plan(q, q, q), strict=strict)
        (w,) = [w for w in caught if "falling back" in str(w.message)]
        return str(w.message)
    monkeypatch.setattr(policy, "_env_strict", True)
    assert message(False).endswith("This call passed strict=False (strict=True makes this an "
                                   "error, as FLASH_ATTN_EXT_STRICT=1 would without it).")
    policy.set_strict(False)
    try:
        assert message(None).endswith("set_strict(False) is in effect (set_strict(True) makes "
                                      "this an error).")
    finally:
        policy.set_strict(None)
    monkeypatch.setattr(policy, "_env_strict", False)
    assert message(False).endswith("(strict=True makes this an error).")
    assert message(None).endswith("Set FLASH_ATTN_EXT_STRICT=1 to make this an error.")
    policy.reset_fallback_counts()


def test_fallback_warns_again_after_reset_under_the_default_filter():
    # reset_fallback_counts() promises the warning anew, but Python's "default" action (once
    # per line) hid it at the same line (new-user trial); the user's filters still apply.
    q = torch.empty(1, 4, 2, 8, device="meta")

    def warned(action):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter(action)
            for _ in range(3):
                policy.reset_fallback_counts()
                policy.record(planning.plan(q, q, q), strict=False)  # (one line, three times)
        return len([w for w in caught if "falling back" in str(w.message)])
    assert warned("default") == 3
    assert warned("ignore") == 0
    policy.reset_fallback_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="falling back"):
            policy.record(planning.plan(q, q, q), strict=False)
    policy.reset_fallback_counts()


def test_strict_env_variable():
    code = ("import torch, flash_attn_ext as f; from flash_attn_ext import planning, policy;"
            "q = torch.empty(1, 4, 2, 8, device='meta');"
            "policy.record(planning.plan(q, q, q), None)")
    env = {"FLASH_ATTN_EXT_STRICT": "1", "PATH": ""}
    r = subprocess.run([sys.executable, "-c", code], env={**env, **_pythonpath()},
                       capture_output=True, text=True)
    assert r.returncode != 0 and "FallbackError" in r.stderr


def _pythonpath():
    import os
    return {"PYTHONPATH": os.pathsep.join(sys.path)}


def test_cuda_without_kernels_is_reported():
    if flash_attn_ext.ops.build_info()["cuda"]:
        pytest.skip("this build has CUDA kernels")
    # Plan a CUDA call without a GPU: fake a CUDA tensor through the meta device's plan path.
    q = torch.empty(1, 4, 2, 8, device="meta", dtype=torch.float32)
    assert "no flash_attn_ext kernel" in str(planning.plan(q, q, q))


@pytest.mark.parametrize("causal,window,br", [(False, (-1, -1), True), (True, (-1, -1), True),
                                              (True, (-1, -1), False), (False, (3, 1), True)])
def test_fallback_path_is_correct(causal, window, br):
    q, k, v = torch.randn(2, 13, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 6)
    out, lse = unfused.fallback_attention(q, k, v, None, window[0], 0 if causal else window[1],
                                           br, 0.0)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_left=window[0],
                                 window_right=window[1], align_bottom_right=br)
    assert (out.double() - ref).abs().max() < 1e-5
    assert_lse_infinities(lse, ref_lse)
    finite = torch.isfinite(ref_lse)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < 1e-5


def test_info_cli_runs():
    r = subprocess.run([sys.executable, "-m", "flash_attn_ext", "info"], capture_output=True,
                       text=True, env=_pythonpath() | {"PATH": ""})
    assert r.returncode == 0, r.stderr
    assert "flash_attn_ext " + flash_attn_ext.__version__ in r.stdout
    # (the imported copy's folder: two checkouts tell apart)
    location = os.path.dirname(os.path.abspath(flash_attn_ext.__file__))
    assert f"  location        {location}\n" in r.stdout
    assert "cpu   float32   d=64   cpu_flash_fwd_fp32" in r.stdout


def test_flash_attn_func_strict_does_not_raise_on_cpu():
    q = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    want, _ = attention_ref(q, q, q)
    assert (flash_attn_func(q, q, q, strict=True) - want).abs().max() < 1e-12


def test_packed_variants_take_strict():
    # The packed variants of flash_attn_func and flash_attn_varlen_func lacked their strict=
    # (new-user trial: TypeError); it is passed through, value rule included.
    from flash_attn_ext import (
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
    )
    qkv = torch.randn(2, 5, 3, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    calls = {
        "qkvpacked": lambda **kw: flash_attn_qkvpacked_func(qkv, **kw),
        "kvpacked": lambda **kw: flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], **kw),
        "varlen_qkvpacked": lambda **kw: flash_attn_varlen_qkvpacked_func(
            qkv.reshape(10, 3, 2, 8), cu, 6, **kw),
        "varlen_kvpacked": lambda **kw: flash_attn_varlen_kvpacked_func(
            qkv.reshape(10, 3, 2, 8)[:, 0], qkv.reshape(10, 3, 2, 8)[:, 1:], cu, cu, 6, 6, **kw),
    }
    for name, call in calls.items():
        want = call()
        assert torch.equal(call(strict=True), want), name
        with pytest.raises(ValueError, match="strict must be True, False or None"):
            call(strict="no")


def test_fallback_through_the_public_api_on_meta():
    q = torch.empty(2, 7, 4, 16, device="meta")
    with pytest.warns(UserWarning, match="'meta'"):
        out = flash_attn_func(q, q, q, causal=True)
    assert out.shape == q.shape and out.device.type == "meta"
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_func(torch.empty(2, 7, 4, 300, device="meta"),
                        torch.empty(2, 7, 4, 300, device="meta"),
                        torch.empty(2, 7, 4, 300, device="meta"))


def test_fallback_path_with_bias_is_correct():
    q, k, v = torch.randn(2, 13, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 6)
    bias = torch.randn(2, 1, 13, 9)
    out, _ = unfused.fallback_attention(q, k, v, None, -1, -1, True, 0.0, bias)
    ref, _ = attention_ref(q, k, v, attn_bias=bias)
    assert (out.double() - ref).abs().max() < 1e-5


def test_fallback_rows_of_finfo_min_are_the_uniform_average():
    # A row whose mask is finfo(float32).min everywhere: every score equals finfo.min (the
    # scores are absorbed), so the exact answer is the mean of v over the keys.  exp(s - lse)
    # gave S times that (lse = finfo.min + log S rounds to finfo.min); softmax does not.
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 6)
    bias = torch.zeros(2, 1, 5, 7)
    bias[:, :, 2] = torch.finfo(torch.float32).min
    out, _ = unfused.fallback_attention(q, k, v, None, -1, -1, True, 0.0, bias)
    ref, _ = attention_ref(q, k, v, attn_bias=bias)
    mean = v.double().mean(1).repeat_interleave(2, 1)  # (B, H, Dv): the uniform average
    assert (out[:, 2].double() - mean).abs().max() < 1e-5
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("softcap", [0.7, 30.0])
def test_fallback_path_with_softcap_is_correct(softcap):
    q, k, v = torch.randn(1, 9, 2, 8) * 3, torch.randn(1, 11, 2, 8), torch.randn(1, 11, 2, 8)
    out, lse = unfused.fallback_attention(q, k, v, 0.5, -1, 0, True, softcap)
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=0.5, causal=True, softcap=softcap)
    assert (out.double() - ref).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5


def test_fallback_propagates_nan_and_zeroes_rows_without_keys():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    out, lse = unfused.fallback_attention(q, k, v, None, -1, 0, True, 0.0)  # L > S: rows 0, 1
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert torch.isneginf(lse[0, 0, :2]).all() and torch.isfinite(out).all()
    q[0, 3, 0, 0] = float("nan")
    out, _ = unfused.fallback_attention(q, k, v, None, -1, -1, True, 0.0)
    assert torch.isnan(out[0, 3]).all() and torch.isfinite(out[0, :3]).all()


def test_plan_notes_are_printed():
    note = "forward and backward on the portable sm80 kernels, not the Hopper ones, because x"
    p = planning.Plan("sm80_fwd_hdim64_bf16", "sm80_bwd_hdim64_bf16", True, notes=(note,))
    assert str(p) == f"sm80_fwd_hdim64_bf16 (backward: sm80_bwd_hdim64_bf16); note: {note}"


def test_kernel_env_is_read_once_at_import():
    # FLASH_ATTN_EXT_KERNEL=sm80 sets the force_portable option when flash_attn_ext is imported;
    # another value makes the import fail with the variable's rule.
    code = ("import flash_attn_ext as f; print(f.ops._C.kernel_options()['force_portable'])")
    for value, out in (("sm80", "True"), ("auto", "False"), ("", "False")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"FLASH_ATTN_EXT_KERNEL": value, "PATH": "", **_pythonpath()})
        assert r.returncode == 0 and r.stdout.strip() == out, (value, r.stderr)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"FLASH_ATTN_EXT_KERNEL": "hopper", "PATH": "", **_pythonpath()})
    assert r.returncode != 0
    assert "FLASH_ATTN_EXT_KERNEL must be 'auto' or 'sm80', got 'hopper'" in r.stderr


def test_kernel_options_are_checked_and_restored(kernel_opts):
    with flash_attn_ext.kernel_options(sm90_schedule="tile", bwd_atomic_dq=True) as now:
        assert now["sm90_schedule"] == "tile" and now["bwd_atomic_dq"]
    assert ops._C.kernel_options()["sm90_schedule"] == "auto"
    assert not ops._C.kernel_options()["bwd_atomic_dq"]
    # The CUDA backward's exact pass on every call by default (huge scores, issue 29).
    assert ops._C.kernel_options()["exact_rows_always"]
    with flash_attn_ext.kernel_options(exact_rows_always=False) as now:
        assert not now["exact_rows_always"]
    with pytest.raises(ValueError, match="exact_rows_always must be a bool"):
        kernel_opts(exact_rows_always=1)
    # Counts from a short list or "auto": a value set and restored, and values refused.
    for name, good, bads, allowed in (
            ("sm90_fma_exp2", 4, (3, 8, -1, True, "2", 2.0), "0, 2 or 4"),
            ("sm90_per_score_consumers", 3, (0, 1, 4, True, "3", 3.0), "2 or 3"),
            ("decode_row_lanes", 8, (0, 1, 16, True, "4", 4.0), "2, 4 or 8"),
            ("decode_combine_splits", 8, (0, 2, 32, True, "8", 8.0), "4, 8 or 16"),
            ("decode_block_rows", 16, (0, 8, 64, True, "16", 16.0), "16 or 32"),
            ("decode_ctas_per_sm", 3, (0, 5, -1, True, "2", 2.0), "1, 2, 3 or 4")):
        assert ops._C.kernel_options()[name] == "auto"
        with flash_attn_ext.kernel_options(**{name: good}) as now:
            assert now[name] == good
        assert ops._C.kernel_options()[name] == "auto"
        for bad in bads:
            with pytest.raises(ValueError, match=f"{name} must be 'auto', {allowed} "):
                kernel_opts(**{name: bad})
    for name, default in (("sm90_alibi_fold", True), ("sm90_narrow_tiles", False),
                          ("sm90_bwd_short_steps", True), ("sm90_mask_rows", True),
                          ("sm90_varlen_sections", True), ("decode_contiguous_loads", True)):
        assert ops._C.kernel_options()[name] is default
        with flash_attn_ext.kernel_options(**{name: not default}) as now:
            assert now[name] is not default
        assert ops._C.kernel_options()[name] is default
        with pytest.raises(ValueError, match=f"{name} must be a bool"):
            kernel_opts(**{name: 1})
    assert ops._C.kernel_options()["decode_pdl"] is True
    with flash_attn_ext.kernel_options(decode_pdl=False) as now:
        assert now["decode_pdl"] is False
    assert ops._C.kernel_options()["decode_pdl"] is True
    with pytest.raises(ValueError, match="decode_pdl must be a bool"):
        kernel_opts(decode_pdl=1)
    with pytest.raises(ValueError, match="unknown kernel options"):
        kernel_opts(sm90_epilogue="direct")
    with pytest.raises(ValueError, match="sm90_pack_gqa must be one of 'auto', 'on', 'off'"):
        kernel_opts(sm90_pack_gqa=True)
    before = ops._C.kernel_options()
    with pytest.raises(ValueError):  # a bad value changes nothing, the good ones neither
        kernel_opts(force_portable=True, sm90_schedule="greedy")
    assert ops._C.kernel_options() == before


def test_build_info_reports_the_hopper_kernels():
    info = ops.build_info()
    assert isinstance(info["sm90"], bool)
    assert not info["sm90"] or info["cuda"]


def test_explain_follows_autocast():
    q = torch.randn(1, 2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert explain(q, q, q).kernel == "cpu_flash_fwd_bf16"
        flash_attn_ext.scaled_dot_product_attention(q, q, q)
        assert policy.last_plan().kernel == "cpu_flash_fwd_bf16"
    assert explain(q, q, q).kernel == "cpu_flash_fwd_fp32"


@pytest.mark.parametrize("archs,capability,runs", [
    ("8.0;9.0a", (8, 0), True), ("8.0;9.0a", (8, 6), True), ("8.0;9.0a", (8, 9), True),
    ("8.0;9.0a", (9, 0), True), ("8.0;9.0a", (10, 0), False), ("8.0;9.0a", (12, 0), False),
    ("8.0;9.0a", (7, 5), False), ("8.6", (8, 0), False), ("9.0a", (8, 0), False),
    ("8.0+PTX", (10, 0), True), ("8.0 9.0+PTX", (10, 0), True), ("9.0a+PTX", (10, 0), False),
    ("9.0", (9, 0), True),
    ("", (9, 0), False)])
def test_arch_runs_on(monkeypatch, archs, capability, runs):
    # The rule's arch test (kernel_select.h: arch_runs_on), seen through a plan.
    monkeypatch.setattr(planning, "_capability", lambda index: capability)
    monkeypatch.setattr(planning, "_smem_per_block", lambda index: 232448)
    monkeypatch.setattr(planning.ops, "build_info",
                        lambda: {"cuda": True, "cuda_archs": archs, "sm90": False})
    q = _CudaLike((2, 100, 4, 64))
    p = planning.plan(q, q, q)
    if capability < (8, 0):
        assert not p.fused and "need sm_80 or newer" in str(p)
    else:
        assert p.fused is runs and (runs or "does not run on it" in str(p))


class _CudaLike:
    """Shape, dtype, strides and a CUDA device: what plan() reads, without a GPU."""

    def __init__(self, shape, dtype=torch.bfloat16):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device("cuda", 0)
        self._strides = torch.empty(shape, device="meta").stride()

    def stride(self, i=None):
        return self._strides if i is None else self._strides[i]


@pytest.mark.parametrize("cap,sm90,kernel,text", [
    ((9, 0), True, "sm90_fwd_hdim64_bf16", ""),
    ((9, 0), False, "sm80_fwd_hdim64_bf16", "no Hopper kernels"),
    ((8, 6), True, "sm80_fwd_hdim64_bf16", ""),
    ((10, 0), True, planning.FALLBACK, "does not run on it"),
    ((7, 5), True, planning.FALLBACK, "need sm_80 or newer")])
def test_cuda_plan_by_gpu_and_build(monkeypatch, cap, sm90, kernel, text):
    monkeypatch.setattr(planning, "_capability", lambda index: cap)
    monkeypatch.setattr(planning, "_smem_per_block", lambda index: 232448)
    monkeypatch.setattr(planning.ops, "build_info",
                        lambda: {"cuda": True, "cuda_archs": "8.0;9.0a", "sm90": sm90})
    q = _CudaLike((2, 100, 4, 64))
    p = planning.plan(q, q, q)
    assert p.kernel == kernel and text in str(p)
    assert planning.plan(q, q, q) is p  # eager CUDA plans are computed once per key


def _pretend_hopper(monkeypatch):
    """plan() as on an H200 with a build that has the Hopper kernels, from an empty cache."""
    monkeypatch.setattr(planning, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(planning, "_smem_per_block", lambda index: 232448)
    monkeypatch.setattr(planning.ops, "build_info",
                        lambda: {"cuda": True, "cuda_archs": "8.0;9.0a", "sm90": True})


def test_cuda_plan_follows_options_flags_and_strides(monkeypatch, kernel_opts):
    # What the CUDA plan depends on reaches the rule: the options, softcap/mask/dropout
    # (score_mods), the dtype, a stride-0 (broadcast) input, the scale.
    _pretend_hopper(monkeypatch)
    q = _CudaLike((2, 100, 4, 128))
    first = planning.plan(q, q, q)
    assert first.kernel == "sm90_fwd_hdim128_bf16"
    with flash_attn_ext.kernel_options(force_portable=True):
        assert planning.plan(q, q, q).kernel == "sm80_fwd_hdim128_bf16"
    assert planning.plan(q, q, q) is first  # the same options again: the cached plan
    # Softcap, a bias and dropout: the Hopper kernels' general variant, backward too; a bias
    # that needs a gradient: the portable backward, saying why.
    p = planning.plan(q, q, q, mods=planning.SOFTCAP | planning.BIAS)
    assert p.kernel == "sm90_fwd_hdim128_bf16_general"
    assert p.backward_kernel == "sm90_bwd_hdim128_bf16_general"
    p = planning.plan(q, q, q, mods=planning.BIAS | planning.BIAS_GRAD)
    assert p.kernel == "sm90_fwd_hdim128_bf16_general"
    assert p.backward_kernel == "sm80_bwd_hdim128_bf16" and "requires grad" in str(p)
    # Dropout with any other modifier: the general variants (a bias with a gradient: the
    # portable backward).
    for mods in (planning.SOFTCAP, planning.ALIBI, planning.BIAS):
        p = planning.plan(q, q, q, mods=mods | planning.DROPOUT)
        assert p.kernel == "sm90_fwd_hdim128_bf16_general", mods
        assert p.backward_kernel == "sm90_bwd_hdim128_bf16_general", mods
    p = planning.plan(q, q, q, mods=planning.BIAS | planning.BIAS_GRAD | planning.DROPOUT)
    assert p.kernel == "sm90_fwd_hdim128_bf16_general"
    assert p.backward_kernel == "sm80_bwd_hdim128_bf16"
    # Dropout alone: the dropout variants (the plain kernels with the mask).
    p = planning.plan(q, q, q, mods=planning.DROPOUT)
    assert p.kernel == "sm90_fwd_hdim128_bf16_dropout" and p.notes == ()
    assert p.backward_kernel == "sm90_bwd_hdim128_bf16_dropout"
    q64 = _CudaLike((2, 100, 4, 40))
    p = planning.plan(q64, q64, q64, mods=planning.DROPOUT)
    assert (p.kernel, p.backward_kernel) == ("sm90_fwd_hdim64_bf16_dropout",
                                             "sm90_bwd_hdim64_bf16_dropout")
    q256 = _CudaLike((2, 100, 4, 256))
    p = planning.plan(q256, q256, q256, mods=planning.DROPOUT)
    assert (p.kernel, p.backward_kernel) == ("sm90_fwd_hdim256_bf16_dropout",
                                             "sm90_bwd_hdim256_bf16_dropout")
    assert planning.plan(q, q, q, run_dtype=torch.float16).kernel == "sm90_fwd_hdim128_fp16"
    kernel_opts(force_portable=True)
    p = planning.plan(q, q, q)
    assert p.kernel == "sm80_fwd_hdim128_bf16" and "FLASH_ATTN_EXT_KERNEL=sm80" in str(p)
    kernel_opts(force_portable=False)
    assert planning.plan(q, q, q).kernel == "sm90_fwd_hdim128_bf16"
    k = _CudaLike((2, 100, 4, 128))
    k._strides = (0, 512, 128, 1)  # batch broadcast: TMA cannot describe it
    p = planning.plan(q, k, k)
    assert p.kernel == "sm80_fwd_hdim128_bf16" and "k has a broadcast" in str(p)
    k._strides = (0, 500, 125, 1)  # not 8-aligned: the glue copies it, broadcast and all
    assert planning.plan(q, k, k).kernel == "sm90_fwd_hdim128_bf16"
    p = planning.plan(q, q, q, softmax_scale=-1.0)
    assert not p.fused and "softmax_scale=-1.0: the CUDA kernels take a positive scale" in str(p)
    assert "softmax_scale=-0.3: " in str(planning.plan(q, q, q, softmax_scale=-0.3))
    p = planning.plan(q, q, q, run_dtype=torch.float32)
    assert not p.fused and "q.dtype=torch.float32" in str(p)


def test_packed_and_kvcache_calls_record_their_plan():
    # flash_attn_varlen_func and flash_attn_with_kvcache recorded no plan: last_plan() still
    # named an earlier dense call's kernels after them.
    def dense():
        flash_attn_func(*(torch.randn(1, 3, 2, 8) for _ in range(3)))
        assert flash_attn_ext.last_plan().kernel == "cpu_flash_fwd_fp32"

    dense()
    q, k = torch.randn(30, 4, 40, dtype=torch.float64), torch.randn(30, 2, 40, dtype=torch.float64)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    flash_attn_ext.flash_attn_varlen_func(q, k, k, cu, cu, 20, 20, causal=True)
    p = flash_attn_ext.last_plan()
    assert (p.kernel, p.backward_kernel, p.fused) == ("cpu_flash_fwd_fp64_varlen",
                                                      "cpu_flash_bwd_fp64_varlen", True)
    dense()
    cache = torch.randn(2, 16, 2, 40)
    flash_attn_ext.flash_attn_with_kvcache(torch.randn(2, 1, 4, 40), cache, cache,
                                           cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))
    assert flash_attn_ext.last_plan().kernel == "cpu_flash_fwd_fp32_varlen"
    assert flash_attn_ext.kvcache._decode_refusal(
        q[None], cache, cache, None, None, None, None, None) == \
        "the decode kernels are CUDA kernels"


def test_cuda_plan_of_packed_calls(monkeypatch):
    # The rule's packed-sequence kernels (kernel_select.h, CallInfo::packed), with q, k, v
    # described as the varlen ops describe them: (1, total, heads, head_dim), a last dimension
    # that is not contiguous as the op's contiguous copy.
    _pretend_hopper(monkeypatch)
    q = _CudaLike((300, 4, 128))
    p = planning.plan(q, q, q, packed=True)
    assert (p.kernel, p.backward_kernel) == ("sm90_fwd_hdim128_bf16_varlen",
                                             "sm90_bwd_hdim128_bf16_varlen")
    p = planning.plan(q, q, q, mods=planning.SOFTCAP, packed=True)
    assert (p.kernel, p.backward_kernel) == ("sm90_fwd_hdim128_bf16_varlen_softcap",
                                             "sm90_bwd_hdim128_bf16_varlen_softcap")
    for mods, name in ((planning.ALIBI, "alibi"), (planning.DROPOUT, "dropout")):
        p = planning.plan(q, q, q, mods=mods, packed=True)
        assert (p.kernel, p.backward_kernel) == (f"sm90_fwd_hdim128_bf16_varlen_{name}",
                                                 f"sm90_bwd_hdim128_bf16_varlen_{name}")
    p = planning.plan(q, q, q, mods=planning.ALIBI | planning.DROPOUT, packed=True)
    assert p.kernel == "sm80_fwd_hdim128_bf16" and "packed sequences" in str(p)
    p = planning.plan(q, q, q, run_dtype=torch.float32, packed=True)
    assert not p.fused  # (varlen records nothing for it: the op refuses the call)
    t = torch.empty(300, 4, 128, 2, device="meta")[..., 0]  # last stride 2
    layout = planning._layout(t, t, t, packed=True)
    copy = torch.empty(300, 4, 128, device="meta").unsqueeze(0)
    assert layout[:8] == (*copy.shape, *copy.stride())
    t = torch.empty(300, 8, 128, device="meta")[:, ::2]
    assert planning._layout(t, t, t, packed=True)[:8] == (*t.unsqueeze(0).shape,
                                                         *t.unsqueeze(0).stride())


def test_pack_gqa_rule(monkeypatch, kernel_opts):
    # The Hopper forward packs a GQA group's query heads where that needs at most half the
    # tiles (csrc/kernels/sm90/pack_gqa.h); the options force it on or off.
    _pretend_hopper(monkeypatch)

    def packs(seqlen_q, heads_q, heads_kv, head_dim):
        q, k = _CudaLike((1, seqlen_q, heads_q, head_dim)), _CudaLike((1, 9, heads_kv, head_dim))
        return planning.plan(q, k, k).kernel.endswith("_packgqa")
    assert packs(1, 32, 4, 128)         # decoding: 1 tile instead of 4
    assert packs(64, 32, 4, 64)         # 2 tiles of 192 rows instead of 4
    assert not packs(128, 32, 4, 64)    # 3 instead of 4: measured slower
    assert not packs(4096, 32, 4, 128)  # long rows fill their tiles
    assert not packs(1, 8, 8, 128)      # no group to pack
    kernel_opts(sm90_pack_gqa="on")
    assert packs(4096, 32, 4, 128) and not packs(1, 8, 8, 64)
    kernel_opts(sm90_pack_gqa="off")
    assert not packs(1, 32, 4, 128)


def test_cuda_plan_names_the_packed_gqa_forward(monkeypatch):
    # A decoding-shaped GQA call on sm_90 is planned as the packed Hopper forward; the same
    # heads at a long seqlen_q, or without GQA, are not; the sm80 forward never packs.
    _pretend_hopper(monkeypatch)
    q1, q2k, k = _CudaLike((2, 1, 32, 64)), _CudaLike((2, 2048, 32, 64)), _CudaLike((2, 9, 4, 64))
    p = planning.plan(q1, k, k)
    assert p.kernel == "sm90_fwd_hdim64_bf16_packgqa" and p.fused
    assert p.backward_kernel == "sm90_bwd_hdim64_bf16" and p.notes == ()
    assert planning.plan(q1, k, k) is p
    assert planning.plan(q2k, k, k).kernel == "sm90_fwd_hdim64_bf16"
    assert planning.plan(q1, q1, q1).kernel == "sm90_fwd_hdim64_bf16"
    # (the general variant does not pack: the bias tells the heads apart; nor do the softcap
    # variants, softcap alone)
    p = planning.plan(q1, k, k, mods=planning.SOFTCAP)
    assert (p.kernel, p.backward_kernel) == ("sm90_fwd_hdim64_bf16_softcap",
                                             "sm90_bwd_hdim64_bf16_softcap")
    for extra in (planning.ALIBI, planning.BIAS, planning.DROPOUT):
        assert planning.plan(q1, k, k, mods=planning.SOFTCAP | extra).kernel == \
            "sm90_fwd_hdim64_bf16_general", extra
    p = planning.plan(q1, k, k, mods=planning.ALIBI)  # (ALiBi alone: the ALiBi variants)
    assert (p.kernel, p.backward_kernel) == ("sm90_fwd_hdim64_bf16_alibi",
                                             "sm90_bwd_hdim64_bf16_alibi")
    assert planning.plan(q1, k, k, mods=planning.DROPOUT).kernel == "sm90_fwd_hdim64_bf16_dropout"
    with flash_attn_ext.kernel_options(sm90_pack_gqa="off"):
        assert planning.plan(q1, k, k).kernel == "sm90_fwd_hdim64_bf16"
    # Rows past the Hopper kernel's 32-bit arithmetic: the portable kernel, with the reason
    # (planned afresh, not from the cached plan of the same dtype and head dim).
    huge = _CudaLike((1, planning.SM90_MAX_ROWS + 1, 1, 64))
    p = planning.plan(huge, huge, huge)
    assert p.kernel == "sm80_fwd_hdim64_bf16" and "32-bit" in str(p)
    assert planning.plan(q1, q1, q1).kernel == "sm90_fwd_hdim64_bf16"


def test_cuda_plan_names_the_mask_variant(monkeypatch):
    # A boolean mask alone runs the Hopper kernels' mask variant, forward and backward, unpacked;
    # with anything else beside it the general variant (the mask then as an fp32 bias), and
    # score_mods marks a boolean attn_bias.
    _pretend_hopper(monkeypatch)
    q1, k = _CudaLike((2, 1, 32, 64)), _CudaLike((2, 9, 4, 64))
    mask = planning.BIAS | planning.MASK
    p = planning.plan(q1, k, k, mods=mask)
    assert (p.kernel, p.backward_kernel) == ("sm90_fwd_hdim64_bf16_mask",
                                             "sm90_bwd_hdim64_bf16_mask")
    # (head dim 256: the backward's split by role has the mask variant too)
    q256, k256 = _CudaLike((2, 1, 32, 256)), _CudaLike((2, 9, 4, 256))
    assert planning.plan(q256, k256, k256, mods=mask).backward_kernel == \
        "sm90_bwd_hdim256_bf16_mask"
    for extra in (planning.SOFTCAP, planning.ALIBI, planning.DROPOUT):
        assert planning.plan(q1, k, k, mods=mask | extra).kernel == "sm90_fwd_hdim64_bf16_general"
    assert planning.plan(q1, k, k, mods=planning.BIAS).kernel == "sm90_fwd_hdim64_bf16_general"
    m = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    assert planning.score_mods(0.0, 0.0, m) == mask
    assert planning.score_mods(0.0, 0.0, m.float()) == planning.BIAS


@pytest.mark.parametrize("cap,smem,head_dim,mods,text", [
    ((9, 0), 232448, 128, 0, None),
    ((9, 0), 232448, 128, planning.SOFTCAP | planning.BIAS, None),
    ((9, 0), 232448, 128, planning.BIAS | planning.BIAS_GRAD, "requires grad"),
    ((9, 0), 232448, 64, 0, None),
    ((9, 0), 232448, 64, planning.SOFTCAP, None),  # the Hopper backward's softcap variant
    ((9, 0), 232448, 128, planning.ALIBI, None),
    ((8, 0), 166912, 64, planning.SOFTCAP, "alibi_slopes and dropout"),
    ((9, 0), 232448, 256, 0, None),  # the Hopper backward's split by role
    ((9, 0), 232448, 256, planning.SOFTCAP, None),  # softcap alone: its variant at 256 too
    ((9, 0), 232448, 256, planning.DROPOUT, None),  # dropout alone: its variant at 256 too
    ((9, 0), 232448, 256, planning.DROPOUT | planning.SOFTCAP, "at head dims up to 128"),
    ((9, 0), 232448, 256, planning.BIAS | planning.MASK, None),  # a boolean mask alone
    ((9, 0), 232448, 256, planning.BIAS, "float attn_bias"),
    ((8, 0), 166912, 256, 0, "214016 bytes of shared memory"),  # not sm_80's 163 KB
    ((8, 6), 101376, 64, 0, None),            # 97 KB: the d=64 kernels fit
    ((8, 6), 101376, 128, 0, "164864 bytes of shared memory"),
    ((8, 0), 166912, 128, 0, None)])
def test_plan_notes_which_backward_kernels_serve(monkeypatch, cap, smem, head_dim, mods, text):
    # The Hopper backward serves sm_90 (score modifiers up to head dim 128); the 8-warp one where
    # the GPU's shared memory allows (head dim 256: sm_90, not sm_80); otherwise the plan says
    # that the 4-warp kernels serve it, and why.
    monkeypatch.setattr(planning, "_capability", lambda index: cap)
    monkeypatch.setattr(planning, "_smem_per_block", lambda index: smem)
    monkeypatch.setattr(planning.ops, "build_info",
                        lambda: {"cuda": True, "cuda_archs": "8.0;8.6;9.0a", "sm90": True})
    q = _CudaLike((2, 100, 4, head_dim))
    p = planning.plan(q, q, q, mods=mods)
    backward_notes = [n for n in p.notes if n.startswith("backward")]
    if text is None:
        assert not backward_notes
    else:
        # (the first note says why not the fastest backward; a second, why the 4-warp kernels)
        assert len(backward_notes) == 1 + (cap == (9, 0) and mods != 0), backward_notes
        assert text in backward_notes[0] and text in str(p)


@pytest.mark.parametrize("value,strict", [("on", True), ("Yes", True), ("off", False),
                                          ("", False), (" 0 ", False)])
def test_strict_env_values(monkeypatch, value, strict):
    # Read once, at import: the parser here; test_strict_env_variable shows the import.
    monkeypatch.setenv("FLASH_ATTN_EXT_STRICT", value)
    assert policy._read_strict_env() is strict
    monkeypatch.setattr(policy, "_env_strict", policy._read_strict_env())
    assert policy.strict_enabled() is strict


def test_strict_env_unknown_value_raises(monkeypatch):
    # An unknown value must not quietly leave strict mode off: the import fails with the rule.
    monkeypatch.setenv("FLASH_ATTN_EXT_STRICT", "enable")
    with pytest.raises(ValueError, match="FLASH_ATTN_EXT_STRICT must be .* got 'enable'"):
        policy._read_strict_env()
    r = subprocess.run([sys.executable, "-c", "import flash_attn_ext"], capture_output=True,
                       text=True, env={"FLASH_ATTN_EXT_STRICT": "enable", "PATH": "",
                                       **_pythonpath()})
    assert r.returncode != 0 and "FLASH_ATTN_EXT_STRICT must be" in r.stderr


def test_fallback_plan_has_no_fused_backward():
    q = torch.randn(1, 3, 1, 300)
    p = flash_attn_ext.explain(q, q, q)
    assert not p.fused and not p.backward_fused
    assert p.backward_reasons == p.reasons and "head dims 1 to 256" in p.reasons[0]


@pytest.mark.parametrize("dynamic", [False, True])
def test_cuda_planning_traces_under_torch_compile(monkeypatch, dynamic):
    # The planning path of every CUDA call (planning._plan_cuda), traced by Dynamo with
    # fullgraph=True here on the CPU, the GPU's answers stood in.  Anything on it that Dynamo
    # cannot trace (a pybind function called directly, say) fails here as it fails every
    # compiled CUDA call; with dynamic shapes the sizes are symbolic and the rule answers
    # without them.
    _pretend_hopper(monkeypatch)

    def f(q, k, v):
        p = planning._plan_cuda(q, k, v, 0, "bf16", None, False, True, False)
        return q * 2 if p.fused and p.kernel.startswith("sm90_fwd") else q

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager", dynamic=dynamic)
    for seqlen in (100, 37):
        q = torch.randn(2, seqlen, 4, 64)
        torch.testing.assert_close(compiled(q, q, q), q * 2)
    torch._dynamo.reset()


def test_a_dropout_p_that_rounds_to_zero_is_no_score_mod():
    # The kernels drop nothing for dropout_p <= 1/512 (csrc/dropout.h: dropout_active), so the
    # plan must not name the general variant for it.
    assert planning.score_mods(0.0, 0.001, None) == 0
    assert planning.score_mods(0.0, 1 / 512, None) == 0
    assert planning.score_mods(0.0, 0.0025, None) == planning.DROPOUT
    assert planning.score_mods(0.0, 0.1, None) == planning.DROPOUT


def test_packed_sequences_rule(kernel_opts):
    # Packed sequences (the varlen ops) on an H200: the Hopper varlen forward and backward for
    # plain attention at head dims up to 256, a deterministic call too (dQ in a fixed order,
    # the note says so), and their varlen softcap, ALiBi and dropout instantiations for each
    # alone; two modifiers together (softcap with dropout, ALiBi with dropout, softcap with
    # ALiBi) and sm90_bwd="off" take the portable backward, the note saying why; on sm_80 the
    # 4-warp kernels, the note saying why not the 8-warp ones.
    build = {"cuda": True, "sm90": True, "cuda_archs": "8.0;9.0a"}

    def rule(head_dim=128, mods=0, deterministic=False, device=(9, 0, 232448)):
        fused, reasons, fwd, bwd, notes = flash_attn_ext.ops._C.select_cuda_kernels(
            build, device, "bf16", None, head_dim, head_dim, None, mods, False, deterministic,
            packed=True)
        assert fused, reasons
        return fwd, bwd, notes

    assert rule() == ("sm90_fwd_hdim128_bf16_varlen", "sm90_bwd_hdim128_bf16_varlen", ())
    assert rule(head_dim=40)[1] == "sm90_bwd_hdim64_bf16_varlen"
    _, bwd, notes = rule(deterministic=True)
    assert bwd == "sm90_bwd_hdim128_bf16_varlen"
    assert [n for n in notes if n.startswith("backward dQ added in a fixed order") and
            "deterministic=True" in n], notes
    assert rule(head_dim=256)[1] == "sm90_bwd_hdim256_bf16_varlen"
    for mods, name in ((planning.SOFTCAP, "softcap"), (planning.ALIBI, "alibi"),
                       (planning.DROPOUT, "dropout")):
        for head_dim in (40, 128, 256):
            padded = 64 if head_dim == 40 else head_dim
            for deterministic in (False, True):
                fwd, bwd, _ = rule(head_dim=head_dim, mods=mods, deterministic=deterministic)
                assert (fwd, bwd) == (f"sm90_fwd_hdim{padded}_bf16_varlen_{name}",
                                      f"sm90_bwd_hdim{padded}_bf16_varlen_{name}")
    for mods in (planning.SOFTCAP | planning.DROPOUT, planning.ALIBI | planning.DROPOUT,
                 planning.SOFTCAP | planning.ALIBI):
        fwd, bwd, notes = rule(mods=mods)
        assert (fwd, bwd) == ("sm80_fwd_hdim128_bf16", "sm80_bwd_hdim128_bf16"), (mods, bwd)
        for part in ("forward", "backward"):
            said = [n for n in notes if n.startswith(part)]
            assert len(said) == 1 and "at most one of softcap, alibi_slopes and dropout" in \
                said[0], (mods, notes)
            assert "not the Hopper one" in said[0], (mods, notes)
    kernel_opts(sm90_bwd="off")
    _, bwd, notes = rule()
    assert bwd == "sm80_bwd_hdim128_bf16"
    assert [n for n in notes if n.startswith("backward") and "sm90_bwd='off'" in n], notes
    kernel_opts(sm90_bwd="auto")
    fwd, bwd, notes = rule(device=(8, 0, 166912))
    assert (fwd, bwd) == ("sm80_fwd_hdim128_bf16", "sm80_bwd_hdim128_bf16")
    assert any("8-warp kernels do not take packed sequences" in n for n in notes), notes


def test_a_call_that_raises_leaves_last_plan_alone():
    # A fused call recorded its plan before its op checked the arguments, so that last_plan()
    # named the kernels of a call that raised and never ran (new-user trial): each function's
    # plan is recorded once its op has returned.  (float64 calls after a float32 one: a stale
    # plan would show.)
    from flash_attn_ext import flash_attn_varlen_func, flash_attn_with_kvcache

    def ok():
        flash_attn_func(*(torch.randn(1, 3, 2, 8) for _ in range(3)))
        return flash_attn_ext.last_plan()
    q, bad_k = torch.randn(1, 3, 2, 8).double(), torch.randn(2, 3, 2, 8).double()
    cu, decreasing = (torch.tensor(c, dtype=torch.int32) for c in ([0, 1, 3], [0, 2, 1]))
    calls = {
        "flash_attn_func": (lambda: flash_attn_func(q, bad_k, bad_k), "batch"),
        "sdpa": (lambda: flash_attn_ext.scaled_dot_product_attention(
            q.transpose(1, 2), bad_k.transpose(1, 2), bad_k.transpose(1, 2)), "batch"),
        "varlen offsets": (lambda: flash_attn_varlen_func(q[0], q[0], q[0], decreasing, cu, 2, 2),
                           "non-decreasing"),
        "varlen max_seqlen": (lambda: flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 1, 2),
                              "shorter than the longest"),
        "varlen alibi": (lambda: flash_attn_varlen_func(
            q[0], q[0], q[0], cu, cu, 2, 2, alibi_slopes=torch.rand(3, 2)), "alibi_slopes"),
    }
    for name, (call, match) in calls.items():
        before = ok()
        with pytest.raises(ValueError, match=match):
            call()
        assert flash_attn_ext.last_plan() is before, name
    # The calls that run are recorded, as before.
    flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 2, 2)
    assert flash_attn_ext.last_plan().kernel == "cpu_flash_fwd_fp64_varlen"
    ok()
    cache = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    flash_attn_with_kvcache(q, cache, cache, cache_seqlens=1)
    assert flash_attn_ext.last_plan().kernel == "cpu_flash_fwd_fp64_varlen"


def test_a_fallback_that_strict_mode_refuses_is_last_plan():
    # The one call that raises and is recorded (policy.last_plan's docstring): strict mode's
    # refusal, so that last_plan() names the refused plan whose reasons FallbackError gives,
    # as explain() does.
    q = torch.empty(1, 4, 2, 8, device="meta")
    flash_attn_func(*(torch.randn(1, 3, 2, 8) for _ in range(3)))
    with pytest.raises(FallbackError, match="'meta' has no flash_attn_ext kernel"):
        flash_attn_func(q, q, q, strict=True)
    assert flash_attn_ext.last_plan() == explain(q, q, q, layout="blhd", strict=True)
    assert not flash_attn_ext.last_plan().fused


def _explain_thd_and_call(q, k, v, **kwargs):
    """(explain's outcome, the varlen call's outcome, last_plan() after it): ("ok", Plan) or
    ("raised", (type, message))."""
    def outcome(f):
        try:
            return "ok", f()
        except Exception as error:  # (every exception is compared)
            return "raised", (type(error), str(error))
    said = outcome(lambda: explain(q, k, v, layout="thd", **kwargs))
    policy._last_plan = None
    done = outcome(lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, **kwargs))
    return said, done, flash_attn_ext.last_plan()


def test_explain_thd_is_the_varlen_calls_plan_and_error():
    # explain() refused flash_attn_varlen_func's arguments (new-user trial): layout="thd"
    # plans a packed call as the call does, its checks in the call's order (its op's too).
    q, k = torch.randn(10, 4, 16, dtype=torch.float64), torch.randn(12, 2, 16, dtype=torch.float64)
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in ([0, 4, 10], [0, 5, 12]))
    base = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=6, max_seqlen_k=7)
    table = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)
    good = [{}, dict(causal=True), dict(softcap=5.0), dict(alibi_slopes=torch.rand(4)),
            dict(dropout_p=0.1), dict(softcap=5.0, alibi_slopes=torch.rand(2, 4), dropout_p=0.2),
            dict(window_size=(2, 1), deterministic=True, softmax_scale=0.3),
            dict(seqused_k=torch.tensor([3, 7], dtype=torch.int32), return_attn_probs=True),
            dict(strict=True), dict(max_seqlen_q=100, max_seqlen_k=2**40)]
    for extra in good:
        said, done, recorded = _explain_thd_and_call(q, k, k, **{**base, **extra})
        assert said[0] == done[0] == "ok" and said[1] == recorded, (extra, said, done)
        assert said[1].kernel == "cpu_flash_fwd_fp64_varlen"
    # a block_table call: its pages' copy in the notes, as the call's plan
    pages = torch.randn(5, 3, 2, 16, dtype=torch.float64)
    said, done, recorded = _explain_thd_and_call(q, pages, pages, **base, block_table=table)
    assert said[0] == "ok" and said[1] == recorded and "block_table" in said[1].notes[0]
    bad = [dict(max_seqlen_q=-1), dict(max_seqlen_k=6), dict(max_seqlen_q=2.5),
           dict(cu_seqlens_q=torch.tensor([0, 6, 4], dtype=torch.int32)),
           dict(cu_seqlens_k=ck.long()), dict(cu_seqlens_q=[0, 4, 10]), dict(causal="yes"),
           dict(alibi_slopes=torch.rand(3)), dict(alibi_slopes=torch.rand(3, 4)),
           dict(seqused_k=torch.tensor([6, 7], dtype=torch.int32)), dict(softcap=-1.0),
           dict(window_size=(-2, 0)), dict(dropout_p=2.0), dict(strict="no"),
           dict(alibi_slopes=torch.rand(4, requires_grad=True)),
           dict(max_seqlen_q=-1, causal="yes"),  # (two bad ones: the call's first error)
           dict(cu_seqlens_q=ck.to("meta"))]
    for extra in bad:
        said, done, recorded = _explain_thd_and_call(q, k, k, **{**base, **extra})
        assert said[0] == done[0] == "raised" and said[1] == done[1], (extra, said, done)
        assert recorded is None
    for args in ((q.float(), k, k), (q, k[:, :, :8], k), (q[0], k, k), (q, k, k.to("meta"))):
        said, done, _ = _explain_thd_and_call(*args, **base)
        assert said[0] == done[0] == "raised" and said[1] == done[1], (said, done)
    # meta tensors: the fallback flash_attn_func's meta calls report (strict: the Plan, where
    # the call raises FallbackError)
    meta = [t.to("meta") for t in (q, k, k)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        said, done, recorded = _explain_thd_and_call(*meta, **base)
    assert said[0] == done[0] == "ok" and said[1] == recorded and not said[1].fused
    said, done, recorded = _explain_thd_and_call(*meta, **base, strict=True)
    assert said[0] == "ok" and done == ("raised", (FallbackError, done[1][1])) and \
        recorded == said[1]
    # layout="thd" takes flash_attn_varlen_func's keywords, its required ones included
    with pytest.raises(TypeError, match=r"missing: \['max_seqlen_k'\]"):
        explain(q, k, k, layout="thd", cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=6)
    with pytest.raises(TypeError, match=r"\['cache_seqlens'\] belong to"):
        explain(q, k, k, layout="thd", **base, cache_seqlens=cq)


def test_explain_thd_on_hopper_names_the_varlen_variants(monkeypatch):
    # The rule for an sm_90 GPU, asked without one (the GPU's answers stood in, as in
    # test_cuda_plan_of_packed_calls): the packed call's flags pick the Hopper varlen
    # instantiations, one of softcap / ALiBi / dropout alone its variant, two together the
    # portable kernels with the rule's note.  explain_packed's plan step on CUDA-like tensors
    # (a CUDA tensor cannot be made without a GPU: the op's checks are run on the CPU call).
    _pretend_hopper(monkeypatch)
    from flash_attn_ext import varlen
    q = _CudaLike((300, 4, 128))

    def plan_of(**flags):
        dropout_p = flags.get("dropout_p", 0.0)
        slopes = torch.rand(4) if flags.get("alibi") else None
        return varlen.packed_plan(q, q, q, None, flags.get("causal", False),
                                  planning.score_mods(flags.get("softcap", 0.0), dropout_p, None,
                                                      slopes), False)
    for flags, suffix in ((dict(), ""), (dict(causal=True), ""), (dict(softcap=5.0), "_softcap"),
                          (dict(alibi=True), "_alibi"), (dict(dropout_p=0.1), "_dropout")):
        p = plan_of(**flags)
        assert (p.kernel, p.backward_kernel) == (f"sm90_fwd_hdim128_bf16_varlen{suffix}",
                                                 f"sm90_bwd_hdim128_bf16_varlen{suffix}"), flags
    for flags in (dict(softcap=5.0, alibi=True), dict(softcap=5.0, dropout_p=0.1),
                  dict(alibi=True, dropout_p=0.1)):
        p = plan_of(**flags)
        assert p.kernel == "sm80_fwd_hdim128_bf16" and "packed sequences" in str(p), flags
    # (a dropout_p that rounds to no dropout picks no dropout variant, as the kernels run)
    assert plan_of(dropout_p=1e-4).kernel == "sm90_fwd_hdim128_bf16_varlen"
