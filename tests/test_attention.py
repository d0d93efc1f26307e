"""Forward and backward of the fused op against the float64 reference, under the error rule."""

import itertools
import math

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import flash_attn_func, ops
from reference import (
    assert_error_rule,
    assert_lse_infinities,
    attention_ref,
    cancellation_scale,
    grad_bound,
    max_err,
    slack,
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v): odd sizes, L != S both
# ways, GQA 4:1 and 2:1, MQA, head dims 40/59/72/256 and Ev != E.
SHAPES = [
    (1, 1, 1, 1, 1, 40, 40),
    (2, 17, 113, 4, 1, 59, 59),
    (1, 113, 17, 4, 2, 72, 40),
    (2, 64, 64, 2, 2, 32, 48),
    (1, 130, 600, 4, 4, 256, 256),
    (1, 600, 130, 8, 2, 16, 16),
]

# (causal, window_left, window_right, align_bottom_right)
MASKS = [
    (False, -1, -1, True),
    (True, -1, -1, True),
    (True, -1, -1, False),
    (False, 8, 3, True),
    (False, 5, -1, False),
    (False, -1, 0, False),
]


def run_case(dtype, shape, mask, softcap=0.0, softmax_scale=None):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v = shape
    causal, wl, wr, br = mask
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, dtype=dtype, requires_grad=True)
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_left=wl, window_right=wr,
              align_bottom_right=br, softcap=softcap)
    out, lse, _ = ops.fwd(q, k, v, softmax_scale, causal, wl, wr, br, softcap)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    true_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    true_out, true_lse = attention_ref(*true_leaves, **kw)
    true_grads = torch.autograd.grad(true_out, true_leaves, dout.double())
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    low_grads = torch.autograd.grad(low_out, (q, k, v), dout)

    assert out.shape == (batch, seqlen_q, heads, head_dim_v) and out.dtype == dtype
    assert lse.shape == (batch, heads, seqlen_q)
    assert_error_rule(out, low_out, true_out, 2.0, "out")
    finite = torch.isfinite(true_lse)
    assert_lse_infinities(lse, true_lse)
    lse_tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert (lse[finite].double() - true_lse[finite]).abs().max().item() <= lse_tol if finite.any() \
        else True
    *cancel, score_scale = cancellation_scale(q, k, v, dout, per_element=True, out=out,
                                              true_out=true_out, **kw)
    for name, ours, low, true, c in zip(("dq", "dk", "dv"), (dq, dk, dv), low_grads, true_grads,
                                        cancel):
        assert_error_rule(ours, low, true, 3.0, name, c, score_scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_matches_reference(dtype, shape, mask):
    run_case(dtype, shape, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_1023(dtype, causal):
    run_case(dtype, (1, 1023, 1023, 2, 1, 64, 64), (causal, -1, -1, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_softcap_and_scale(dtype):
    run_case(dtype, (2, 33, 47, 2, 1, 24, 24), (True, -1, -1, True), softcap=2.5,
             softmax_scale=0.7)
    run_case(dtype, (1, 20, 20, 1, 1, 8, 8), (False, -1, -1, True), softmax_scale=-0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows(dtype):
    # Bottom-right causal with L > S: the first L - S rows see no key; a top-left window with
    # L > S empties the rows past the keys; seqlen_k = 0 empties all.
    for shape, mask in [((2, 10, 4, 2, 1, 16, 16), (True, -1, -1, True)),
                        ((1, 30, 5, 2, 2, 8, 8), (False, 2, 1, False)),
                        ((1, 40, 600, 1, 1, 8, 8), (False, 0, 0, True))]:
        batch, seqlen_q, seqlen_k, heads, heads_kv, d, dv_ = shape
        q = torch.randn(batch, seqlen_q, heads, d, dtype=dtype, requires_grad=True)
        k = torch.randn(batch, seqlen_k, heads_kv, d, dtype=dtype, requires_grad=True)
        v = torch.randn(batch, seqlen_k, heads_kv, dv_, dtype=dtype, requires_grad=True)
        causal, wl, wr, br = mask
        out, lse, _ = ops.fwd(q, k, v, None, causal, wl, wr, br)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        for t in (out, lse, dq, dk, dv):
            assert not torch.isnan(t).any()
        from reference import visible_mask
        empty_rows = ~visible_mask(seqlen_q, seqlen_k, causal, wl, wr, br).any(-1)
        assert empty_rows.any() == (shape[1] > shape[2])
        assert (out[:, empty_rows] == 0).all()
        assert (lse[:, :, empty_rows] == float("-inf")).all()
        assert (dq[:, empty_rows] == 0).all()
        assert torch.isfinite(lse[:, :, ~empty_rows]).all()
    q = torch.randn(1, 3, 2, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 0, 2, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 0, 2, 8, dtype=dtype, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, return_softmax_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    dq, = torch.autograd.grad(out.sum(), (q,))
    assert (dq == 0).all()


def test_strided_inputs_need_no_copy_and_match():
    # Packed qkv (B, L, 3, H, D): q/k/v are strided views; also an SDPA-style transposed view and a
    # last-dim-strided tensor (copied internally).
    qkv = torch.randn(2, 37, 3, 4, 32, requires_grad=True)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert_error_rule(out, attention_ref(q, k, v, causal=True, compute_dtype=torch.float32)[0],
                      ref, 2.0, "packed qkv out")
    (g,) = torch.autograd.grad(out.sum(), (qkv,))
    (g_ref,) = torch.autograd.grad(ref.sum(), (qkv,))
    low = attention_ref(q, k, v, causal=True, compute_dtype=torch.float32)[0]
    (g_low,) = torch.autograd.grad(low.sum(), (qkv,))
    *cancel, score_scale = cancellation_scale(q, k, v, torch.ones_like(out), per_element=True,
                                          out=out, true_out=ref, causal=True)
    assert_error_rule(g, g_low, g_ref, 3.0, "packed qkv grads", torch.stack(cancel, 2),
                      score_scale)
    base = torch.randn(2, 4, 29, 64)[..., ::2]  # last dim stride 2
    qt = base.transpose(1, 2)
    out2 = flash_attn_func(qt, qt, qt)
    ref2, _ = attention_ref(qt, qt, qt)
    assert (out2.double() - ref2).abs().max() < 1e-5


def test_gqa_does_not_copy_kv_and_matches_repeat():
    q = torch.randn(1, 19, 8, 16)
    k = torch.randn(1, 23, 2, 16)
    v = torch.randn(1, 23, 2, 16)
    out = flash_attn_func(q, k, v)
    out_rep = flash_attn_func(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2))
    assert torch.allclose(out, out_rep, atol=1e-6, rtol=0)


def test_gradcheck_float64():
    for causal, window, (lq, lk) in itertools.product([False, True], [(-1, -1), (2, 1)],
                                                      [(5, 7), (6, 3)]):
        q = torch.randn(1, lq, 2, 4, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, lk, 1, 4, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, lk, 1, 3, dtype=torch.float64, requires_grad=True)

        def f(q, k, v, causal=causal, window=window):
            return flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=0.0)

        assert torch.autograd.gradcheck(f, (q, k, v))

    q = torch.randn(1, 4, 1, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q: flash_attn_func(q, q, q, softcap=1.5), (q,))


def test_empty_batch_and_sequences():
    for bq, lq, lk in [(0, 5, 5), (2, 0, 5), (2, 5, 0), (2, 0, 0)]:
        q = torch.randn(bq, lq, 2, 8, requires_grad=True)
        k = torch.randn(bq, lk, 2, 8, requires_grad=True)
        v = torch.randn(bq, lk, 2, 8, requires_grad=True)
        out, lse = flash_attn_func(q, k, v, return_softmax_lse=True)
        assert out.shape == (bq, lq, 2, 8) and lse.shape == (bq, 2, lq)
        assert not torch.isnan(out).any()
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        for g, t in ((dq, q), (dk, k), (dv, v)):
            assert g.shape == t.shape and (g == 0).all()


def test_lse_is_logsumexp_of_scaled_scores():
    q, k, v = torch.randn(1, 9, 1, 8), torch.randn(1, 11, 1, 8), torch.randn(1, 11, 1, 8)
    _, lse = flash_attn_func(q, k, v, softmax_scale=0.5, return_softmax_lse=True)
    expected = torch.logsumexp(torch.einsum("bld,bsd->bls", q[:, :, 0], k[:, :, 0]) * 0.5, -1)
    assert torch.allclose(lse[:, 0], expected, atol=1e-5)


def test_nan_input_propagates():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    q[0, 2, 0, 3] = float("nan")
    out = flash_attn_func(q, k, v)
    assert torch.isnan(out[0, 2]).all() and not torch.isnan(out[0, [0, 1, 3]]).any()


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = torch.randn(1, 5, 1, 10), torch.randn(1, 5, 1, 10), torch.randn(1, 5, 1, 10)
    a = flash_attn_func(q, k, v)
    b = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(10))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mqa_backward_split_over_key_tiles(dtype):
    # One (batch, kv head) pair and several key tiles: the CPU backward splits the keys across
    # threads and sums the partial dQ; it must match the single-thread result and the reference.
    run_case(dtype, (1, 300, 1500, 4, 1, 32, 32), (False, -1, -1, True))
    run_case(dtype, (1, 1500, 1500, 2, 1, 32, 32), (True, -1, -1, True))
    q, k, v = (torch.randn(1, n, h, 32, dtype=dtype, requires_grad=True)
               for n, h in ((300, 4), (1500, 1), (1500, 1)))
    out = flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        grads_1 = torch.autograd.grad(flash_attn_func(q, k, v), (q, k, v), dout)
    finally:
        torch.set_num_threads(threads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(grads, grads_1):
        scale = max(1.0, b.abs().max().item())
        assert (a.double() - b.double()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softmax_scale", [1e-6, 1.0, 100.0, 1000.0, 1e6])
def test_extreme_softmax_scales_stay_finite_and_exact(dtype, softmax_scale):
    # Scores of ~5e9 (|q|, |k| up to 900, d = 64, scale 1000) are far inside float32: nothing
    # but the inputs and outputs may be in half precision, so the answer must be finite and
    # under the error rule, forward and backward, at tiny and huge scales alike (issue 29:
    # the CUDA kernels gave inf/NaN at scale 100 in fp16).
    torch.manual_seed(0)
    q, k = ((torch.rand(2, 77, 4, 64) * -900).to(dtype).requires_grad_() for _ in "qk")
    v = torch.rand(2, 77, 4, 64).to(dtype).requires_grad_()
    out, lse, _ = ops.fwd(q, k, v, softmax_scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    kw = dict(softmax_scale=softmax_scale)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    true_out, true_lse = attention_ref(*leaves, **kw)
    true_grads = torch.autograd.grad(true_out, leaves, dout.double())
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    low_grads = torch.autograd.grad(low_out, (q, k, v), dout)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # Where PyTorch's own low-precision computation overflows, the error rule bounds nothing
    # (assert_error_rule refuses such a yardstick) and is not applied: then out (weights of v
    # in [0, 1]) must still be within its dtype's rounding of the truth, and each gradient
    # within a few of its dtype's ulps of the largest true one (below, in every case).
    if math.isfinite(max_err(low_out, true_out)):
        assert_error_rule(out, low_out, true_out, 2.0, "out")
    eps = torch.finfo(dtype).eps
    assert max_err(out, true_out) <= 2 * eps + slack(true_out, dtype)
    rel = (lse.double() - true_lse).abs().max().item() / max(1.0, true_lse.abs().max().item())
    assert rel <= (1e-12 if dtype == torch.float64 else 1e-6)
    *cancel, score_scale = cancellation_scale(q, k, v, dout, per_element=True, out=out,
                                              true_out=true_out, **kw)
    cancel_max = cancellation_scale(q, k, v, dout, **kw)[:3]  # (grad_bound's form)
    for name, ours, low, true, c, cm in zip(("dq", "dk", "dv"), grads, low_grads, true_grads,
                                            cancel, cancel_max):
        assert torch.isfinite(ours).all(), name
        if math.isfinite(max_err(low, true)):
            assert_error_rule(ours, low, true, 3.0, name, c, score_scale)
        bound = grad_bound(true, dtype, cm)
        assert max_err(ours, true) <= bound, (name, max_err(ours, true), bound)


@pytest.mark.parametrize("score_range", [20.0, 87.0])
def test_cpu_float32_probabilities_are_accurate_elementwise(score_range):
    # The CPU softmax's exp (csrc/cpu/softmax_rows.cpp: a degree-5 polynomial after Cody-Waite
    # range reduction, at most 2.3 ulp) read out exactly: with v columns of the identity, out
    # is the row of probabilities P (each output element one P_j times 1, the rest exact
    # zeros, then 1 / l).  Scores in [-score_range, 0] over 1500 keys (three key tiles of 512,
    # the maximum in the last, so the running rescale runs too); each P_j above 1e-30 (the
    # normal range, with margin: smaller ones are subnormal after 1 / l) within a few float32
    # eps of the float64 truth, and the row within the error rule against PyTorch's float32
    # softmax.  The edges: -inf gives exactly 0; scores near -87.3 (where the exp flushes what
    # float32 would make subnormal: relative to the running maximum, so after the rescale they
    # may survive as subnormals) give at most ~1e-38 and never a negative or NaN; a NaN score
    # makes the whole row NaN, as PyTorch's softmax does.
    g = torch.Generator().manual_seed(int(score_range))
    S, d, chunk = 1500, 8, 250
    scores = -torch.rand(S, generator=g, dtype=torch.float64) * score_range
    scores[-7] = 0.0
    scores[3], scores[4], scores[5] = float("-inf"), -87.31, -87.29
    scores = scores.float()

    def probabilities(scores):
        q = torch.zeros(1, 1, 1, d)
        q[..., 0] = 1.0
        k = torch.zeros(1, S, 1, d)
        k[0, :, 0, 0] = scores
        # (head_dim_v is at most 256: the row in six calls, v the identity on 250 keys each)
        return torch.cat([
            flash_attn_func(q, k, torch.eye(S)[:, c:c + chunk].reshape(1, S, 1, chunk),
                            softmax_scale=1.0)[0, 0, 0] for c in range(0, S, chunk)])

    out = probabilities(scores)
    true = torch.softmax(scores.double(), 0)
    theirs = torch.softmax(scores, 0)
    normal = true > 1e-30
    rel = ((out.double() - true).abs() / true)[normal].max().item()
    assert rel <= 8 * torch.finfo(torch.float32).eps, rel
    assert out[3].item() == 0.0
    assert 0.0 <= out[4].item() <= 2e-38 and 0.0 < out[5].item() <= 2e-38
    assert_error_rule(out, theirs, true, 2.0, "probabilities")
    scores[11] = float("nan")
    assert torch.isnan(probabilities(scores)).all()


def test_packed_dense_variants_read_in_place_and_match():
    # FlashAttention-2's flash_attn_qkvpacked_func / flash_attn_kvpacked_func: views of one
    # buffer, the same answer as the unpacked call, one gradient of the packed shape.
    from flash_attn_ext import flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    qkv = torch.randn(2, 13, 3, 4, 16, dtype=torch.float64, requires_grad=True)
    out, lse, probs = flash_attn_qkvpacked_func(qkv, 0.0, None, True, (-1, -1), 0.0, None,
                                                False, True)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    want, want_lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    assert probs is None and torch.equal(out, want) and torch.equal(lse, want_lse)
    (grad,) = torch.autograd.grad(out.sum(), qkv)
    for i, g in enumerate(torch.autograd.grad(want.sum(), (q, k, v))):
        assert torch.equal(grad[:, :, i], g)
    kv = torch.randn(2, 9, 2, 2, 16, dtype=torch.float64,
                     requires_grad=True)  # (GQA: 2 key/value heads)
    out = flash_attn_kvpacked_func(q, kv, softcap=3.0)
    k, v = (kv[:, :, i].detach().clone().requires_grad_() for i in range(2))
    want = flash_attn_func(q, k, v, softcap=3.0)
    assert torch.equal(out, want)
    (grad,) = torch.autograd.grad(out.sum(), kv)
    for i, g in enumerate(torch.autograd.grad(want.sum(), (k, v))):
        assert torch.equal(grad[:, :, i], g)
    out2, lse2 = flash_attn_qkvpacked_func(qkv, causal=True, return_softmax_lse=True)
    assert torch.equal(lse2, want_lse) and torch.equal(
        out2, flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True))
    with pytest.raises(ValueError, match=r"qkv must be a tensor of shape .* got \(2, 13, 2"):
        flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(TypeError, match="kv must be a torch.Tensor, got list"):
        flash_attn_kvpacked_func(q, [kv])
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got list"):
        flash_attn_qkvpacked_func([1, 2])


def test_scalars_that_require_grad_are_refused():
    # A 0-d tensor scale or softcap that requires grad was read with .item(): a learnable
    # temperature silently got no gradient (new-user trial; PyTorch's own function refuses a
    # tensor scale).  Without grad mode, or detached, it is a number as before.
    from flash_attn_ext import scaled_dot_product_attention

    q = torch.randn(1, 5, 2, 8)
    s = torch.tensor(0.3, requires_grad=True)
    with pytest.raises(ValueError, match="softmax_scale is a tensor that requires grad"):
        flash_attn_func(q, q, q, softmax_scale=s)
    with pytest.raises(ValueError, match="softcap is a tensor that requires grad"):
        flash_attn_func(q, q, q, softcap=torch.tensor(5.0, requires_grad=True))
    with pytest.raises(ValueError, match="scale is a tensor that requires grad"):
        scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2),
                                     scale=s)
    want = flash_attn_func(q, q, q, softmax_scale=0.3)
    assert torch.equal(flash_attn_func(q, q, q, softmax_scale=s.detach()), want)
    with torch.no_grad():
        assert torch.equal(flash_attn_func(q, q, q, softmax_scale=s), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mods", [{}, {"causal": True}, {"window_left": 2, "window_right": 1},
                                  {"softcap": 5.0}, {"alibi": True}, {"bias": True},
                                  {"dropout_p": 0.3}], ids=str)
def test_decode_rows_of_a_gqa_group_packed_into_one_tile(dtype, mods):
    # Decoding with GQA (a few query rows per head): the CPU forward packs query heads of a
    # group into one tile (flash_fwd_cpu.cpp: pack_gqa), as many as leave every thread a task.
    # With one thread the whole group, with twice as many threads as (batch, key/value head)
    # pairs half of it, with a thread per query head none: each gives the reference's answer
    # (the error rule), every row with its own head's ALiBi slope, bias row, mask and dropout
    # cells, and they agree (with dropout: the same cells dropped).
    torch.manual_seed(0)
    batch, heads, heads_kv, seqlen_k, d = 2, 8, 2, 700, 40
    for seqlen_q in (1, 3):
        q = torch.randn(batch, seqlen_q, heads, d, dtype=dtype)
        k, v = (torch.randn(batch, seqlen_k, heads_kv, d, dtype=dtype) for _ in "kv")
        kw = dict(causal=mods.get("causal", False), window_left=mods.get("window_left", -1),
                  window_right=mods.get("window_right", -1), softcap=mods.get("softcap", 0.0))
        alibi = (torch.rand(batch, heads) * 0.3).float() if "alibi" in mods else None
        bias = (torch.randn(batch, heads, seqlen_q, seqlen_k, dtype=dtype)
                if "bias" in mods else None)
        dropout_p = mods.get("dropout_p", 0.0)
        runs = []
        for threads in (1, 2 * batch * heads_kv, batch * heads):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                torch.manual_seed(1)
                runs.append(ops.fwd(q, k, v, None, kw["causal"], kw["window_left"],
                                    kw["window_right"], True, kw["softcap"], alibi, bias,
                                    dropout_p))
            finally:
                torch.set_num_threads(before)
        out1, lse1, rng1 = runs[0]
        eps = torch.finfo(dtype).eps
        for out, lse, rng in runs:
            assert torch.equal(rng, rng1) and torch.isfinite(out).all()
            assert max_err(out, out1) <= 8 * eps * max(1.0, out1.abs().max().item())
            assert max_err(lse, lse1) <= 8 * eps * max(1.0, lse1.abs().max().item())
        keep = None
        if dropout_p:  # the cells the kernel dropped, regenerated from its (seed, offset)
            seed, offset = (int(x) for x in rng1)
            keep = ops._C.dropout_mask(seed, offset, batch, heads, seqlen_q, seqlen_k, dropout_p)
        ref_kw = dict(kw, attn_bias=bias, alibi_slopes=alibi, dropout_keep=keep,
                      dropout_p=dropout_p)
        true, true_lse = attention_ref(q, k, v, **ref_kw)
        low, _ = attention_ref(q, k, v, compute_dtype=dtype, **ref_kw)
        for out, _, _ in runs:
            assert_error_rule(out, low, true, 2.0, f"out {mods} L={seqlen_q}")
        assert max_err(lse1, true_lse) <= 1e-3 * max(1.0, true_lse.abs().max().item())


@pytest.mark.parametrize("bottom_right", [True, False])
def test_packed_gqa_rows_with_uneven_chunks_empty_rows_and_packed_sequences(bottom_right):
    # The CPU forward's GQA packing beyond the plain decode call: a group of 8 query heads
    # split 3 + 3 + 2 (three threads, one key/value head), rows that see no key (causal with
    # seqlen_q > seqlen_k: out 0, lse -inf), head_dim_v != head_dim, both causal alignments;
    # and packed sequences of unequal lengths, one of them empty (flash_attn_varlen_func).
    torch.manual_seed(0)
    q = torch.randn(1, 3, 8, 40, dtype=torch.float64)
    k, v = torch.randn(1, 2, 1, 40, dtype=torch.float64), torch.randn(1, 2, 1, 24,
                                                                      dtype=torch.float64)
    true, true_lse = attention_ref(q, k, v, causal=True, align_bottom_right=bottom_right)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3, 8):  # the whole group, chunks of 3 + 3 + 2, unpacked
            torch.set_num_threads(threads)
            out, lse, _ = ops.fwd(q, k, v, None, True, -1, -1, bottom_right)
            assert max_err(out, true) <= 1e-12 and max_err(lse, true_lse) <= 1e-12, threads
        if bottom_right:
            assert (out[0, 0] == 0).all() and torch.isneginf(lse[0, :, 0]).all()
        lens_q, lens_k = [1, 0, 3], [5, 0, 2]
        cq, ck = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lens_q, lens_k))
        qv = torch.randn(sum(lens_q), 8, 40, dtype=torch.float64)
        kv, vv = (torch.randn(sum(lens_k), 2, d, dtype=torch.float64) for d in (40, 24))
        outs = []
        for threads in (1, 8):
            torch.set_num_threads(threads)
            outs.append(flash_attn_ext.flash_attn_varlen_func(qv, kv, vv, cq, ck, 3, 5,
                                                              causal=True))
    finally:
        torch.set_num_threads(before)
    for b in range(3):
        if lens_q[b] == 0:
            continue
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ref, _ = attention_ref(qv[None, rows], kv[None, keys], vv[None, keys], causal=True)
        for out in outs:
            assert max_err(out[rows], ref[0]) <= 1e-12, b
