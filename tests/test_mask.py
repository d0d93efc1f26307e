"""attn_mask (SDPA) / attn_bias (op) in the CPU and CUDA kernels, against PyTorch's own SDPA."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn_ext import ops, scaled_dot_product_attention
from reference import assert_error_rule

HAS_CUDA = torch.cuda.is_available() and ops.build_info()["cuda"]
# (device, dtype, (B, H, L, S, E, Ev)): small odd shapes everywhere; on CUDA also shapes that
# span several tiles of every kernel (the padded head dims 64/128 and 256).
CASES = [("cpu", dt, (2, 4, 37, 53, 16, 24))
         for dt in (torch.float32, torch.float64, torch.bfloat16)]
if HAS_CUDA:  # pragma: no cover - needs a GPU
    CASES += [("cuda", dt, (2, 4, 37, 53, 16, 24)) for dt in (torch.bfloat16, torch.float16)]
    CASES += [("cuda", torch.bfloat16, (2, 4, 300, 517, 128, 128)),
              ("cuda", torch.float16, (1, 2, 129, 200, 200, 256))]


def torch_math(query, key, value, mask, gqa):
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=gqa)
    return out.nan_to_num(0.0)  # rows the mask empties: PyTorch NaN, ours 0 (docs/design.md)


def torch_math_grads(inputs, dout, gqa, compute_dtype, mask=None):
    """torch_math and its gradients in compute_dtype, of inputs (query, key, value[, mask]) as
    fresh leaves; `mask`: the fixed mask where it is not among the inputs."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in inputs]
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().to(compute_dtype)
    out = torch_math(*leaves[:3], leaves[3] if len(leaves) > 3 else mask, gqa)
    return out, torch.autograd.grad(out, leaves, dout.to(compute_dtype))


MASKS = {
    "padding_bool_B11S": lambda B, H, L, S: torch.rand(B, 1, 1, S) > 0.3,
    "bool_B1LS": lambda B, H, L, S: torch.rand(B, 1, L, S) > 0.5,
    "bool_LS": lambda B, H, L, S: torch.rand(L, S) > 0.5,
    "float_1HLS": lambda B, H, L, S: torch.randn(1, H, L, S),
    "float_BHLS": lambda B, H, L, S: torch.randn(B, H, L, S),
    # rows 0, 5, ... see nothing
    "empty_rows": lambda B, H, L, S: (torch.arange(L)[:, None] % 5 != 0).expand(L, S).clone(),
}


@pytest.mark.parametrize("device,dtype,shape", CASES, ids=str)
@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("gqa", [False, True])
def test_mask_matches_torch(device, dtype, shape, name, gqa):
    B, H, L, S, E, EV = shape
    mask = MASKS[name](B, H, L, S).to(device)
    mask_grad = mask.is_floating_point()
    if mask_grad:
        mask = mask.to(dtype).requires_grad_()
    heads_kv = H // 2 if gqa else H
    query = torch.randn(B, H, L, E, dtype=dtype, device=device, requires_grad=True)
    key = torch.randn(B, heads_kv, S, E, dtype=dtype, device=device, requires_grad=True)
    value = torch.randn(B, heads_kv, S, EV, dtype=dtype, device=device, requires_grad=True)
    inputs = [query, key, value] + ([mask] if mask_grad else [])
    out = scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=gqa,
                                       strict=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)

    true, true_g = torch_math_grads(inputs, dout, gqa, torch.float64, mask)
    low, low_g = torch_math_grads(inputs, dout, gqa, dtype, mask)
    assert_error_rule(out, low, true, 2.0, "out")
    names = ["dq", "dk", "dv", "dmask"]
    for n, a, lo, t in zip(names, grads, low_g, true_g):
        assert a.shape == t.shape
        # Gradients of rows a mask empties are 0 on both sides (torch: NaN -> nan_to_num).
        assert_error_rule(a, lo.nan_to_num(0.0), t.nan_to_num(0.0), 3.0, n)


def test_mask_rows_emptied_give_zero_and_no_nan():
    query = torch.randn(1, 2, 6, 8, requires_grad=True)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    out = scaled_dot_product_attention(query, query, query, attn_mask=mask)
    assert (out[:, :, 2] == 0).all() and not torch.isnan(out).any()
    (g,) = torch.autograd.grad(out.sum(), query)
    assert not torch.isnan(g).any()


