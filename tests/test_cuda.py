"""CUDA kernels against an fp32 reference (skipped without a GPU or without a CUDA build)."""

import itertools
import warnings

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import flash_attn_func, ops, planning, policy, scaled_dot_product_attention
from reference import (
    SM90_BWD_FLAGS,
    SM90_FWD_FLAGS,
    assert_bwd_fake_strides_match,
    assert_error_rule,
    assert_lse_infinities,
    attention_ref,
    cancellation_scale,
    launched_kernels,
    sm90_variant_flags,
)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.build_info()["cuda"]),
    reason="needs a CUDA device and a CUDA build of flash_attn_ext")

HEAD_DIMS = [32, 40, 64, 96, 128, 192, 256]
SEQLENS = [(1, 1), (17, 113), (113, 17), (256, 256), (1023, 2048), (2048, 1023), (4224, 4224)]
MASKS = [(False, -1, -1, True), (True, -1, -1, True), (True, -1, -1, False),
         (False, 128, 16, True)]


def check(dtype, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v, mask,
          grads=True, transposed=False, alibi=None, softcap=0.0):
    """One call against the fp32 reference under the error rule; ``alibi``: None, or ALiBi
    slopes per head ("head": (heads,)) or per batch and head ("batch_head": (batch, heads))."""
    causal, wl, wr, br = mask
    dev = "cuda"

    def make(seqlen, h, d):
        if transposed:
            return torch.randn(batch, h, seqlen, d, device=dev, dtype=dtype).transpose(1, 2)
        return torch.randn(batch, seqlen, h, d, device=dev, dtype=dtype)

    q, k, v = make(seqlen_q, heads, head_dim), make(seqlen_k, heads_kv, head_dim), \
        make(seqlen_k, heads_kv, head_dim_v)
    for t in (q, k, v):
        t.requires_grad_(grads)
    slopes = None if alibi is None else \
        torch.rand(*((batch,) if alibi == "batch_head" else ()), heads, device=dev) * 0.5
    kw = dict(causal=causal, window_left=wl, window_right=wr, align_bottom_right=br,
              alibi_slopes=slopes, softcap=softcap)
    out, lse, _ = ops.fwd(q, k, v, None, causal, wl, wr, br, softcap, slopes)
    leaves32 = [t.detach().float().requires_grad_(grads) for t in (q, k, v)]
    true_out, true_lse = attention_ref(*leaves32, compute_dtype=torch.float32, **kw)
    low_out, _ = attention_ref(q, k, v, compute_dtype=dtype, **kw)
    assert_error_rule(out, low_out, true_out.to(torch.float64), 2.0, "out")
    finite = torch.isfinite(true_lse)
    assert_lse_infinities(lse, true_lse)
    if finite.any():
        assert (lse[finite] - true_lse[finite]).abs().max().item() < 1e-2
    if not grads:
        return
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), dout)
    true_g = torch.autograd.grad(true_out, leaves32, dout.float())
    low_g = torch.autograd.grad(low_out, (q, k, v), dout)
    *cancel, score_scale = cancellation_scale(q, k, v, dout, per_element=True, out=out,
                                              true_out=true_out, **kw)
    for name, a, lo, t, c in zip(("dq", "dk", "dv"), ours, low_g, true_g, cancel):
        assert_error_rule(a, lo, t.double(), 3.0, name, c, score_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_forward_matches_reference(dtype, head_dim, seqlens, mask):
    big = seqlens[0] * seqlens[1] > 2_000_000
    check(dtype, 1 if big else 2, *seqlens, 4, 1 if head_dim % 64 else 2, head_dim, head_dim,
          mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,heads_kv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_gqa_mqa_and_strided(dtype, heads, heads_kv, mask):
    check(dtype, 2, 300, 517, heads, heads_kv, 64, 64, mask, transposed=True)
    check(dtype, 2, 97, 64, heads, heads_kv, 72, 40, mask)  # Ev != E, padded head dims


@pytest.mark.parametrize("kernel", ["auto", "sm80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("seqlens", [(1, 1), (17, 113), (113, 17), (1023, 1023)], ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_alibi_matches_reference(kernel_opts, kernel, dtype, head_dim, seqlens, mask):
    # ALiBi on the default kernels (sm_90: the Hopper forward's and backward's ALiBi
    # variants; the 4-warp portable backward at head dim 256) and on the portable ones.
    kernel_opts(force_portable=kernel == "sm80")
    check(dtype, 2, *seqlens, 4, 2, head_dim, head_dim, mask, alibi="batch_head")
    if seqlens == (113, 17):  # one slope per head (stride 0 over the batch), with softcap
        check(dtype, 2, *seqlens, 4, 2, head_dim, head_dim, mask, alibi="head", softcap=5.0)


def test_many_batch_heads():
    # B * H > 65535 blocks in the old grid.y limit.
    check(torch.bfloat16, 4200, 16, 16, 16, 16, 32, 32, (True, -1, -1, True))


def test_fully_masked_rows_and_empty():
    q = torch.randn(2, 40, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, 4, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, k, causal=True, return_softmax_lse=True)
    assert (out[:, :32] == 0).all() and (lse[:, :, :32] == float("-inf")).all()
    assert not torch.isnan(out).any()
    q.requires_grad_(True)
    k.requires_grad_(True)
    dq, dk = torch.autograd.grad(flash_attn_func(q, k, k, causal=True).sum(), (q, k))
    assert (dq[:, :32] == 0).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    k0 = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out0 = flash_attn_func(q, k0, k0)
    assert out0.shape == q.shape and (out0 == 0).all()
    dq0, dk0 = torch.autograd.grad(out0.sum(), (q, k0))
    assert (dq0 == 0).all() and dk0.shape == k0.shape
    q0 = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dk1, = torch.autograd.grad(flash_attn_func(q0, k, k).sum(), (k,))
    assert (dk1 == 0).all()


def test_forward_is_deterministic():
    q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    first = flash_attn_func(q, k, v, causal=True)
    for _ in range(10):
        assert torch.equal(flash_attn_func(q, k, v, causal=True), first)


def _gqa_causal_grads(deterministic, dim=128):
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 1000, 8, dim, device="cuda", dtype=torch.bfloat16, generator=gen,
                    requires_grad=True)
    k, v = (torch.randn(2, 1100, 2, dim, device="cuda", dtype=torch.bfloat16, generator=gen,
                        requires_grad=True) for _ in "kv")
    dout = torch.randn(2, 1000, 8, dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    def grads():
        out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return torch.autograd.grad(out, (q, k, v), dout)
    return grads


@pytest.mark.parametrize("dim", [128, 256])
def test_backward_is_bitwise_reproducible(dim):
    # deterministic=True: the separate dQ kernel, no atomics: the same gradients bit for bit.
    grads = _gqa_causal_grads(True, dim)
    first = grads()
    for _ in range(10):
        assert all(torch.equal(a, b) for a, b in zip(grads(), first))


def test_use_deterministic_algorithms_selects_the_reproducible_backward():
    grads = _gqa_causal_grads(False)
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = grads()
        for _ in range(5):
            assert all(torch.equal(a, b) for a, b in zip(grads(), first))
    finally:
        torch.use_deterministic_algorithms(old)


@pytest.mark.parametrize("dq_mode", ["auto", "atomic"])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_atomic_dq_matches_deterministic(dim, dq_mode, kernel_opts):
    # deterministic=False: dQ added in fp32 by the 8-warp dK/dV kernel (sm_90: bulk reductions
    # of whole tiles by default, the bwd_atomic_dq option: per-lane atomics, the sm_80 path
    # and head dim 256's on sm_90; order varies either way), dK and dV from the same arithmetic as
    # the deterministic path; dq equal up to the fp32 summation order and the recomputed dS's
    # last bit.  seqlen_q = 1000 leaves the last query tile partly outside the sequence.
    kernel_opts(bwd_atomic_dq=dq_mode == "atomic", sm90_bwd="off")  # (test_sm90.py: Hopper's)
    dq0, dk0, dv0 = _gqa_causal_grads(True, dim)()
    for _ in range(3):
        dq1, dk1, dv1 = _gqa_causal_grads(False, dim)()
        for a, b in ((dk1, dk0), (dv1, dv0)):  # same arithmetic, another instantiation
            assert (a.float() - b.float()).abs().max().item() <= 1e-3 * b.float().abs().max()
        assert not dq1.isnan().any()
        tol = 1e-2 * dq0.float().abs().max().item()
        assert (dq1.float() - dq0.float()).abs().max().item() <= tol


def test_gradients_keep_the_sdpa_layout():
    # Inputs in SDPA's (B, H, L, d) layout: the kernels see (B, L, H, d) views of them and write
    # the gradients with the same strides, so autograd keeps them as .grad (no copy pass).
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in "qkv")
    dout = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16)
    scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True).backward(dout.float())
    for x, r in zip((q, k, v), ref):
        assert x.grad.stride() == x.stride()
        err = (x.grad.float() - r.grad).abs().max().item()
        assert err <= 2e-2 * r.grad.abs().max().item() + 1e-3, err


def test_bwd_atomic_dq_option_is_validated(kernel_opts):
    with pytest.raises(ValueError, match="bwd_atomic_dq must be a bool, got 'fast'"):
        kernel_opts(bwd_atomic_dq="fast")


def test_sdpa_api_on_cuda_and_plan():
    q = torch.randn(2, 8, 333, 64, device="cuda", dtype=torch.bfloat16)
    out = scaled_dot_product_attention(q, q, q, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(),
                                                           is_causal=True)
    low = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert_error_rule(out, low, ref.double(), 2.0, "out")
    p = planning.plan(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
    hopper = (torch.cuda.get_device_capability() == (9, 0) and ops.build_info()["sm90"]
              and not flash_attn_ext.ops._C.kernel_options()["force_portable"])
    assert p.fused and p.kernel == ("sm90" if hopper else "sm80") + "_fwd_hdim64_bf16"
    assert p.backward_fused
    assert p.backward_kernel == ("sm90" if hopper else "sm80") + "_bwd_hdim64_bf16"


def test_compile_on_cuda():
    torch._dynamo.reset()
    policy.reset_fallback_counts()
    f = torch.compile(lambda q: flash_attn_func(q, q, q, causal=True), fullgraph=True)
    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f(q).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    ref = flash_attn_func(q.detach(), q.detach(), q.detach(), causal=True)
    assert torch.equal(f(q.detach()), ref)
    q2 = q.detach().clone().requires_grad_(True)
    flash_attn_func(q2, q2, q2, causal=True).sum().backward()
    # q is q, k and v at once: the three gradients are summed in an order of the compiler's
    # choosing, so equal up to rounding.
    torch.testing.assert_close(q.grad, q2.grad, atol=2e-2, rtol=2e-2)
    assert policy.fallback_counts() == {}


@pytest.mark.parametrize("head_dim", [40, 64])  # 40: kernel_ready pads it (copies, contiguous)
@pytest.mark.parametrize("layout", ["blhd", "bhld", "sliced"])
def test_bwd_fake_strides_match_the_kernels(layout, head_dim):
    # torch.compile's inductor asserts that dq, dk, dv have the fake kernel's strides: the fake
    # must follow kernel_ready's rule (laid out like q/k/v when the kernels take them as they
    # are, else contiguous).
    def make(seqlen, h):
        if layout == "bhld":
            return torch.randn(2, h, seqlen, head_dim, device="cuda",
                               dtype=torch.bfloat16).transpose(1, 2)
        if layout == "sliced":
            return torch.randn(2, seqlen, h, head_dim + 8, device="cuda",
                               dtype=torch.bfloat16)[..., :head_dim]
        return torch.randn(2, seqlen, h, head_dim, device="cuda", dtype=torch.bfloat16)

    q, k, v = make(33, 4), make(47, 2), make(47, 2)
    out, lse, rng = ops.fwd(q, k, v, None, True)
    args = (torch.randn_like(out), q, k, v, out, lse, rng, None, True, -1, -1, True, 0.0, None,
            None, 0.0, False, False)
    assert_bwd_fake_strides_match(ops.bwd_op, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_sdpa_drop_in_backward_on_cuda(backend):
    # Plain contiguous (batch, heads, seqlen, head_dim) inputs, as most code calls SDPA.
    torch._dynamo.reset()

    def fn(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    inputs = [torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True) for _ in range(3)]
    inputs_ref = [x.detach().clone().requires_grad_() for x in inputs]
    compiled(*inputs).float().square().sum().backward()
    fn(*inputs_ref).float().square().sum().backward()
    for a, b in zip(inputs, inputs_ref):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_checkpointed_dropout_on_cuda(backend):
    # Activation checkpointing recomputes the forward in the backward.  The fwd op's
    # nondeterministic_seeded tag makes the partitioner run the forward and its recomputation on
    # the same generator state, so the backward's dropout mask is the forward's.  Compiled, the
    # mask on CUDA is not eager's (the partitioner runs the op on its own copy of the generator
    # state), so the check is one that holds for any mask M (out = M v, dv = M^T dout):
    # sum(dout * out) == sum(dv * v) per (batch, head); a different mask in the backward breaks it.
    from torch.utils.checkpoint import checkpoint
    torch._dynamo.reset()

    def attn(q, k, v):
        return scaled_dot_product_attention(q.sin(), k, v, dropout_p=0.3)

    compiled = torch.compile(lambda q, k, v: checkpoint(attn, q, k, v, use_reentrant=False),
                             backend=backend, fullgraph=True)
    q, k, v = (torch.randn(2, 4, 77, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(2, 4, 77, 64, device="cuda", dtype=torch.bfloat16)
    out = compiled(q, k, v)
    out.backward(dout)
    lhs = (dout.float() * out.float()).sum((-2, -1))
    terms = v.grad.float() * v.float()
    rhs = terms.sum((-2, -1))
    # bf16 rounding of out and dv: ~0.003x sqrt(sum of squares) on the CPU; another mask ~1x.
    bound = 0.05 * terms.square().sum((-2, -1)).sqrt()
    assert torch.isfinite(lhs).all() and ((lhs - rhs).abs() <= bound).all(), (lhs, rhs)
    assert (bound > 0).all()  # (nonzero out and dv: the identity does not hold trivially)


def test_training_call_is_fused_in_strict_mode():
    policy.reset_fallback_counts()
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flash_attn_func(q, q, q, strict=True).sum().backward()
    assert policy.fallback_counts() == {}


@pytest.mark.parametrize("causal,window,br", list(itertools.product(
    [False, True], [(-1, -1), (3, 2)], [True, False]))[::3])
def test_opcheck_cuda(causal, window, br):
    q = torch.randn(2, 9, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 13, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(ops.fwd_op, (q, k, k, None, causal, window[0], window[1], br, 0.0,
                                       None, None, 0.0, False))


def test_float32_falls_back_visibly_and_correctly():
    policy.reset_fallback_counts()
    q = torch.randn(1, 33, 2, 64, device="cuda")
    with pytest.warns(UserWarning, match="float32"):
        out = flash_attn_func(q, q, q, causal=True)
    ref, _ = attention_ref(q, q, q, causal=True, compute_dtype=torch.float32)
    assert (out - ref).abs().max().item() < 1e-4
    with pytest.raises(policy.FallbackError, match="float32"):
        flash_attn_func(q, q, q, strict=True)
    slopes = torch.rand(2, device="cuda")  # ALiBi on the unfused path too
    policy.reset_fallback_counts()  # (a reason warns once)
    with pytest.warns(UserWarning, match="float32"):
        out = flash_attn_func(q, q, q, causal=True, alibi_slopes=slopes)
    ref, _ = attention_ref(q, q, q, causal=True, alibi_slopes=slopes,
                           compute_dtype=torch.float32)
    assert (out - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("head_dim", [64, 288])
def test_float32_fallback_rows_of_finfo_min_are_the_uniform_average(head_dim):
    # Issue 29 item 3: float32 on CUDA runs the unfused math (not PyTorch's function, whose
    # memory-efficient kernel answers such rows with garbage); a row masked by finfo.min
    # everywhere is the mean of v, as every exact float32 computation gives.
    q, k, v = (torch.randn(2, 4, n, head_dim, device="cuda") for n in (9, 13, 13))
    mask = torch.zeros(2, 1, 9, 13, device="cuda")
    mask[:, :, 3] = torch.finfo(torch.float32).min
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's warning)
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref, _ = attention_ref(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                           v.transpose(1, 2).double(), attn_bias=mask.double())
    assert (out.transpose(1, 2).double() - ref).abs().max().item() < 1e-4
    assert (out[:, :, 3].double() - v.double().mean(2)).abs().max().item() < 1e-4
    assert "flash_attn_ext.unfused" in str(flash_attn_ext.explain(q, k, v, attn_mask=mask))


def test_non_positive_scale_falls_back_visibly_and_correctly():
    policy.reset_fallback_counts()
    q = torch.randn(1, 33, 2, 64, device="cuda", dtype=torch.bfloat16)
    for scale in (-0.3, 0.0):
        with pytest.warns(UserWarning, match="positive"):
            out = flash_attn_func(q, q, q, softmax_scale=scale, causal=True)
        ref, _ = attention_ref(q, q, q, softmax_scale=scale, causal=True,
                               compute_dtype=torch.float32)
        assert (out.float() - ref).abs().max().item() < 3e-2
        policy.reset_fallback_counts()
    with pytest.raises(NotImplementedError, match="softmax_scale > 0"):
        ops.fwd(q, q, q, -0.3)


@pytest.mark.parametrize("causal,bias", [(False, False), (True, False), (False, True)])
def test_lse_gradient_on_cuda(causal, bias):
    # A loss on out and softmax_lse (chunk merging): the gradient through lse enters the
    # backward as delta - dlse.  Error rule against the fp32 reference.
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(2, 77, 4, 64, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(2, 130, 2, 64, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(2, 130, 2, 64, device=dev, dtype=dt, requires_grad=True)
    b = torch.randn(2, 1, 77, 130, device=dev, requires_grad=True) if bias else None
    w_out = torch.randn(2, 77, 4, 64, device=dev)
    w_lse = torch.randn(2, 4, 77, device=dev)
    out, lse, _ = ops.fwd(q, k, v, None, causal, -1, -1, True, 0.0, None, b)
    leaves = [q, k, v] + ([b] if bias else [])
    ours = torch.autograd.grad((out.float() * w_out).sum() + (lse * w_lse).sum(), leaves)
    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    kw = dict(causal=causal, attn_bias=leaves32[3] if bias else None)
    o32, l32 = attention_ref(*leaves32[:3], compute_dtype=torch.float32, **kw)
    true_g = torch.autograd.grad((o32 * w_out).sum() + (l32 * w_lse).sum(), leaves32)
    low_leaves = [t.detach().requires_grad_() for t in leaves]
    kw_low = dict(causal=causal, attn_bias=low_leaves[3] if bias else None)
    ol, ll = attention_ref(*low_leaves[:3], compute_dtype=dt, **kw_low)
    low_g = torch.autograd.grad((ol.float() * w_out).sum() + (ll.float() * w_lse).sum(),
                                low_leaves)
    for name, a, lo, t in zip(("dq", "dk", "dv", "dbias"), ours, low_g, true_g):
        assert_error_rule(a, lo, t.double(), 3.0, name)


@pytest.mark.parametrize("kernel", ["auto", "sm80"])
def test_rng_state_is_written_without_dropout(kernel, kernel_opts):
    # The forward kernel writes rng_state ((0, 0) without dropout; no separate fill launch):
    # recycle a block the caching allocator hands back, filled with garbage first.
    kernel_opts(force_portable=kernel == "sm80")
    q = torch.randn(2, 77, 4, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        junk = torch.full((2,), 12345, device="cuda", dtype=torch.int64)
        del junk
        _, _, rng_state = ops.fwd(q, q, q)
        assert rng_state.tolist() == [0, 0]
    torch.manual_seed(7)
    _, _, rng_state = ops.fwd(q, q, q, dropout_p=0.3)  # (seed, offset) of torch's generator
    assert rng_state.dtype == torch.int64 and rng_state.tolist()[0] == 7


def test_fp16_gradients_with_large_score_gradients():
    # dS = P (dP - D) reaches ~7.7e4 here, beyond fp16's 65504; the kernels round dS * scale
    # (~6.8e3) to 16 bits, as the gradient of the scaled scores, so dq and dk stay finite.
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = ((torch.randn(1, 2, 1, 128, device="cuda", generator=g) * 1e-2).half()
            .requires_grad_() for _ in "qk")
    v = torch.full((1, 2, 1, 128), 4.0, device="cuda", dtype=torch.half)
    v[:, 1] = -4.0
    v.requires_grad_()
    dout = torch.full((1, 2, 1, 128), 300.0, device="cuda", dtype=torch.half)
    ours = torch.autograd.grad(flash_attn_func(q, k, v), (q, k, v), dout)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    true_out, _ = attention_ref(*leaves, compute_dtype=torch.float32)
    ref = torch.autograd.grad(true_out, leaves, dout.float())
    for name, a, r in zip(("dq", "dk", "dv"), ours, ref):
        assert torch.isfinite(a).all(), name
        assert (a.float() - r).abs().max().item() <= 1e-2 * r.abs().max().item() + 1e-3, name


def check_sm90_variants(plan, names):
    """The Hopper kernels among the launched ``names`` are the variants the plan names: the
    bool flags of their traits (Sm90FwdTraits<..., kPackGQA, kGeneral, kDropout, kMask, kVarlen,
    kSoftcap, kAlibi, ...>, Sm90BwdTraits<..., kGeneral, kDropout, kMask, kVarlen, kSoftcap,
    kAlibi>) against the names' suffixes: one flag or none."""
    fwd = [n for n in names if "flash_fwd_sm90_kernel" in n]
    assert bool(fwd) == plan.kernel.startswith("sm90_fwd"), (plan, names)
    for flag in SM90_FWD_FLAGS:
        assert any(sm90_variant_flags(n) == {flag} for n in fwd) == \
            plan.kernel.endswith("_" + flag), (plan, fwd)
    bwd = [n for n in names if "flash_bwd_sm90_kernel" in n]
    assert bool(bwd) == plan.backward_kernel.startswith("sm90_bwd"), (plan, names)
    for flag in SM90_BWD_FLAGS:
        assert any(sm90_variant_flags(n, "Sm90BwdTraits") == {flag} for n in bwd) == \
            plan.backward_kernel.endswith("_" + flag), (plan, bwd)


@pytest.mark.parametrize("case", [
    dict(head_dim=64), dict(head_dim=128, causal=True), dict(head_dim=256),
    dict(head_dim=40, seqlen_q=1, heads_q=32, heads_kv=4),     # decoding GQA: packed on sm_90
    dict(head_dim=128, softcap=5.0),                           # the softcap variants
    dict(head_dim=64, softcap=5.0),
    dict(head_dim=64, deterministic=True),                     # separate dQ kernel
    dict(head_dim=128, dropout_p=0.1),                         # the dropout variants
    dict(head_dim=64, dropout_p=0.1, causal=True),
    dict(head_dim=256, dropout_p=0.1),                         # Hopper fwd, portable bwd
    dict(head_dim=128, softcap=5.0, dropout_p=0.1),            # general: dropout with softcap
    dict(head_dim=128, window_size=(64, 0), portable=True)],   # forced portable forward
    ids=str)
def test_explain_names_the_kernels_the_glue_launches(case, kernel_opts):
    # explain() asks the same C++ rule (csrc/kernel_select.h) the glue obeys: the kernels the
    # profiler sees launched are the ones the plan names, forward and backward.
    case = dict(case)
    d, seqlen_q = case.pop("head_dim"), case.pop("seqlen_q", 300)
    heads_q, heads_kv = case.pop("heads_q", 4), case.pop("heads_kv", 4)
    kernel_opts(force_portable=case.pop("portable", False))
    q = torch.randn(2, seqlen_q, heads_q, d, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    k, v = (torch.randn(2, 257, heads_kv, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in "kv")
    plan = flash_attn_ext.explain(q, k, v, layout="blhd", **case)
    names = launched_kernels(lambda: flash_attn_func(q, k, v, **case).sum().backward())
    sm90 = [n for n in names if "flash_fwd_sm90_kernel" in n]
    assert bool(sm90) == plan.kernel.startswith("sm90_fwd"), (plan, names)
    assert any("flash_fwd_kernel" in n for n in names) == plan.kernel.startswith("sm80_fwd")
    check_sm90_variants(plan, names)
    hopper_bwd = [n for n in names if "flash_bwd_sm90_kernel" in n]
    if hopper_bwd:
        assert any("convert_dq" in n for n in names), names
        assert not any("flash_bwd_dkdv" in n or "flash_bwd_dq" in n for n in names), names
        return
    eight = any("flash_bwd_dkdv_lean_kernel" in n for n in names)
    assert eight == (not any("4-warp" in n for n in plan.notes)), (plan, names)
    assert any("flash_bwd_dkdv_kernel" in n for n in names) == (not eight)
    if eight:
        separate = any("flash_bwd_dq_lean_kernel" in n for n in names)
        assert separate == any("separate dQ kernel" in n for n in plan.notes), (plan, names)
        assert any("convert_dq" in n for n in names) == (not separate)


@pytest.mark.parametrize("head_dim,causal", [(128, False), (64, True), (256, False)])
def test_boolean_mask_runs_the_mask_variant(head_dim, causal):
    # A boolean attn_mask alone: explain names the Hopper mask variant (the backward's up to
    # head dim 128) and those are the kernels launched; the same mask as a float bias runs the
    # general variant.
    if torch.cuda.get_device_capability() != (9, 0) or not ops.build_info().get("sm90", False):
        pytest.skip("needs an sm_90 GPU and a build with the Hopper kernels")
    q, k, v = (torch.randn(2, 4, 300, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in "qkv")
    mask = torch.rand(2, 1, 300, 300, device="cuda") < 0.8
    if causal:
        mask &= torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
    for attn_mask, variant in ((mask, "_mask"), (torch.zeros(mask.shape, device="cuda")
                                                 .masked_fill(~mask, float("-inf")), "_general")):
        plan = flash_attn_ext.explain(q, k, v, attn_mask=attn_mask)
        assert plan.kernel.endswith(variant), plan
        names = launched_kernels(lambda m=attn_mask: flash_attn_ext.scaled_dot_product_attention(
            q, k, v, attn_mask=m).sum().backward())
        check_sm90_variants(plan, names)


@pytest.mark.parametrize("kernel", ["auto", "sm80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min])
def test_huge_finite_mask_values_mask_like_minus_inf(kernel_opts, kernel, dtype, fill):
    # An additive mask of huge finite values (transformers' finfo(dtype).min style) with left
    # padding: every row's first key tiles are masked, so the running max starts there.  Its
    # exponent must be exactly 0 (not 2^18 from rounding at -1e9, not NaN from m * log2(e)
    # overflowing): the answer equals the -inf mask's, forward and backward; a row of nothing
    # but such values gives a finite answer (finfo.min: zeros, as a row of -inf; -1e9: the
    # uniform average, its q zeroed so that its scores are exactly the fill, a row the
    # backward's exact pass takes).
    kernel_opts(force_portable=kernel == "sm80", sm90_bwd="on")
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=dtype, requires_grad=True)
               for _ in "qkv")
    with torch.no_grad():
        q[1, 5] = 0
    bias = torch.zeros(2, 1, 300, 300, device="cuda")
    bias[0, ..., :200] = fill
    bias[1, :, 5, :] = fill  # one row with no key left
    out, lse, _ = ops.fwd(q, k, v, None, False, -1, -1, True, 0.0, None, bias)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    # The reference: finfo.min as -inf (the kernels' rule); -1e9 as it is, but for row (1, 5),
    # whose q is 0, so that any constant bias gives it the same uniform softmax: 0 there keeps
    # PyTorch's fp16 yardstick finite (-1e9 overflows fp16 to -inf, which would empty the row).
    if fill < -1e30:
        ref_bias = bias.masked_fill(bias == fill, float("-inf"))
    else:
        ref_bias = bias.clone()
        ref_bias[1, :, 5] = 0
    leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*leaves32, attn_bias=ref_bias, compute_dtype=torch.float32)
    ref_grads = torch.autograd.grad(ref, leaves32, dout.float())
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    low_out, _ = attention_ref(*low, attn_bias=ref_bias, compute_dtype=dtype)
    low_grads = torch.autograd.grad(low_out, low, dout)
    assert_error_rule(out, low_out, ref.double(), 2.0, "out")
    if fill < -1e30:
        assert torch.equal(out[1, 5], torch.zeros_like(out[1, 5]))
        assert bool((lse[1, :, 5] == float("-inf")).all())
    for name, a, lo, t in zip(("dq", "dk", "dv"), grads, low_grads, ref_grads):
        assert_error_rule(a, lo, t.double(), 3.0, name, 1e-2)
