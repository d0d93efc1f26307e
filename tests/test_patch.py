"""flash_attn_ext.patch(): existing modules that call F.scaled_dot_product_attention use ours."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import flash_attn_ext
from flash_attn_ext import policy


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, mask=None, dropout_p=0.0):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask,
                                             dropout_p=dropout_p, is_causal=mask is None)
        return out.transpose(1, 2).reshape(b, n, d)


def test_patch_routes_and_undoes():
    original = F.scaled_dot_product_attention
    model = TinyAttention()
    x = torch.randn(2, 11, 32)
    ref = model(x)
    with flash_attn_ext.patch():
        assert flash_attn_ext.is_patched()
        policy._last_plan = None
        out = model(x)
        assert flash_attn_ext.last_plan().kernel == "cpu_flash_fwd_fp32"
        mask = torch.rand(2, 1, 1, 11) > 0.3
        out_masked = model(x, mask=mask)
    assert F.scaled_dot_product_attention is original and not flash_attn_ext.is_patched()
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(out_masked, model(x, mask=mask), atol=1e-5)
    handle = flash_attn_ext.patch()
    assert flash_attn_ext.is_patched()
    handle.undo()
    assert F.scaled_dot_product_attention is original


def test_patch_runs_dropout_fused_and_falls_back_visibly_for_unknown_arguments():
    policy.reset_fallback_counts()
    model = TinyAttention()
    x = torch.randn(1, 5, 32)
    with flash_attn_ext.patch():
        policy.set_strict(True)
        try:
            torch.manual_seed(3)
            first = model(x, dropout_p=0.3)
            torch.manual_seed(3)
            assert torch.equal(model(x, dropout_p=0.3), first)  # reproducible, fused
        finally:
            policy.set_strict(None)
    q = torch.randn(5, 8)  # 2-D: PyTorch's function takes it, ours does not
    with flash_attn_ext.patch(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = F.scaled_dot_product_attention(q, q, q)
    assert out.shape == q.shape
    assert any("query.dim()=2" in str(w.message) for w in caught)
    q = torch.randn(1, 1, 2, 5, 8)  # 5-D: ours, fused (strict mode would raise otherwise)
    with flash_attn_ext.patch():
        policy.set_strict(True)
        try:
            out = F.scaled_dot_product_attention(q, q, q)
        finally:
            policy.set_strict(None)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))


def test_patch_handles_undone_in_any_order():
    original = F.scaled_dot_product_attention
    h1 = flash_attn_ext.patch()
    h2 = flash_attn_ext.patch()
    h1.undo()
    assert flash_attn_ext.is_patched()  # h2 is still live
    h2.undo()
    assert F.scaled_dot_product_attention is original and not flash_attn_ext.is_patched()
    h2.undo()  # idempotent
    assert F.scaled_dot_product_attention is original


def test_patch_handles_from_many_threads_restore_the_original():
    # Made and undone concurrently, the handles must leave PyTorch's function in place at the
    # end (without a lock one thread could record the patched function as "the original").
    import sys
    import threading
    original = torch.nn.functional.scaled_dot_product_attention
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # makes a race frequent
    try:
        def worker():
            for _ in range(300):
                flash_attn_ext.patch().undo()

        for _ in range(5):
            threads = [threading.Thread(target=worker) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert torch.nn.functional.scaled_dot_product_attention is original
    finally:
        sys.setswitchinterval(interval)
        flash_attn_ext.unpatch()


def test_torchscript_under_patch_uses_pytorchs_operator():
    import pickle
    x = torch.randn(5, 1, 8)
    with flash_attn_ext.patch():
        mha = torch.nn.MultiheadAttention(8, 2)
        scripted = torch.jit.script(mha)
        assert torch.allclose(scripted(x, x, x)[0], mha(x, x, x)[0], atol=1e-6)
        pickle.dumps(torch.nn.functional.scaled_dot_product_attention)  # picklable by name
    torch.jit.script(torch.nn.TransformerEncoderLayer(8, 2))  # scripting still works after


def test_patch_hands_broadcasting_calls_to_pytorch():
    # PyTorch's function broadcasts key and value against query (a batch or head count of 1,
    # fewer dimensions); the drop-in refuses them (ValueError), so under patch() a model that
    # relied on it broke (new-user trial).  Those calls now go to PyTorch's function, reported
    # as a fallback (warned once, counted, refused in strict mode); grouped heads with
    # enable_gqa stay ours, and a mismatch that does not broadcast still raises ours.
    q = torch.randn(4, 8, 16, 32)
    cases = {"batch of 1": torch.randn(1, 8, 16, 32), "one head": torch.randn(4, 1, 16, 32),
             "3-D": torch.randn(8, 16, 32)}
    policy.reset_fallback_counts()
    with flash_attn_ext.patch():
        for name, kv in cases.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
            want = torch.nn.functional.softmax(
                (q @ kv.transpose(-1, -2) / 32 ** 0.5).masked_fill(
                    torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")), -1) @ kv
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, msg=name)
            assert all(w.filename == __file__ for w in caught
                       if "falling back" in str(w.message)), name
            # (last_plan() named the previous call's fused kernels after such a call)
            plan = flash_attn_ext.last_plan()
            assert not plan.fused and "broadcast" in str(plan), (name, plan)
            assert "original torch.nn.functional" in plan.kernel, (name, plan)
        counts = policy.fallback_counts()
        assert sum(counts.values()) == 3 and all("broadcast" in r for r in counts), counts
        policy.set_strict(True)
        try:
            with pytest.raises(flash_attn_ext.FallbackError, match="broadcast"):
                F.scaled_dot_product_attention(q, cases["one head"], cases["one head"])
            kv = torch.randn(4, 2, 16, 32)  # grouped heads: ours, fused
            out = F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            kv4 = kv.repeat_interleave(4, 1)  # (each key/value head serves 4 query heads)
            want = torch.nn.functional.softmax(q @ kv4.transpose(-1, -2) / 32 ** 0.5, -1) @ kv4
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        finally:
            policy.set_strict(None)
        with pytest.raises(ValueError, match="heads"):  # (no enable_gqa: ours, its error)
            F.scaled_dot_product_attention(q, kv, kv)
    policy.reset_fallback_counts()


@pytest.mark.parametrize("shape", [(1, 2, 16, 32), (2, 16, 32), (1, 1, 16, 32)],
                         ids=["batch of 1", "3-D", "batch and head of 1"])
def test_patch_hands_grouped_heads_that_broadcast_to_pytorch(shape):
    # enable_gqa with key / value whose batch broadcasts (or fewer dimensions): the head counts
    # 2 and 8 do not broadcast, so the check took these for the drop-in's, which refused them
    # (ValueError); PyTorch's function takes them (new-user trial).  Now a reported fallback,
    # equal to PyTorch's result.
    q = torch.randn(4, 8, 16, 32, dtype=torch.float64)
    kv = torch.randn(*shape, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    policy.reset_fallback_counts()
    with flash_attn_ext.patch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    torch.testing.assert_close(out, want)
    counts = policy.fallback_counts()
    assert sum(counts.values()) == 1 and all("broadcast" in r for r in counts), counts
    policy.reset_fallback_counts()


def test_patch_hands_grouped_heads_of_unequal_counts_to_pytorch():
    # enable_gqa with key and value of different head counts, each dividing query's: PyTorch's
    # function takes it, the drop-in refuses it (one KV head count), so under patch() it was a
    # ValueError (new-user trial).  Now a reported fallback, equal to PyTorch's result; strict
    # mode refuses it by that reason.
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 8, dtype=torch.float64)
    v = torch.randn(2, 1, 9, 8, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    policy.reset_fallback_counts()
    with flash_attn_ext.patch():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(out, want)
        counts = policy.fallback_counts()
        assert sum(counts.values()) == 1 and all("head counts (2 and 1)" in r for r in counts), \
            counts
        assert not flash_attn_ext.last_plan().fused
        policy.set_strict(True)
        try:
            with pytest.raises(flash_attn_ext.FallbackError, match="different head counts"):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        finally:
            policy.set_strict(None)
    policy.reset_fallback_counts()


def test_patch_hands_torch_func_gradient_transforms_to_pytorch():
    # Code that takes torch.func.grad (or vjp) of SDPA works unpatched; the drop-in refuses
    # those transforms, so under patch() such calls go to PyTorch's function, reported (a
    # new-user trial found them raising NotImplementedError).
    q = torch.randn(2, 2, 5, 8, dtype=torch.float64)

    def f(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()
    want = torch.func.grad(f)(q)
    want_value = f(q)  # PyTorch's, before the patch
    policy.reset_fallback_counts()
    with flash_attn_ext.patch(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.func.grad(f)(q)
        _, vjp = torch.func.vjp(f, q)
        got_vjp, = vjp(torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_vjp, want)
    assert any("gradient transforms" in str(w.message) for w in caught)
    assert sum(policy.fallback_counts().values()) >= 2
    with flash_attn_ext.patch():  # outside a transform: ours, fused, against PyTorch's
        policy.set_strict(True)
        try:
            torch.testing.assert_close(f(q), want_value)
            assert flash_attn_ext.last_plan().kernel.startswith("cpu_flash_fwd")
        finally:
            policy.set_strict(None)


def test_a_patch_handle_entered_again_patches_again():
    # The handle is live from patch() on; `with` on a handle that was undone (by its own
    # earlier `with`, .undo() or unpatch()) makes it live again, not a silent no-op.
    original = F.scaled_dot_product_attention
    handle = flash_attn_ext.patch()
    with handle:
        assert flash_attn_ext.is_patched()
    assert F.scaled_dot_product_attention is original
    with handle:
        assert flash_attn_ext.is_patched()
    assert F.scaled_dot_product_attention is original
    handle = flash_attn_ext.patch()
    flash_attn_ext.unpatch()
    with handle:
        assert flash_attn_ext.is_patched()
    assert F.scaled_dot_product_attention is original


@pytest.mark.parametrize("bad", ["query", "key", "value"])
def test_patch_raises_typeerror_for_a_non_tensor_as_pytorch_does(bad):
    """A list where a tensor belongs: PyTorch's function raises TypeError, and so does the
    patched one (it read query.dim() first and raised AttributeError): PyTorch's own."""
    args = {name: torch.randn(1, 2, 5, 8) for name in ("query", "key", "value")}
    args[bad] = [1.0]
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(args["query"], args["key"], args["value"])
    with flash_attn_ext.patch(), pytest.raises(TypeError, match=bad):
        F.scaled_dot_product_attention(args["query"], args["key"], args["value"])


