"""The op layer: pinned schemas, opcheck, autograd registration, torch.compile, double backward."""

import itertools

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import flash_attn_func, ops, scaled_dot_product_attention
from reference import assert_bwd_fake_strides_match, attention_ref

EXPECTED_SCHEMAS = {
    "fwd": (
        "flash_attn_ext::fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, "
        "bool causal=False, int window_left=-1, int window_right=-1, "
        "bool align_bottom_right=True, float softcap=0., Tensor? alibi_slopes=None, "
        "Tensor? attn_bias=None, float dropout_p=0., bool deterministic=False) "
        "-> (Tensor out, Tensor softmax_lse, Tensor rng_state)"),
    "bwd": (
        "flash_attn_ext::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor softmax_lse, Tensor rng_state, float? softmax_scale=None, bool causal=False, "
        "int window_left=-1, int window_right=-1, bool align_bottom_right=True, "
        "float softcap=0., Tensor? alibi_slopes=None, Tensor? attn_bias=None, "
        "float dropout_p=0., bool deterministic=False, bool bias_requires_grad=False, "
        "Tensor? dsoftmax_lse=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_SCHEMAS))
def test_schema_is_pinned(name):
    # Schema evolution adds arguments at the end with defaults; change this test only that way.
    assert str(getattr(torch.ops.flash_attn_ext, name).default._schema) == EXPECTED_SCHEMAS[name]


FLAG_GRID = list(itertools.product(
    [False, True],                      # causal
    [(-1, -1), (3, 2)],                 # window
    [True, False],                      # align_bottom_right
    [0.0, 3.0],                         # softcap
))


@pytest.mark.parametrize("causal,window,br,softcap", FLAG_GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_fwd(causal, window, br, softcap, dtype):
    q = torch.randn(2, 9, 4, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 13, 2, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 13, 2, 8, dtype=dtype, requires_grad=True)
    args = (q, k, v, None, causal, window[0], window[1], br, softcap, None, None, 0.0, False)
    torch.library.opcheck(ops.fwd_op, args)


@pytest.mark.parametrize("causal,window,br,softcap", FLAG_GRID[::3])
def test_opcheck_bwd(causal, window, br, softcap):
    q, k, v = torch.randn(1, 7, 2, 8), torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 4)
    out, lse, rng = ops.fwd(q, k, v, None, causal, window[0], window[1], br, softcap)
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, rng, None, causal, window[0], window[1], br, softcap, None,
            None, 0.0, False, False)
    torch.library.opcheck(ops.bwd_op, args)


def _laid_out(layout, *shape):
    """A (batch, seqlen, heads, head_dim) tensor of random values in one of the memory layouts
    callers hand the ops: contiguous; a (batch, heads, seqlen, head_dim) tensor transposed (the
    SDPA drop-in's view); sliced from a wider head dim (not dense); every other element of the
    last dimension (not last-dim contiguous)."""
    b, s, h, d = shape
    if layout == "contiguous":
        return torch.randn(b, s, h, d)
    if layout == "bhsd":
        return torch.randn(b, h, s, d).transpose(1, 2)
    if layout == "sliced":
        return torch.randn(b, s, h, d + 3)[..., :d]
    return torch.randn(b, s, h, 2 * d)[..., ::2]


@pytest.mark.parametrize("layout", ["contiguous", "bhsd", "sliced", "strided_last_dim"])
def test_opcheck_bwd_input_layouts(layout):
    # The fake bwd kernel must give dq, dk, dv the real kernels' strides (like q, k, v where the
    # kernel takes them as they are): torch.compile's inductor asserts them at run time, and a
    # mismatch made every compiled SDPA-drop-in backward fail.
    q, k, v = _laid_out(layout, 2, 7, 2, 8), _laid_out(layout, 2, 5, 1, 8), _laid_out(
        layout, 2, 5, 1, 8)
    out, lse, rng = ops.fwd(q, k, v, None, True)
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, rng, None, True, -1, -1, True, 0.0, None, None, 0.0, False,
            False)
    torch.library.opcheck(ops.bwd_op, args)
    assert_bwd_fake_strides_match(ops.bwd_op, args)
    if layout == "bhsd":  # dense: laid out like the input, so autograd keeps it without a copy
        assert ops.bwd_op(*args)[0].stride() == q.stride()


