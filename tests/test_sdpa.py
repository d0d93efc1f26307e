"""The SDPA drop-in against PyTorch's own scaled_dot_product_attention."""

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext
from flash_attn_ext import scaled_dot_product_attention, sdpa
from reference import assert_error_rule


def torch_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [
    ((2, 4, 17, 32), (2, 4, 113, 32), (2, 4, 113, 40)),   # L < S, Ev != E
    ((1, 8, 113, 64), (1, 2, 17, 64), (1, 2, 17, 64)),    # L > S, GQA 4:1
    ((3, 1, 1, 16), (3, 1, 1, 16), (3, 1, 1, 16)),        # seqlen 1
    ((2, 33, 24), (2, 45, 24), (2, 45, 24)),              # 3-D (N, L, E)
], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_sdpa(dtype, shape, is_causal):
    (qs, ks, vs) = shape
    gqa = len(qs) == 4 and qs[1] != ks[1]
    query, key, value = (torch.randn(s, dtype=dtype, requires_grad=True) for s in shape)
    scale = 0.3 if dtype == torch.float64 else None
    out = scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale,
                                       enable_gqa=gqa)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), dout)

    def torch_version(compute_dtype):
        # Leaves in compute_dtype, so float64 gradients are not rounded back to the input dtype.
        leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (query, key, value)]
        o = torch_sdpa(*leaves, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        # PyTorch gives NaN for rows that see no key; docs/design.md section 2 says 0.
        o = o.nan_to_num(0.0)
        return o, torch.autograd.grad(o, leaves, dout.to(compute_dtype))

    true, true_g = torch_version(torch.float64)
    low, low_g = torch_version(dtype)
    assert out.shape == true.shape and out.dtype == dtype
    assert_error_rule(out, low, true, 2.0, "out")
    for name, a, lo, t in zip(("dq", "dk", "dv"), grads, low_g, true_g):
        assert_error_rule(a, lo, t, 3.0, name)


def test_top_left_causal_alignment_with_l_not_s():
    # is_causal=True is torch.tril(ones(L, S)): with L < S, query i sees keys 0..i only.
    query = torch.randn(1, 1, 3, 8)
    key = torch.randn(1, 1, 6, 8)
    value = torch.randn(1, 1, 6, 8)
    out = scaled_dot_product_attention(query, key, value, is_causal=True)
    mask = torch.tril(torch.ones(3, 6, dtype=torch.bool))
    ref = torch_sdpa(query, key, value, attn_mask=mask)
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("L,S", [(4, 4), (5, 9), (9, 5)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_with_is_causal_applies_both(L, S, kind):
    # PyTorch's fused CPU kernel takes attn_mask with is_causal=True and applies both (its
    # documentation calls it an error, its math backend raises); the drop-in raised ValueError,
    # so a model that ran on PyTorch broke under patch() (new-user trial).  Against PyTorch
    # with the two combined into one mask by hand, float64, out and gradients (the float
    # mask's too); rows the two empty give zeros.
    torch.manual_seed(L * 10 + S)
    q = torch.randn(2, 3, L, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, S, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    causal = torch.ones(L, S, dtype=torch.bool).tril()
    if kind == "bool":
        mask = torch.rand(2, 1, L, S) > 0.3
        combined = mask & causal
    else:
        mask = torch.randn(2, 1, L, S, dtype=torch.float64, requires_grad=True)
        combined = mask.masked_fill(~causal, float("-inf"))
    leaves = [q, k, v] + ([mask] if kind == "float" else [])
    ours = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=combined).nan_to_num()
    torch.testing.assert_close(ours, want, atol=1e-12, rtol=1e-12)
    dout = torch.randn_like(ours)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"),
                          torch.autograd.grad(ours, leaves, dout),
                          torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(a, b.nan_to_num(), atol=1e-12, rtol=1e-12, msg=name)
    with flash_attn_ext.patch():  # (no fallback: ours)
        flash_attn_ext.reset_fallback_counts()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        assert flash_attn_ext.fallback_counts() == {}


def test_sdpa_reads_views_without_copy():
    # A (B, L, 3, H, E) projection viewed as (B, H, L, E), the usual transformer layout.
    qkv = torch.randn(2, 21, 3, 4, 16)
    query, key, value = (t.transpose(1, 2) for t in qkv.unbind(2))
    out = scaled_dot_product_attention(query, key, value, is_causal=True)
    ref = torch_sdpa(query, key, value, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_keep_the_input_layout(dtype):
    # (B, H, L, E) inputs and a (B, L, 3, H, E) projection's views: the gradients come back with
    # the inputs' strides where those are dense (autograd then keeps them as .grad without a
    # copy), and right either way.
    dense = [torch.randn(2, 4, 37, 16, dtype=dtype, requires_grad=True) for _ in "qkv"]
    qkv = torch.randn(2, 37, 3, 4, 16, dtype=dtype, requires_grad=True)
    for inputs in (dense, [t.transpose(1, 2) for t in qkv.unbind(2)]):
        dout = torch.randn(2, 4, 37, 16, dtype=dtype)
        grads = torch.autograd.grad(scaled_dot_product_attention(*inputs, is_causal=True),
                                    inputs, dout)
        ref = [x.detach().double().requires_grad_() for x in inputs]
        ref_grads = torch.autograd.grad(torch_sdpa(*ref, is_causal=True), ref, dout.double())
        low = [x.detach().clone().requires_grad_() for x in inputs]  # PyTorch in dtype
        low_grads = torch.autograd.grad(torch_sdpa(*low, is_causal=True), low, dout)
        for name, x, g, lo, r in zip("qkv", inputs, grads, low_grads, ref_grads):
            if x.is_contiguous():
                assert g.stride() == x.stride()
            assert_error_rule(g, lo, r, 3.0, f"d{name}")


def test_head_dim_beyond_the_kernels_falls_back_visibly():
    import flash_attn_ext
    from flash_attn_ext import policy

    policy.reset_fallback_counts()
    q = torch.randn(1, 2, 9, 288)
    with pytest.warns(UserWarning, match="head dims 1 to 256"):
        out = scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert not flash_attn_ext.explain(q, q, q).fused
    with pytest.raises(policy.FallbackError, match="head dims 1 to 256"):
        scaled_dot_product_attention(q, q, q, strict=True)
    # A bad mask is the call's error, before any fallback is counted or refused (the fallback
    # was recorded first: strict mode named the fallback, not the mask).
    policy.reset_fallback_counts()
    bad = torch.zeros(3, 9, dtype=torch.bool)
    for strict in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match="attn_mask of shape \\(3, 9\\) is not "
                                                 "broadcastable"):
                scaled_dot_product_attention(q, q, q, attn_mask=bad, strict=strict)
    assert not policy.fallback_counts()


def test_head_dims_beyond_the_kernels_run_the_unfused_math_with_masks():
    # Head dim 288 with a float mask whose row 2 is finfo.min everywhere (the mean of v there)
    # and a boolean mask: the unfused math, equal to PyTorch's CPU function.
    q, k, v = torch.randn(1, 2, 5, 288), torch.randn(1, 2, 7, 288), torch.randn(1, 2, 7, 288)
    mask = torch.randn(1, 2, 5, 7)
    mask[:, :, 2] = torch.finfo(torch.float32).min
    for m in (mask, mask > 0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = scaled_dot_product_attention(q, k, v, attn_mask=m)
        assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                              atol=1e-5)
        if m.dtype == torch.float32:
            assert torch.allclose(out[:, :, 2], v.mean(2), atol=1e-5)
    assert "flash_attn_ext.unfused" in str(flash_attn_ext.explain(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("e,ev", [(0, 5), (8, 0), (0, 0)])
def test_empty_head_dims_answer_as_pytorch(e, ev):
    # PyTorch answers E = 0 (every score 0: the mean of the visible values) and Ev = 0 (an
    # empty output); so does the drop-in (and under patch()), through PyTorch's function,
    # reported as a fallback.
    import flash_attn_ext
    from flash_attn_ext import policy

    q, k, v = torch.randn(2, 3, 7, e), torch.randn(2, 3, 9, e), torch.randn(2, 3, 9, ev)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.warns(UserWarning, match="head dims 1 to 256"):
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == want.shape and torch.allclose(out, want)
    with flash_attn_ext.patch():
        assert torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True), want)
    assert not flash_attn_ext.explain(q, k, v).fused
    with pytest.raises(policy.FallbackError, match="head dims 1 to 256"):
        scaled_dot_product_attention(q, k, v, strict=True)


def test_mask_rank_and_dtype_are_checked_as_pytorch_checks_them():
    q = torch.randn(1, 2, 3, 8)
    k = torch.randn(1, 2, 4, 8)
    for mask in (torch.ones(4, dtype=torch.bool), torch.zeros(4)):  # PyTorch: IndexError
        with pytest.raises(ValueError, match=r"at least 2 dimensions \(L, S\), got shape \(4,\)"):
            scaled_dot_product_attention(q, k, k, attn_mask=mask)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):  # PyTorch: RuntimeError
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k, k, attn_mask=torch.zeros(3, 4, dtype=dtype))
        with pytest.raises(ValueError, match=f"attn_mask.dtype={dtype}: a float mask must be "
                                             "float32 or query's dtype torch.float32"):
            scaled_dot_product_attention(q, k, k, attn_mask=torch.zeros(3, 4, dtype=dtype))
    # Accepted, as by PyTorch: a float32 mask with bf16 queries, a mask in query's dtype.
    qb, kb = q.bfloat16(), k.bfloat16()
    for mask in (torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.bfloat16)):
        want = F.scaled_dot_product_attention(qb.float(), kb.float(), kb.float(),
                                              attn_mask=mask.float())
        got = scaled_dot_product_attention(qb, kb, kb, attn_mask=mask)
        assert (got.float() - want).abs().max() < 2e-2