def test_torch_fx_traces_a_module_under_patch():
    """torch.fx.symbolic_trace passes Proxies, not tensors: the patched function hands them to
    PyTorch's, which records the call (the drop-in raised TypeError for a Proxy); the traced
    module runs on whatever the function is when it is called."""
    model = TinyAttention()
    x, mask = torch.randn(2, 11, 32), torch.rand(2, 1, 1, 11) > 0.3
    with flash_attn_ext.patch():
        # (a mask: the trace fixes is_causal=mask is None for a Proxy mask, as False)
        traced = torch.fx.symbolic_trace(model)
        assert torch.allclose(traced(x, mask), model(x, mask), atol=1e-5)
    assert any(node.target is F.scaled_dot_product_attention or
               getattr(node.target, "__name__", "") == "scaled_dot_product_attention"
               for node in traced.graph.nodes)


def test_compiled_multihead_attention_with_dynamic_shapes_under_patch():
    """torch.compile(dynamic=True) of nn.MultiheadAttention in training mode: Dynamo records
    F.multi_head_attention_forward as one node and runs it on fake tensors with the module's
    dropout as a symbolic float, which the drop-in takes as PyTorch's function does (it raised
    "dropout_p must be a number" for a SymFloat; a new-user finding).  With dropout 0 the
    compiled module under patch() equals the eager one unpatched, forward and gradients."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True, dropout=0.0).train()
    x = torch.randn(2, 9, 16, requires_grad=True)
    ref = mha(x, x, x, need_weights=False)[0]
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(mha, dynamic=True, backend="aot_eager")
    with flash_attn_ext.patch():
        out = compiled(x, x, x, need_weights=False)[0]
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        # dropout 0.1 traces too (a symbolic float compared and read as a number)
        mha.dropout = 0.1
        torch._dynamo.reset()
        dropped = torch.compile(mha, dynamic=True, backend="aot_eager")(x, x, x,
                                                                         need_weights=False)[0]
    mha.dropout = 0.0
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=2e-5, rtol=1e-5)
    assert dropped.shape == ref.shape and torch.isfinite(dropped).all()


def test_patch_keeps_the_backends_sdpa_kernel_pins():
    """Code that pins PyTorch's backends with sdpa_kernel (the math backend for a double
    backward) keeps them under patch(): with the flash backend disabled the patched function
    hands the call to PyTorch's, a reported fallback (it ran ours, whose double backward
    raises; a new-user finding).  Outside the context, ours again."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64, requires_grad=True)
    with sdpa_kernel([SDPBackend.MATH]):
        expected = torch.autograd.grad(
            torch.autograd.grad(F.scaled_dot_product_attention(q, q, q).square().sum(), q,
                                create_graph=True)[0].sum(), q)[0]
    with flash_attn_ext.patch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, q, q)
            plan = flash_attn_ext.last_plan()
            (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
            (gg,) = torch.autograd.grad(g.sum(), q)
        assert not plan.fused and "flash backend is disabled" in " ".join(plan.reasons), plan
        F.scaled_dot_product_attention(q, q, q)
        assert flash_attn_ext.last_plan().kernel.startswith("cpu_flash"), \
            flash_attn_ext.last_plan()
    torch.testing.assert_close(gg, expected)


@pytest.mark.parametrize("mask", [None, "bool3", "float2"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_three_dimensional_grouped_heads_as_pytorch(mask, is_causal):
    """3-D inputs with enable_gqa whose first sizes differ are PyTorch's heads and KV heads,
    (H, L, E) against (H_kv, S, E): the drop-in and patch() group them as PyTorch's function
    does (both raised "must have the same batch size"; a new-user finding), forward and
    gradients against PyTorch's math in float64."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 7, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    attn_mask = None
    if mask == "bool3":
        attn_mask = torch.rand(4, 9, 7, generator=gen) > 0.3
        attn_mask[..., 0] = True
    elif mask == "float2":
        attn_mask = torch.randn(9, 7, generator=gen, dtype=torch.float64)
    if is_causal and attn_mask is not None:
        pytest.skip("PyTorch's math backend refuses a mask with is_causal")
    kw = dict(attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for fn in ("drop-in", "patched"):
        if fn == "drop-in":
            out = flash_attn_ext.scaled_dot_product_attention(q, k, v, **kw)
        else:
            with flash_attn_ext.patch():
                out = F.scaled_dot_product_attention(q, k, v, **kw)
        assert out.shape == ref.shape == (4, 9, 8)
        torch.testing.assert_close(out, ref)
        for g, r in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), ref_grads):
            torch.testing.assert_close(g, r)


def test_three_dimensional_grouped_heads_explained_and_masks_checked():
    """explain() plans 3-D grouped heads as the call runs them (it raised the batch-size
    error the call no longer raises); a 4-D mask against them gets the mask-shape error,
    as PyTorch's function refuses it (it broadcast against the (1, H, L, S) the call runs; a
    review's findings)."""
    q, k, v = torch.randn(4, 5, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    plan = flash_attn_ext.explain(q, k, v, enable_gqa=True)
    assert plan.fused and plan.kernel.startswith("cpu_flash"), plan
    mask = torch.ones(1, 4, 5, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(1, 4, 5, 6\) is not broadcast"):
        flash_attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with pytest.raises(RuntimeError):  # PyTorch's own refusal
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