def test_double_backward_raises_clearly():
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64, requires_grad=True)
    out = flash_attn_func(q, q, q)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


@pytest.mark.parametrize("causal,window,softcap,gqa,bias,use_out", [
    (False, (-1, -1), 0.0, False, False, True), (True, (-1, -1), 0.0, True, False, True),
    (False, (3, 2), 0.0, False, False, True), (False, (-1, -1), 5.0, False, True, True),
    (True, (-1, -1), 0.0, False, True, False)])
def test_lse_gradient_matches_reference(causal, window, softcap, gqa, bias, use_out):
    # Merging attention chunks (ring attention, split-KV) differentiates through softmax_lse.
    dt = torch.float64
    q = torch.randn(2, 9, 4, 8, dtype=dt, requires_grad=True)
    k = torch.randn(2, 13, 2 if gqa else 4, 8, dtype=dt, requires_grad=True)
    v = torch.randn(2, 13, 2 if gqa else 4, 6, dtype=dt, requires_grad=True)
    b = torch.randn(2, 1, 9, 13, dtype=dt, requires_grad=True) if bias else None
    w_out, w_lse = torch.randn(2, 9, 4, 6, dtype=dt), torch.randn(2, 4, 9, dtype=dt)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1], softcap=softcap)
    out, lse, _ = ops.fwd(q, k, v, None, causal, window[0], window[1], True, softcap, None, b)
    ref_out, ref_lse = attention_ref(q, k, v, attn_bias=b, **kw)
    finite = torch.isfinite(ref_lse)
    leaves = [q, k, v] + ([b] if bias else [])

    def loss(o, s):
        total = (torch.where(finite, s, 0) * w_lse).sum()
        return total + (o * w_out).sum() if use_out else total

    ours = torch.autograd.grad(loss(out, lse), leaves)
    theirs = torch.autograd.grad(loss(ref_out, ref_lse), leaves, allow_unused=True)
    for name, a, t, x in zip(("dq", "dk", "dv", "dbias"), ours, theirs, leaves):
        t = torch.zeros_like(x) if t is None else t  # lse alone does not depend on v
        assert torch.isfinite(a).all() and (a - t).abs().max().item() < 1e-9, name