def test_dropout_p_one_gives_zeros_like_torch():
    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    out = scaled_dot_product_attention(q, q, q, dropout_p=1.0)
    assert (out == 0).all() and torch.equal(out, F.scaled_dot_product_attention(q, q, q,
                                                                                dropout_p=1.0))
    (g,) = torch.autograd.grad(out.sum(), q)
    assert (g == 0).all()


@settings(max_examples=400, deadline=None)
@given(b=st.integers(0, 2), hk=st.integers(0, 3), hq=st.integers(0, 6),
       seq=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       e=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       ranks=st.sampled_from([(4, 4, 4), (4, 4, 4), (3, 3, 3), (4, 4, 3), (3, 4, 4)]),
       perturb=st.one_of(st.none(), st.tuples(st.integers(0, 11), st.integers(0, 4))),
       enable_gqa=st.booleans())
def test_to_bshd_fast_path_follows_the_checked_rules(b, hk, hq, seq, e, ranks, perturb,
                                                     enable_gqa):
    # to_bshd's one-expression fast path must accept exactly what the rule-by-rule checks
    # accept, with the same views; otherwise it defers to them for their error.  SDPA shapes
    # (valid but for the head counts, which may or may not form GQA groups), then (perturb) one
    # size changed.
    dims = [b, hq, seq[0], e[0], b, hk, seq[1], e[0], b, hk, seq[1], e[1]]
    if perturb is not None:
        dims[perturb[0]] = perturb[1]
    shapes = [dims[4 * i:4 * i + 4] if r == 4 else dims[4 * i:4 * i + 1] + dims[4 * i + 2:4 * i + 4]
              for i, r in enumerate(ranks)]
    q, k, v = (torch.empty(s) for s in shapes)
    try:
        expected = sdpa._checked_to_bshd(q, k, v, enable_gqa)
    except ValueError as err:
        with pytest.raises(ValueError, match=re.escape(str(err))):
            sdpa.to_bshd(q, k, v, enable_gqa)
        return
    got = sdpa.to_bshd(q, k, v, enable_gqa)
    for x, y in zip(got, expected):
        assert x.shape == y.shape and x.stride() == y.stride() and x.data_ptr() == y.data_ptr()


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_dtype_mismatch_names_the_sdpa_arguments(which):
    # The drop-in's error names its own arguments (query/key/value), with every dtype, for 4-D
    # and 3-D inputs alike; PyTorch's function refuses the same calls.
    for shape in ((1, 2, 5, 8), (2, 5, 8)):
        t = {n: torch.randn(shape) for n in ("query", "key", "value")}
        t[which] = t[which].to(torch.bfloat16)
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(t["query"], t["key"], t["value"])
        dtypes = ", ".join(f"{n}.dtype={t[n].dtype}" for n in ("query", "key", "value"))
        with pytest.raises(ValueError, match=re.escape(
                f"query, key and value must have the same dtype, got {dtypes}")):
            scaled_dot_product_attention(t["query"], t["key"], t["value"])


