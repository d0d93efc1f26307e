"""The Hopper kernels (csrc/kernels/sm90: TMA + wgmma, warp-specialised), forward and backward:
which calls they serve, and their answers against an fp32 reference next to the portable
kernels'.

The full CUDA grid (tests/test_cuda.py) runs on whichever forward the dispatcher picks, so on an
H200 it exercises this kernel; FLASH_ATTN_EXT_KERNEL=sm80 runs the same grid on the portable one
(and kernel_options(force_portable=True) switches within a process).
Skipped without an sm_90 GPU and a build with the Hopper kernels.
"""

import pytest
import torch

from flash_attn_ext import explain, flash_attn_func, flash_attn_varlen_func, ops, planning
from reference import (
    assert_error_rule,
    assert_lse_infinities,
    attention_ref,
    cancellation_scale,
    grad_bound,
    launched_fwd_traits,
    max_err,
    slack,
    visible_mask,
)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.build_info()["cuda"]
         and ops.build_info().get("sm90", False)
         and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU and a build with the Hopper kernels")


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def check_forward(out, lse, low_out, true_out, true_lse, what):
    """out within the error rule against the fp32 reference (at most 2x the error of the same
    computation in the low precision, ``low_out``); the LSE finite exactly where the
    reference's is, and within 1e-2 of it there."""
    assert_error_rule(out, low_out, true_out.double(), 2.0, what)
    finite = torch.isfinite(true_lse)
    assert_lse_infinities(lse, true_lse)
    if finite.any():
        assert (lse[finite] - true_lse[finite]).abs().max().item() < 1e-2


@pytest.mark.parametrize("head_dim,padded", [(40, 64), (64, 64), (72, 128), (128, 128),
                                             (200, 256), (256, 256)])
def test_plan_names_the_hopper_forward(head_dim, padded):
    q = rand(2, 100, 4, head_dim)
    p = planning.plan(q, q, q)
    assert p.kernel == f"sm90_fwd_hdim{padded}_bf16" and p.fused
    assert p.notes == ()
    assert p.backward_kernel == f"sm90_bwd_hdim{padded}_bf16"
    for mods, suffix in ((planning.SOFTCAP, "_softcap"), (planning.ALIBI, "_alibi"),
                         (planning.DROPOUT, "_dropout"), (planning.BIAS | planning.MASK, "_mask")):
        assert planning.plan(q, q, q, mods=mods).backward_kernel == \
            f"sm90_bwd_hdim{padded}_bf16{suffix}"
    p = planning.plan(q, q, q, deterministic=True)
    assert p.backward_kernel == f"sm90_bwd_hdim{padded}_bf16" and len(p.notes) == 1
    assert "fixed order" in p.notes[0]
    # Head dim 256 with score modifiers together or a float bias: the portable backward (the
    # 4-warp kernels with modifiers), and the plan says why.
    if padded == 256:
        for kw in (dict(mods=planning.DROPOUT | planning.SOFTCAP),
                   dict(mods=planning.SOFTCAP | planning.ALIBI), dict(mods=planning.BIAS)):
            p = planning.plan(q, q, q, **kw)
            assert p.backward_kernel == f"sm80_bwd_hdim{padded}_bf16", kw
            assert "at head dims up to 128" in p.notes[0], (kw, p.notes)


def test_explain_names_the_deterministic_dq_path():
    q = rand(2, 100, 4, 128)
    assert explain(q, q, q, layout="blhd").notes == ()
    p = explain(q, q, q, layout="blhd", deterministic=True)
    assert p.backward_kernel == "sm90_bwd_hdim128_bf16" and len(p.notes) == 1
    assert "fixed order of key blocks" in p.notes[0]
    torch.use_deterministic_algorithms(True)
    try:
        assert "fixed order of key blocks" in explain(q, q, q).notes[0]
    finally:
        torch.use_deterministic_algorithms(False)
    # Head dim 256: the Hopper backward's split by role, its order warp.
    q = rand(2, 100, 4, 256)
    p = explain(q, q, q, layout="blhd", deterministic=True)
    assert p.backward_kernel == "sm90_bwd_hdim256_bf16" and len(p.notes) == 1
    assert "fixed order of key blocks" in p.notes[0]


def test_general_calls_and_the_portable_switch_name_their_forward(kernel_opts):
    q = rand(2, 100, 4, 64)
    p = explain(q, q, q, layout="blhd", softcap=5.0)
    assert (p.kernel, p.backward_kernel) == ("sm90_fwd_hdim64_bf16_softcap",
                                             "sm90_bwd_hdim64_bf16_softcap")
    p = explain(q, q, q, layout="blhd", softcap=5.0, dropout_p=0.1)
    assert p.kernel == "sm90_fwd_hdim64_bf16_general"
    assert p.backward_kernel == "sm90_bwd_hdim64_bf16_general"
    kernel_opts(force_portable=True)
    p = planning.plan(q, q, q)
    assert p.kernel == "sm80_fwd_hdim64_bf16" and "FLASH_ATTN_EXT_KERNEL=sm80" in str(p)
    with pytest.raises(ValueError, match="force_portable must be a bool"):
        kernel_opts(force_portable="sm70")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (129, 129),
                                               (1000, 1000), (2048, 1023)])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal,window,bottom_right", [
    (False, (-1, -1), True), (True, (-1, -1), True), (True, (-1, -1), False),
    (False, (100, 7), True)])
def test_hopper_and_portable_forward_both_meet_the_error_rule(
        kernel_opts, dtype, seqlen_q, seqlen_k, head_dim, causal, window, bottom_right):
    q, k, v = rand(2, seqlen_q, 4, head_dim, dtype=dtype), \
        rand(2, seqlen_k, 2, head_dim, dtype=dtype), rand(2, seqlen_k, 2, head_dim, dtype=dtype)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1],
              align_bottom_right=bottom_right)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    outs = {}
    for choice in ("auto", "sm80"):
        kernel_opts(force_portable=choice == "sm80")
        out, lse, _ = ops.fwd(q, k, v, None, causal, window[0], window[1], bottom_right)
        check_forward(out, lse, low_out, true_out, true_lse, f"out ({choice})")
        outs[choice] = out
    # Same inputs, two kernels, two summation orders: close, not bitwise equal.
    assert (outs["auto"].float() - outs["sm80"].float()).abs().max().item() < 0.05


def _huge_scores(dtype, softmax_scale):
    # Scores q.k of ~1.3e7 (|q|, |k| up to 900, d = 64): M = |score * scale * log2(e)| ~ 2^22
    # at scale 0.25, 2^24 at 1, 2^31 at 100 (issue 29's reproduction).  512 keys, so the
    # reference max rises over several key tiles.
    torch.manual_seed(29)
    q, k = ((torch.rand(2, 512, 4, 64, device="cuda") * -900).to(dtype) for _ in "qk")
    v = torch.rand(2, 512, 4, 64, device="cuda").to(dtype)
    true_out, true_lse = attention_ref(q.double(), k.double(), v.double(),
                                       softmax_scale=softmax_scale)
    return q, k, v, true_out, true_lse


