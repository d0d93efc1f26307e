"""Hypothesis fuzz: random shapes, masks, GQA groups, strides and dtypes against the reference."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from flash_attn_ext import _C, ops
from reference import (
    assert_error_rule,
    assert_lse_infinities,
    attention_ref,
    cancellation_scale,
    dbias_cancellation,
    fuzz_settings,
)


def check_lse(lse, true_lse, q, k, bias, kw):
    """softmax_lse where finite against the float64 one: off by at most the scores' rounding in
    the kernels' accumulator (a dot product of d terms: d eps sum |q_i k_i| scale, the sum's
    bound; the LSE moves by no more than its scores do), the bias's and softcap's own rounding,
    and a few ulps of the result; -inf exactly where the reference has it."""
    assert_lse_infinities(lse, true_lse)
    finite = torch.isfinite(true_lse)
    if not finite.any():
        return
    eps = torch.finfo(torch.float64 if q.dtype == torch.float64 else torch.float32).eps
    group = q.shape[2] // k.shape[2]
    sm = kw["softmax_scale"] or q.shape[-1] ** -0.5
    kabs = k.detach().double().abs().repeat_interleave(group, dim=2)
    dot_abs = sm * torch.einsum("blhd,bshd->bhls", q.detach().double().abs(), kabs)
    dot_abs = dot_abs.max().item() if dot_abs.numel() else 0.0
    extra = 0.0 if bias is None else bias.detach().double().nan_to_num(
        0.0, posinf=0.0, neginf=0.0).abs().max().item()
    extra += kw["softcap"] + true_lse[finite].abs().max().item() + 1.0
    tol = eps * (q.shape[-1] * dot_abs + 8 * extra)
    err = (lse.double()[finite] - true_lse[finite]).abs().max().item()
    assert err <= tol, f"softmax_lse: error {err:.3e} > {tol:.3e}"


def check_bias_grads(q, k, v, bias, out, dout, kw, attn_kw, p, score_scale):
    """dq, dk, dv (and dbias, where the bias requires grad) of a call with a bias under the
    error rule: float64 autograd as the truth, the same reference in the inputs' dtype as the
    yardstick, the cancellation terms of each gradient (dbias's summed over the dimensions the
    bias broadcasts; dropout scales them by up to 1 / P(kept))."""
    inputs = [q, k, v] + ([bias] if bias.requires_grad else [])
    ours = torch.autograd.grad(out, inputs, dout)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    true, _ = attention_ref(*leaves[:3], attn_bias=leaves[3] if len(leaves) > 3 else bias, **kw)
    true_grads = torch.autograd.grad(true, leaves, dout.double())
    low_leaves = [t.detach().requires_grad_() for t in inputs]
    low, _ = attention_ref(*low_leaves[:3], compute_dtype=q.dtype,
                           attn_bias=low_leaves[3] if len(low_leaves) > 3 else bias, **kw)
    low_grads = torch.autograd.grad(low, low_leaves, dout)
    drop = _C.dropout_scale(p)
    drop_kw = {n: x for n, x in kw.items() if n.startswith("dropout")}  # (term (c)'s dP)
    cancel = [x * drop for x in cancellation_scale(q, k, v, dout, per_element=True, out=out,
                                                   true_out=true, attn_bias=bias,
                                                   **attn_kw, **drop_kw)[:3]]
    if len(inputs) > 3:
        cancel.append(drop * dbias_cancellation(q, k, v, dout, bias.shape, attn_bias=bias,
                                                **attn_kw))
    for name, a, lo, t, c in zip(("dq", "dk", "dv", "dbias"), ours, low_grads, true_grads,
                                 cancel):
        # (-inf bias entries: no gradient; autograd gives NaN or 0 there)
        hidden = ~torch.isfinite(bias.detach()).expand(a.shape) if name == "dbias" else None
        if hidden is not None:
            a, lo, t = (x.masked_fill(hidden, 0.0) for x in (a, lo, t))
        assert_error_rule(a, lo, t, 3.0, name, c, score_scale)


@st.composite
def configs(draw):
    heads_kv = draw(st.integers(1, 3))
    return dict(
        batch=draw(st.integers(1, 2)),
        seqlen_q=draw(st.integers(1, 80)),
        seqlen_k=draw(st.integers(0, 80)),
        heads_kv=heads_kv,
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.integers(1, 72)),
        head_dim_v=draw(st.integers(1, 72)),
        causal=draw(st.booleans()),
        window_left=draw(st.sampled_from([-1, -1, 0, 1, 7, 30])),
        window_right=draw(st.sampled_from([-1, -1, 0, 2, 13])),
        align_bottom_right=draw(st.booleans()),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 1.0, 20.0])),
        softmax_scale=draw(st.sampled_from([None, None, 0.05, 1.3])),
        dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])),
        transposed=draw(st.booleans()),
        # attention bias: None or a broadcast pattern over (batch, heads, rows, keys)
        bias=draw(st.sampled_from([None, None, (1, 1, 0, 1), (0, 1, 1, 1), (0, 0, 0, 0),
                                   (1, 0, 0, 1)])),
        bias_grad=draw(st.booleans()),
        dropout_p=draw(st.sampled_from([0.0, 0.0, 0.0, 0.2, 0.6])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make(shape, dtype, transposed):
    if transposed:  # (B, H, L, D) storage read through a (B, L, H, D) view, like the SDPA API
        b, seqlen, heads, d = shape
        return torch.randn(b, heads, seqlen, d, dtype=dtype).transpose(1, 2).requires_grad_()
    return torch.randn(shape, dtype=dtype, requires_grad=True)


@fuzz_settings(250)
@given(configs())
def test_fuzz_against_reference(c):
    torch.manual_seed(c["seed"])
    heads = c["heads_kv"] * c["group"]
    q = make((c["batch"], c["seqlen_q"], heads, c["head_dim"]), c["dtype"], c["transposed"])
    k = make((c["batch"], c["seqlen_k"], c["heads_kv"], c["head_dim"]), c["dtype"],
             c["transposed"])
    v = make((c["batch"], c["seqlen_k"], c["heads_kv"], c["head_dim_v"]), c["dtype"],
             c["transposed"])
    kw = dict(softmax_scale=c["softmax_scale"], causal=c["causal"],
              window_left=c["window_left"], window_right=c["window_right"],
              align_bottom_right=c["align_bottom_right"], softcap=c["softcap"])
    bias = None
    if c["bias"] is not None:  # 1 = that dimension broadcasts
        full = (c["batch"], heads, c["seqlen_q"], c["seqlen_k"])
        shape = tuple(1 if bc else n for bc, n in zip(c["bias"], full))
        bias = torch.randn(shape, dtype=c["dtype"])
        bias = bias.masked_fill(torch.rand(shape) < 0.2, float("-inf")).requires_grad_(
            c["bias_grad"])
    p = c["dropout_p"]
    out, lse, rng = ops.fwd(q, k, v, kw["softmax_scale"], kw["causal"], kw["window_left"],
                            kw["window_right"], kw["align_bottom_right"], kw["softcap"], None,
                            bias, p)
    if p > 0:  # the kernels' mask, regenerated from rng_state, in the reference too
        kw["dropout_keep"] = _C.dropout_mask(int(rng[0]), int(rng[1]), c["batch"], heads,
                                             c["seqlen_q"], c["seqlen_k"], p)
        kw["dropout_p"] = p
    dout = torch.randn_like(out)
    attn_kw = {n: x for n, x in kw.items() if not n.startswith("dropout")}
    # Forward slack for scores' rounding: an fp32 score of size |s| is off by ~eps32 |s|, which
    # moves P (and out) relatively by that much; a different summation order than PyTorch's
    # can cost it where PyTorch got lucky (large scale, few visible keys).
    # (with dropout the terms take the kept weights: the dropped output for delta, dP masked)
    *cancel, score_scale = (x * _C.dropout_scale(p)
                            for x in cancellation_scale(q, k, v, dout, per_element=True, out=out,
                                                        attn_bias=bias, **kw))
    if bias is not None:
        true_out, true_lse = attention_ref(*(t.detach().double() for t in (q, k, v)),
                                           attn_bias=bias, **kw)
        low_out, _ = attention_ref(q, k, v, compute_dtype=c["dtype"], attn_bias=bias, **kw)
        assert_error_rule(out, low_out, true_out, 2.0, "out", 0.0, score_scale)
        check_lse(lse, true_lse, q, k, bias, kw)
        if c["seqlen_k"] > 0:
            check_bias_grads(q, k, v, bias, out, dout, kw, attn_kw, p, score_scale)
        return
    grads = torch.autograd.grad(out, (q, k, v), dout)
    true_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    true_out, true_lse = attention_ref(*true_leaves, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=c["dtype"], **kw)
    assert_error_rule(out, low_out, true_out, 2.0, "out", 0.0, score_scale)
    check_lse(lse, true_lse, q, k, None, kw)
    if c["seqlen_k"] == 0:
        return
    true_grads = torch.autograd.grad(true_out, true_leaves, dout.double())
    low_grads = torch.autograd.grad(low_out, (q, k, v), dout)
    # (cancel, score_scale: above; dropout scales the cancelling terms by up to 1 / P(kept).)
    for name, ours, low, true, c in zip(("dq", "dk", "dv"), grads, low_grads, true_grads, cancel):
        assert_error_rule(ours, low, true, 3.0, name, c, score_scale)
