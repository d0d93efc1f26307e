"""flash_attn_ext as PyTorch's flash attention implementation (flash_attn_ext.integrations.
torch_flash): the aten flash ops' contracts, forward and through PyTorch's own autograd
formulas, on the CPU (our kernels registered for the CPU key, where PyTorch has none for these
ops) and, with a GPU, SDPA's FLASH backend routed to our kernels by activate_flash_attention_impl.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from test_varlen import _low_grads, _low_per_sequence, _packed, _per_sequence
from torch.nn import attention

import flash_attn_ext
from flash_attn_ext import ops
from flash_attn_ext.integrations import torch_flash
from reference import assert_error_rule, assert_lse_infinities, attention_ref

aten = torch.ops.aten
needs_registry = pytest.mark.skipif(not hasattr(attention, "activate_flash_attention_impl"),
                                    reason="this torch has no flash attention registry")
needs_inplace = pytest.mark.skipif(
    not hasattr(aten, "_flash_attention_forward_no_dropout_inplace"),
    reason="this torch has no _flash_attention_forward_no_dropout_inplace")


@pytest.fixture
def cpu_kernels():
    """Our kernels for the aten flash ops under the CPU key, for one test."""
    lib = torch_flash.register_kernels("CPU")
    yield
    lib._destroy()


def _leaves(shapes, dtype=torch.float64):
    return [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)),
                                           (False, (3, 1))])
@pytest.mark.parametrize("seqlens", [(17, 17), (9, 23)])
def test_flash_attention_forward_and_backward_match_the_reference(cpu_kernels, causal, window,
                                                                    seqlens):
    # (B, L, H, D) with GQA; is_causal and windows bottom-right (query i sees keys
    # j <= i + S - L), as PyTorch's own flash kernel (FlashAttention-2).
    L, S = seqlens
    q, k, v = _leaves([(2, L, 4, 24), (2, S, 2, 24), (2, S, 2, 24)])
    out, lse, rng, unused, debug = aten._flash_attention_forward(
        q, k, v, None, None, L, S, 0.0, causal, False, scale=0.3,
        window_size_left=window[0], window_size_right=window[1])
    assert out.shape == (2, L, 4, 24) and lse.shape == (2, 4, L) and debug.numel() == 0
    assert rng.dtype == torch.uint64 and rng.shape in ((2,), ())
    wl = -1 if window[0] is None else window[0]
    wr = -1 if window[1] is None else window[1]
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=0.3, causal=causal, window_left=wl,
                                 window_right=wr, align_bottom_right=True)
    assert (out - ref).abs().max().item() < 1e-12
    finite = torch.isfinite(ref_lse)
    assert_lse_infinities(lse, ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-12
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)  # PyTorch's formula: the backward op
    true = torch.autograd.grad(ref, (q, k, v), dout)
    for g, t in zip(grads, true):
        assert (g - t).abs().max().item() < 1e-11


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)),
                                           (False, (3, 2))])
def test_varlen_flash_attention_forward_and_backward_per_sequence(cpu_kernels, causal, window):
    # cum_seq_q/cum_seq_k: q (total_q, H, D), k/v (total_k, H_kv, D); each sequence its own
    # attention, causal and windows bottom-right per sequence (PyTorch's kernel is
    # FlashAttention-2's varlen); lengths 5, 0, 17, 9 queries over 7, 3, 17, 4 keys (L < S, an
    # empty sequence, L = S, L > S: with causal or the window its first rows see no key), GQA,
    # rows past the last offset; logsumexp (H, total_q) with +inf where a row sees no key (which
    # the backward then reads); the gradients through PyTorch's autograd formula, which calls
    # the backward op with the offsets.
    lens_q, lens_k = [5, 0, 17, 9], [7, 3, 17, 4]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, 16, 16, torch.float64, tail=(2, 3))
    out, lse, rng, unused, debug = aten._flash_attention_forward(
        q, k, v, cq, ck, max(lens_q), max(lens_k), 0.0, causal, False, scale=0.3,
        window_size_left=window[0], window_size_right=window[1])
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wl = -1 if window[0] is None else window[0]
    wr = -1 if window[1] is None else window[1]
    ref, ref_lse, ref_grads = _per_sequence(q, k, v, cq, ck, dout, softmax_scale=0.3,
                                            causal=causal, window_left=wl, window_right=wr)
    seen = torch.isfinite(ref_lse)  # (the tail rows see no key either)
    assert bool((~seen[:, :-2]).any()) == (causal or window[0] is not None)
    assert (out - ref).abs().max().item() < 1e-12
    assert torch.isposinf(lse[~seen]).all()
    assert (lse[seen] - ref_lse[seen]).abs().max().item() < 1e-12
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < 1e-11


@pytest.mark.skipif(importlib.util.find_spec("torch.nn.attention.varlen") is None,
                    reason="this torch has no varlen_attn")
def test_pytorch_varlen_attn_runs_on_our_kernels(cpu_kernels):
    # torch.nn.attention.varlen.varlen_attn calls the aten flash ops with the offsets, forward
    # and backward (its custom op runs on any device; here the CPU key, where ours serve them).
    from torch.nn.attention.varlen import varlen_attn

    lens = [6, 1, 13]
    q, k, v, cq, ck = _packed(lens, lens, 2, 2, 8, 8, torch.float64)
    out = varlen_attn(q, k, v, cq, ck, max(lens), max(lens))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _, ref_grads = _per_sequence(q, k, v, cq, ck, dout)
    assert (out - ref).abs().max().item() < 1e-12
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < 1e-11


@needs_inplace
def test_varlen_no_dropout_inplace_writes_out(cpu_kernels):
    # (Rows past the last offset are left alone, as PyTorch's kernel leaves them.)
    lens = [4, 9]
    q, k, v, cq, ck = _packed(lens, [5, 9], 2, 1, 8, 8, torch.float64, tail=(2, 0))
    out = torch.full_like(q, float("nan")).detach()
    lse = aten._flash_attention_forward_no_dropout_inplace(out, q, k, v, cq, ck, 9, 9, 0.0, True,
                                                           False)
    want, want_lse = aten._flash_attention_forward(q, k, v, cq, ck, 9, 9, 0.0, True, False)[:2]
    assert torch.equal(out[:-2], want[:-2]) and torch.equal(lse, want_lse)
    assert out[-2:].isnan().all()


@pytest.mark.parametrize("blhd_buffer", [False, True])
def test_sdpa_flash_ops_take_bhld_and_lay_out_as_pytorch(cpu_kernels, blhd_buffer):
    # (B, H, L, D) tensors, contiguous or views of a (B, L, H, D) buffer; the output's strides
    # are those of PyTorch's meta kernel (which torch.compile plans with): like the query's.
    shape = (2, 13, 4, 16) if blhd_buffer else (2, 4, 13, 16)
    q, k, v = (t.transpose(1, 2) if blhd_buffer else t for t in _leaves([shape] * 3))
    out, lse, cum_q, cum_k, max_q, max_k, first, second, debug = \
        aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    meta = aten._scaled_dot_product_flash_attention(*(t.to("meta") for t in (q, k, v)), 0.0,
                                                    True)
    assert (max_q, max_k) == (13, 13) and lse.shape == (2, 4, 13)
    assert out.shape == (2, 4, 13, 16) and out.stride() == meta[0].stride()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - ref).abs().max().item() < 1e-12
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, t in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)):
        assert (g - t).abs().max().item() < 1e-11


@pytest.mark.parametrize("sdpa", [False, True])
def test_dropout_state_travels_from_forward_to_backward(cpu_kernels, sdpa):
    # The same seed gives flash_attn_func's mask; the backward regenerates it from the rng
    # outputs PyTorch hands back (gradients equal to flash_attn_func's).
    q, k, v = _leaves([(1, 33, 2, 16)] * 3, torch.float32)
    dout = torch.randn(1, 33, 2, 16)
    torch.manual_seed(7)
    want = flash_attn_ext.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.manual_seed(7)
    if sdpa:
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        out = aten._scaled_dot_product_flash_attention(qs, ks, vs, 0.3, True)[0].transpose(1, 2)
    else:
        out = aten._flash_attention_forward(q, k, v, None, None, 33, 33, 0.3, True, False)[0]
    assert torch.equal(out, want)
    assert not torch.allclose(out, flash_attn_ext.flash_attn_func(q, k, v, causal=True))
    for g, w in zip(torch.autograd.grad(out, (q, k, v), dout), want_grads):
        assert torch.equal(g, w)



@needs_inplace
def test_no_dropout_inplace_writes_out_and_returns_lse(cpu_kernels):
    q, k, v = (torch.randn(2, 11, 2, 8) for _ in "qkv")
    out = torch.full((2, 11, 2, 8), float("nan"))
    lse = aten._flash_attention_forward_no_dropout_inplace(out, q, k, v, None, None, 11, 11,
                                                           0.0, False, False)
    want, want_lse, _ = ops.fwd(q, k, v, None, False, -1, -1, True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    with pytest.raises(RuntimeError, match="out must be"):  # (not broadcast into)
        aten._flash_attention_forward_no_dropout_inplace(torch.empty(3, 11, 2, 8), q[:1], k[:1],
                                                         v[:1], None, None, 11, 11, 0.0, False,
                                                         False)


@pytest.mark.parametrize("case", ["cum_seq_q", "seqused_k", "alibi_slopes", "block_table",
                                  "debug", pytest.param("inplace_dropout", marks=needs_inplace)])
def test_calls_we_do_not_serve_raise_naming_what(cpu_kernels, case):
    q = torch.randn(1, 8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=case.replace("debug", "return_debug_mask")
                       .replace("inplace_", "")):
        if case == "cum_seq_q":  # (one offset alone)
            aten._flash_attention_forward(q[0], q[0], q[0], cu, None, 8, 8, 0.0, False, False)
        elif case == "seqused_k":  # (without offsets)
            aten._flash_attention_forward(q, q, q, None, None, 8, 8, 0.0, False, False,
                                          seqused_k=torch.tensor([8], dtype=torch.int32))
        elif case == "alibi_slopes":
            aten._flash_attention_forward(q, q, q, None, None, 8, 8, 0.0, False, False,
                                          alibi_slopes=torch.ones(2))
        elif case == "block_table":
            aten._flash_attention_forward(q, q, q, None, None, 8, 8, 0.0, False, False,
                                          block_table=torch.zeros(1, 1, dtype=torch.int32))
        elif case == "debug":
            aten._flash_attention_forward(q, q, q, None, None, 8, 8, 0.0, False, True)
        else:
            aten._flash_attention_forward_no_dropout_inplace(torch.empty_like(q), q, q, q, None,
                                                             None, 8, 8, 0.1, False, False)


def test_a_call_no_kernel_serves_raises_with_the_rule_s_reason(cpu_kernels):
    q = torch.randn(1, 8, 2, 300)  # head dim beyond the kernels'
    with pytest.raises(RuntimeError, match="head dims 1 to 256"):
        aten._flash_attention_forward(q, q, q, None, None, 8, 8, 0.0, False, False)


@needs_registry
def test_registered_on_import_activated_only_on_request():
    assert torch_flash.NAME in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != torch_flash.NAME
    if not ops.build_info()["cuda"]:
        # Nothing to serve the calls SDPA would send: activation refuses, changing nothing.
        with pytest.raises(RuntimeError, match="no CUDA kernels"):
            attention.activate_flash_attention_impl(torch_flash.NAME)
        assert attention.current_flash_attention_impl() is None
        return
    attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        assert attention.current_flash_attention_impl() == torch_flash.NAME
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None


def test_single_query_causal_sees_every_key(cpu_kernels):
    # Decoding (L = 1) with is_causal: bottom-right, the query sees all S keys (PyTorch's
    # kernel turns causal off for L = 1).
    q, k, v = torch.randn(1, 1, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    out = aten._flash_attention_forward(q, k, v, None, None, 1, 8, 0.0, True, False)[0]
    assert torch.allclose(out, aten._flash_attention_forward(q, k, v, None, None, 1, 8, 0.0,
                                                             False, False)[0])


def test_value_head_dim_unlike_the_query_s_is_refused(cpu_kernels):
    q, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 32)
    with pytest.raises(RuntimeError, match="value head dim 32 != query head dim 16"):
        aten._flash_attention_forward(q, q, v, None, None, 8, 8, 0.0, False, False)


def test_no_keys_give_logsumexp_plus_inf_as_pytorch(cpu_kernels):
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 0, 2, 8)
    out, lse = aten._flash_attention_forward(q, k, k, None, None, 3, 0, 0.0, False, False)[:2]
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    # Causal with L > S, bottom-right: the first L - S rows see no key.
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 4, 2, 8)
    out, lse = aten._flash_attention_forward(q, k, k, None, None, 6, 4, 0.0, True, False)[:2]
    assert torch.isposinf(lse[..., :2]).all() and torch.isfinite(lse[..., 2:]).all()
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))


@needs_registry
@pytest.mark.skipif(not (torch.cuda.is_available() and ops.build_info()["cuda"]),
                    reason="needs a CUDA device and a CUDA build of flash_attn_ext")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sdpa_flash_backend_runs_on_our_kernels(dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 8, 300, 128, device="cuda", dtype=dtype, requires_grad=True)
               for _ in "qkv")
    dout = torch.randn_like(q)
    attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        flash_attn_ext.policy._last_plan = None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        plan = flash_attn_ext.last_plan()
        assert plan is not None and plan.kernel.startswith("sm"), plan
        with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            flash_attn_ext.policy._last_plan = None
            # no_grad: the no-dropout in-place op
            out_no_grad = F.scaled_dot_product_attention(q, k, v)
        assert flash_attn_ext.last_plan() is not None
    finally:
        attention.restore_flash_attention_impl()
    # Under the error rule against float32, PyTorch's own kernel in dtype as the yardstick
    # (the impl restored above), forward, gradients and the in-place op's output.
    leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    true = F.scaled_dot_product_attention(*leaves32, is_causal=True)
    low_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    low = F.scaled_dot_product_attention(*low_leaves, is_causal=True)
    assert_error_rule(out, low, true.double(), 2.0, "out")
    true_g = torch.autograd.grad(true, leaves32, dout.float())
    low_g = torch.autograd.grad(low, low_leaves, dout)
    for name, g, lo, t in zip(("dq", "dk", "dv"), grads, low_g, true_g):
        assert_error_rule(g, lo, t.double(), 3.0, name)
    with torch.no_grad():
        true = F.scaled_dot_product_attention(*(t.float() for t in (q, k, v)))
        low = F.scaled_dot_product_attention(q, k, v)
    assert_error_rule(out_no_grad, low, true.double(), 2.0, "out, no grad")
    flash_attn_ext.policy._last_plan = None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert flash_attn_ext.last_plan() is None  # restored: PyTorch's own kernel again


@needs_registry
@pytest.mark.skipif(not (torch.cuda.is_available() and ops.build_info()["cuda"]),
                    reason="needs a CUDA device and a CUDA build of flash_attn_ext")
@pytest.mark.parametrize("seqlen,head_dim", [(1, 64), (17, 40), (113, 59), (1023, 72),
                                             (300, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_flash_backend_grid_is_our_kernels_answer(seqlen, head_dim, causal, gqa):
    # SDPA's FLASH backend with our kernels behind it, over odd lengths and head dims (59:
    # SDPA pads it to 64 and passes the scale), causal, GQA (enable_gqa): out and gradients
    # are flash_attn_func's on the same tensors (the same kernels: out bit for bit), and out
    # is under the error rule against float32.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads_kv = 2 if gqa else 8
    q = torch.randn(2, 8, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    k, v = (torch.randn(2, heads_kv, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in "kv")
    dout = torch.randn_like(q)
    attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                                 scale=head_dim ** -0.5)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        attention.restore_flash_attention_impl()
    bshd = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    want = flash_attn_ext.flash_attn_func(*bshd, causal=causal, softmax_scale=head_dim ** -0.5)
    want_grads = torch.autograd.grad(want, bshd, dout.transpose(1, 2))
    assert torch.equal(out, want.transpose(1, 2))
    for g, w in zip(grads, want_grads):  # (dQ by atomics: equal up to summation order)
        w = w.transpose(1, 2).float()
        assert (g.float() - w).abs().max().item() <= 1e-2 * w.abs().max().item() + 1e-3
    leaves32 = [t.detach().float() for t in (q, k, v)]
    true = F.scaled_dot_product_attention(*leaves32, is_causal=causal, enable_gqa=gqa)
    low = F.scaled_dot_product_attention(*(t.detach() for t in (q, k, v)), is_causal=causal,
                                         enable_gqa=gqa)
    assert_error_rule(out, low, true.double(), 2.0, "out")


@needs_registry
@pytest.mark.skipif(not (torch.cuda.is_available() and ops.build_info()["cuda"]),
                    reason="needs a CUDA device and a CUDA build of flash_attn_ext")
def test_sdpa_flash_backend_dropout_is_our_mask():
    # dropout_p through SDPA's FLASH backend: our kernels' Philox mask from PyTorch's generator,
    # so the same seed gives flash_attn_func's bits, forward and backward (the backward
    # regenerates the mask from the (seed, offset) PyTorch's rng outputs carried).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 4, 257, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in "qkv")
    dout = torch.randn_like(q)
    attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        torch.manual_seed(7)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        attention.restore_flash_attention_impl()
    bshd = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    want = flash_attn_ext.flash_attn_func(*bshd, dropout_p=0.2, causal=True)
    want_grads = torch.autograd.grad(want, bshd, dout.transpose(1, 2))
    assert torch.equal(out, want.transpose(1, 2))
    for g, w in zip(grads, want_grads):
        w = w.transpose(1, 2).float()
        assert (g.float() - w).abs().max().item() <= 1e-2 * w.abs().max().item() + 1e-3


@needs_registry
@pytest.mark.skipif(not (torch.cuda.is_available() and ops.build_info()["cuda"]),
                    reason="needs a CUDA device and a CUDA build of flash_attn_ext")
def test_sdpa_flash_backend_on_our_kernels_compiles():
    # Inductor calls the aten op at run time (our kernels) and checks its outputs' sizes and
    # strides against PyTorch's meta kernel, which stays in place.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in "qkv")

    def f(q, k, v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        out = torch.compile(f, fullgraph=True)(q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        flash_attn_ext.policy._last_plan = None
        want = f(q, k, v)
        assert flash_attn_ext.last_plan() is not None  # (eager: ours too)
        want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    finally:
        attention.restore_flash_attention_impl()
    assert torch.equal(out, want)
    for g, w in zip(grads, want_grads):  # (dQ by atomics: equal up to summation order)
        assert (g.float() - w.float()).abs().max().item() <= 1e-2 * w.float().abs().max().item()


@needs_registry
@pytest.mark.skipif(not (torch.cuda.is_available() and ops.build_info()["cuda"]),
                    reason="needs a CUDA device and a CUDA build of flash_attn_ext")
@pytest.mark.skipif(importlib.util.find_spec("torch.nn.attention.varlen") is None,
                    reason="this torch has no varlen_attn")
@pytest.mark.parametrize("causal", [False, True])
def test_pytorch_varlen_attn_on_the_gpu_runs_our_varlen_kernels(causal):
    # Activated, PyTorch's varlen_attn reaches our fwd_varlen/bwd_varlen ops: the same bits as
    # flash_attn_varlen_func, and each sequence under the error rule (float32 reference).
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    lens_q, lens_k = [300, 0, 77, 1, 129, 64], [300, 5, 77, 64, 200, 3]  # (the last: L > S)
    q, k, v, cq, ck = _packed(lens_q, lens_k, 8, 2, 128, 128, torch.float32)
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    cq, ck = cq.cuda(), ck.cuda()
    dout = torch.randn_like(q)
    kw = (dict(is_causal=causal) if "is_causal" in inspect.signature(varlen_attn).parameters
          else dict(window_size=(-1, 0) if causal else (-1, -1)))
    attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        out = varlen_attn(q, k, v, cq, ck, max(lens_q), max(lens_k), **kw)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        attention.restore_flash_attention_impl()
    want = flash_attn_ext.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                                 causal=causal)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    assert torch.equal(out, want)
    for g, w in zip(grads, want_grads):  # (dQ by atomics: equal up to summation order)
        assert (g.float() - w.float()).abs().max().item() <= 1e-2 * w.float().abs().max().item()
    # (flash_attn_varlen_func's kernels are under the error rule in test_varlen; this checks
    # that the provider hands them the right sequences and flags.)
    cpu = [t.detach().cpu() for t in (q, k, v)]
    true, _, true_grads = _per_sequence(*cpu, cq.cpu(), ck.cpu(), dout.cpu(), causal=causal)
    low, leaves = _low_per_sequence(*cpu, cq.cpu(), ck.cpu(), torch.bfloat16, causal=causal)
    assert_error_rule(out.cpu(), low, true, 2.0, "out")
    for name, g, lo, t in zip(("dq", "dk", "dv"), grads,
                              _low_grads(low, leaves, dout, torch.bfloat16), true_grads):
        assert_error_rule(g.cpu(), lo, t, 3.0, name)


@needs_registry
@pytest.mark.skipif(not (torch.cuda.is_available() and ops.build_info()["cuda"]),
                    reason="needs a CUDA device and a CUDA build of flash_attn_ext")
def test_nested_tensor_sdpa_runs_our_varlen_kernels():
    # SDPA on jagged nested tensors sends FLASH calls with cum_seq_q/k: activated, they run on
    # our varlen kernels (the same bits as flash_attn_varlen_func on the packed sequences).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lens = [100, 37, 256]
    packed = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 137, 393], dtype=torch.int32, device="cuda")
    nested = torch.nested.nested_tensor(list(packed.split(lens)), layout=torch.jagged)
    attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            x = nested.transpose(1, 2)  # (B, H, j, D)
            out = F.scaled_dot_product_attention(x, x, x, is_causal=True).transpose(1, 2)
    finally:
        attention.restore_flash_attention_impl()
    want = flash_attn_ext.flash_attn_varlen_func(packed, packed, packed, cu, cu, 256, 256,
                                                 causal=True)
    assert torch.equal(torch.cat(out.unbind()), want)