@pytest.mark.parametrize("forward", ["hopper", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("softmax_scale", [0.25, 1.0, 100.0])
def test_forward_huge_scores_are_exact(kernel_opts, forward, dtype, softmax_scale):
    # issue 29: the forwards form each exponent with one FMA against the reference max rounded
    # to fp32, m * c, so a row's P carries a common factor of up to 2^(ulp(M) / 2).  The Hopper
    # forward's O, l and LSE share that rounded value, so the factor cancels (before: 7e-3 at
    # 2^24 in dev/huge_scores_emulation.py) until P overflows (M ~ 2^31 at scale 100: inf /
    # NaN, or -inf where every P underflowed); rows whose |lse * log2 e| >= 2^13, +inf, NaN,
    # or -inf although they see keys now take the forward's exact pass (cuda/exact_rows.h).
    # Out is a weighted average of v in [0, 1]: within the dtype's rounding of the float64
    # truth.
    kernel_opts(force_portable=forward == "portable")
    q, k, v, true_out, true_lse = _huge_scores(dtype, softmax_scale)
    assert explain(q, k, v, layout="blhd").kernel.startswith(
        "sm90_fwd" if forward == "hopper" else "sm80_fwd")
    eps = torch.finfo(dtype).eps

    def error():
        out, lse, _ = ops.fwd(q, k, v, softmax_scale)
        if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
            return float("inf"), float("inf")
        # The LSE is ~M ln 2: fp32 holds it to 2^-24 relative.
        rel = (lse.double() - true_lse).abs().max().item() / true_lse.abs().max().item()
        return max_err(out, true_out) - 2 * eps - slack(true_out, dtype), rel - 1e-6

    assert max(error()) <= 0
    if forward == "hopper" and softmax_scale == 100.0:
        kernel_opts(exact_rows_always=False)
        assert max(error()) > 0  # (the test would not see the defect otherwise)


def test_issue_29_large_softmax_scale_stays_finite():
    # The issue's reproduction, through the SDPA drop-in: fp16 q, k uniform in [-900, 0], v in
    # [0, 1]; scale 100 and 1000 gave 57,600 and 121,920 non-finite elements.
    from flash_attn_ext import scaled_dot_product_attention
    torch.manual_seed(0)
    q, k = ((torch.rand(2, 8, 128, 64, device="cuda") * -900).half() for _ in "qk")
    v = torch.rand(2, 8, 128, 64, device="cuda").half()
    for scale in (1.0, 10.0, 100.0, 1000.0):
        out = scaled_dot_product_attention(q, k, v, scale=scale)
        true = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, -1) @ v.double()
        assert torch.isfinite(out).all(), scale
        bound = 2 * torch.finfo(torch.float16).eps + slack(true, torch.float16)
        assert max_err(out, true) <= bound, scale


@pytest.mark.parametrize("backward", ["hopper", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("softmax_scale", [0.25, 1.0])
def test_backward_huge_scores_take_the_exact_pass(kernel_opts, backward, dtype, softmax_scale):
    # issue 29: the backwards' P = exp2(s * c - lse * log2(e)) takes the LSE as one fp32 of
    # magnitude ~M, so P was off by up to 2^(ulp(M) / 2) (3% at M = 2^20, 40% at 2^22).  Rows
    # whose |lse * log2 e| >= 2^13 now take the exact pass on every call (cuda/exact_rows.h);
    # with the option off (only with a floating bias, as before) the error comes back.
    kernel_opts(sm90_bwd="on" if backward == "hopper" else "off")
    q, k, v, _, _ = _huge_scores(dtype, softmax_scale)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    true_out, _ = attention_ref(*leaves, softmax_scale=softmax_scale)
    dout = torch.randn_like(true_out)
    true_grads = torch.autograd.grad(true_out, leaves, dout)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    # (the rows are nearly one-hot: grad_bound's allowance for the terms that cancel in dS)
    cancel = cancellation_scale(q, k, v, dout, softmax_scale=softmax_scale)[:3]

    def errors():
        grads = torch.autograd.grad(flash_attn_func(q, k, v, softmax_scale=softmax_scale),
                                    (q, k, v), dout.to(dtype))
        assert all(torch.isfinite(g).all() for g in grads)
        return [max_err(ours, true) - grad_bound(true, dtype, c)
                for ours, true, c in zip(grads, true_grads, cancel)]

    over = errors()
    assert max(over) <= 0, dict(zip(("dq", "dk", "dv"), over))
    if softmax_scale == 1.0:  # (M ~ 2^24: P off by up to 2x; at 2^22 by up to 19%)
        kernel_opts(exact_rows_always=False)
        assert max(errors()) > 0  # (the test would not see the defect otherwise)


@pytest.mark.parametrize("backward", ["hopper", "portable"])
def test_backward_exact_pass_keeps_a_nan_row_nan(kernel_opts, backward):
    # A row the backward's exact pass takes (a huge finite LSE) whose scores are NaN (a NaN in
    # its q) gives NaN gradients: its dq row and dk / dv of every key it sees, as the main
    # backward's P would; the other rows' dq stay finite.  (Through autograd such a row has a
    # NaN LSE and is not flagged; the op takes any LSE.)
    kernel_opts(sm90_bwd="on" if backward == "hopper" else "off")
    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    out, lse, rng_state = ops.fwd(q, k, v)
    q[0, 3, 1, 5] = float("nan")
    lse[0, 1, 3] = 1e5  # |lse * log2 e| >= 2^13: flagged
    dout = torch.randn_like(out)
    dq, dk, dv, _ = ops.bwd_op(dout, q, k, v, out, lse, rng_state)
    assert torch.isnan(dq[0, 3, 1]).all()
    assert torch.isnan(dk[0, :, 1]).all() and torch.isnan(dv[0, :, 1]).all()
    others = torch.ones(64, 2, dtype=torch.bool, device="cuda")
    others[3, 1] = False
    assert torch.isfinite(dq[0][others]).all()
    assert torch.isfinite(dk[0, :, 0]).all() and torch.isfinite(dv[0, :, 0]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_huge_scores_with_a_boolean_mask_take_the_exact_passes(dtype):
    # A boolean mask alone runs the Hopper kernels' mask variant, whose scores are plain (the
    # one-FMA exponent) and which read the mask as bytes: the exact passes must read it as
    # bytes too (cuda/exact_rows.cu: RowScore).  M ~ 2^24 (scale 1): flagged rows throughout.
    q, k, v, _, _ = _huge_scores(dtype, 1.0)
    mask = torch.ones(2, 1, 1, 512, dtype=torch.bool, device="cuda")
    mask[1, ..., 412:] = False
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    true_out, true_lse = attention_ref(*leaves, softmax_scale=1.0, attn_bias=mask)
    dout = torch.randn_like(true_out)
    true_grads = torch.autograd.grad(true_out, leaves, dout)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, _ = ops.fwd(q, k, v, 1.0, attn_bias=mask)
    eps = torch.finfo(dtype).eps
    assert max_err(out, true_out) <= 2 * eps + slack(true_out, dtype)
    assert (lse.double() - true_lse).abs().max().item() <= 1e-6 * true_lse.abs().max().item()
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    cancel = cancellation_scale(q, k, v, dout, softmax_scale=1.0, attn_bias=mask)[:3]
    for name, ours, true, c in zip(("dq", "dk", "dv"), grads, true_grads, cancel):
        assert max_err(ours, true) <= grad_bound(true, dtype, c), name


@pytest.mark.parametrize("kernels", ["hopper", "portable"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_with_huge_scores_take_the_exact_passes(kernel_opts, kernels, causal):
    # The exact passes over packed sequences (cuda/exact_rows.cu: each flagged row located by
    # cu_seqlens_q, its keys by cu_seqlens_k, causal bottom-right per sequence): out and the
    # gradients of every sequence against its own float64 reference.  M ~ 2^24 (scale 1, fp16).
    hopper = kernels == "hopper"
    kernel_opts(force_portable=not hopper, sm90_bwd="on" if hopper else "off")
    lens_q, lens_k = [100, 0, 237, 175], [130, 5, 237, 150]
    torch.manual_seed(290)

    def packed(lens, heads):
        return (torch.rand(sum(lens), heads, 64, device="cuda") * -900).half()

    q, k = packed(lens_q, 4), packed(lens_k, 2)
    v = torch.rand(sum(lens_k), 2, 64, device="cuda").half()
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for x in (lens_q, lens_k))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                 softmax_scale=1.0, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    eps = torch.finfo(torch.float16).eps
    for b in range(len(lens_q)):
        sq = slice(cu_q[b].item(), cu_q[b + 1].item())
        sk = slice(cu_k[b].item(), cu_k[b + 1].item())
        ref = [t[s].detach().double().unsqueeze(0).requires_grad_()
               for t, s in ((q, sq), (k, sk), (v, sk))]
        true_out, _ = attention_ref(*ref, softmax_scale=1.0, causal=causal)
        if true_out.numel() == 0:
            continue
        seq_dout = dout[sq].double().unsqueeze(0)
        true_grads = torch.autograd.grad(true_out, ref, seq_dout)
        assert max_err(out[sq].unsqueeze(0), true_out) <= 2 * eps + slack(true_out, torch.float16)
        # (nearly one-hot rows: the cancellation allowance of the test above)
        cancel = cancellation_scale(*(t.detach().half() for t in ref), seq_dout,
                                    softmax_scale=1.0, causal=causal)[:3]
        for name, ours, true, c in zip(("dq", "dk", "dv"),
                                       (grads[0][sq], grads[1][sk], grads[2][sk]), true_grads,
                                       cancel):
            assert max_err(ours.unsqueeze(0), true) <= grad_bound(true, torch.float16, c), \
                (b, name)


@pytest.fixture
def hopper_bwd(kernel_opts):
    """The Hopper backward wherever it applies, whatever "auto" picks."""
    kernel_opts(sm90_bwd="on")


def hopper_backward_case(dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                         head_dim_v=None, causal=False, window=(-1, -1), bottom_right=True,
                         transposed=False, softcap=0.0, attn_bias=None, alibi_slopes=None,
                         deterministic=False):
    """Gradients of one call with the Hopper backward (the plan must name it) against an fp32
    reference, by the backward's error rule (3x the same computation's error in ``dtype``).
    ``attn_bias``: an fp32 bias (no gradient) or a boolean mask broadcastable to (batch,
    heads_q, L, S);
    ``alibi_slopes``: (heads_q,) or (batch, heads_q);
    ``deterministic``: dQ added in a fixed order (the plan must say so)."""
    head_dim_v = head_dim_v or head_dim

    def make(seqlen, heads, d):
        if transposed:
            return rand(batch, heads, seqlen, d, dtype=dtype).transpose(1, 2)
        return rand(batch, seqlen, heads, d, dtype=dtype)

    q, k = make(seqlen_q, heads_q, head_dim), make(seqlen_k, heads_kv, head_dim)
    v = make(seqlen_k, heads_kv, head_dim_v)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1],
              align_bottom_right=bottom_right, softcap=softcap, attn_bias=attn_bias,
              alibi_slopes=alibi_slopes)
    mods = planning.score_mods(softcap, 0.0, attn_bias, alibi_slopes)
    # (the mask does not change the backward's kernel)
    plan = planning.plan(q, k, v, mods=mods, deterministic=deterministic)
    assert plan.backward_kernel.startswith("sm90_bwd"), plan
    assert deterministic == any("fixed order" in n for n in plan.notes), plan
    variant = "_mask" if mods == planning.BIAS | planning.MASK else \
        "_softcap" if mods == planning.SOFTCAP else "_alibi" if mods == planning.ALIBI else \
        "_general" if mods else ""
    assert plan.backward_kernel.endswith(variant) and \
        plan.backward_kernel.count("_") == 3 + bool(variant), plan
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _, _ = ops.fwd(*leaves, None, causal, window[0], window[1], bottom_right, softcap,
                        alibi_slopes, attn_bias, deterministic=deterministic)
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, leaves, dout, retain_graph=deterministic)
    if deterministic:  # bit for bit, run after run
        for _ in range(3):
            again = torch.autograd.grad(out, leaves, dout, retain_graph=True)
            assert all(torch.equal(a, b) for a, b in zip(again, ours))
    leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    true_out, _ = attention_ref(*leaves32, compute_dtype=torch.float32, **kw)
    true_g = torch.autograd.grad(true_out, leaves32, dout.float())
    low_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    low_out, _ = attention_ref(*low_leaves, compute_dtype=dtype, **kw)
    low_g = torch.autograd.grad(low_out, low_leaves, dout)
    *cancel, score_scale = cancellation_scale(q, k, v, dout, per_element=True, out=out,
                                              true_out=true_out, **kw)
    for name, a, lo, t, c in zip(("dq", "dk", "dv"), ours, low_g, true_g, cancel):
        leaf = leaves[("dq", "dk", "dv").index(name)]
        assert a.shape == leaf.shape and a.stride() == leaf.stride()
        assert_error_rule(a, lo, t.double(), 3.0, name, c, score_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (129, 129),
                                               (1000, 1000), (2048, 1023)])
@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 128, 136, 200, 256])
@pytest.mark.parametrize("causal,window,bottom_right", [
    (False, (-1, -1), True), (True, (-1, -1), True), (True, (-1, -1), False),
    (False, (100, 7), True)])
def test_hopper_backward_meets_the_error_rule(hopper_bwd, dtype, seqlen_q, seqlen_k, head_dim,
                                              causal, window, bottom_right):
    hopper_backward_case(dtype, 2, seqlen_q, seqlen_k, 4, 2, head_dim, causal=causal,
                         window=window, bottom_right=bottom_right)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 8), (8, 1), (12, 4)])
@pytest.mark.parametrize("head_dim,head_dim_v", [(64, 64), (128, 128), (64, 128), (128, 40),
                                                  (256, 256), (200, 136)])
def test_hopper_backward_gqa_mqa_strides_and_value_dims(hopper_bwd, heads_q, heads_kv, head_dim,
                                                        head_dim_v):
    # dK / dV of a KV head summed over its group's query heads in one CTA; SDPA's (B, H, L, d)
    # storage seen as (B, L, H, d); a value head dim unlike the query's.
    hopper_backward_case(torch.bfloat16, 2, 577, 700, heads_q, heads_kv, head_dim, head_dim_v,
                         causal=True, transposed=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (1000, 1000),
                                               (2048, 1023), (1023, 2048)])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("causal,window,bottom_right", [
    (False, (-1, -1), True), (True, (-1, -1), True), (True, (-1, -1), False),
    (False, (100, 7), True), (False, (-1, 300), True)])
def test_hopper_deterministic_backward_meets_the_error_rule(hopper_bwd, dtype, seqlen_q,
                                                            seqlen_k, head_dim, causal, window,
                                                            bottom_right):
    # deterministic=True on the Hopper backward: dQ tiles added in a fixed order of key blocks
    # (rotated without a mask, descending with one), every order's turn count exercised by
    # windows, both causal alignments, L != S and odd lengths; GQA (4 query heads per KV head).
    hopper_backward_case(dtype, 2, seqlen_q, seqlen_k, 8, 2, head_dim, causal=causal,
                         window=window, bottom_right=bottom_right, deterministic=True)


