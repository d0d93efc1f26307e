"""explain(), strict mode, warn-once and counters (the no-silent-fallback rule)."""

import subprocess
import sys
import warnings

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import FallbackError, dispatch, explain, flash_attn_func, ops
from reference import attention_ref


@pytest.fixture(autouse=True)
def _clean_state():
    dispatch.reset_fallback_counts()
    dispatch.set_strict(None)
    yield
    dispatch.reset_fallback_counts()
    dispatch.set_strict(None)


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


def test_deterministic_backward_note():
    # The CUDA 8-warp backward's dQ path: a note only where deterministic moves it to the
    # separate dQ kernel (plans built here: no GPU needed).
    fast = dispatch.Plan("sm90_fwd_hdim64_bf16", "sm80_bwd_hdim64_bf16", True)
    noted = dispatch.deterministic_backward_note(fast, True)
    assert len(noted.notes) == 1 and "separate dQ kernel" in noted.notes[0]
    assert noted.kernel == fast.kernel and noted.backward_kernel == fast.backward_kernel
    assert dispatch.deterministic_backward_note(fast, False) == fast
    four_warp = dispatch.Plan("sm80_fwd_hdim256_bf16", "sm80_bwd_hdim256_bf16", True,
                              notes=("backward on the 4-warp sm80 kernels, not ...",))
    assert dispatch.deterministic_backward_note(four_warp, True) == four_warp
    cpu = torch.randn(1, 5, 2, 8)
    assert explain(cpu, cpu, cpu, layout="blhd", deterministic=True).notes == ()
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        explain(cpu, cpu, cpu, layout="blhd", deterministic="yes")


def test_last_plan_carries_the_deterministic_note(monkeypatch):
    # The recorded plan says what explain() says.  A CUDA-like plan stands in for dispatch.plan
    # (the CPU op still runs): the note depends on the plan only, not on the device.
    cuda_like = dispatch.Plan("sm90_fwd_hdim64_fp32", "sm80_bwd_hdim64_fp32", True)
    monkeypatch.setattr(dispatch, "plan", lambda *args, **kwargs: cuda_like)
    q = torch.randn(1, 5, 2, 8)
    flash_attn_ext.flash_attn_func(q, q, q, deterministic=True)
    assert any("separate dQ kernel" in n for n in flash_attn_ext.last_plan().notes)
    flash_attn_ext.flash_attn_func(q, q, q)
    assert flash_attn_ext.last_plan() == cuda_like
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        flash_attn_ext.flash_attn_func(q, q, q)
    finally:
        torch.use_deterministic_algorithms(old)
    assert any("separate dQ kernel" in n for n in flash_attn_ext.last_plan().notes)


def test_fallback_reasons_warn_once_count_and_strict():
    q = torch.empty(1, 4, 2, 8, device="meta")
    p = dispatch.plan(q, q, q)
    assert not p.fused and p.kernel == dispatch.FALLBACK
    assert any("'meta'" in r for r in p.reasons)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dispatch.record(p, strict=False)
        dispatch.record(p, strict=False)
    assert len([w for w in caught if "falling back" in str(w.message)]) == 1
    assert sum(flash_attn_ext.fallback_counts().values()) == 2
    with pytest.raises(FallbackError, match="strict mode.*'meta'"):
        dispatch.record(p, strict=True)
    dispatch.set_strict(True)
    with pytest.raises(FallbackError):
        dispatch.record(p, strict=None)
    dispatch.record(p, strict=False)  # the call's own argument wins


def test_strict_env_variable():
    code = ("import torch, flash_attn_ext as f; from flash_attn_ext import dispatch;"
            "q = torch.empty(1, 4, 2, 8, device='meta');"
            "dispatch.record(dispatch.plan(q, q, q), None)")
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
    assert "no flash_attn_ext kernel" in str(dispatch.plan(q, q, q))


@pytest.mark.parametrize("causal,window,br", [(False, (-1, -1), True), (True, (-1, -1), True),
                                              (True, (-1, -1), False), (False, (3, 1), True)])
def test_fallback_path_is_correct(causal, window, br):
    q, k, v = torch.randn(2, 13, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 6)
    out, lse = dispatch.fallback_attention(q, k, v, None, window[0], 0 if causal else window[1],
                                           br, 0.0)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_left=window[0],
                                 window_right=window[1], align_bottom_right=br)
    assert (out.double() - ref).abs().max() < 1e-5
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))