def test_mixed_dtypes_under_autocast_run_as_pytorch_does():
    # Under torch.autocast PyTorch's function casts a float32 query (here beside bfloat16 key and
    # value) to the autocast dtype; so does the drop-in.  float64 stays float64 under autocast,
    # so float64 beside bfloat16 is still refused, with the dtypes after the casts.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 17, 8, generator=gen)
    k, v = (torch.randn(1, 2, 17, 8, generator=gen).to(torch.bfloat16) for _ in "kv")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k, v)
        ref = F.scaled_dot_product_attention(q, k, v)
        assert out.dtype == ref.dtype == torch.bfloat16
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        # within twice PyTorch's own bf16 error, plus bf16's rounding of the output
        assert (out.double() - exact).abs().max() <= 2 * (ref.double() - exact).abs().max() + 1e-2
        with pytest.raises(ValueError, match=re.escape(
                "key.dtype=torch.float32, value.dtype=torch.bfloat16 (under torch.autocast: "
                "torch.float64, torch.bfloat16 and torch.bfloat16)")):
            scaled_dot_product_attention(q.double(), k.float(), v)


@pytest.mark.parametrize("mask_shape", [None, (7, 9), (3, 1, 7, 9), (2, 1, 1, 1, 9),
                                        (2, 3, 4, 7, 9)], ids=str)