DETERMINISTIC_CASES = ["plain", "causal", "window", "softcap", "causal_padding_mask",
                       "causal_flag_padding_mask", "window_padding_bias", "padding_bias",
                       "dropout", "dropout_softcap", "causal_alibi"]


# (head dim 256: the variants its Hopper backward has, plain, a boolean mask alone, dropout
# alone, softcap alone, ALiBi alone)
@pytest.mark.parametrize("head_dim,what", [(d, w) for d in (64, 128) for w in DETERMINISTIC_CASES]
                         + [(256, w) for w in ("plain", "causal", "window", "softcap",
                                               "causal_padding_mask",
                                               "causal_flag_padding_mask", "dropout",
                                               "causal_alibi")])
def test_hopper_deterministic_backward_is_bitwise_reproducible(hopper_bwd, head_dim, what):
    # Ten runs, the same bits, in every variant of the Hopper backward (plain, general, mask,
    # dropout, softcap, ALiBi), on a shape with many key blocks per query block (16 at L = 2k)
    # and enough CTAs to fill the GPU (B * H_kv * 16 = 256): the order in which CTAs reach a
    # query block varies from run to run, so an unordered add would show.  Equal to the
    # unordered backward up to the fp32 summation order.  (The causal flag and windows take the
    # descending order, the rest the rotated one; with a padding mask beside them, steps the
    # bias skips count in.)
    batch, seqlen, heads_q, heads_kv = 4, 2048, 8, 4
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(batch, seqlen, heads_q, head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in "kv")
    dout = torch.randn(batch, seqlen, heads_q, head_dim, device="cuda", dtype=torch.bfloat16,
                       generator=gen)
    window = (300, 100) if what.startswith("window") else (-1, -1)
    causal = what in ("causal", "causal_flag_padding_mask", "causal_alibi")
    slopes = torch.rand(heads_q, device="cuda", generator=gen) if "alibi" in what else None
    softcap, dropout_p, bias = 20.0 if "softcap" in what else 0.0, 0.1 * ("dropout" in what), None
    if "mask" in what or "bias" in what:
        lengths = torch.tensor([seqlen, 1500, 700, 1], device="cuda")
        visible = (torch.arange(seqlen, device="cuda") < lengths[:, None])[:, None, None, :]
        if what == "causal_padding_mask":
            i = torch.arange(seqlen, device="cuda")[:, None]
            visible = visible & (torch.arange(seqlen, device="cuda")[None, :] <= i)
        bias = visible if "mask" in what else \
            torch.zeros(visible.shape, device="cuda").masked_fill(~visible, -1e4)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def grads(deterministic):
        torch.manual_seed(5)  # (the same dropout mask every run)
        out, _, _ = ops.fwd(*leaves, None, causal, window[0], window[1], True, softcap, slopes,
                            bias, dropout_p, deterministic)
        return torch.autograd.grad(out, leaves, dout)

    mods = planning.score_mods(softcap, dropout_p, bias, slopes)
    plan = planning.plan(q, k, v, mods=mods, deterministic=True)
    assert plan.backward_kernel.startswith("sm90_bwd") and "fixed order" in plan.notes[-1], plan
    first = grads(True)
    for _ in range(10):
        assert all(torch.equal(a, b) for a, b in zip(grads(True), first))
    for a, b in zip(grads(False), first):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def test_hopper_deterministic_backward_beyond_one_cta_per_sm():
    # More key blocks per (batch, KV head) than an H200 has SMs (133 > 132) and no mask: the
    # rotated order could wait for a CTA that is not resident, so the launcher takes the
    # descending one, every key block starting at query block 0.  Bitwise reproducible, equal to
    # the unordered backward up to the fp32 summation order.
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 17000, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 17000, 1, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in "kv")
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def grads(deterministic):
        out = flash_attn_func(*leaves, deterministic=deterministic)
        return torch.autograd.grad(out, leaves, dout)
    first = grads(True)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(grads(True), first))
    for a, b in zip(grads(False), first):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def score_mod_case(what, batch, seqlen_q, seqlen_k, heads_q):
    """(softcap, attn_bias, causal, window, alibi_slopes) of a score-modifier case (the
    general variant's; softcap alone or ALiBi alone their own variants'): ``what`` names its
    modifiers.  Biases are fp32: "bias" a dense (1, H, L, S) one (broadcast over the
    batch); "padding" a transformers-style key-padding mask as 0 / -inf (B, 1, 1, S), the last
    batch entry with no key at all (every row empty: zeros, LSE -inf, zero gradients);
    "causal_padding" a (B, 1, L, S) causal + padding mask (rows the padding empties included).
    "alibi": ALiBi slopes, (B, H) random ones with "causal", else the paper's (H,) ones."""
    softcap = (50.0 if what == "softcap" else 7.5) if "softcap" in what else 0.0
    causal = "causal" in what and "padding" not in what
    window = (37, 5) if "window" in what else (-1, -1)
    bias = None
    if "bias" in what:
        bias = 2 * torch.randn(1, heads_q, seqlen_q, seqlen_k, device="cuda")
    if "padding" in what:
        lengths = torch.randint(1, seqlen_k + 1, (batch,), device="cuda")
        lengths[-1] = 0
        visible = torch.arange(seqlen_k, device="cuda") < lengths[:, None]  # (B, S)
        visible = visible[:, None, None, :]
        if what.startswith("causal"):
            i = torch.arange(seqlen_q, device="cuda")[:, None]
            j = torch.arange(seqlen_k, device="cuda")[None, :]
            visible = visible & (j <= i + seqlen_k - seqlen_q)
        bias = torch.zeros(visible.shape, device="cuda").masked_fill(~visible, float("-inf"))
    slopes = None
    if "alibi" in what:
        slopes = torch.rand(batch, heads_q, device="cuda") if causal else \
            torch.tensor([2.0 ** (-8.0 * (h + 1) / heads_q) for h in range(heads_q)],
                         device="cuda")
    return softcap, bias, causal, window, slopes


SCORE_MODS = ["softcap", "bias", "padding", "causal_padding", "softcap_bias_causal",
              "window_padding", "alibi_causal", "softcap_alibi_window_padding",
              "alibi_causal_bias"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (1023, 1023)])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("what", SCORE_MODS + ["softcap_causal", "softcap_window", "alibi",
                                               "alibi_window"])
def test_hopper_general_forward_meets_the_error_rule(dtype, seqlen_q, seqlen_k, head_dim, what):
    # Softcap, an additive bias and masks as biases on the Hopper forward's general variant
    # (softcap alone and ALiBi alone, with or without causal / window masks, on their
    # variants), with causal / window masks and GQA, against the fp32 reference.
    q, k, v = rand(3, seqlen_q, 4, head_dim, dtype=dtype), \
        rand(3, seqlen_k, 2, head_dim, dtype=dtype), rand(3, seqlen_k, 2, head_dim, dtype=dtype)
    softcap, bias, causal, window, slopes = score_mod_case(what, 3, seqlen_q, seqlen_k, 4)
    mods = planning.score_mods(softcap, 0.0, bias, slopes)
    plan = planning.plan(q, k, v, mods=mods)
    variant = "_softcap" if mods == planning.SOFTCAP else \
        "_alibi" if mods == planning.ALIBI else "_general"
    assert plan.kernel == f"sm90_fwd_hdim{max(64, 1 << (head_dim - 1).bit_length())}_" \
        f"{'bf16' if dtype == torch.bfloat16 else 'fp16'}{variant}", plan
    kw = dict(causal=causal, window_left=window[0], window_right=window[1], softcap=softcap,
              attn_bias=bias, alibi_slopes=slopes)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    out, lse, _ = ops.fwd(q, k, v, None, causal, window[0], window[1], True, softcap, slopes,
                          bias)
    check_forward(out, lse, low_out, true_out, true_lse, f"out ({what})")
    if "padding" in what:  # the last batch entry sees no key
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        assert bool((lse[-1] == float("-inf")).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fma_exp2", ["auto", 0, 2, 4])
@pytest.mark.parametrize("softcap", [30.0, 100.0])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_softcap_forward_with_exp2_on_the_fma_pipe(kernel_opts, dtype, fma_exp2, softcap, mask):
    # The softcap variant at head dim 64 computes some exp2s as a polynomial on the FMA pipe
    # (fwd_softmax.h's exp2_fma; the option sm90_fma_exp2 picks how many of every 8 columns,
    # each its own instantiation).  Softcap 30 takes bf16's fixed reference max (exponents up
    # to 43), 100 the running max; L > S with a bottom-right causal mask or window leaves rows
    # 0 .. L - S - 1 without keys (exp2_fma must give exactly 0 for a masked score: out 0, LSE
    # -inf).  Against the fp32 reference (the error rule), and against the same call with
    # every exp2 on the MUFU (sm90_fma_exp2=0) within what the polynomial's relative error
    # (1.02e-4 bf16, 2.9e-6 fp16) allows; a NaN in q makes its row NaN and no other.
    seqlen_q, seqlen_k = 300, 257
    q = rand(2, seqlen_q, 4, 64, dtype=dtype) * 3
    k, v = rand(2, seqlen_k, 2, 64, dtype=dtype) * 3, rand(2, seqlen_k, 2, 64, dtype=dtype)
    causal = mask == "causal"
    window = (40, 0) if mask == "window" else (-1, -1)
    assert planning.plan(q, k, v, mods=planning.SOFTCAP).kernel.endswith("_softcap")
    kw = dict(causal=causal, window_left=window[0], window_right=window[1], softcap=softcap)
    args = (None, causal, window[0], window[1], True, softcap, None, None)
    kernel_opts(sm90_fma_exp2=0)
    out0, lse0, _ = ops.fwd(q, k, v, *args)
    kernel_opts(sm90_fma_exp2=fma_exp2)
    traits, name = launched_fwd_traits(lambda: ops.fwd(q, k, v, *args))
    assert traits[-1] == {0: "0", 4: "4"}.get(fma_exp2, "-1"), name
    out, lse, _ = ops.fwd(q, k, v, *args)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    check_forward(out, lse, low_out, true_out, true_lse, f"out ({mask}, {fma_exp2})")
    rel = 1.02e-4 if dtype == torch.bfloat16 else 2.9e-6
    finite = torch.isfinite(lse0)
    assert_lse_infinities(lse, lse0)
    assert (lse - lse0)[finite].abs().max().item() <= 2 * rel + 1e-5 * lse0[finite].abs().max()
    ulp = torch.finfo(dtype).eps * out0.float().abs().max().item()
    assert (out.float() - out0.float()).abs().max().item() <= ulp + 2 * rel * \
        v.float().abs().max().item()
    if mask != "none":  # rows 0 .. L - S - 1 see no key
        empty = seqlen_q - seqlen_k
        assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
        assert bool((lse[:, :, :empty] == float("-inf")).all())
    q_nan = q.clone()
    q_nan[1, 100, 2, 7] = float("nan")  # (a row that sees keys under every mask here)
    out_nan, lse_nan, _ = ops.fwd(q_nan, k, v, *args)
    row = torch.zeros_like(out, dtype=torch.bool)
    row[1, 100, 2] = True
    assert bool(out_nan[row].isnan().all()) and bool(lse_nan[1, 2, 100].isnan())
    assert torch.equal(out_nan[~row], out[~row])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 300), (300, 17), (200, 777), (1023, 1023)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bottom_right", [True, False], ids=["bottom_right", "top_left"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("slopes", ["standard", "steep"])
