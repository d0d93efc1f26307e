"""ALiBi (alibi_slopes, FlashAttention-2's definition) on the CPU kernels and every path that
serves flash_attn_func: forward, softmax_lse and gradients against the float64 reference under
the error rule, its argument checks, explain, the unfused path and torch.compile.  The CUDA
kernels' cases are in test_cuda.py (portable) and test_sm90.py (Hopper)."""

import math

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import flash_attn_func, ops, planning, unfused
from reference import (
    alibi_ref,
    assert_error_rule,
    assert_lse_infinities,
    attention_ref,
    cancellation_scale,
    max_err,
)


def standard_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes for a power-of-two head count: 2^(-8 h / H), h = 1..H."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


def alibi_case(dtype, shape, causal=False, window=(-1, -1), bottom_right=True,
               per_batch=False, softcap=0.0, bias=False):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = shape
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, requires_grad=True)
    slopes = torch.rand(batch, heads) * 0.5 if per_batch else standard_slopes(heads)
    attn_bias = torch.randn(1, heads, seqlen_q, seqlen_k) if bias else None
    kw = dict(causal=causal, window_left=window[0], window_right=window[1],
              align_bottom_right=bottom_right, softcap=softcap, attn_bias=attn_bias,
              alibi_slopes=slopes)
    out, lse, _ = ops.fwd(q, k, v, None, causal, window[0], window[1], bottom_right, softcap,
                          slopes, attn_bias)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    true_out, true_lse = attention_ref(*leaves, **kw)
    true_grads = torch.autograd.grad(true_out, leaves, dout.double())
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    low_grads = torch.autograd.grad(low_out, (q, k, v), dout)
    assert_error_rule(out, low_out, true_out, 2.0, "out")
    finite = torch.isfinite(true_lse)
    assert_lse_infinities(lse, true_lse)
    if finite.any():  # softmax_lse includes ALiBi (the reference's logsumexp of the scores)
        tol = 1e-12 if dtype == torch.float64 else 2e-5 * max(1.0, true_lse[finite].abs().max())
        assert (lse[finite].double() - true_lse[finite]).abs().max().item() <= tol
    *cancel, score_scale = cancellation_scale(q, k, v, dout, per_element=True, out=out,
                                              true_out=true_out, **kw)
    for name, ours, low, true, c in zip(("dq", "dk", "dv"), grads, low_grads, true_grads,
                                        cancel):
        assert_error_rule(ours, low, true, 3.0, name, c, score_scale)
    return out


SHAPES = [(1, 1, 1, 1, 1, 40), (2, 17, 113, 4, 1, 59), (1, 113, 17, 4, 2, 72),
          (1, 130, 600, 2, 2, 256)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(causal=True, bottom_right=False),
                                  dict(window=(8, 3))], ids=str)
def test_alibi_matches_reference(dtype, shape, mask):
    alibi_case(dtype, shape, **mask)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_alibi_per_batch_slopes_with_softcap_and_bias(dtype):
    alibi_case(dtype, (3, 33, 47, 4, 2, 24), causal=True, per_batch=True, softcap=2.5, bias=True)
    alibi_case(dtype, (2, 64, 64, 2, 1, 32), window=(5, -1), per_batch=True)


def test_alibi_through_flash_attn_func_and_the_unfused_path():
    # flash_attn_func passes the slopes to the op (bottom-right, FlashAttention-2's definition);
    # the unfused path adds the same bias.
    q, k, v = (torch.randn(2, n, 4, 16, dtype=torch.float64) for n in (20, 31, 31))
    slopes = torch.rand(2, 4)
    out, lse = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_softmax_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    fb, fb_lse = unfused.fallback_attention(q, k, v, None, -1, 0, True, 0.0,
                                            alibi_slopes=slopes)
    torch.testing.assert_close(fb, ref)
    torch.testing.assert_close(fb_lse, ref_lse)
    bias = alibi_ref(slopes, 20, 31, True, torch.float64)
    torch.testing.assert_close(unfused.alibi_bias(slopes, 20, 31, True, torch.float64), bias)


