"""Bad input gets a clear error naming the argument, its value and the rule."""

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import flash_attn_func, ops, scaled_dot_product_attention


def qkv(b=1, lq=4, lk=4, h=2, hk=2, d=8, dv=8, dtype=torch.float32):
    return (torch.randn(b, lq, h, d, dtype=dtype), torch.randn(b, lk, hk, d, dtype=dtype),
            torch.randn(b, lk, hk, dv, dtype=dtype))


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have 4 dimensions.*q.dim\(\)=3"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match=r"k must have 4 dimensions.*k.dim\(\)=5"):
        flash_attn_func(q, k[None], v)
    with pytest.raises(ValueError, match=r"v must have 4 dimensions"):
        flash_attn_func(q, k, v[0])


def test_mismatched_batch_heads_seqlen_head_dim():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"same batch size.*q.size\(0\)=1.*k.size\(0\)=2"):
        flash_attn_func(q, k.expand(2, -1, -1, -1), v)
    with pytest.raises(ValueError, match=r"same seqlen_k.*k.size\(1\)=4, v.size\(1\)=5"):
        flash_attn_func(q, k, torch.randn(1, 5, 2, 8))
    with pytest.raises(ValueError, match=r"same number of heads.*k.size\(2\)=2, v.size\(2\)=1"):
        flash_attn_func(q, k, torch.randn(1, 4, 1, 8))
    with pytest.raises(ValueError, match=r"k.size\(3\) \(head_dim\) must equal q.size\(3\)=8"):
        flash_attn_func(q, torch.randn(1, 4, 2, 16), v)


def test_head_dim_limits():
    with pytest.raises(ValueError, match=r"head_dim must be between 1 and 256, got q.*=257"):
        flash_attn_func(*qkv(d=257))
    with pytest.raises(ValueError, match=r"head_dim must be between 1 and 256, got q.size\(3\)=0"):
        flash_attn_func(*qkv(d=0))
    with pytest.raises(ValueError, match=r"head_dim_v must be between 1 and 256.*=300"):
        flash_attn_func(*qkv(dv=300))


def test_heads_not_multiple():
    with pytest.raises(ValueError, match=r"multiple of the number of key/value heads.*q.size\(2\)=3"
                                         r" and num_heads_k k.size\(2\)=2"):
        flash_attn_func(*qkv(h=3, hk=2))


def test_keys_without_heads():
    # (k of zero heads read as a GQA ratio before: "a multiple of ... num_heads_k=0")
    with pytest.raises(ValueError, match=r"k and v must have at least one head when q has heads, "
                                         r"got k.size\(2\)=0 with q.size\(2\)=2"):
        flash_attn_func(*qkv(h=2, hk=0))
    q, k = torch.randn(5, 2, 8), torch.randn(5, 0, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"at least one head when q has heads, got k.size\(1\)=0"
                                         r" with q.size\(1\)=2"):
        flash_attn_ext.flash_attn_varlen_func(q, k, k, cu, cu, 5, 5)


def test_dtype_and_device_mismatch():
    q, k, v = qkv()
    # (dtypes named as Python writes them, not as c10 does: torch.float32, not Float)
    with pytest.raises(ValueError,
                       match=r"same dtype.*q.dtype=torch.float32.*k.dtype=torch.float64"):
        flash_attn_func(q, k.double(), v)
    with pytest.raises(ValueError, match=r"q.dtype=torch.int32 is not supported"):
        flash_attn_func(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match=r"same device.*k.device=meta"):
        flash_attn_func(q, k.to("meta"), v)