def test_hopper_alibi_forward_in_both_alignments(dtype, seqlen_q, seqlen_k, head_dim,
                                                 bottom_right, mask, slopes):
    # The ALiBi variant's forward takes key tiles on one side of every row's diagonal
    # (i + off - j >= 0 for each key a row may see: all tiles under a causal mask, those left
    # of the diagonal without one) with a per-column term, and the others with |i + off - j|
    # per score; row half 1 carries a constant that the LSE takes back.  Both causal
    # alignments (off = S - L or 0), windows whose right edge crosses the diagonal, L != S,
    # slopes up to 1 (steep rows: far keys vanish) and "steep" ones (10, and 100, which takes
    # |.| per score everywhere: the per-column term's extra rounding grows with the slope; a
    # negative one, 0), out and LSE against the fp32 reference.
    heads_q = 4
    q = rand(2, seqlen_q, heads_q, head_dim, dtype=dtype)
    k, v = (rand(2, seqlen_k, 2, head_dim, dtype=dtype) for _ in range(2))
    slopes = torch.tensor([1.0, 0.25, 2.0 ** -4, 2.0 ** -8] if slopes == "standard" else
                          [10.0, 100.0, -0.05, 0.0], device="cuda")
    causal = mask == "causal"
    window = (50, 20) if mask == "window" else (-1, -1)
    plan = planning.plan(q, k, v, mods=planning.ALIBI)
    assert plan.kernel.endswith("_alibi"), plan
    kw = dict(causal=causal, window_left=window[0], window_right=window[1],
              align_bottom_right=bottom_right, alibi_slopes=slopes)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    out, lse, _ = ops.fwd(q, k, v, None, causal, window[0], window[1], bottom_right, 0.0,
                          slopes, None)
    check_forward(out, lse, low_out, true_out, true_lse, f"out (ALiBi, {mask})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (200, 777),
                                               (1023, 1023)])
@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("window", [(-1, 0), (50, 0)], ids=["causal", "left_window"])
@pytest.mark.parametrize("bottom_right", [True, False], ids=["bottom_right", "top_left"])
@pytest.mark.parametrize("slopes", ["standard", "mixed", "scaled"])
@pytest.mark.parametrize("consumers", ["auto", 2, "narrow"])
def test_hopper_alibi_term_in_the_gemm_against_the_term_per_score(kernel_opts, dtype, seqlen_q,
                                                                  seqlen_k, head_dim, window,
                                                                  bottom_right, slopes,
                                                                  consumers):
    # The ALiBi variant at head dim 64 under a causal mask (window_right = 0, with or without a
    # left window) adds the term's column part through one more K step of Q K^T (QFold: slope /
    # scale in three 16-bit parts; KFold: the key offset in the tile) and its part per tile in
    # the softmax (fwd_kernel.h's fold_alibi; the option sm90_alibi_fold = False takes the term
    # per score).  Both against the fp32 reference (the error rule), both alignments, L != S,
    # seq 1; slopes up to 1 (FA-2's range), "mixed" ones (10 and 100 are steeper than the
    # fold's |slope log2 e| <= 2 and take the term per score in the same call; -0.05 and 0
    # fold), and "scaled" (softmax_scale 0.01: slope / scale up to 100, the parts' split at a
    # larger v).  The fold is taken where it applies: its rounding differs from the term per
    # score's on the large causal case.  The three shapes of the variant (three warpgroups with
    # 128-key tiles; two with 128: sm90_per_score_consumers; three with 96: sm90_narrow_tiles).
    if consumers == "narrow":
        kernel_opts(sm90_narrow_tiles=True)
    else:
        kernel_opts(sm90_per_score_consumers=consumers)
    heads_q = 4
    q = rand(2, seqlen_q, heads_q, head_dim, dtype=dtype)
    k, v = (rand(2, seqlen_k, 2, head_dim, dtype=dtype) for _ in range(2))
    slopes_t = torch.tensor([10.0, 100.0, -0.05, 0.0] if slopes == "mixed" else
                            [1.0, 0.25, 2.0 ** -4, 2.0 ** -8], device="cuda")
    scale = 0.01 if slopes == "scaled" else None
    if slopes == "scaled":
        q = q * 8
    assert planning.plan(q, k, v, mods=planning.ALIBI).kernel.endswith("_alibi")
    kw = dict(softmax_scale=scale, causal=False, window_left=window[0], window_right=window[1],
              align_bottom_right=bottom_right, alibi_slopes=slopes_t)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    args = (scale, False, window[0], window[1], bottom_right, 0.0, slopes_t, None)
    outs = {}
    for fold in (True, False):
        kernel_opts(sm90_alibi_fold=fold)
        out, lse, _ = ops.fwd(q, k, v, *args)
        check_forward(out, lse, low_out, true_out, true_lse, f"out (fold {fold}, {window})")
        outs[fold] = out
    if (seqlen_q, seqlen_k) == (1023, 1023) and slopes == "standard":
        assert not torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (200, 777),
                                               (1023, 1023)])
@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("what", ["alibi", "alibi_steep", "dropout"])
@pytest.mark.parametrize("consumers", ["auto", 2, 3])
def test_alibi_and_dropout_forward_with_either_warpgroup_count(kernel_opts, dtype, seqlen_q,
                                                               seqlen_k, head_dim, mask, what,
                                                               consumers):
    # The ALiBi and dropout variants at head dim 64 with two consumer warpgroups and 128-key
    # tiles (dropout's default) or three (ALiBi's default; the option
    # sm90_per_score_consumers picks the other, an instantiation of its own:
    # 192-row tiles, idle warpgroups in the partial causal block, keep bits of 6 dropout cells
    # per tile):
    # the kernel that ran, and out and LSE against the fp32 reference with the same slopes or
    # the same keep mask, both causal alignments' bottom-right case, windows crossing the
    # diagonal, L != S, seq 1.
    kernel_opts(sm90_per_score_consumers=consumers)
    heads_q, p_drop = 4, 0.17 * (what == "dropout")
    q = rand(2, seqlen_q, heads_q, head_dim, dtype=dtype)
    k, v = (rand(2, seqlen_k, 2, head_dim, dtype=dtype) for _ in range(2))
    slopes = None if what == "dropout" else \
        torch.tensor([1.0, 0.25, 2.0 ** -4, 2.0 ** -8] if what == "alibi" else
                     [10.0, 100.0, -0.05, 0.0], device="cuda")
    causal = mask == "causal"
    window = (50, 20) if mask == "window" else (-1, -1)
    args = (None, causal, window[0], window[1], True, 0.0, slopes, None, p_drop)
    traits, name = launched_fwd_traits(lambda: ops.fwd(q, k, v, *args))
    three = consumers == 3 or (consumers == "auto" and what != "dropout")
    assert traits[4] == ("3" if three else "2"), name
    assert traits[2] == "128", name
    out, lse, rng = ops.fwd(q, k, v, *args)
    keep = None
    if p_drop:
        seed, offset = (int(x) for x in rng.cpu())
        keep = ops._C.dropout_mask(seed, offset, 2, heads_q, seqlen_q, seqlen_k, p_drop)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1],
              alibi_slopes=slopes, dropout_keep=keep, dropout_p=p_drop)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    check_forward(out, lse, low_out, true_out, true_lse, f"out ({what}, {mask}, {consumers})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (1023, 1023)])
@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("what", ["alibi", "softcap"])
@pytest.mark.parametrize("narrow", [True, False], ids=["96_keys", "128_keys"])
def test_softcap_and_alibi_forward_with_either_tile_width(kernel_opts, dtype, seqlen_q, seqlen_k,
                                                          head_dim, mask, what, narrow):
    # The softcap and ALiBi variants at head dim 64 with their 128-key tiles or, under the
    # option sm90_narrow_tiles, 96 (an instantiation of its own, three consumer warpgroups
    # either way; ALiBi's term in the GEMM at both widths): the kernel that ran, and out and
    # LSE against the fp32 reference.
    kernel_opts(sm90_narrow_tiles=narrow)
    q = rand(2, seqlen_q, 4, head_dim, dtype=dtype) * 2
    k, v = (rand(2, seqlen_k, 2, head_dim, dtype=dtype) for _ in range(2))
    slopes = torch.tensor([1.0, 0.25, 2.0 ** -4, 0.7], device="cuda") if what == "alibi" \
        else None
    softcap = 5.0 if what == "softcap" else 0.0
    causal = mask == "causal"
    window = (50, 20) if mask == "window" else (-1, -1)
    args = (None, causal, window[0], window[1], True, softcap, slopes, None, 0.0)
    traits, name = launched_fwd_traits(lambda: ops.fwd(q, k, v, *args))
    assert (traits[2], traits[4]) == ("96" if narrow else "128", "3"), name
    out, lse, _ = ops.fwd(q, k, v, *args)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1],
              alibi_slopes=slopes, softcap=softcap)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    check_forward(out, lse, low_out, true_out, true_lse, f"out ({what}, {mask}, {narrow})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 17), (1023, 1023)])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap", [0.5, 30.0, 50.0, 50.5, 1e3])
