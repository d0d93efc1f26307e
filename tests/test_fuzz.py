"""Hypothesis fuzz: random shapes, masks, GQA groups, strides and dtypes against the reference."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_attn_ext import _C, ops
from reference import assert_error_rule, attention_ref, cancellation_scale


def check_lse(lse, true_lse, q, k, bias, kw):
    """softmax_lse where finite against the float64 one: off by at most the scores' rounding in
    the kernels' accumulator (a dot product of d terms: d eps sum |q_i k_i| scale, the sum's
    bound; the LSE moves by no more than its scores do), the bias's and softcap's own rounding,
    and a few ulps of the result; -inf exactly where the reference has it."""
    assert torch.equal(torch.isfinite(lse), torch.isfinite(true_lse))
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


def check_grads_relative(q, k, v, bias, out, dout, kw):
    """dq, dk, dv (and dbias) of ``out`` against float64 autograd, relative to each gradient's
    size (for calls with a bias or dropout; ``kw`` includes the dropout mask)."""
    inputs = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    ours = torch.autograd.grad(out, inputs, dout)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    ref, _, probs = attention_ref(*leaves[:3], attn_bias=leaves[3] if len(leaves) > 3 else bias,
                                  return_probs=True, **kw)
    refs = torch.autograd.grad(ref, leaves, dout.double())
    tol = 1e-9 if q.dtype == torch.float64 else (1e-4 if q.dtype == torch.float32 else 5e-2)
    # FlashAttention's D = rowsum(dO * O) reads `out` rounded to the input dtype: each dS_ij is
    # off by up to P_ij * eps * sum_c |dO_ic O_ic|, and dbias sums dS over broadcast dimensions.
    eps = torch.finfo(q.dtype).eps
    delta_err = eps * (dout.double().abs() * ref.detach().abs()).sum(-1).transpose(1, 2)
    pd = probs.detach() * delta_err.unsqueeze(-1)  # bound on each |dS_ij| error, (B, H, L, S)
    group = q.shape[2] // k.shape[2]
    sm = kw["softmax_scale"] or q.shape[-1] ** -0.5
    kabs = k.detach().double().abs().repeat_interleave(group, dim=2)
    dq_bound = sm * torch.einsum("bhls,bshd->blhd", pd, kabs)
    dk_bound = sm * torch.einsum("bhls,blhd->bshd", pd, q.detach().double().abs())
    dk_bound = dk_bound.reshape(*k.shape[:2], k.shape[2], group, k.shape[3]).sum(3)
    bounds = {"dq": dq_bound, "dk": dk_bound, "dv": 0.0,
              "dbias": pd.sum_to_size(bias.shape) if bias is not None else 0.0}
    for name, a, r in zip(("dq", "dk", "dv", "dbias"), ours, refs):
        r = r.nan_to_num(0.0)  # -inf bias entries: no gradient
        scale = max(1.0, r.abs().max().item())
        assert a.shape == r.shape and not torch.isnan(a).any(), name
        err = (a.double() - r).abs() - 4 * bounds[name]
        assert err.max().item() <= tol * scale, name


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


# CI runs a fixed set of 250 examples; FLASH_ATTN_EXT_FUZZ_EXAMPLES=N explores N fresh ones.
EXPLORE = int(os.environ.get("FLASH_ATTN_EXT_FUZZ_EXAMPLES", "0"))


@settings(max_examples=EXPLORE or 250, deadline=None, derandomize=not EXPLORE,
          suppress_health_check=[HealthCheck.too_slow])
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
    *cancel, score_scale = (x * _C.dropout_scale(p)
                            for x in cancellation_scale(q, k, v, dout, **attn_kw))
    if bias is not None:
        true_out, true_lse = attention_ref(*(t.detach().double() for t in (q, k, v)),
                                           attn_bias=bias, **kw)
        low_out, _ = attention_ref(q, k, v, compute_dtype=c["dtype"], attn_bias=bias, **kw)
        assert_error_rule(out, low_out, true_out, 2.0, "out", 0.0, score_scale)
        check_lse(lse, true_lse, q, k, bias, kw)
        if c["seqlen_k"] > 0:
            check_grads_relative(q, k, v, bias, out, dout, kw)
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