def test_window_scale_softcap_dropout():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"window_left must be >= -1.*got -2"):
        flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match=r"window_right must be >= -1.*got -5"):
        flash_attn_func(q, k, v, window_size=(0, -5))
    with pytest.raises(ValueError, match=r"window_size must be a pair"):
        flash_attn_func(q, k, v, window_size=(1, 2, 3))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"softmax_scale must be a finite number.*got"):
            flash_attn_func(q, k, v, softmax_scale=bad)
    with pytest.raises(ValueError, match=r"softcap must be finite and >= 0.*got -1"):
        flash_attn_func(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\], got 1.5"):
        flash_attn_func(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(num_heads,\)"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(q.shape[2] + 1))


def test_op_level_checks():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1"):
        ops.fwd(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got -0.5"):
        ops.fwd(q, k, v, dropout_p=-0.5)
    with pytest.raises(ValueError, match="attn_bias of shape .* is not broadcastable"):
        ops.fwd(q, k, v, attn_bias=torch.zeros(3, 4))
    out, lse, rng = ops.fwd(q, k, v)
    args = (q, k, v, out, lse, rng)
    with pytest.raises(ValueError, match=r"dout must have shape \[1, 4, 2, 8\], got \[1, 4, 2, 7"):
        ops.bwd_op(torch.randn(1, 4, 2, 7), *args)
    with pytest.raises(ValueError, match=r"softmax_lse must have shape \[1, 2, 4\]"):
        ops.bwd_op(torch.randn_like(out), q, k, v, out, lse[:, :1], rng)
    with pytest.raises(ValueError, match=r"softmax_lse must have dtype torch.float32"):
        ops.bwd_op(torch.randn_like(out), q, k, v, out, lse.double(), rng)


def test_sdpa_argument_errors():
    q, k, v = (t.transpose(1, 2) for t in qkv())
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\], got 1.5"):
        scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"query must have at least 3 dim.* got query.dim\(\)=2"):
        scaled_dot_product_attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(*(t.transpose(1, 2) for t in qkv(h=4, hk=2)))
    # A string was taken as True (new-user trial).
    with pytest.raises(ValueError, match="enable_gqa must be a bool, got 'no'"):
        scaled_dot_product_attention(q, k, v, enable_gqa="no")


def test_flag_types_and_dropout_range():
    q, k, v = qkv()
    for bad in (None, (1.7, 0), (1,), "ab"):
        with pytest.raises(ValueError, match="window_size must be a pair of ints"):
            flash_attn_func(q, k, v, window_size=bad)
    with pytest.raises(ValueError, match="causal must be a bool"):
        flash_attn_func(q, k, v, causal=None)
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\]"):
            flash_attn_func(q, k, v, dropout_p=bad)
        with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\]"):
            scaled_dot_product_attention(q, k, v, dropout_p=bad)
    with pytest.raises(ValueError, match="softmax_scale must be finite and representable"):
        flash_attn_func(q, k, v, softmax_scale=1e300)


def test_huge_windows_mean_unbounded():
    import sys
    q, k, v = torch.randn(1, 10, 1, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    full = flash_attn_func(q, k, v)
    for window in ((-1, sys.maxsize), (sys.maxsize, -1), (sys.maxsize, sys.maxsize)):
        assert torch.equal(flash_attn_func(q, k, v, window_size=window), full)


def test_zero_query_heads_give_zero_kv_grads():
    q = torch.randn(2, 5, 0, 4, requires_grad=True)
    k = torch.randn(2, 7, 2, 4, requires_grad=True)
    v = torch.randn(2, 7, 2, 3, requires_grad=True)
    out = flash_attn_func(q, k, v)
    _, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert (dk == 0).all() and (dv == 0).all()


def test_forward_mode_and_functorch_grad_are_refused():
    q, k, v = (torch.randn(1, 10, 2, 8, dtype=torch.float64) for _ in range(3))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda q: flash_attn_func(q, k, v), (q,), (torch.randn_like(q),))
    with pytest.raises(NotImplementedError, match="torch.func's gradient transforms"):
        torch.func.grad(lambda q: flash_attn_func(q, k, v).sum())(q)
    with pytest.raises(NotImplementedError, match=r"\(grad, vjp, jacrev"):  # (its name too)
        torch.func.vjp(lambda q: flash_attn_func(q, k, v), q)
    # A tangent on the mask or the ALiBi slopes alone (forward AD and torch.func.jvp): the
    # same error (it was autograd's "jvp is not implemented for the c++ API of custom
    # Function", naming neither; a new-user finding).
    import torch.autograd.forward_ad as fwad
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    mask = torch.randn(1, 1, 10, 10, dtype=torch.float64)
    slopes = torch.rand(2, dtype=torch.float64)
    with fwad.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            scaled_dot_product_attention(qs, ks, vs,
                                         attn_mask=fwad.make_dual(mask, torch.randn_like(mask)))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flash_attn_func(q, k, v, alibi_slopes=fwad.make_dual(slopes,
                                                                 torch.randn_like(slopes)))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda m: scaled_dot_product_attention(qs, ks, vs, attn_mask=m), (mask,),
                       (torch.randn_like(mask),))
    # vmap of the forward is fine.
    out = torch.vmap(lambda q: flash_attn_func(q, k, v))(q.unsqueeze(0).expand(3, -1, -1, -1,
                                                                                -1))
    assert torch.allclose(out[1], flash_attn_func(q, k, v))