@pytest.mark.parametrize("scores", ["spread", "low", "high"])
def test_hopper_softcap_forward_either_side_of_the_fixed_max(dtype, seqlen_q, seqlen_k,
                                                             head_dim, causal, softcap, scores):
    # The softcap variant's forward with bf16 inputs takes a fixed reference max of 0 for
    # softcaps up to 50.25 and the running max above (fwd_softmax.h, OnlineSoftmax::fixed_max);
    # fp16 always the running max.  Scores spread over the cap's range, and rows whose scores
    # all sit at -softcap ("low": tanh = -1, the smallest P, 2^-72 at softcap 50, with bf16
    # values of 2^-40, near the fixed max's documented range, so that O = sum P v is 2^-112)
    # or at +softcap ("high": the largest P, 2^72), where every row is the plain average of its
    # visible keys' values.  (At softcap 1e3 those scores are -600 and 600.)  Out and LSE
    # against the fp32 reference; "low" also to 1% of the largest value.
    v = rand(2, seqlen_k, 2, head_dim, dtype=dtype)
    # (Scores of at most ~1e4 before the scale: the fp16 reference computes them in fp16.)
    if scores in ("low", "high"):  # every scaled score -/+10 softcap: tanh(10) = 1 in fp32
        u = torch.rand(head_dim, device="cuda") + 0.5
        a = (min(10 * softcap, 600.0) * head_dim ** 0.5 / u.square().sum()).sqrt()
        q = (u * a).expand(2, seqlen_q, 4, head_dim).to(dtype).contiguous()
        k = ((-u if scores == "low" else u) * a).expand(2, seqlen_k, 2, head_dim)
        k = k.to(dtype).contiguous()
        if scores == "low" and dtype == torch.bfloat16:
            v = v * 2.0 ** -40
    else:  # scaled scores ~ N(0, sigma^2), sigma = softcap up to 100
        sigma = min(softcap, 100.0)
        q = (rand(2, seqlen_q, 4, head_dim) * sigma ** 0.5).to(dtype)
        k = (rand(2, seqlen_k, 2, head_dim) * sigma ** 0.5).to(dtype)
    assert planning.plan(q, k, v, mods=planning.SOFTCAP).kernel.endswith("_softcap")
    kw = dict(causal=causal, softcap=softcap)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    out, lse, _ = ops.fwd(q, k, v, None, causal, -1, -1, True, softcap, None, None)
    assert torch.isfinite(out).all()
    check_forward(out, lse, low_out, true_out, true_lse, f"out (softcap {softcap}, {scores})")
    if scores == "low":  # (the rule's absolute slack would pass zeros for tiny values)
        assert max_err(out, true_out) <= 1e-2 * true_out.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 300), (300, 17), (1023, 1023)])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("what", SCORE_MODS + ["softcap_causal", "softcap_window", "alibi",
                                               "alibi_window"])
def test_hopper_general_backward_meets_the_error_rule(hopper_bwd, dtype, seqlen_q, seqlen_k,
                                                      head_dim, what):
    # (softcap alone or ALiBi alone, with or without causal / window masks: the softcap and
    # ALiBi variants, forward and backward; softcap 7.5 with the masks, where tanh
    # saturates, 50 without)
    softcap, bias, causal, window, slopes = score_mod_case(what, 2, seqlen_q, seqlen_k, 4)
    hopper_backward_case(dtype, 2, seqlen_q, seqlen_k, 4, 2, head_dim, causal=causal,
                         window=window, softcap=softcap, attn_bias=bias, alibi_slopes=slopes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (1023, 1023)])
@pytest.mark.parametrize("head_dim", [200, 256])
@pytest.mark.parametrize("what", ["softcap", "softcap_causal", "softcap_window", "alibi",
                                  "alibi_causal", "alibi_window"])
def test_hopper_head_dim_256_softcap_alibi_backward_meets_the_error_rule(
        hopper_bwd, dtype, seqlen_q, seqlen_k, head_dim, what):
    # Softcap alone and ALiBi alone at head dim 256: the role split's variants (warpgroup 0
    # hands over P^T (1 - t^2) / adds ALiBi's term), with causal / window masks and GQA.
    softcap, bias, causal, window, slopes = score_mod_case(what, 2, seqlen_q, seqlen_k, 4)
    hopper_backward_case(dtype, 2, seqlen_q, seqlen_k, 4, 2, head_dim, causal=causal,
                         window=window, softcap=softcap, attn_bias=bias, alibi_slopes=slopes)


def mask_case(what, batch, seqlen_q, seqlen_k, heads_q):
    """(boolean mask, causal, window) of a mask-variant case.  "padding", "causal_padding",
    "window_padding": score_mod_case's masks as booleans (the last batch entry sees no key);
    "random": a dense (1, H, L, S) mask, about 70% visible, with every tenth row fully hidden;
    "rows": a (B, 1, L, 1) mask expanded along the keys (stride 0: whole rows hidden);
    "sliced": a key-padding mask cut from a wider one (row stride S + 3: odd, so its rows are
    not 2-byte aligned); "blockdiag": three packed sequences as one (L, S) block-diagonal causal
    mask (whole tiles masked between visible ones, in both directions); "perhead": a (B, H, L, S)
    mask whose structure differs per head and batch entry (head h sees a causal band of keys
    shifted by h * L / 4 and cut at a per-batch length; some heads see nothing in some rows),
    so that each head's block spans differ (the GQA group's union in the backward)."""
    if what == "random":
        mask = torch.rand(1, heads_q, seqlen_q, seqlen_k, device="cuda") < 0.7
        mask[:, :, ::10] = False
        return mask, False, (-1, -1)
    if what == "rows":
        mask = torch.rand(batch, 1, seqlen_q, 1, device="cuda") < 0.8
        return mask.expand(batch, 1, seqlen_q, seqlen_k), False, (-1, -1)
    if what == "perhead":
        i = torch.arange(seqlen_q, device="cuda")[:, None]
        j = torch.arange(seqlen_k, device="cuda")[None, :]
        shift = (torch.arange(heads_q, device="cuda") * max(seqlen_k // 4, 1))[:, None, None]
        band = (j >= shift) & (j - shift <= i * seqlen_k // seqlen_q)  # (H, L, S)
        lengths = torch.randint(1, seqlen_k + 1, (batch,), device="cuda")
        return band[None] & (j < lengths[:, None, None, None]), False, (-1, -1)
    if what == "blockdiag":
        seg_q = torch.arange(seqlen_q, device="cuda") * 3 // seqlen_q
        seg_k = torch.arange(seqlen_k, device="cuda") * 3 // seqlen_k
        i = torch.arange(seqlen_q, device="cuda")[:, None]
        j = torch.arange(seqlen_k, device="cuda")[None, :]
        return (seg_q[:, None] == seg_k[None, :]) & (j * seqlen_q <= i * seqlen_k), False, \
            (-1, -1)
    if what == "sliced":
        lengths = torch.randint(1, seqlen_k + 4, (batch,), device="cuda")
        wide = torch.arange(seqlen_k + 3, device="cuda") < lengths[:, None]
        wide = wide[:, None, None, :].expand(batch, 1, seqlen_q, seqlen_k + 3).contiguous()
        return wide[..., :seqlen_k], True, (-1, -1)
    _, bias, causal, window, _ = score_mod_case(what, batch, seqlen_q, seqlen_k, heads_q)
    return bias == 0, causal, window


MASKS = ["padding", "causal_padding", "window_padding", "random", "rows", "sliced", "blockdiag",
         "perhead"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (1023, 1023)])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("what", MASKS)
def test_hopper_mask_variant_forward_meets_the_error_rule(dtype, seqlen_q, seqlen_k, head_dim,
                                                          what):
    # A boolean mask alone, read as it is (a byte per score) by the Hopper forward's mask
    # variant, with causal / window masks and GQA, against the fp32 reference; rows it empties
    # give zeros and an LSE of -inf.
    q, k, v = rand(3, seqlen_q, 4, head_dim, dtype=dtype), \
        rand(3, seqlen_k, 2, head_dim, dtype=dtype), rand(3, seqlen_k, 2, head_dim, dtype=dtype)
    mask, causal, window = mask_case(what, 3, seqlen_q, seqlen_k, 4)
    plan = planning.plan(q, k, v, mods=planning.score_mods(0.0, 0.0, mask))
    assert plan.kernel.startswith("sm90_fwd") and plan.kernel.endswith("_mask"), plan
    kw = dict(causal=causal, window_left=window[0], window_right=window[1], attn_bias=mask)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    out, lse, _ = ops.fwd(q, k, v, None, causal, window[0], window[1], True, 0.0, None, mask)
    check_forward(out, lse, low_out, true_out, true_lse, f"out ({what})")
    empty = ~(mask.expand(3, 4, seqlen_q, seqlen_k) & visible_mask(
        seqlen_q, seqlen_k, causal, window[0], window[1], True, q.device)).any(-1)  # (B, H, L)
    assert torch.equal(lse.isinf(), empty)
    assert not out.transpose(1, 2)[empty].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 300), (300, 17), (1023, 1023)])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 200, 256])
@pytest.mark.parametrize("what", MASKS)
def test_hopper_mask_variant_backward_meets_the_error_rule(hopper_bwd, dtype, seqlen_q,
                                                           seqlen_k, head_dim, what):
    # (head dims 200 and 256: the step split by role, 64 keys per CTA, its warpgroup 0 reading
    # the mask's bytes)
    mask, causal, window = mask_case(what, 2, seqlen_q, seqlen_k, 4)
    hopper_backward_case(dtype, 2, seqlen_q, seqlen_k, 4, 2, head_dim, causal=causal,
                         window=window, attn_bias=mask)


@pytest.mark.parametrize("what", ["causal_padding", "blockdiag"])
def test_hopper_mask_variant_at_256_top_left_and_deterministic(hopper_bwd, what):
    # Head dim 256's mask variant with the causal mask aligned top-left (L != S) and with dQ in
    # a fixed order (steps of wholly masked 64 x 64 blocks skipped by the consumers and counted
    # in by the order warp), against the fp32 reference; GQA, SDPA's transposed layout.
    mask, _, _ = mask_case(what, 2, 700, 900, 8)
    for deterministic in (False, True):
        hopper_backward_case(torch.bfloat16, 2, 700, 900, 8, 2, 256, causal=True,
                             bottom_right=False, transposed=True,
                             attn_bias=mask, deterministic=deterministic)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("what", ["causal_padding", "random"])
def test_mask_variant_equals_the_mask_as_a_bias(kernel_opts, what, head_dim):
    # The same mask as a boolean (the mask variant, with and without the block summary) and as
    # 0 / -inf in fp32 (the general variant, with its own exp2 form): the mask variant's
    # forward bitwise equal with and without the summary (a skipped tile adds exact zeros), the
    # general variant's within rounding; the gradients equal up to the order of the dQ
    # additions.  (Head dim 256: the float bias's backward is the portable one.)
    q, k, v = (rand(2, 700, 4, head_dim) for _ in "qkv")
    mask, causal, window = mask_case(what, 2, 700, 700, 4)
    bias = torch.zeros(mask.shape, device="cuda").masked_fill(~mask, float("-inf"))
    results = []
    for attn_bias, blocks in ((mask, True), (mask, False), (bias, True)):
        kernel_opts(sm90_bias_blocks=blocks)
        plan = planning.plan(q, k, v, mods=planning.score_mods(0.0, 0.0, attn_bias))
        assert plan.kernel.endswith("_mask" if attn_bias is mask else "_general"), plan
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse, _ = ops.fwd(*leaves, None, causal, window[0], window[1], True, 0.0, None,
                              attn_bias)
        results.append((out.detach(), lse.detach(),
                        torch.autograd.grad(out, leaves, torch.ones_like(out))))
    (out1, lse1, g1), (out0, lse0, g0), (outb, lseb, gb) = results
    assert torch.equal(out1, out0) and torch.equal(lse1, lse0)
    torch.testing.assert_close(out1, outb, atol=2e-3, rtol=0)
    for a, b, c in zip(g1, g0, gb):
        assert not a.isnan().any()
        for other in (b, c):
            assert (a.float() - other.float()).abs().max().item() <= \
                1e-2 * max(other.abs().max().item(), 1)