def test_lse_gradient_gradcheck():
    q, k, v = (torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.autograd.gradcheck(lambda q, k, v: ops.fwd(q, k, v, None, True)[1], (q, k, v))
    torch.autograd.gradcheck(
        lambda q, k, v: [t.sum() for t in ops.fwd(q, k, v, None, False)[:2]], (q, k, v))


def _train_step(fn, q, k, v):
    out = fn(q, k, v)
    loss = (out.float() ** 2).sum()
    loss.backward()
    return out


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_and_backward(backend):
    torch._dynamo.reset()

    def fn(q, k, v):
        a = flash_attn_func(q, k, v, causal=True)
        b = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
        return a + b.transpose(1, 2)

    _assert_compiled_training_matches(fn, backend, [torch.randn(2, 33, h, 16) for h in (4, 2, 2)])


def _assert_compiled_training_matches(fn, backend, inputs):
    """fn compiled (fullgraph) gives eager fn's output and input gradients."""
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    leaves = [x.clone().requires_grad_() for x in inputs]
    leaves_ref = [x.clone().requires_grad_() for x in inputs]
    out = _train_step(compiled, *leaves)
    out_ref = _train_step(fn, *leaves_ref)
    assert torch.allclose(out, out_ref, atol=1e-5)
    for a, b in zip(leaves, leaves_ref):
        assert torch.allclose(a.grad, b.grad, atol=1e-4)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_sdpa_drop_in_backward_plain_inputs(backend):
    # The SDPA drop-in as most code calls it: contiguous (batch, heads, seqlen, head_dim)
    # tensors, which reach the op as transposed views (inductor checks the fake kernel's
    # strides of dq, dk, dv against the real ones).
    torch._dynamo.reset()

    def fn(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True)

    _assert_compiled_training_matches(fn, backend, [torch.randn(2, 3, 17, 8) for _ in range(3)])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_checkpointed_dropout_recomputes_the_same_mask(backend):
    # Activation checkpointing recomputes the forward in the backward; compiled, the partitioner
    # replays the generator state only for ops tagged nondeterministic_seeded (the fwd op is),
    # else the recomputation draws another dropout mask and the gradients are of that mask.
    from torch.utils.checkpoint import checkpoint
    torch._dynamo.reset()

    def attn(q, k, v):
        return scaled_dot_product_attention(q.sin(), k, v, dropout_p=0.5)

    inputs = [torch.randn(1, 2, 8, 16) for _ in range(3)]

    def grads(fn):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        torch.manual_seed(3)
        out = fn(q, k, v)
        (out * torch.arange(out.numel()).view(out.shape)).sum().backward()
        return out, q.grad

    out_ref, dq_ref = grads(attn)
    compiled = torch.compile(lambda q, k, v: checkpoint(attn, q, k, v, use_reentrant=False),
                             backend=backend, fullgraph=True)
    out, dq = grads(compiled)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(dq, dq_ref, atol=1e-3, rtol=1e-4)
    assert torch.Tag.nondeterministic_seeded in ops.fwd_op.tags


def test_compile_dynamic_shapes_static_mask():
    # A learned (1, H, L, L) bias: Dynamo keeps a parameter's shape static while the inputs'
    # are symbolic; the mask's broadcast check must still see them equal.
    torch._dynamo.reset()

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(1, 2, 6, 6))

        def forward(self, q, k, v):
            return scaled_dot_product_attention(q, k, v, attn_mask=self.bias)

    module = Biased()
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), module(q, k, v))