def test_varlen_and_kvcache_refuse_forward_mode_and_functorch_grad():
    # flash_attn_func's refusal, not PyTorch's "cannot use C++ torch::autograd::Function with
    # functorch transforms" (a new-user finding).
    from flash_attn_ext import flash_attn_varlen_func, flash_attn_with_kvcache
    q = torch.randn(5, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)

    def varlen(q):
        return flash_attn_varlen_func(q, q, q, cu, cu, 3, 3)

    with pytest.raises(NotImplementedError, match="torch.func's gradient transforms"):
        torch.func.grad(lambda q: varlen(q).sum())(q)
    with pytest.raises(NotImplementedError, match="torch.func's gradient transforms"):
        torch.func.vjp(varlen, q)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(varlen, (q,), (torch.randn_like(q),))
    cache = torch.randn(2, 6, 2, 8, dtype=torch.float64)
    qc = torch.randn(2, 1, 2, 8, dtype=torch.float64)

    def decode(q):
        return flash_attn_with_kvcache(q, cache, cache, cache_seqlens=4)

    with pytest.raises(NotImplementedError, match="torch.func's gradient transforms"):
        torch.func.grad(lambda q: decode(q).sum())(qc)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(decode, (qc,), (torch.randn_like(qc),))
    import torch.autograd.forward_ad as fwad
    with fwad.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            varlen(fwad.make_dual(q, torch.randn_like(q)))
    # vmap stays served, and reverse mode too.
    out = torch.vmap(varlen)(q.unsqueeze(0).expand(3, -1, -1, -1))
    assert torch.equal(out[2], varlen(q))
    qg = q.clone().requires_grad_()
    (dq,) = torch.autograd.grad(varlen(qg).sum(), qg)
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0


def test_sdpa_errors_use_callers_dimensions():
    r = torch.randn
    with pytest.raises(ValueError, match=r"key.size\(2\)=4, value.size\(2\)=5"):
        scaled_dot_product_attention(r(1, 2, 3, 8), r(1, 2, 4, 8), r(1, 2, 5, 8))
    with pytest.raises(ValueError, match=r"query.size\(1\)=3 must be a multiple of key.size"):
        scaled_dot_product_attention(r(1, 3, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8),
                                     enable_gqa=True)
    with pytest.raises(ValueError, match=r"query.size\(3\)=8, key.size\(3\)=9"):
        scaled_dot_product_attention(r(1, 2, 4, 8), r(1, 2, 4, 9), r(1, 2, 4, 9))