def test_hopper_general_bias_strides_and_a_bias_that_needs_its_gradient():
    # A bias whose keys are not unit-stride (a transposed view) is copied, one broadcast along
    # the keys is read once per row (not copied: the kernels' stride-0 path); a bias that
    # requires grad runs the portable backward (which writes dS out), with the same forward.
    q, k, v = (rand(2, 200, 4, 128).requires_grad_() for _ in "qkv")
    for bias in (torch.randn(2, 4, 200, 200, device="cuda").transpose(2, 3),
                 torch.randn(2, 4, 200, 1, device="cuda").expand(2, 4, 200, 200)):
        out, lse, _ = ops.fwd(q, k, v, None, True, -1, 0, True, 0.0, None, bias)
        ref, ref_lse = attention_ref(q.float(), k.float(), v.float(), causal=True,
                                     attn_bias=bias, compute_dtype=torch.float32)
        low, _ = attention_ref(q, k, v, causal=True, attn_bias=bias, compute_dtype=q.dtype)
        check_forward(out.detach(), lse.detach(), low, ref, ref_lse, "out")
    bias = torch.randn(1, 4, 200, 200, device="cuda", requires_grad=True)
    p = planning.plan(q, k, v, mods=planning.score_mods(0.0, 0.0, bias))
    assert p.kernel.endswith("_general") and p.backward_kernel.startswith("sm80_bwd"), p
    out, _, _ = ops.fwd(q, k, v, None, False, -1, -1, True, 0.0, None, bias)
    grads = torch.autograd.grad(out.float().square().sum(), (q, bias))
    b32 = bias.detach().requires_grad_()
    q32 = q.detach().float().requires_grad_()
    ref, _ = attention_ref(q32, k.float(), v.float(), attn_bias=b32, compute_dtype=torch.float32)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q32, b32))
    b_low, q_low = bias.detach().requires_grad_(), q.detach().requires_grad_()
    low, _ = attention_ref(q_low, k, v, attn_bias=b_low, compute_dtype=q.dtype)
    low_grads = torch.autograd.grad(low.float().square().sum(), (q_low, b_low))
    for name, a, lo, t in zip(("dq", "dbias"), grads, low_grads, ref_grads):
        assert_error_rule(a, lo, t.double(), 3.0, name)


@pytest.mark.parametrize("what", ["padding", "causal_padding", "window_padding", "bias"])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim", [(1023, 1023, 128), (300, 700, 64),
                                                        (129, 2000, 256), (2000, 129, 128)])
def test_bias_block_summary_changes_no_result(hopper_bwd, kernel_opts, what, seqlen_q, seqlen_k,
                                              head_dim):
    # The block summary skips key tiles (forward) and steps (backward) that the bias masks for
    # all their rows, and reads no bias where it is 0: the forward is bitwise the same as
    # reading every value (a skipped tile adds exact zeros), the gradients equal up to the
    # order of the dQ additions.
    q, k, v = rand(3, seqlen_q, 4, head_dim), rand(3, seqlen_k, 2, head_dim), \
        rand(3, seqlen_k, 2, head_dim)
    softcap, bias, causal, window, _ = score_mod_case(what, 3, seqlen_q, seqlen_k, 4)
    results = {}
    for blocks in (True, False):
        kernel_opts(sm90_bias_blocks=blocks)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse, _ = ops.fwd(*leaves, None, causal, window[0], window[1], True, softcap, None,
                              bias)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out)) \
            if head_dim <= 128 else ()
        results[blocks] = (out.detach(), lse.detach(), grads)
    (out1, lse1, g1), (out0, lse0, g0) = results[True], results[False]
    assert torch.equal(out1, out0) and torch.equal(lse1, lse0)
    for a, b in zip(g1, g0):
        assert not a.isnan().any()
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * max(b.abs().max().item(), 1)
    with pytest.raises(ValueError, match="sm90_bias_blocks must be a bool"):
        kernel_opts(sm90_bias_blocks="yes")


def _diagonal_masks(seqlen_q, seqlen_k):
    """Boolean (L, S) masks whose 64 x 64 blocks straddle a diagonal in every way: causal masks
    shifted by offsets on and off the blocks' grid, and near-diagonal masks (a row one key
    longer, a hole, random prefixes, the line's mirror as left padding makes it)."""
    i = torch.arange(seqlen_q, device="cuda")[:, None]
    j = torch.arange(seqlen_k, device="cuda")[None, :]
    masks = {f"tril{d}": j <= i + d for d in (-70, -63, -1, 0, 1, 37, 62, 63, 64, 130)}
    longer = j <= i
    longer[70, 71] = True
    masks["one_row_longer"] = longer
    hole = j <= i
    hole[100, 50] = False
    masks["one_row_hole"] = hole
    lengths = torch.randint(0, seqlen_k + 1, (seqlen_q, 1), device="cuda")
    masks["random_prefixes"] = j < lengths
    masks["suffix"] = j >= i - 5
    return masks


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mask_variant_on_diagonal_blocks(kernel_opts, head_dim):
    # The mask variant's forward with the block summary (tiles skipped, visible runs, mixed
    # tiles read) bitwise the same as reading every byte, and within the error rule, on masks
    # whose blocks cut a diagonal at every offset (rows emptied by the shift included); the
    # Hopper backward on two of them.
    seqlen_q, seqlen_k = 200, 331
    q, k, v = rand(2, seqlen_q, 4, head_dim), rand(2, seqlen_k, 2, head_dim), \
        rand(2, seqlen_k, 2, head_dim)
    masks = _diagonal_masks(seqlen_q, seqlen_k)
    for name, mask in masks.items():
        outs = {}
        for blocks in (True, False):
            kernel_opts(sm90_bias_blocks=blocks)
            outs[blocks] = ops.fwd(q, k, v, None, False, -1, -1, True, 0.0, None, mask)[:2]
        (out, lse), (out0, lse0) = outs[True], outs[False]
        assert torch.equal(out, out0) and torch.equal(lse, lse0), name
        true_out, true_lse = attention_ref(q.float(), k.float(), v.float(), attn_bias=mask,
                                           compute_dtype=torch.float32)
        low_out, _ = attention_ref(q, k, v, attn_bias=mask, compute_dtype=q.dtype)
        check_forward(out, lse, low_out, true_out, true_lse, f"out ({name})")
    kernel_opts(sm90_bias_blocks=True, sm90_bwd="on")
    for name in ("tril37", "one_row_longer"):
        hopper_backward_case(torch.bfloat16, 2, seqlen_q, seqlen_k, 4, 2, head_dim,
                             attn_bias=masks[name])


def _mask_row_keys_ref(mask):
    """What the summary's row intervals of a boolean mask (B, H, L, S) must be
    (ops._C.sm90_mask_row_keys): over the mask's own extent (one where a dimension is of size 1
    or stride 0), per row (begin, end) where its visible keys are exactly [begin, end) ((0, 0)
    where it sees none), else (1, 0)."""
    own = mask[tuple(slice(0, 1) if mask.shape[i] == 1 or mask.stride(i) == 0 else slice(None)
                     for i in range(3))].cpu()
    keys = torch.arange(own.shape[-1])
    count = own.sum(-1)
    first = torch.where(own, keys, own.shape[-1]).min(-1).values
    last = torch.where(own, keys, -1).max(-1).values
    interval = count == last - first + 1
    begin = torch.where(count == 0, 0, torch.where(interval, first, 1))
    end = torch.where(count == 0, 0, torch.where(interval, last + 1, 0))
    return torch.stack([begin, end], -1).int()


def _left_padding_mask(batch, seqlen_q, seqlen_k):
    """A (B, 1, L, S) causal mask with left padding (each batch entry's first keys hidden, the
    last entry's all of them): rows whose keys are an interval not starting at 0."""
    pad = torch.tensor([0, 37, seqlen_k][:batch] + [5] * max(batch - 3, 0), device="cuda")
    i = torch.arange(seqlen_q, device="cuda")[:, None]
    j = torch.arange(seqlen_k, device="cuda")[None, :]
    return ((j <= i + seqlen_k - seqlen_q) & (j >= pad[:, None, None]))[:, None]


def _summary_mask(what, seqlen_q, seqlen_k, holes):
    """A (3, H, L, S) or broadcast boolean mask of a summary test: mask_case's, the left padding
    mask, or "random_holes": a causal + padding mask with the (rows, keys) index `holes` of
    batch entry 1, head 2 hidden (rows or keys that are then not one interval)."""
    if what == "left_padding":
        mask = _left_padding_mask(3, seqlen_q, seqlen_k)
    elif what == "random_holes":
        mask, _, _ = mask_case("causal_padding", 3, seqlen_q, seqlen_k, 4)
        mask = mask.expand(3, 4, seqlen_q, seqlen_k).clone()
        mask[(1, 2) + holes] = False
    else:
        mask, _, _ = mask_case(what, 3, seqlen_q, seqlen_k, 4)
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # ("blockdiag": (L, S))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (65, 131),
                                               (1023, 1023), (4500, 1100)])
@pytest.mark.parametrize("what", [m for m in MASKS if m != "rows"] + ["left_padding",
                                                                      "random_holes"])
def test_mask_row_keys_summary(seqlen_q, seqlen_k, what):
    # The summary's rows as key intervals, which the Hopper forward's mask variant masks by
    # comparisons in mixed blocks: against each row's visible keys, over the mask's own
    # extent; whole 64-key blocks read 16 bytes a lane, partial ones (S = 131, 300) and odd row
    # strides ("sliced") two keys a lane; rows that see nothing (0, 0); rows whose keys are not
    # one interval ("random", and "random_holes": a padding mask with one hidden key in some
    # rows) marked (1, 0).  A row block's keys are walked by one CTA, or by n CTAs (at most one
    # per 8 key blocks) where n per (row block, batch, head) fit in 264, whose parts are added
    # by atomics: (4500, 1100), 71 row blocks of 18 key blocks (the last partial: two keys a
    # lane after whole blocks), is walked by one CTA a row block for the masks of 3, 4 or 12
    # (batch, head) pairs of their own (a warp then walks up to 3 blocks), by 3 for 1; of the
    # smaller shapes only (1023, 1023) splits (by 2, for 1, 3 or 4 pairs).
    mask = _summary_mask(what, seqlen_q, seqlen_k, holes=(slice(None, None, 3), seqlen_k // 2))
    if seqlen_k == 1:  # (one key: its dimension broadcasts, and no intervals are kept)
        with pytest.raises(RuntimeError, match="no row intervals"):
            ops._C.sm90_mask_row_keys(mask)
        return
    got = ops._C.sm90_mask_row_keys(mask).cpu()
    want = _mask_row_keys_ref(mask)
    assert torch.equal(got, want), (what, (got != want).nonzero()[:8])
    if what in ("causal_padding", "window_padding", "left_padding", "blockdiag"):
        assert (want[..., 0] <= want[..., 1]).all()  # (every row an interval)
    # Keys broadcast (stride 0): no intervals kept (such rows are read once per row, not per key).
    with pytest.raises(RuntimeError, match="no row intervals"):
        ops._C.sm90_mask_row_keys(mask_case("rows", 3, seqlen_q, seqlen_k, 4)[0])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(200, 331), (1023, 1023), (300, 17)])