def test_info_cli_runs():
    r = subprocess.run([sys.executable, "-m", "flash_attn_ext", "info"], capture_output=True,
                       text=True, env=_pythonpath() | {"PATH": ""})
    assert r.returncode == 0, r.stderr
    assert "flash_attn_ext " + flash_attn_ext.__version__ in r.stdout
    assert "cpu   float32   d=64   cpu_flash_fwd_fp32" in r.stdout


def test_flash_attn_func_strict_does_not_raise_on_cpu():
    q = torch.randn(1, 3, 1, 4)
    flash_attn_func(q, q, q, strict=True)


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
    out, _ = dispatch.fallback_attention(q, k, v, None, -1, -1, True, 0.0, bias)
    ref, _ = attention_ref(q, k, v, attn_bias=bias)
    assert (out.double() - ref).abs().max() < 1e-5


def test_plan_notes_are_printed():
    p = dispatch.Plan("sm80_fwd_hdim64_bf16", "sm80_bwd_hdim64_bf16", True,
                      notes=("forward on the portable sm80 kernel, not the Hopper one, because x",))
    assert str(p) == ("sm80_fwd_hdim64_bf16 (backward: sm80_bwd_hdim64_bf16); note: forward on "
                      "the portable sm80 kernel, not the Hopper one, because x")


def test_kernel_choice_env(monkeypatch):
    monkeypatch.delenv("FLASH_ATTN_EXT_KERNEL", raising=False)
    assert dispatch.kernel_choice() == "auto"
    monkeypatch.setenv("FLASH_ATTN_EXT_KERNEL", "sm80")
    assert dispatch.kernel_choice() == "sm80"
    monkeypatch.setenv("FLASH_ATTN_EXT_KERNEL", "hopper")
    with pytest.raises(ValueError, match="FLASH_ATTN_EXT_KERNEL must be 'auto' or 'sm80'"):
        dispatch.kernel_choice()


def test_build_info_reports_the_hopper_kernels():
    info = ops.build_info()
    assert isinstance(info["sm90"], bool)
    assert not info["sm90"] or info["cuda"]


def test_explain_follows_autocast():
    q = torch.randn(1, 2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert explain(q, q, q).kernel == "cpu_flash_fwd_bf16"
        flash_attn_ext.scaled_dot_product_attention(q, q, q)
        assert dispatch.last_plan().kernel == "cpu_flash_fwd_bf16"
    assert explain(q, q, q).kernel == "cpu_flash_fwd_fp32"


@pytest.mark.parametrize("archs,capability,runs", [
    ("8.0;9.0a", (8, 0), True), ("8.0;9.0a", (8, 6), True), ("8.0;9.0a", (8, 9), True),
    ("8.0;9.0a", (9, 0), True), ("8.0;9.0a", (10, 0), False), ("8.0;9.0a", (12, 0), False),
    ("8.0;9.0a", (7, 5), False), ("8.6", (8, 0), False), ("9.0a", (8, 0), False),
    ("8.0+PTX", (10, 0), True), ("8.0 9.0+PTX", (10, 0), True), ("9.0a+PTX", (10, 0), False),
    ("9.0", (9, 0), True),
    ("", (9, 0), False)])
def test_arch_runs_on(archs, capability, runs):
    assert dispatch.arch_runs_on(archs, capability) is runs


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
    ((10, 0), True, dispatch.FALLBACK, "does not run on it"),
    ((7, 5), True, dispatch.FALLBACK, "need sm_80 or newer")])