def test_alibi_far_keys_vanish_without_nan():
    # A steep slope on a long row: distant keys' scores are hundreds below the diagonal's, their
    # weights exactly 0 in fp32; no overflow, no NaN.
    q, k, v = (torch.randn(1, 600, 2, 8) for _ in "qkv")
    slopes = torch.tensor([4.0, 0.0])
    out = flash_attn_func(q, k, v, alibi_slopes=slopes)
    ref, _ = attention_ref(q.double(), k.double(), v.double(), alibi_slopes=slopes)
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("slopes,match", [
    (torch.ones(3), r"alibi_slopes must have shape \(num_heads,\) = \(4,\)"),
    (torch.ones(2, 4, 1), r"alibi_slopes must have shape"),
    (torch.ones(3, 4), r"\(batch, num_heads\) = \(2, 4\)"),
    (torch.ones(4, dtype=torch.int32), "a floating tensor .* got dtype torch.int32"),
    (torch.ones(4, device="meta"), "alibi_slopes must be on cpu"),
    (torch.ones(4, requires_grad=True), "computes no gradient for the slopes"),
])
def test_alibi_slopes_checks(slopes, match):
    q = torch.randn(2, 5, 4, 8)
    with pytest.raises(ValueError, match=match):
        flash_attn_func(q, q, q, alibi_slopes=slopes)


def test_alibi_slopes_that_are_not_a_tensor_are_a_type_error():
    # (reference.md: TypeError where a tensor argument is not a tensor; was a ValueError here
    # and an AttributeError in the packed and kvcache functions)
    q = torch.randn(2, 5, 4, 8)
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor, got list"):
        flash_attn_func(q, q, q, alibi_slopes=[0.5] * 4)


@pytest.mark.parametrize("slopes,match", [
    (torch.ones(3), r"alibi_slopes must have shape \(num_heads,\) = \(4,\) or \(batch, "
                    r"num_heads\) = \(2, 4\), got \[3\]"),
    (torch.ones(4, dtype=torch.int32), "alibi_slopes must be a floating tensor"),
    (torch.ones(4, requires_grad=True), "computes no gradient for the slopes"),
])
def test_the_op_checks_alibi_slopes(slopes, match):
    # The op's own checks (csrc/ops.cpp, and its autograd for slopes that want a gradient),
    # for code that calls torch.ops.flash_attn_ext.fwd directly.
    q = torch.randn(2, 5, 4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        ops.fwd(q, q, q, alibi_slopes=slopes)


def test_a_wrong_q_rank_is_reported_as_such_with_slopes():
    q = torch.randn(5, 4, 8)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(4))


@pytest.mark.parametrize("slopes,match", [
    (torch.ones(3, device="meta"), r"alibi_slopes must have shape .* got \[3\]"),
    (torch.ones(4, dtype=torch.int64, device="meta"), "got dtype torch.int64"),
])
def test_the_fake_kernel_checks_alibi_slopes(slopes, match):
    # Traced calls (FakeTensor, torch.compile) never reach the C++ checks: the fake kernel
    # makes the same ones.
    q = torch.randn(2, 5, 4, 8, device="meta")
    with pytest.raises(ValueError, match=match):
        ops.fwd(q, q, q, alibi_slopes=slopes)


def test_alibi_slopes_that_need_no_gradient_under_no_grad():
    # Slopes that require grad are accepted under no_grad (no gradient is asked for) and
    # detached ones anywhere; both give the reference's answer.
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    slopes = torch.tensor([1.0, 0.25], requires_grad=True)
    want, _ = attention_ref(q, q, q, alibi_slopes=slopes.detach())
    with torch.no_grad():
        out = flash_attn_func(q, q, q, alibi_slopes=slopes)
    assert max_err(out, want) < 1e-12
    assert max_err(flash_attn_func(q, q, q, alibi_slopes=slopes.detach()), want) < 1e-12


def test_explain_and_plan_take_alibi():
    q = torch.randn(1, 8, 2, 16)
    plan = flash_attn_ext.explain(q, q, q, layout="blhd", alibi_slopes=torch.ones(2))
    assert plan.fused and plan.kernel == "cpu_flash_fwd_fp32"
    assert planning.score_mods(0.0, 0.0, None, torch.ones(2)) == planning.ALIBI
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attn_ext.explain(q, q, q, layout="blhd", alibi_slopes=torch.ones(3))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_with_alibi(backend):
    torch._dynamo.reset()
    slopes = standard_slopes(4)

    def fn(q, k, v):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)

    inputs = [torch.randn(2, 33, 4, 16) for _ in range(3)]
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    leaves = [x.clone().requires_grad_() for x in inputs]
    ref_leaves = [x.clone().requires_grad_() for x in inputs]
    out, ref = compiled(*leaves), fn(*ref_leaves)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad)
    assert not math.isnan(out.sum().item())