FINITE_FILLS = [("cpu", dt, fill) for dt, fill in [
    (torch.float32, -1e4), (torch.float32, -1e6), (torch.float32, -1e9),
    (torch.float32, torch.finfo(torch.float32).min), (torch.bfloat16, -1e9),
    (torch.float64, -1e300), (torch.float64, torch.finfo(torch.float64).min)]]
if HAS_CUDA:  # pragma: no cover - needs a GPU
    # (values below about -2.4e38 are -inf on CUDA, docs/reference.md: not these)
    FINITE_FILLS += [("cuda", dt, fill) for dt, fill in [
        (torch.bfloat16, -1e4), (torch.bfloat16, -1e6), (torch.bfloat16, -1e9),
        (torch.bfloat16, -1e30), (torch.float16, -1e4), (torch.float16, -65504.0)]]


@pytest.mark.parametrize("device,dtype,fill", FINITE_FILLS, ids=str)
@pytest.mark.parametrize("seqlen_k", [7, 300])
@pytest.mark.parametrize("heads_kv", [1, 4])
@pytest.mark.parametrize("mask_grad", [True, False], ids=["mask_grad", "fixed_mask"])
def test_rows_a_finite_mask_value_hides_keep_their_gradients(device, dtype, fill, seqlen_k,
                                                             heads_kv, mask_grad):
    # A row whose every key a large finite mask value hides (masked_fill(-1e9), finfo.min: a
    # padded row in older code) is the uniform average of v, forward and backward alike.  The
    # CPU backward recomputed P = exp(S - lse) from an LSE of magnitude |fill|, whose float
    # cannot carry log(S_k): that row's P came out ~S_k times too large, and so its dq, dv and
    # dmask (new-user trial).  Those rows' q is 0, so that their scores are exactly `fill` in
    # every precision and the float64 truth is the same uniform average.  MQA (heads_kv 1) splits
    # the key tiles over threads; 300 keys span several key tiles.
    torch.manual_seed(0)
    B, H, L, E, EV = 2, 4, 9, 16, 24
    query = torch.randn(B, H, L, E, dtype=dtype, device=device)
    query[0, :, [2, 7]] = 0
    query.requires_grad_()
    key = torch.randn(B, heads_kv, seqlen_k, E, dtype=dtype, device=device, requires_grad=True)
    value = torch.randn(B, heads_kv, seqlen_k, EV, dtype=dtype, device=device,
                        requires_grad=True)
    mask = torch.randn(B, 1, L, seqlen_k, dtype=dtype, device=device)
    mask[0, :, [2, 7]] = fill
    # (on an H200 a mask without gradient runs the Hopper backward's general variant, one with
    # gradient the portable backward, which writes the mask's gradient)
    mask.requires_grad_(mask_grad)
    inputs = [query, key, value] + ([mask] if mask_grad else [])
    gqa = heads_kv != H
    out = scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=gqa,
                                       strict=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)

    true, true_g = torch_math_grads(inputs, dout, gqa, torch.float64, mask)
    low, low_g = torch_math_grads(inputs, dout, gqa, dtype, mask)
    assert_error_rule(out, low, true, 2.0, "out")
    for n, a, lo, t in zip(["dq", "dk", "dv", "dmask"], grads, low_g, true_g):
        assert_error_rule(a, lo, t, 3.0, n)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("mask_grad", [True, False], ids=["mask_grad", "fixed_mask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hidden_rows_on_cuda_at_size_and_deterministic(mask_grad, dtype):
    # The CUDA backward's exact pass over rows a finite mask value hides, where it has more
    # than one window of rows (300 query rows), several key tiles (1023 keys), head dim 128, a
    # GQA group of 4, and hidden rows beside ordinary ones in every (batch, head); under
    # torch.use_deterministic_algorithms its gradients are bitwise the same run after run.
    torch.manual_seed(1)
    B, H, HKV, L, S, E = 2, 8, 2, 300, 1023, 128
    dev = "cuda"
    query = torch.randn(B, H, L, E, dtype=dtype, device=dev)
    key = torch.randn(B, HKV, S, E, dtype=dtype, device=dev)
    value = torch.randn(B, HKV, S, E, dtype=dtype, device=dev)
    mask = torch.randn(B, 1, L, S, dtype=dtype, device=dev)
    hidden = torch.tensor([0, 1, 7, 150, 255, 256, 299], device=dev)
    query[:, :, hidden] = 0  # scores exactly the fill: the float64 truth is the uniform average
    mask[:, :, hidden] = -1e9 if dtype == torch.bfloat16 else -65504.0
    inputs = [t.requires_grad_() for t in (query, key, value)]
    if mask_grad:
        inputs.append(mask.requires_grad_())
    dout = torch.randn(B, H, L, E, dtype=dtype, device=dev)
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            out = scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True,
                                               strict=True)
            runs.append(torch.autograd.grad(out, inputs, dout))
    finally:
        torch.use_deterministic_algorithms(False)
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert torch.equal(a, b)
    true, true_g = torch_math_grads(inputs, dout, True, torch.float64, mask)
    low, low_g = torch_math_grads(inputs, dout, True, dtype, mask)
    assert_error_rule(out, low, true, 2.0, "out")
    for n, a, lo, t in zip(["dq", "dk", "dv", "dmask"], runs[0], low_g, true_g):
        assert_error_rule(a, lo, t, 3.0, n)


def test_bias_op_opcheck():
    q = torch.randn(2, 9, 4, 16, requires_grad=True)
    k = torch.randn(2, 13, 2, 16, requires_grad=True)
    bias = torch.randn(2, 1, 9, 13, requires_grad=True)
    torch.library.opcheck(ops.fwd_op, (q, k, k, None, False, -1, -1, True, 0.0, None, bias, 0.0,
                                       False))
    q, k, bias = q.detach(), k.detach(), bias.detach()  # bwd has no backward of its own
    out, lse, rng = ops.fwd(q, k, k, None, True, -1, -1, True, 0.0, None, bias)
    torch.library.opcheck(ops.bwd_op, (torch.randn_like(out), q, k, k, out, lse, rng, None, True,
                                       -1, -1, True, 0.0, None, bias, 0.0, False, True))


def test_mask_under_compile():
    torch._dynamo.reset()
    query = torch.randn(2, 4, 17, 8, requires_grad=True)
    mask = torch.rand(2, 1, 1, 17) > 0.2

    def f(q):
        return scaled_dot_product_attention(q, q, q, attn_mask=mask)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(query)
    out.sum().backward()
    assert torch.allclose(out, f(query), atol=1e-6)


def test_mask_errors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="not broadcastable"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool or floating"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("layout", ["rows_expanded", "keys_padding", "dense"])
def test_boolean_attn_bias_of_the_op_equals_its_additive_form(layout):
    # The op takes a boolean attn_bias (True = attend) itself: the CPU kernels read its bytes
    # through its strides (an expanded, stride-0 dimension staying one), hiding the scores the
    # additive 0 / -inf form hides: the result equals that form's bitwise, and a boolean mask
    # has no gradient (bias_requires_grad=True is refused).
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 24, dtype=torch.float64) for n in (33, 50, 50))
    if layout == "rows_expanded":
        mask = (torch.rand(2, 1, 33, 1) < 0.7).expand(2, 1, 33, 50)
    elif layout == "keys_padding":
        mask = torch.arange(50)[None, None, None, :] < torch.tensor([50, 17])[:, None, None, None]
    else:
        mask = torch.rand(2, 4, 33, 50) < 0.6
    bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    out, lse, _ = ops.fwd(q, k, v, None, False, -1, -1, True, 0.0, None, mask)
    ref, ref_lse, _ = ops.fwd(q, k, v, None, False, -1, -1, True, 0.0, None, bias)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    grads = ops.bwd_op(dout, q, k, v, out, lse, torch.zeros(2, dtype=torch.int64), None, False,
                       -1, -1, True, 0.0, None, mask, 0.0, False, False)
    ref_grads = ops.bwd_op(dout, q, k, v, out, lse, torch.zeros(2, dtype=torch.int64), None,
                           False, -1, -1, True, 0.0, None, bias, 0.0, False, False)
    for a, b in zip(grads[:3], ref_grads[:3]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="a mask has no gradient"):
        ops.bwd_op(dout, q, k, v, out, lse, torch.zeros(2, dtype=torch.int64), None, False, -1,
                   -1, True, 0.0, None, mask, 0.0, False, True)