def test_cuda_plan_by_gpu_and_build(monkeypatch, cap, sm90, kernel, text):
    monkeypatch.setattr(dispatch, "_capability", lambda index: cap)
    monkeypatch.setattr(dispatch, "_smem_per_block", lambda index: 232448)
    monkeypatch.setattr(dispatch.ops, "build_info",
                        lambda: {"cuda": True, "cuda_archs": "8.0;9.0a", "sm90": sm90})
    monkeypatch.delenv("FLASH_ATTN_EXT_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "_cuda_plans", {})  # plans are cached per process
    q = _CudaLike((2, 100, 4, 64))
    p = dispatch.plan(q, q, q)
    assert p.kernel == kernel and text in str(p)
    assert dispatch.plan(q, q, q) is p  # eager CUDA plans are computed once per key


def _pretend_hopper(monkeypatch):
    """plan() as on an H200 with a build that has the Hopper kernels, from an empty cache."""
    monkeypatch.setattr(dispatch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(dispatch, "_smem_per_block", lambda index: 232448)
    monkeypatch.setattr(dispatch.ops, "build_info",
                        lambda: {"cuda": True, "cuda_archs": "8.0;9.0a", "sm90": True})
    monkeypatch.setattr(dispatch, "_cuda_plans", {})
    monkeypatch.delenv("FLASH_ATTN_EXT_KERNEL", raising=False)


def test_cuda_plan_cache_keys(monkeypatch):
    # What the cached CUDA plan depends on is in its key: the kernel variable, softcap/mask/
    # dropout ("general"), the dtype; a stride-0 (broadcast) input is planned afresh.
    _pretend_hopper(monkeypatch)
    q = _CudaLike((2, 100, 4, 128))
    assert dispatch.plan(q, q, q).kernel == "sm90_fwd_hdim128_bf16"
    assert dispatch.plan(q, q, q, general=True).kernel == "sm80_fwd_hdim128_bf16"
    assert dispatch.plan(q, q, q, run_dtype=torch.float16).kernel == "sm90_fwd_hdim128_fp16"
    monkeypatch.setenv("FLASH_ATTN_EXT_KERNEL", "sm80")
    assert dispatch.plan(q, q, q).kernel == "sm80_fwd_hdim128_bf16"
    monkeypatch.setenv("FLASH_ATTN_EXT_KERNEL", "auto")
    assert dispatch.plan(q, q, q).kernel == "sm90_fwd_hdim128_bf16"
    monkeypatch.setenv("FLASH_ATTN_EXT_KERNEL", "bogus")
    with pytest.raises(ValueError, match="FLASH_ATTN_EXT_KERNEL"):
        dispatch.plan(q, q, q)
    monkeypatch.delenv("FLASH_ATTN_EXT_KERNEL")
    k = _CudaLike((2, 100, 4, 128))
    k._strides = (0, 512, 128, 1)  # batch broadcast: TMA cannot describe it
    assert dispatch.plan(q, k, k).kernel == "sm80_fwd_hdim128_bf16"
    assert dispatch.plan(q, q, q).kernel == "sm90_fwd_hdim128_bf16"
    assert len(dispatch._cuda_plans) == 5  # unset, general, fp16, sm80, auto; not the broadcast


def test_pack_gqa_rule_is_the_compiled_one(monkeypatch):
    # dispatch.sm90_packs_gqa (which names the kernel) applies the CUDA glue's rule
    # (csrc/kernels/sm90/pack_gqa.h, exposed as _C.sm90_pack_gqa) where the variable is unset.
    monkeypatch.delenv(dispatch.PACK_GQA_ENV, raising=False)
    seen = set()
    for seqlen_q in (1, 2, 16, 17, 47, 48, 95, 127, 128, 129, 191, 192, 193, 500, 1000, 4096,
                     dispatch.SM90_MAX_ROWS // 8, dispatch.SM90_MAX_ROWS // 8 + 1):
        for heads_q, heads_kv in ((8, 8), (8, 4), (12, 4), (32, 4), (32, 8), (16, 1), (6, 4),
                                  (40, 8), (64, 2), (0, 4)):
            for padded in (64, 128, 256):
                packs = dispatch.sm90_packs_gqa(seqlen_q, heads_q, heads_kv, padded)
                assert packs == ops._C.sm90_pack_gqa(seqlen_q, heads_q, heads_kv, padded), \
                    (seqlen_q, heads_q, heads_kv, padded)
                seen.add(packs)
    assert seen == {True, False}
    assert dispatch.sm90_packs_gqa(1, 32, 4, 128)         # decoding: 1 tile instead of 4
    assert dispatch.sm90_packs_gqa(64, 32, 4, 64)         # 2 tiles of 192 rows instead of 4
    assert not dispatch.sm90_packs_gqa(128, 32, 4, 64)    # 3 instead of 4: measured slower
    assert not dispatch.sm90_packs_gqa(4096, 32, 4, 128)  # long rows fill their tiles
    assert not dispatch.sm90_packs_gqa(1, 8, 8, 128)      # no group to pack
    monkeypatch.setenv(dispatch.PACK_GQA_ENV, "on")
    assert dispatch.sm90_packs_gqa(4096, 32, 4, 128) and not dispatch.sm90_packs_gqa(1, 8, 8, 64)
    monkeypatch.setenv(dispatch.PACK_GQA_ENV, "off")
    assert not dispatch.sm90_packs_gqa(1, 32, 4, 128)
    monkeypatch.setenv(dispatch.PACK_GQA_ENV, "sometimes")
    with pytest.raises(ValueError, match=dispatch.PACK_GQA_ENV):
        dispatch.sm90_packs_gqa(1, 32, 4, 128)


def test_cuda_plan_names_the_packed_gqa_forward(monkeypatch):
    # A decoding-shaped GQA call on sm_90 is planned as the packed Hopper forward; the same
    # heads at a long seqlen_q, or without GQA, are not; the sm80 forward never packs.
    _pretend_hopper(monkeypatch)
    monkeypatch.delenv(dispatch.PACK_GQA_ENV, raising=False)
    q1, q2k, k = _CudaLike((2, 1, 32, 64)), _CudaLike((2, 2048, 32, 64)), _CudaLike((2, 9, 4, 64))
    p = dispatch.plan(q1, k, k)
    assert p.kernel == "sm90_fwd_hdim64_bf16_packgqa" and p.fused
    assert p.backward_kernel == "sm80_bwd_hdim64_bf16" and p.notes == ()
    assert dispatch.plan(q1, k, k) is p
    assert dispatch.plan(q2k, k, k).kernel == "sm90_fwd_hdim64_bf16"
    assert dispatch.plan(q1, q1, q1).kernel == "sm90_fwd_hdim64_bf16"
    assert dispatch.plan(q1, k, k, general=True).kernel == "sm80_fwd_hdim64_bf16"
    monkeypatch.setenv(dispatch.PACK_GQA_ENV, "off")
    assert dispatch.plan(q1, k, k).kernel == "sm90_fwd_hdim64_bf16"
    # Rows past the Hopper kernel's 32-bit arithmetic: the portable kernel, with the reason
    # (planned afresh, not from the cached plan of the same dtype and head dim).
    huge = _CudaLike((1, dispatch.SM90_MAX_ROWS + 1, 1, 64))
    p = dispatch.plan(huge, huge, huge)
    assert p.kernel == "sm80_fwd_hdim64_bf16" and "32-bit" in str(p)
    assert dispatch.plan(q1, q1, q1).kernel == "sm90_fwd_hdim64_bf16"


@pytest.mark.parametrize("cap,smem,head_dim,general,text", [
    ((9, 0), 232448, 128, False, None),
    ((9, 0), 232448, 64, True, "softcap, attn_mask/attn_bias and dropout"),
    ((9, 0), 232448, 256, False, None),           # 209 KB: fits sm_90's 227 KB
    ((8, 0), 166912, 256, False, "214016 bytes of shared memory"),  # not sm_80's 163 KB
    ((8, 6), 101376, 64, False, None),            # 97 KB: the d=64 kernels fit
    ((8, 6), 101376, 128, False, "164864 bytes of shared memory"),
    ((8, 0), 166912, 128, False, None)])
def test_plan_notes_which_backward_kernels_serve(monkeypatch, cap, smem, head_dim, general,
                                                 text):
    # The 8-warp backward serves plain attention where the GPU's shared memory allows (head dim
    # 256: sm_90, not sm_80); otherwise the plan says that the 4-warp kernels serve it, and why.
    monkeypatch.setattr(dispatch, "_capability", lambda index: cap)
    monkeypatch.setattr(dispatch, "_smem_per_block", lambda index: smem)
    monkeypatch.setattr(dispatch.ops, "build_info",
                        lambda: {"cuda": True, "cuda_archs": "8.0;8.6;9.0a", "sm90": True})
    monkeypatch.setattr(dispatch, "_cuda_plans", {})
    monkeypatch.delenv("FLASH_ATTN_EXT_KERNEL", raising=False)
    q = _CudaLike((2, 100, 4, head_dim))
    p = dispatch.plan(q, q, q, general=general)
    backward_notes = [n for n in p.notes if n.startswith("backward")]
    if text is None:
        assert not backward_notes
    else:
        assert len(backward_notes) == 1 and text in backward_notes[0] and text in str(p)


@pytest.mark.parametrize("value,strict", [("on", True), ("Yes", True), ("off", False),
                                          ("", False), (" 0 ", False)])
def test_strict_env_values(monkeypatch, value, strict):
    monkeypatch.setenv("FLASH_ATTN_EXT_STRICT", value)
    assert dispatch.strict_enabled() is strict


def test_strict_env_unknown_value_raises(monkeypatch):
    # An unknown value must not quietly leave strict mode off.
    monkeypatch.setenv("FLASH_ATTN_EXT_STRICT", "enable")
    with pytest.raises(ValueError, match="FLASH_ATTN_EXT_STRICT must be .* got 'enable'"):
        dispatch.strict_enabled()


def test_fallback_plan_has_no_fused_backward():
    q = torch.randn(1, 3, 1, 300)
    p = flash_attn_ext.explain(q, q, q)
    assert not p.fused and not p.backward_fused
    assert p.backward_reasons == p.reasons and "head dims up to 256" in p.reasons[0]