def test_sdpa_errors_of_grouped_3d_calls_use_callers_shapes():
    # 3-D inputs with enable_gqa and different first sizes are (H, L, E) against (H_kv, S, E),
    # one batch, as PyTorch's function groups dimension -3.  Their errors named an attention
    # of (N, L, S) or of the (1, H, L, S) the call runs on, that view's dimension numbers, and
    # a batch size.
    import re

    from flash_attn_ext import explain, to_bshd
    r = torch.randn
    q, k = r(8, 5, 16), r(2, 7, 16)
    for shape in ((2, 8, 5, 7), (3, 5, 7), (8, 4, 7)):
        mask = torch.ones(shape, dtype=torch.bool)
        for fn in (scaled_dot_product_attention, explain):
            with pytest.raises(ValueError) as error:
                fn(q, k, k, attn_mask=mask, enable_gqa=True)
            assert str(error.value) == (f"attn_mask of shape {shape} is not broadcastable to "
                                        f"the attention's (H, L, S) = (8, 5, 7)")
    for args, message in (
            ((q, k, r(2, 6, 16)), "key and value must have the same sequence length, got "
                                  "key.size(1)=7, value.size(1)=6"),
            ((q, r(2, 7, 8), r(2, 7, 8)), "query and key must have the same embedding size, got "
                                          "query.size(2)=16, key.size(2)=8"),
            ((q, k, r(4, 7, 16)), "key and value must have the same number of heads, got "
                                  "key.size(0)=2, value.size(0)=4"),
            ((r(6, 5, 16), r(4, 7, 16), r(4, 7, 16)), "with enable_gqa, query.size(0)=6 must be "
                                                      "a multiple of key.size(0)=4"),
            ((q, r(0, 7, 16), r(0, 7, 16)), "key.size(0)=0 heads cannot serve query.size(0)=8 "
                                            "heads")):
        for fn in (scaled_dot_product_attention, explain):
            with pytest.raises(ValueError, match=re.escape(message)):
                fn(*args, enable_gqa=True)
    # Without enable_gqa the first size is the batch.
    with pytest.raises(ValueError, match=re.escape("same batch size, got query.size(0)=8")):
        scaled_dot_product_attention(q, k, k)
    # to_bshd takes such inputs as the drop-in does: one batch of heads.
    assert [t.shape for t in to_bshd(q, k, k, True)] == [(1, 5, 8, 16), (1, 7, 2, 16),
                                                          (1, 7, 2, 16)]


def test_explain_checks_like_a_call():
    from flash_attn_ext import explain
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="is_casual"):
        explain(q, q, q, is_casual=True)
    with pytest.raises(ValueError):
        explain(q, torch.randn(1, 2, 3, 9), q)
    # (the call's own message, naming query: the SDPA drop-in's tensor rules come first)
    with pytest.raises(ValueError, match=r"query.dtype=torch.int64 is not supported: query"):
        explain(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match=r"q.dtype=torch.int64 is not supported on cpu"):
        explain(*(t.transpose(1, 2) for t in (q.long(),) * 3), layout="blhd")
    # The call's own flags and mask are checked as the call checks them.
    with pytest.raises(ValueError, match="not broadcastable"):
        explain(q, q, q, attn_mask=torch.ones(5, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p"):
        explain(q, q, q, dropout_p=2.0)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        explain(q, q, q, scale=float("inf"))
    with pytest.raises(ValueError, match="softcap"):
        explain(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), layout="blhd",
                softcap=-1.0)
    # (a mask with is_causal=True is taken: both apply, as PyTorch's fused CPU kernel)
    assert explain(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True).fused
    # Only the keywords of the layout's own function (SDPA has no window or softcap).
    with pytest.raises(TypeError, match="window_size"):
        explain(q, q, q, window_size=(4, 0))
    with pytest.raises(TypeError, match="attn_mask"):
        explain(q, q, q, layout="blhd", attn_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="window_left must be >= -1"):
        explain(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), layout="blhd",
                window_size=(-5, 0))
    assert explain(q, q, q, dropout_p=1.0, is_causal=True).fused  # SDPA takes dropout_p=1