def test_leading_batch_dimensions_as_pytorch(mask_shape):
    # (N, ..., H, L, E) inputs, as PyTorch's function takes them (new-user trial: 5-D raised):
    # the leading dimensions flattened into one, the mask broadcast over them; out and
    # gradients against PyTorch's function in float64.
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 7, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 2, 9, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 2, 9, 8, dtype=torch.float64, requires_grad=True)
    mask = None if mask_shape is None else torch.rand(mask_shape) < 0.8
    if mask is not None:
        mask[..., 0] = True  # (no empty rows: PyTorch's math answers them with NaN)
    outs, grads = [], []
    for fn in (flash_attn_ext.scaled_dot_product_attention, F.scaled_dot_product_attention):
        out = fn(q, k, v, attn_mask=mask, enable_gqa=True)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
        outs.append(out)
    assert outs[0].shape == (2, 3, 4, 7, 8)
    torch.testing.assert_close(outs[0], outs[1])
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs)


def test_leading_batch_dimensions_must_match():
    q = torch.randn(2, 3, 4, 7, 16)
    with pytest.raises(ValueError, match="same leading \\(batch\\) dimensions"):
        flash_attn_ext.scaled_dot_product_attention(q, torch.randn(2, 1, 4, 7, 16), q)
    # One message naming the mask's shape and the shape it must broadcast to, as the caller
    # passed them (new-user trial: masks of up to 3 dimensions were checked after the
    # flattening, against an (N, H, L, S) of 6 batch rows the caller never passed; larger ones
    # by a second, differently worded rule).
    for shape in ((3, 3, 4, 7, 7), (5, 7, 7), (3, 5, 7, 7), (2, 3, 4, 7, 8), (1, 2, 3, 4, 7, 7)):
        with pytest.raises(ValueError) as error:
            flash_attn_ext.scaled_dot_product_attention(
                q, q, q, attn_mask=torch.ones(shape, dtype=torch.bool))
        assert str(error.value) == (f"attn_mask of shape {shape} is not broadcastable to the "
                                    "attention's (N, ..., H, L, S) = (2, 3, 4, 7, 7)")
        assert error.value.__cause__ is None and error.value.__context__ is None
    with pytest.raises(ValueError, match=re.escape("attn_mask must have at least 2 dimensions")):
        flash_attn_ext.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8) > 0)


def test_rank_errors_state_the_rule():
    # A 2-D query named "3 or 4 dimensions" although 5-D inputs are taken (new-user trial).
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=re.escape("query must have at least 3 dimensions: "
                                                   "(N, L, E), (N, H, L, E) or")):
        flash_attn_ext.scaled_dot_product_attention(x, x, x)
    q, kv = torch.randn(2, 4, 8, 16), torch.randn(1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="key must have 3 .* dimensions here"):
        flash_attn_ext.scaled_dot_product_attention(q, kv, kv)
    q5 = torch.randn(1, 2, 4, 8, 16)
    assert flash_attn_ext.scaled_dot_product_attention(q5, q5, q5).shape == q5.shape


def test_errors_name_the_drop_in_arguments():
    # The drop-in's errors name its own arguments (query / key / value, scale), also where its
    # fast path leaves a rule to the kernels' checks, whose messages say q, k, v and
    # softmax_scale (new-user trial): devices, an integer dtype, a scale beyond float32.
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"^query, key and value must be on the same device, "
                                         r"got query.device=cpu, key.device=meta"):
        scaled_dot_product_attention(q, q.to("meta"), q)
    with pytest.raises(ValueError, match=r"^query.dtype=torch.int64 is not supported"):
        scaled_dot_product_attention(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match=r"^scale must be finite and representable in "
                                         r"float32 .* got 1e\+300"):
        scaled_dot_product_attention(q, q, q, scale=1e300)


@pytest.mark.parametrize("shape", [(2, 3, 0, 5, 8), (2, 3, 4, 0, 8), (2, 3, 4, 5, 0),
                                   (0, 3, 4, 5, 8)])
def test_five_dimensional_inputs_with_a_zero_size_as_pytorch(shape):
    """(..., H, L, E) inputs with more than one leading dimension and a 0 in H, L or E: an
    empty answer (E = 0: the fallback's, PyTorch's), as PyTorch's function gives (the batch
    flattening's reshape(-1, ...) raised "cannot reshape tensor of 0 elements"; found by the
    explain property test)."""
    q = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = scaled_dot_product_attention(q, q, q)
    ref = F.scaled_dot_product_attention(q, q, q)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert q.grad.shape == q.shape