@pytest.mark.parametrize("what", ["causal_padding", "left_padding", "window_padding", "random",
                                  "blockdiag", "perhead"])
def test_mask_variant_row_intervals_agree_with_the_bytes(kernel_opts, head_dim, seqlen_q,
                                                         seqlen_k, what):
    # The mask variant's forward masking the rows that are key intervals by comparisons in mixed
    # blocks (sm90_mask_rows, the default) gives the same bits as reading the mask's bytes
    # there, with the causal flag too; the error rule holds for the default in the tests above.
    q, k, v = rand(3, seqlen_q, 4, head_dim), rand(3, seqlen_k, 2, head_dim), \
        rand(3, seqlen_k, 2, head_dim)
    if what == "left_padding":
        mask, causal, window = _left_padding_mask(3, seqlen_q, seqlen_k), False, (-1, -1)
    else:
        mask, causal, window = mask_case(what, 3, seqlen_q, seqlen_k, 4)
    for flag in (causal, True):
        outs = []
        for rows in (True, False):
            kernel_opts(sm90_mask_rows=rows)
            outs.append(ops.fwd(q, k, v, None, flag, window[0], window[1], True, 0.0, None,
                                mask)[:2])
        (out, lse), (out0, lse0) = outs
        assert not out.isnan().any()
        assert torch.equal(out, out0) and torch.equal(lse, lse0), (what, flag)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 17), (17, 300), (300, 17), (65, 131),
                                               (1023, 1023), (1100, 4500)])
@pytest.mark.parametrize("what", [m for m in MASKS if m != "rows"] + ["left_padding",
                                                                      "random_holes"])
def test_mask_col_rows_summary(seqlen_q, seqlen_k, what):
    # The summary's keys as row intervals, which the Hopper backward's mask variant masks by
    # comparisons in mixed steps: against each key's visible rows (the row rule on the
    # transposed mask), over the mask's own extent; whole 64-key blocks gathered from the
    # 16-byte loads by warp votes, partial ones (S = 17, 131, 300) and odd row strides
    # ("sliced") two keys a lane; keys no row sees (0, 0); keys whose rows are not one interval
    # ("random", "random_holes", "perhead" bands cut per batch entry) marked (1, 0).  A key
    # block's rows are walked by one CTA or several, as the rows' keys above ((1100, 4500):
    # one for 3, 4 or 12 (batch, head) pairs of the mask's own, 3 for 1).
    mask = _summary_mask(what, seqlen_q, seqlen_k, holes=(seqlen_q // 2, slice(None, None, 3)))
    if mask.shape[2] == 1 or mask.stride(2) == 0:
        # (one row, or rows broadcast, as the (B, 1, 1, S) padding masks: no intervals are
        # kept, the mask's mixed blocks are then its padding edges alone)
        with pytest.raises(RuntimeError, match="no column intervals"):
            ops._C.sm90_mask_row_keys(mask, columns=True)
        return
    got = ops._C.sm90_mask_row_keys(mask, columns=True).cpu()
    want = _mask_row_keys_ref(mask.transpose(2, 3))
    assert torch.equal(got, want), (what, (got != want).nonzero()[:8])
    if what in ("causal_padding", "left_padding", "blockdiag"):
        assert (want[..., 0] <= want[..., 1]).all()  # (every key an interval)
    # Keys broadcast (stride 0): no intervals kept.
    with pytest.raises(RuntimeError, match="no column intervals"):
        ops._C.sm90_mask_row_keys(mask_case("rows", 3, seqlen_q, seqlen_k, 4)[0], columns=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(200, 331), (1023, 1023), (300, 17)])
@pytest.mark.parametrize("what", ["causal_padding", "left_padding", "window_padding", "random",
                                  "blockdiag", "perhead"])
def test_mask_variant_col_intervals_agree_with_the_bytes(hopper_bwd, kernel_opts, head_dim,
                                                         seqlen_q, seqlen_k, what):
    # The mask variant's backward masking a thread's keys that are row intervals by
    # comparisons in mixed steps (sm90_mask_cols, the default) gives the same bits as reading
    # the mask's bytes there: dQ in the fixed order (deterministic), with the causal flag too;
    # the error rule holds for the default in the tests above.
    q, k, v = rand(3, seqlen_q, 4, head_dim), rand(3, seqlen_k, 2, head_dim), \
        rand(3, seqlen_k, 2, head_dim)
    dout = rand(3, seqlen_q, 4, head_dim)
    if what == "left_padding":
        mask, causal, window = _left_padding_mask(3, seqlen_q, seqlen_k), False, (-1, -1)
    else:
        mask, causal, window = mask_case(what, 3, seqlen_q, seqlen_k, 4)
    plan = planning.plan(q, k, v, mods=planning.score_mods(0.0, 0.0, mask), deterministic=True)
    assert plan.backward_kernel.startswith("sm90_bwd") and "_mask" in plan.backward_kernel, plan
    for flag in (causal, True):
        grads = []
        for cols in (True, False):
            kernel_opts(sm90_mask_cols=cols)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out, _, _ = ops.fwd(*leaves, None, flag, window[0], window[1], True, 0.0, None,
                                mask, deterministic=True)
            grads.append(torch.autograd.grad(out, leaves, dout))
        for a, b, name in zip(*grads, "qkv"):
            assert not a.isnan().any(), (what, flag, name)
            assert torch.equal(a, b), (what, flag, name)


def test_nan_in_a_bias_block_reaches_the_rows_that_see_it():
    # A NaN in a block that is otherwise 0 makes the block "mixed": read, so the NaN reaches
    # exactly the rows that see it, forward and backward (never a silently finite answer).
    q, k, v = (rand(2, 300, 4, 128).requires_grad_() for _ in "qkv")
    bias = torch.zeros(1, 1, 300, 300, device="cuda")
    bias[..., 100:, :] = float("-inf")  # whole masked blocks too
    bias[..., 5, 7] = float("nan")
    out, _, _ = ops.fwd(q, k, v, None, False, -1, -1, True, 0.0, None, bias)
    nan_rows = out.isnan().any(-1).any(-1).any(0)  # (L,)
    assert nan_rows.nonzero().flatten().tolist() == [5]
    dq, = torch.autograd.grad(out.float().sum(), (q,))
    assert dq.isnan().any()


def test_hopper_backward_long_sequence(hopper_bwd):
    hopper_backward_case(torch.bfloat16, 1, 4224, 4224, 4, 4, 128, causal=True)
    hopper_backward_case(torch.bfloat16, 1, 4096, 4096, 2, 2, 64)
    hopper_backward_case(torch.bfloat16, 1, 4224, 4224, 2, 1, 256, causal=True)


@pytest.mark.parametrize("head_dim, seqlen", [(128, 16384), (64, 32768), (256, 8192)])
def test_hopper_backward_causal_sections_cover_every_key_block(hopper_bwd, head_dim, seqlen):
    # Causal calls with dQ in any order launch in sections of (batch, KV head) pairs sized to
    # ~40 MiB of L2, the key block slowest within each (bwd_launch_template.h, bwd_kernel.h).
    # A pair takes 16 MiB here (d = 64 at 32k, 128 at 16k, 256 at 8k): two make a section
    # and three pairs leave a last section of one.  Every key block must be computed exactly
    # once: dK and dV (summed in the CTA) bitwise equal to the deterministic order's, which
    # launches the key block fastest; dQ (added in another order) close to it.
    q, k, v = (rand(1, seqlen, 3, head_dim).requires_grad_() for _ in "qkv")
    dout = rand(1, seqlen, 3, head_dim)
    grads = [torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=det),
                                 (q, k, v), dout) for det in (False, True)]
    (dq, dk, dv), (dq_det, dk_det, dv_det) = grads
    assert torch.equal(dk, dk_det) and torch.equal(dv, dv_det)
    assert dk.abs().amax(dim=(0, 2, 3)).min() > 0  # (no key row left at zero)
    torch.testing.assert_close(dq.float(), dq_det.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim, head_dim_v", [(64, 64), (40, 40), (128, 128), (72, 72),
                                                 (128, 64), (256, 256), (200, 200)])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_hopper_backward_staged_and_direct_dkdv_stores_agree(kernel_opts, head_dim, head_dim_v,
                                                             packed):
    # dK and dV stored through shared memory (16-byte rows, the default) and from registers
    # (sm90_direct_epilogue): the same accumulators, so bitwise equal (256: the role split),
    # with partial key blocks (113 keys; packed: sequences ending inside a warpgroup's 64 rows
    # and one with no key), GQA and cut head dims.  Outputs are poisoned (conftest.py): a row
    # or column left unwritten shows.
    kernel_opts(sm90_bwd="on")
    lens = [113, 0, 70, 190] if packed else [113] * 2
    total = sum(lens)
    q = rand(total, 4, head_dim).requires_grad_()
    k = rand(total, 2, head_dim).requires_grad_()
    v = rand(total, 2, head_dim_v).requires_grad_()
    dout = rand(total, 4, head_dim_v)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    shapes = (rand(2, 113, 4, head_dim), rand(2, 113, 2, head_dim), rand(2, 113, 2, head_dim_v))
    assert planning.plan(*shapes).backward_kernel.startswith("sm90_bwd_")
    grads = {}
    for direct in (False, True):
        kernel_opts(sm90_direct_epilogue=direct)
        if packed:
            out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        else:
            out = flash_attn_func(*(t.view(2, 113, *t.shape[1:]) for t in (q, k, v)),
                                  causal=True).view(total, 4, head_dim_v)
        grads[direct] = torch.autograd.grad(out, (k, v), dout)
    for name, staged, direct in zip(("dk", "dv"), grads[False], grads[True]):
        assert torch.isfinite(staged).all(), name
        assert torch.equal(staged, direct), name