def test_fake_kernel_errors_are_clear_under_compile():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: ops.fwd(q, k, v)[0], fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="q must have 4 dimensions"):
        f(torch.randn(4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))


def test_sdpa_errors_use_the_callers_names():
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4)
    with pytest.raises(ValueError, match=r"attn_mask must be on query's device cpu, got meta"):
        scaled_dot_product_attention(q, k, k, attn_mask=torch.randn(5, 7, device="meta"))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(2, 2, 5, 7\) is not "
                                         r"broadcastable to the attention's \(N, L, S\)"):
        scaled_dot_product_attention(q[:, 0], k[:, 0], k[:, 0], attn_mask=torch.randn(2, 2, 5, 7))
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor or None, got list"):
        scaled_dot_product_attention(q, k, k, attn_mask=[[True]])
    with pytest.raises(TypeError, match="query must be a torch.Tensor, got ndarray"):
        scaled_dot_product_attention(q.numpy(), k, k)
    with pytest.raises(ValueError, match=r"scale must be a finite number .* got nan"):
        scaled_dot_product_attention(q, k, k, scale=float("nan"))
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\], got '0.1'"):
        scaled_dot_product_attention(q, k, k, dropout_p="0.1")
    with pytest.raises(ValueError, match="window_size sides must fit in int64"):
        flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                        window_size=(2**70, 0))
    with pytest.raises(ValueError, match="attn_bias must be on cpu, got meta"):  # op level
        ops.fwd(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                attn_bias=torch.randn(5, 7, device="meta"))


def test_scale_as_in_pytorch_and_strict_type_checks():
    # A 0-d tensor scale is taken as PyTorch takes it; bools and strings are refused.
    q = torch.randn(2, 4, 9, 32)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.5)
    np = pytest.importorskip("numpy")
    for scale in (torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64), 0.5,
                  np.float32(0.5), np.float64(0.5)):
        assert torch.allclose(scaled_dot_product_attention(q, q, q, scale=scale), ref, atol=1e-6)
        assert torch.allclose(flash_attn_func(*(t.transpose(1, 2) for t in (q, q, q)),
                                              softmax_scale=scale).transpose(1, 2), ref, atol=1e-6)
    assert torch.equal(scaled_dot_product_attention(q, q, q, scale=np.int64(1)),
                       scaled_dot_product_attention(q, q, q, scale=1.0))
    # dropout_p as a NumPy number or a 0-d tensor, as PyTorch takes it (same mask as the float).
    outs = []
    for p in (0.25, np.float32(0.25), torch.tensor(0.25)):
        torch.manual_seed(0)
        outs.append(scaled_dot_product_attention(q, q, q, dropout_p=p))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    qt = q.transpose(1, 2)
    # FlashAttention-2's flags as NumPy numbers or 0-d tensors (configs loaded from arrays):
    # dropout_p, window_size, softcap; the same answer and the same dropout mask as the floats.
    plain = dict(dropout_p=0.25, window_size=(3, 1), softcap=5.0)
    for flags in (dict(dropout_p=np.float32(0.25), window_size=(np.int64(3), np.int32(1)),
                       softcap=np.float32(5.0)),
                  dict(dropout_p=torch.tensor(0.25), window_size=(torch.tensor(3), 1),
                       softcap=torch.tensor(5.0))):
        torch.manual_seed(0)
        ours = flash_attn_func(qt, qt, qt, **flags)
        torch.manual_seed(0)
        assert torch.equal(ours, flash_attn_func(qt, qt, qt, **plain))
    with pytest.raises(ValueError, match="window_size must be a pair of ints"):
        flash_attn_func(qt, qt, qt, window_size=(np.float32(1.5), 2))
    for bad in (True, "0.5", torch.tensor([0.5]), torch.tensor(True), np.bool_(True)):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            scaled_dot_product_attention(q, q, q, scale=bad)
        with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
            flash_attn_func(qt, qt, qt, softmax_scale=bad)
    for bad in (None, "3", True):
        with pytest.raises(ValueError, match="softcap must be a number"):
            flash_attn_func(qt, qt, qt, softcap=bad)
    with pytest.raises(ValueError, match="deterministic must be a bool, got 'no'"):
        flash_attn_func(qt, qt, qt, deterministic="no")
    with pytest.raises(ValueError, match="return_softmax_lse must be a bool, got 'yes'"):
        flash_attn_func(qt, qt, qt, return_softmax_lse="yes")
    with pytest.raises(ValueError, match=r"window_left must be >= -1 \(-1 = unbounded\), got"):
        flash_attn_func(qt, qt, qt, window_size=(-2**70, 0))
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        flash_attn_func(qt.tolist(), qt, qt)
    from flash_attn_ext import set_strict
    with pytest.raises(ValueError, match="set_strict takes True, False or None, got 'false'"):
        set_strict("false")
    with pytest.raises(ValueError, match="strict must be True, False or None, got 'no'"):
        scaled_dot_product_attention(q, q, q, strict="no")