def test_compile_checks_arguments_of_calls_no_kernel_serves():
    # A call the kernels refuse (here head_dim 300, which eager flash_attn_func rejects with
    # ValueError) must not run silently on the fallback path when compiled: the checks run
    # while the graph is traced (Dynamo wraps the ValueError).
    torch._dynamo.reset()
    q = torch.randn(1, 4, 2, 300)
    compiled = torch.compile(lambda q: flash_attn_func(q, q, q), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(Exception, match="head_dim must be between 1 and 256"):
        compiled(q)


def test_compile_dynamic_shapes_no_graph_break():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    compiled = torch.compile(lambda q: flash_attn_func(q, q, q, causal=True), fullgraph=True,
                             backend="aot_eager", dynamic=True)
    for seqlen in (8, 13, 21):
        q = torch.randn(1, seqlen, 2, 8, requires_grad=True)
        out = compiled(q)
        out.sum().backward()
        assert out.shape == q.shape
    assert not counters["graph_break"]


def test_compile_symbolic_scale_no_graph_break():
    # A scale computed from a dynamic size (or changed between calls) is a symbolic float
    # under torch.compile: the check's math.isfinite could not be traced (new-user trial).
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    sdpa = torch.compile(lambda q: scaled_dot_product_attention(q, q, q,
                                                                scale=q.size(-1) ** -0.5),
                         fullgraph=True, backend="aot_eager", dynamic=True)
    fa = torch.compile(lambda q, s: flash_attn_func(q, q, q, softmax_scale=s), fullgraph=True,
                       backend="aot_eager")
    for seqlen, head_dim, s in ((8, 16, 0.1), (13, 24, 0.2), (21, 8, 0.3)):
        q = torch.randn(1, 2, seqlen, head_dim)
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        assert torch.allclose(sdpa(q), ref, atol=1e-5)
        qb = q.transpose(1, 2)
        assert torch.allclose(fa(qb, s), flash_attn_func(qb, qb, qb, softmax_scale=s), atol=1e-6)
    assert not counters["graph_break"]


def test_compile_fullgraph_inside_activation_checkpointing():
    # Dynamo refuses side effects inside a higher-order op such as checkpoint: tracing must not
    # write module state (it did: the last plan), or fullgraph=True fails.
    from torch.utils.checkpoint import checkpoint
    torch._dynamo.reset()
    flash_attn_ext.policy._last_plan = None

    def block(q):
        return scaled_dot_product_attention(q, q, q, is_causal=True)

    compiled = torch.compile(lambda q: checkpoint(block, q, use_reentrant=False),
                             fullgraph=True, backend="aot_eager")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    q_ref = q.detach().clone().requires_grad_()
    out = compiled(q)
    out.sum().backward()
    ref = block(q_ref)
    ref.sum().backward()
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(q.grad, q_ref.grad, atol=1e-5)
    assert flash_attn_ext.last_plan().kernel == "cpu_flash_fwd_fp32"  # the eager call's


def test_build_info_and_version():
    info = ops.build_info()
    assert info["version"] == flash_attn_ext.__version__
    assert info["cpu"] is True and isinstance(info["cuda"], bool)


def _expanded_kv(kind, seqlen, dim, device, dtype):
    """(leaf, k): k of shape (1, seqlen, 2, dim) expanded over its heads (stride 0) from leaf.
    "batch_last": the leaf's storage puts the batch innermost (k's strides (1, dim, 0, 1));
    "plain": an ordinary (1, seqlen, 1, dim) leaf (strides (seqlen * dim, dim, 0, 1))."""
    if kind == "batch_last":
        leaf = torch.randn(seqlen, dim, 1, device=device, dtype=dtype, requires_grad=True)
        return leaf, leaf.permute(2, 0, 1).unsqueeze(2).expand(1, seqlen, 2, dim)
    leaf = torch.randn(1, seqlen, 1, dim, device=device, dtype=dtype, requires_grad=True)
    return leaf, leaf.expand(1, seqlen, 2, dim)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("kind", ["batch_last", "plain"])
def test_expanded_inputs_get_the_gradients_of_their_copies(device, kind):
    # An input expanded (stride 0) over its heads is not dense: empty_like of it ordered the
    # gradient's dimensions by stride and put the heads inside the head dim, so the kernels'
    # rows overwrote each other and dk/dv came back wrong while the forward was right.
    if device == "cuda" and not ops.build_info()["cuda"]:
        pytest.skip("a build without CUDA kernels")
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    seqlen, dim = 112, 32
    leaf_k, k = _expanded_kv(kind, seqlen, dim, device, dtype)
    leaf_v, v = _expanded_kv(kind, seqlen, dim, device, dtype)
    q = torch.randn(1, 14, 4, dim, device=device, dtype=dtype, requires_grad=True)
    dk, dv = torch.autograd.grad(flash_attn_func(q, k, v).sum(), (leaf_k, leaf_v))
    k2, v2 = (x.detach().contiguous().requires_grad_() for x in (k, v))
    dk2, dv2 = torch.autograd.grad(flash_attn_func(q, k2, v2).sum(), (k2, v2))
    tol = 1e-10 if dtype == torch.float64 else 2e-2
    for got, full, leaf in ((dk, dk2, leaf_k), (dv, dv2, leaf_v)):
        want = full.sum(2, keepdim=True)  # the expand's backward sums over the heads
        want = want.view(leaf.shape) if kind == "plain" else want.view(seqlen, dim, 1)
        assert torch.isfinite(got).all()
        err = (got.float() - want.float()).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), err
    args = (torch.ones(1, 14, 4, dim, device=device, dtype=dtype), q.detach(), k.detach(),
            v.detach(), *ops.fwd(q.detach(), k.detach(), v.detach())[:2],
            torch.zeros(2, dtype=torch.int64, device=device))
    assert_bwd_fake_strides_match(ops.bwd_op, args)
