"""Under torch.autocast, float32 inputs run the low-precision kernels, as SDPA does."""

import pytest
import torch
import torch.nn.functional as F

from flash_attn_ext import flash_attn_func, last_plan, ops, scaled_dot_product_attention
from reference import assert_error_rule


def test_autocast_cpu_bf16_matches_explicit_cast_and_sdpa_dtype():
    q, k, v = (torch.randn(2, 4, 33, 16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == theirs.dtype == torch.bfloat16
    assert last_plan().kernel == "cpu_flash_fwd_bf16"
    explicit = scaled_dot_product_attention(*(t.detach().bfloat16() for t in (q, k, v)),
                                            is_causal=True)
    assert torch.equal(out, explicit)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_autocast_casts_as_sdpa_does():
    # Autocast off: inputs untouched.  On: every floating input but float64 runs in the
    # autocast dtype (mixed q/k/v dtypes included), float64 stays, as PyTorch's SDPA.
    q = torch.randn(1, 9, 2, 8)
    assert flash_attn_func(q, q, q).dtype == torch.float32
    qs = q.transpose(1, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = q.half()
        assert flash_attn_func(h, h, h).dtype == torch.bfloat16
        d = q.double()
        assert flash_attn_func(d, d, d).dtype == torch.float64
        for args in ((qs.bfloat16(), qs, qs), (qs, qs.bfloat16(), qs.half()),
                     (qs.half(), qs.half(), qs.half())):
            out = scaled_dot_product_attention(*args)
            assert out.dtype == F.scaled_dot_product_attention(*args).dtype == torch.bfloat16
            assert torch.equal(out, scaled_dot_product_attention(
                *(t.bfloat16() for t in args)))
        d = qs.double()
        assert scaled_dot_product_attention(d, d, d).dtype == torch.float64
        assert last_plan().kernel == "cpu_flash_fwd_fp64"


def test_autocast_dtype_error_names_the_dtypes_passed():
    # Under autocast a float64 q with float32 k and v runs as float64 against bfloat16: refused,
    # naming the dtypes the user passed and the ones autocast made of them (the op alone would
    # name only the cast ones), in the FlashAttention API as in the SDPA drop-in.
    import flash_attn_ext
    q, k = torch.randn(2, 6, 4, 8, dtype=torch.float64), torch.randn(2, 6, 4, 8)
    want = (r"q\.dtype=torch\.float64, k\.dtype=torch\.float32, v\.dtype=torch\.float32 "
            r"\(under torch\.autocast: torch\.float64, torch\.bfloat16 and torch\.bfloat16\)")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=want):
            flash_attn_func(q, k, k)
        with pytest.raises(ValueError, match=want):
            flash_attn_ext.explain(q, k, k, layout="blhd")
    # Without autocast the same call is refused by the op, with the same dtypes.
    with pytest.raises(ValueError, match=r"q\.dtype=torch\.float64, k\.dtype=torch\.float32"):
        flash_attn_func(q, k, k)


def test_autocast_under_compile():
    torch._dynamo.reset()
    q = torch.randn(1, 17, 2, 8, requires_grad=True)
    f = torch.compile(lambda q: flash_attn_func(q, q, q, causal=True), fullgraph=True,
                      backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = f(q)
        eager = flash_attn_func(q, q, q, causal=True)
    assert out.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(out, eager)  # (the same kernels on the same cast inputs)
    dout = torch.randn_like(out)
    grad, = torch.autograd.grad(out, q, dout)
    grad_eager, = torch.autograd.grad(eager, q, dout)
    assert grad.dtype == torch.float32 and torch.equal(grad, grad_eager)


@pytest.mark.skipif(not (torch.cuda.is_available() and ops.build_info()["cuda"]),
                    reason="needs a CUDA device and a CUDA build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_cuda_runs_the_fused_kernel(dtype):
    # The usual mixed-precision training setup: float32 model, autocast on CUDA.
    q, k, v = (torch.randn(2, 4, 257, 64, device="cuda", requires_grad=True) for _ in range(3))
    with torch.autocast("cuda", dtype=dtype):
        out = scaled_dot_product_attention(q, k, v, is_causal=True, strict=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    assert out.dtype == theirs.dtype == dtype
    arch = last_plan().kernel[:4]  # (sm90 on an H100/H200 unless forced portable, else sm80)
    assert last_plan().kernel == f"{arch}_fwd_hdim64_{name}"
    assert last_plan().backward_kernel == f"{arch}_bwd_hdim64_{name}"
    # Under the error rule against float32, PyTorch's own autocast call as the yardstick;
    # the gradients reach the float32 leaves as float32.
    true = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_error_rule(out, theirs, true.double(), 2.0, "out")
    dout = torch.randn_like(true)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    low_grads = torch.autograd.grad(theirs, (q, k, v), dout)
    true_grads = torch.autograd.grad(true, (q, k, v), dout)
    for n, g, lo, t in zip(("dq", "dk", "dv"), grads, low_grads, true_grads):
        assert g.dtype == torch.float32, n
        assert_error_rule(g, lo, t.double(), 3.0, n)


def test_autocast_float_mask_in_a_half_dtype():
    # Under autocast PyTorch casts a float mask with q, k and v: with float32 q, k, v a mask in
    # the autocast dtype (or the other half dtype) is valid, as in PyTorch; a float32 mask is
    # kept in float32 (the more precise bias); float64 is refused, as PyTorch refuses it.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    base = torch.randn(5, 6)
    for mask_dtype in (torch.bfloat16, torch.float16, torch.float32):
        mask = base.to(mask_dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
            theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert out.dtype == theirs.dtype == torch.bfloat16
        cast = mask if mask_dtype == torch.float32 else mask.bfloat16()
        assert torch.equal(out, scaled_dot_product_attention(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=cast))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            ValueError, match=r"attn_mask.dtype=torch.float64: a float mask must be float32 or "
            r"query's dtype torch.bfloat16 under torch.autocast"):
        scaled_dot_product_attention(q, k, v, attn_mask=base.double())