def test_numpy_bools_as_flash_attention_2_takes_them():
    # causal=np.bool_(True) was refused (new-user trial).  The FlashAttention-2 functions take
    # NumPy bools for their flags, as FlashAttention-2 does; the SDPA drop-in refuses them for
    # is_causal and enable_gqa, as PyTorch's function does; strings, None and ints stay errors.
    np = pytest.importorskip("numpy")
    from flash_attn_ext import explain, flash_attn_varlen_func, flash_attn_with_kvcache
    q, k = torch.randn(1, 7, 2, 16), torch.randn(1, 9, 2, 16)
    want = flash_attn_func(q, k, k, causal=True, deterministic=True)
    assert torch.equal(flash_attn_func(q, k, k, causal=np.bool_(True),
                                       deterministic=np.bool_(True)), want)
    assert torch.equal(flash_attn_func(q, k, k, causal=np.False_), flash_attn_func(q, k, k))
    out, lse = flash_attn_func(q, k, k, causal=np.True_, return_softmax_lse=np.True_)
    assert torch.equal(out, want) and lse.shape == (1, 2, 7)
    assert len(flash_attn_func(q, k, k, return_attn_probs=np.True_)) == 3
    cu_q, cu_k = torch.tensor([0, 7], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    varlen = flash_attn_varlen_func(q[0], k[0], k[0], cu_q, cu_k, 7, 9, causal=np.True_,
                                    deterministic=np.True_, return_attn_probs=np.False_)
    assert torch.equal(varlen, want[0])
    cached, _ = flash_attn_with_kvcache(q, k.clone(), k.clone(), causal=np.True_,
                                        rotary_interleaved=np.False_,
                                        return_softmax_lse=np.True_)
    assert torch.equal(cached, flash_attn_with_kvcache(q, k.clone(), k.clone(), causal=True))
    assert explain(q, k, k, layout="blhd", causal=np.True_, deterministic=np.True_) == \
        explain(q, k, k, layout="blhd", causal=True, deterministic=True)
    for bad in ("yes", None, 1, 0, np.int64(1), torch.tensor(True)):
        with pytest.raises(ValueError, match="causal must be a bool, got"):
            flash_attn_func(q, k, k, causal=bad)
        with pytest.raises(ValueError, match="causal must be a bool, got"):
            flash_attn_varlen_func(q[0], k[0], k[0], cu_q, cu_k, 7, 9, causal=bad)
        with pytest.raises(ValueError, match="causal must be a bool, got"):
            flash_attn_with_kvcache(q, k.clone(), k.clone(), causal=bad)
        with pytest.raises(ValueError, match="deterministic must be a bool, got"):
            flash_attn_func(q, k, k, deterministic=bad)
    qs = q.transpose(1, 2)
    for name in ("is_causal", "enable_gqa"):
        with pytest.raises(TypeError, match=f"argument '{name}' must be bool"):
            torch.nn.functional.scaled_dot_product_attention(qs, qs, qs, **{name: np.True_})
        with pytest.raises(ValueError, match=f"{name} must be a bool, got"):
            scaled_dot_product_attention(qs, qs, qs, **{name: np.True_})


def test_zero_heads_and_nested_tensors():
    q = torch.randn(2, 0, 9, 32)
    out = scaled_dot_product_attention(q, q, q)  # as PyTorch: an empty result
    assert out.shape == (2, 0, 9, 32)
    with pytest.raises(ValueError, match=r"key.size\(1\)=0 heads cannot serve"):
        scaled_dot_product_attention(torch.randn(2, 4, 9, 32), q, q, enable_gqa=True)
    nt = torch.nested.nested_tensor([torch.randn(5, 4, 16), torch.randn(3, 4, 16)],
                                    layout=torch.jagged).transpose(1, 2)
    with pytest.raises(ValueError, match="query is a nested tensor"):
        scaled_dot_product_attention(nt, nt, nt)
    import flash_attn_ext.policy as policy
    from flash_attn_ext import patch
    policy.reset_fallback_counts()
    with patch(), pytest.warns(UserWarning, match="nested"):
        out = torch.nn.functional.scaled_dot_product_attention(nt, nt, nt)
    assert out.is_nested and any("nested" in r for r in policy.fallback_counts())


def test_raw_ops_refuse_mixed_meta_arguments():
    # A meta tensor among the other arguments sends the call to the fake kernel, which must
    # refuse it rather than return uninitialised CPU memory.
    q = torch.randn(1, 8, 2, 16)
    out, lse, rng = ops.fwd(q, q, q, dropout_p=0.5)
    dout = torch.randn_like(out)
    for name, args in (("rng_state", (dout, q, q, q, out, lse, rng.to("meta"))),
                       ("out", (dout, q, q, q, out.to("meta"), lse, rng)),
                       ("dout", (dout.to("meta"), q, q, q, out, lse, rng))):
        with pytest.raises(ValueError, match=f"{name} must be on cpu, got meta"):
            ops.bwd_op(*args, None, False, -1, -1, True, 0.0, None, None, 0.5)
    with pytest.raises(ValueError, match="alibi_slopes must be on cpu, got meta"):
        torch.ops.flash_attn_ext.fwd(q, q, q, alibi_slopes=torch.ones(2, device="meta"))


def test_flash_attention_2_return_attn_probs():
    q = torch.randn(1, 9, 2, 16)
    out, lse, probs = flash_attn_func(q, q, q, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (1, 2, 9)
    assert torch.equal(out, flash_attn_func(q, q, q, causal=True, return_attn_probs=False))
    with pytest.raises(ValueError, match="return_attn_probs must be a bool"):
        flash_attn_func(q, q, q, return_attn_probs=1)
    # FlashAttention-2's 11th positional argument is return_attn_probs, as here.
    positional = flash_attn_func(q, q, q, 0.0, None, True, (-1, -1), 0.0, None, False, True)
    assert len(positional) == 3 and positional[2] is None
    assert torch.equal(positional[0], out) and torch.equal(positional[1], lse)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_is_refused_on_every_route(dtype):
    # float8 counts as floating in ATen, and calls used to run unfused in float8 with a warning
    # that nothing took them (a new-user finding); every route refuses it as it refuses int8.
    from flash_attn_ext import explain, flash_attn_func, scaled_dot_product_attention
    q = torch.randn(1, 5, 2, 8).to(dtype)
    name = str(dtype)
    with pytest.raises(ValueError, match=rf"q.dtype={name} is not supported on cpu"):
        flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match=rf"q.dtype={name} is not supported on cpu"):
        flash_attn_func(q, q, q, strict=True)
    with pytest.raises(ValueError, match=rf"q.dtype={name} is not supported on cpu"):
        explain(q, q, q, layout="blhd")
    with pytest.raises(ValueError, match=rf"query.dtype={name} is not supported"):
        scaled_dot_product_attention(*(q.transpose(1, 2),) * 3)
    # (head dims past the kernels: the drop-in's own fallback, before the op's checks)
    wide = torch.randn(1, 2, 5, 512).to(dtype)
    with pytest.raises(ValueError, match=rf"query.dtype={name} is not supported"):
        scaled_dot_product_attention(wide, wide, wide)
    # (torch.compile with dynamic shapes, where the traced check skips what sizes decide)
    torch._dynamo.reset()
    compiled = torch.compile(flash_attn_func, backend="aot_eager", dynamic=True, fullgraph=True)
    with pytest.raises(Exception, match=rf"q.dtype={name} is not supported on cpu"):
        compiled(q, q, q)


def test_nested_tensors_get_an_error_naming_the_argument():
    """Jagged nested tensors passed to the FlashAttention-2 functions: a ValueError naming the
    argument and pointing to flash_attn_varlen_func (the op's "NotImplementedError:
    flash_attn_ext.fwd.default" and slicing's "not supported for NestedTensor" named nothing; a
    new-user finding)."""
    def nested(heads=4):
        return torch.nested.nested_tensor([torch.randn(n, heads, 16) for n in (5, 9)],
                                          layout=torch.jagged)
    dense = torch.randn(2, 9, 4, 16)
    packed = torch.nested.nested_tensor([torch.randn(n, 3, 4, 16) for n in (5, 9)],
                                        layout=torch.jagged)
    offsets = torch.tensor([0, 5, 14], dtype=torch.int32)
    calls = {
        "q": lambda: flash_attn_ext.flash_attn_func(nested(), dense, dense),
        "v": lambda: flash_attn_ext.flash_attn_func(dense, dense, nested()),
        "qkv": lambda: flash_attn_ext.flash_attn_qkvpacked_func(packed),
        "kv": lambda: flash_attn_ext.flash_attn_kvpacked_func(dense, packed),
        "k": lambda: flash_attn_ext.flash_attn_varlen_func(
            torch.randn(14, 4, 16), nested(), torch.randn(14, 4, 16), offsets, offsets, 9, 9),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{name} is a nested tensor.*varlen_func"):
            call()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.complex32])