def test_hopper_and_portable_backward_agree(kernel_opts):
    # The same call on both backwards: two summation orders, close, not bitwise equal; the
    # option switches within the process and the plan follows it.
    q, k, v = (rand(2, 1000, 4, 128).requires_grad_() for _ in "qkv")
    dout = rand(2, 1000, 4, 128)
    grads = {}
    for choice in ("auto", "off"):
        kernel_opts(sm90_bwd=choice)
        name = planning.plan(q, k, v).backward_kernel
        assert name.startswith("sm90_bwd" if choice == "auto" else "sm80_bwd"), name
        out = flash_attn_func(q, k, v, causal=True)
        grads[choice] = torch.autograd.grad(out, (q, k, v), dout)
    with pytest.raises(ValueError, match="sm90_bwd must be one of 'auto', 'on', 'off'"):
        kernel_opts(sm90_bwd=True)
    for a, b in zip(grads["auto"], grads["off"]):
        assert not a.isnan().any()
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def test_strided_and_broadcast_inputs():
    # (B, H, L, D) storage seen as (B, L, H, D): what scaled_dot_product_attention passes.
    q = rand(3, 8, 333, 128).transpose(1, 2)
    k = rand(3, 2, 400, 128).transpose(1, 2)
    v = rand(3, 2, 400, 128).transpose(1, 2)
    assert planning.plan(q, k, v).kernel.startswith("sm90")
    out = flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=True,
                           compute_dtype=torch.float32)
    low, _ = attention_ref(q, k, v, causal=True, compute_dtype=torch.bfloat16)
    assert_error_rule(out, low, ref.double(), 2.0, "out")
    # A key/value head broadcast over the batch (stride 0): TMA cannot load it, the portable
    # kernel does, and the plan says so.
    kb, vb = k[:1].expand(3, -1, -1, -1), v[:1].expand(3, -1, -1, -1)
    p = planning.plan(q, kb, vb)
    assert p.kernel.startswith("sm80") and "broadcast" in p.notes[0]
    out = flash_attn_func(q, kb, vb)
    ref, _ = attention_ref(q.float(), kb.float(), vb.float(), compute_dtype=torch.float32)
    low, _ = attention_ref(q, kb, vb, compute_dtype=torch.bfloat16)
    assert_error_rule(out, low, ref.double(), 2.0, "out (broadcast k, v)")


def test_long_sequence_and_many_heads():
    q, k, v = rand(1, 8192, 16, 128), rand(1, 8192, 16, 128), rand(1, 8192, 16, 128)
    out = flash_attn_func(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True).transpose(1, 2)
    low = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    assert_error_rule(out, low, ref.double(), 2.0, "out")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window,bottom_right", [
    (1500, 700, True, (-1, -1), True),     # the first 800 rows see no key: empty tiles
    (700, 1500, True, (-1, -1), False),    # top-left causal, L < S
    (1200, 1200, False, (150, 0), True),   # sliding window: a band of key tiles per block
    (333, 2500, False, (-1, -1), True)])   # few query blocks, long rows
@pytest.mark.parametrize("schedule", ["auto", "dynamic", "static", "tile"])
@pytest.mark.parametrize("epilogue", ["tma", "direct"])
def test_many_tiles_empty_short_and_long_mixed(kernel_opts, schedule, epilogue, head_dim,
                                               seqlen_q, seqlen_k, causal, window, bottom_right):
    # Hundreds of (query block, head) tiles, more than the GPU has SMs, long, short and empty ones
    # (rows that see no key) mixed in one launch; outputs are poisoned by conftest, so every
    # element must be written.  (Written for a persistent version of the kernel, which runs
    # several tiles per CTA; kept for the one-CTA-per-tile kernel.)
    kernel_opts(sm90_schedule=schedule, sm90_direct_epilogue=epilogue == "direct")
    q = rand(3, seqlen_q, 20, head_dim)
    k, v = rand(3, seqlen_k, 4, head_dim), rand(3, seqlen_k, 4, head_dim)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1],
              align_bottom_right=bottom_right)
    assert planning.plan(q, k, v).kernel.startswith("sm90")
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=torch.bfloat16, **kw)
    for _ in range(2):  # the same result twice
        out, lse, _ = ops.fwd(q, k, v, None, causal, window[0], window[1], bottom_right)
        check_forward(out, lse, low_out, true_out, true_lse, "out")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_running_max_that_keeps_growing(kernel_opts, dtype, head_dim, causal):
    # The Hopper kernel moves a row's reference max only when a key tile's max exceeds it by
    # more than 2^8 (lazy rescaling); random scores almost never do past the first tile.  Keys
    # whose norm grows along the sequence make the row maxima grow tile after tile, by more and
    # by less than that threshold, so both the rescaled and the unscaled (P up to 256) paths run.
    seqlen = 1000
    q = rand(2, seqlen, 4, head_dim, dtype=dtype)
    ramp = torch.logspace(-1, 1, seqlen, device="cuda").view(1, seqlen, 1, 1)
    k = (rand(2, seqlen, 4, head_dim) * ramp).to(dtype)
    v = rand(2, seqlen, 4, head_dim, dtype=dtype)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, causal=causal)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, causal=causal)
    for choice in ("auto", "sm80"):
        kernel_opts(force_portable=choice == "sm80")
        assert planning.plan(q, k, v).kernel.startswith("sm90" if choice == "auto" else "sm80")
        out, lse, _ = ops.fwd(q, k, v, None, causal)
        assert_error_rule(out, low_out, true_out.double(), 2.0, f"out ({choice})")
        assert (lse - true_lse).abs().max().item() < 1e-2


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_order_sections_change_no_result(kernel_opts, head_dim, causal):
    # The sm90_section_pairs option only reorders the tiles: each tile's arithmetic is the same,
    # so every order gives the default's output bit for bit.
    q, k, v = rand(3, 700, 6, head_dim), rand(3, 700, 2, head_dim), rand(3, 700, 2, head_dim)
    out, lse, _ = ops.fwd(q, k, v, None, causal)
    for pairs in (1, 4, 1000):
        kernel_opts(sm90_section_pairs=pairs)
        out2, lse2, _ = ops.fwd(q, k, v, None, causal)
        assert torch.equal(out, out2) and torch.equal(lse, lse2), pairs
    for bad in (-2, "x", 3.0, True):
        with pytest.raises(ValueError, match="sm90_section_pairs"):
            kernel_opts(sm90_section_pairs=bad)


@pytest.mark.parametrize("seqlen_q,seqlen_k,bottom_right", [
    (1000, 1000, True),    # 5 1/3 blocks of 192 rows: the first block holds rows [-128, 64)
    (2000, 2000, True),    # 10 5/12 blocks: rows [-64, 128), one idle warpgroup
    (700, 1300, True),     # L < S, bottom-right: the first block sees the first 664 keys
    (1300, 700, True),     # L > S: the first 600 rows see nothing
    (900, 1500, False),    # top-left alignment
    (65, 65, True)])       # one block, two of its warpgroups idle
@pytest.mark.parametrize("head_dim", [64, 128])
def test_causal_partial_block_first_changes_no_result(kernel_opts, head_dim, seqlen_q, seqlen_k,
                                                      bottom_right):
    # Under a causal mask the head-dim-64 kernel (192-row tiles) puts the query block that
    # seqlen_q fills only in part first, its missing rows below row 0, instead of last.  Every
    # row still meets its key tiles in the same order (extra fully masked ones add exact zeros),
    # so sm90_row_shift=False must give the same result bit for bit, and both the
    # fp32 reference's within the error rule; every output element written (poisoned outputs).
    # Head dim 128 (128-row tiles) never shifts: the same check holds trivially there.
    q = rand(2, seqlen_q, 6, head_dim)
    k, v = rand(2, seqlen_k, 2, head_dim), rand(2, seqlen_k, 2, head_dim)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(), causal=True,
                                       align_bottom_right=bottom_right,
                                       compute_dtype=torch.float32)
    low_out, _ = attention_ref(q, k, v, causal=True, align_bottom_right=bottom_right,
                               compute_dtype=torch.bfloat16)
    results = {}
    for shift in ("auto", "off"):
        for schedule in ("dynamic", "static"):
            kernel_opts(sm90_row_shift=shift == "auto", sm90_schedule=schedule)
            out, lse, _ = ops.fwd(q, k, v, None, True, -1, -1, bottom_right)
            check_forward(out, lse, low_out, true_out, true_lse, f"out ({shift}, {schedule})")
            results[shift, schedule] = out, lse
    out, lse = results["auto", "dynamic"]
    for key, (out2, lse2) in results.items():
        assert torch.equal(out, out2) and torch.equal(lse, lse2), key
    with pytest.raises(ValueError, match="sm90_row_shift must be a bool"):
        kernel_opts(sm90_row_shift="1")


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads_q,heads_kv,causal,window,bottom_right", [
    (1, 1000, 32, 4, True, (-1, -1), True),       # decoding: one tile per group of 8
    (3, 257, 12, 4, True, (-1, -1), True),        # group of 3: 9 rows, none a power of two
    (17, 700, 16, 1, False, (-1, -1), True),      # MQA: 272 packed rows, 2-3 tiles
    (113, 113, 8, 2, True, (-1, -1), False),      # prefill, top-left causal
    (200, 1500, 6, 2, False, (64, 0), True),      # sliding window, L < S
    (700, 300, 4, 2, True, (-1, -1), True),       # L > S: the first 400 positions see nothing
    (1000, 1000, 8, 2, True, (-1, -1), True)])    # many tiles, the partial block first
@pytest.mark.parametrize("strided", [False, True])
def test_packed_gqa_changes_no_result(kernel_opts, head_dim, seqlen_q, seqlen_k, heads_q,
                                      heads_kv, causal, window, bottom_right, strided):
    # sm90_pack_gqa="on" puts the query heads of a KV head's group in one tile
    # (tile row = position * group + head in group; Q by cp.async, O from registers).  Each row
    # still meets its key tiles in the same order (extra fully masked ones add exact zeros), so
    # the result must equal the unpacked kernel's bit for bit, and the fp32 reference's within
    # the error rule; outputs are poisoned by conftest, so every element must be written.
    # strided: q, k, v are slices of one fused (batch, seqlen, heads, 3 * head_dim) buffer.
    def make(seqlen, heads):
        if not strided:
            return [rand(2, seqlen, heads, head_dim) for _ in range(3)]
        fused = rand(2, seqlen, heads, 3 * head_dim)
        return [fused[..., i * head_dim:(i + 1) * head_dim] for i in range(3)]
    q = make(seqlen_q, heads_q)[0]
    _, k, v = make(seqlen_k, heads_kv)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1],
              align_bottom_right=bottom_right)
    true_out, true_lse = attention_ref(q.float(), k.float(), v.float(),
                                       compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=torch.bfloat16, **kw)
    results = {}
    for pack in ("on", "off"):
        kernel_opts(sm90_pack_gqa=pack)
        kernel = planning.plan(q, k, v).kernel
        assert kernel.startswith("sm90") and kernel.endswith("_packgqa") == (pack == "on")
        out, lse, _ = ops.fwd(q, k, v, None, causal, window[0], window[1], bottom_right)
        check_forward(out, lse, low_out, true_out, true_lse, f"out (pack {pack})")
        results[pack] = out, lse
    assert torch.equal(results["on"][0], results["off"][0])
    assert torch.equal(results["on"][1], results["off"][1])


def test_pack_gqa_option_is_checked(kernel_opts):
    q, k = rand(1, 1, 8, 64), rand(1, 64, 2, 64)
    kernel_opts(sm90_pack_gqa="auto")
    assert planning.plan(q, k, k).kernel == "sm90_fwd_hdim64_bf16_packgqa"  # decoding, group 4
    with pytest.raises(ValueError, match="sm90_pack_gqa must be one of 'auto', 'on', 'off'"):
        kernel_opts(sm90_pack_gqa="yes")


def test_schedule_option_is_checked(kernel_opts):
    with pytest.raises(ValueError, match="sm90_schedule must be one of"):
        kernel_opts(sm90_schedule="greedy")