def test_complex_dtypes_are_named_as_torch_names_them(dtype):
    # A complex64 q was named "torch.complexfloat" (c10's ComplexFloat lowercased, a name torch
    # has not; a new-user finding): q, k and v of each function name it as torch users write it.
    from flash_attn_ext import flash_attn_varlen_func, flash_attn_with_kvcache
    c = torch.zeros(1, 4, 2, 8, dtype=dtype)
    real = torch.randn(1, 4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    name = str(dtype)
    assert "complexfloat" not in name and "complexdouble" not in name
    unsupported = rf"q.dtype={name} is not supported on cpu"
    with pytest.raises(ValueError, match=unsupported):
        flash_attn_func(c, c, c)
    with pytest.raises(ValueError, match=unsupported):
        flash_attn_varlen_func(c[0], c[0], c[0], cu, cu, 4, 4)
    with pytest.raises(ValueError, match=rf"got {name}$"):
        flash_attn_with_kvcache(c, c, c, cache_seqlens=4)
    for args, which in (((real, c, real), "k"), ((real, real, c), "v")):
        mixed = rf"same dtype, got q.dtype=torch.float32, .*{which}.dtype={name}"
        with pytest.raises(ValueError, match=mixed):
            flash_attn_func(*args)
        with pytest.raises(ValueError, match=mixed):
            flash_attn_varlen_func(*(t[0] for t in args), cu, cu, 4, 4)
        with pytest.raises(ValueError, match=rf"must have q's dtype, .*{name}"):
            flash_attn_with_kvcache(*args, cache_seqlens=4)
