"""Dropout on the attention weights inside the kernels (CPU and CUDA).

The mask is a pure function of the forward's rng_state (seed, offset) (csrc/dropout.h), which
``_C.dropout_mask`` regenerates on the host: forward and all gradients must equal plain attention
computed with that same mask, the kept fraction and scaling must be right, torch.manual_seed must
reproduce a call, and on CUDA the device's Philox (curand) must drop exactly the elements the
host's (ATen) drops, also inside a captured CUDA graph.
"""

import itertools
import math

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import _C, flash_attn_func, ops, policy, scaled_dot_product_attention
from reference import (
    assert_error_rule,
    attention_ref,
    dropout_scale,
    launched_kernels,
    sm90_variant_flags,
)

HAS_CUDA = torch.cuda.is_available() and ops.build_info()["cuda"]
HOPPER = HAS_CUDA and ops.build_info()["sm90"] and torch.cuda.get_device_capability() == (9, 0)
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
# (device, kernels): on CUDA the default rule (on sm_90 the Hopper kernels' dropout variants;
# the general variants where dropout comes with softcap, a bias or ALiBi) and the portable
# kernels, which must drop the same elements.
DEVICE_KERNELS = [("cpu", "auto")] + ([("cuda", "auto"), ("cuda", "sm80")] if HAS_CUDA else [])
LOW = {"cpu": torch.float32, "cuda": torch.bfloat16}


def reference(q, k, v, keep, dropout_p, causal, dtype):
    """softmax(q k^T scale + causal mask) * keep * scale @ v in ``dtype``, (B, L, H, D), scale
    the kernels' 1 / P(kept) (csrc/dropout.h)."""
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:  # bottom-right, as flash_attn_func
        L, S = s.shape[-2:]
        visible = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    p = p * keep.to(q.device) * dropout_scale(dropout_p)
    return (p @ vh).transpose(1, 2)


def assert_error_rule_with_grads(leaves, out, dtype, ref):
    """out and the gradients of `leaves` (q, k, v) for a random dout against ref(q, k, v,
    compute_dtype) in float64 (the truth) and in dtype (PyTorch's error), by the error rule."""
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)

    def theirs(compute):
        ref_leaves = [t.detach().to(compute).requires_grad_() for t in leaves]
        o = ref(*ref_leaves, compute)
        return o, torch.autograd.grad(o, ref_leaves, dout.to(compute))

    true, true_g = theirs(torch.float64)
    low, low_g = theirs(dtype)
    assert_error_rule(out, low, true, 2.0, "out")
    for name, a, lo, t in zip(("dq", "dk", "dv"), grads, low_g, true_g):
        assert_error_rule(a, lo, t, 3.0, name)


def run_ours(q, k, v, dropout_p, causal):
    out, lse, rng = ops.fwd(q, k, v, None, causal, -1, -1, True, 0.0, None, None, dropout_p)
    return out, rng


@pytest.mark.parametrize("device,kernel", DEVICE_KERNELS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 37, 53, 4, 2, 16), (1, 130, 200, 2, 1, 64),
                                   (1, 113, 300, 2, 2, 128), (1, 17, 150, 2, 1, 256)], ids=str)
def test_forward_and_grads_equal_reference_with_the_same_mask(device, kernel, causal, shape,
                                                               kernel_opts):
    B, L, S, H, HKV, D = shape
    if device == "cuda":
        kernel_opts(force_portable=kernel == "sm80")
    dtype, p_drop = LOW[device], 0.3
    q = torch.randn(B, L, H, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, HKV, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, HKV, D, device=device, dtype=dtype, requires_grad=True)
    out, rng = run_ours(q, k, v, p_drop, causal)
    seed, offset = (int(x) for x in rng.cpu())
    keep = _C.dropout_mask(seed, offset, B, H, L, S, p_drop)
    if device == "cuda" and kernel == "auto" and HOPPER:
        plan = flash_attn_ext.explain(q, k, v, layout="blhd", dropout_p=p_drop, causal=causal)
        assert plan.kernel.endswith("_dropout"), plan
        assert plan.backward_kernel.endswith("_dropout"), plan
    assert_error_rule_with_grads(
        (q, k, v), out, dtype, lambda q, k, v, dt: reference(q, k, v, keep, p_drop, causal, dt))


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a build with the Hopper kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2, 1, 64), (2, 17, 300, 4, 2, 40),
                                   (1, 300, 17, 2, 2, 72), (1, 1023, 1023, 2, 1, 128),
                                   (2, 200, 257, 4, 4, 59), (1, 113, 200, 2, 1, 200),
                                   (2, 700, 301, 4, 2, 256)], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 7)], ids=str)
def test_hopper_dropout_variants_meet_the_error_rule(dtype, shape, window):
    # The Hopper forward's and backward's dropout variants (the plain kernels with the
    # forward's mask) at odd sizes, both dtypes, causal and window masks, GQA: out and
    # gradients against float64 with the same mask, by the error rule.
    B, L, S, H, HKV, D = shape
    p_drop = 0.17
    g = torch.Generator().manual_seed(L * 7 + D)
    q, k, v = (torch.randn(B, n, h, D, generator=g).to("cuda", dtype).requires_grad_()
               for n, h in ((L, H), (S, HKV), (S, HKV)))
    plan = flash_attn_ext.explain(q, k, v, layout="blhd", dropout_p=p_drop, window_size=window)
    assert plan.kernel.startswith("sm90_fwd") and plan.kernel.endswith("_dropout"), plan
    # (head dims above 128: the step split by role, warpgroup 0 drawing the keep bits and
    # handing them to warpgroup 1 in P^T's sign)
    assert plan.backward_kernel.startswith("sm90_bwd") and \
        plan.backward_kernel.endswith("_dropout"), plan
    kw = dict(softmax_scale=None, causal=False, window_left=window[0], window_right=window[1],
              align_bottom_right=True, softcap=0.0)
    out, _, rng = ops.fwd(q, k, v, None, False, window[0], window[1], True, 0.0, None, None,
                          p_drop)
    seed, offset = (int(x) for x in rng.cpu())
    keep = _C.dropout_mask(seed, offset, B, H, L, S, p_drop)
    assert_error_rule_with_grads(
        (q, k, v), out, dtype,
        lambda q, k, v, dt: attention_ref(q, k, v, compute_dtype=dt, dropout_keep=keep,
                                          dropout_p=p_drop, **kw)[0])


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a build with the Hopper kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2, 1, 64), (2, 17, 300, 4, 2, 40),
                                   (1, 300, 17, 2, 2, 59), (1, 1023, 1023, 2, 1, 64),
                                   (2, 200, 257, 4, 4, 64),
                                   # GQA groups of 4 and 6 (dK / dV summed over them), 65-127
                                   # query rows (the fixed order's rotation with one partial
                                   # block), head_dim_v != head_dim (the kernel at their max;
                                   # at 24 the second 32-column box of K lies wholly outside)
                                   (1, 100, 300, 8, 2, 64), (2, 77, 129, 6, 1, 24, 64),
                                   (1, 113, 90, 4, 1, 64, 40)], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 7)], ids=str)
@pytest.mark.parametrize("short_steps", [False, True], ids=["128_rows", "64_rows"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["any_order", "deterministic"])
def test_hopper_dropout_backward_with_either_step_height(kernel_opts, dtype, shape, window,
                                                         short_steps, deterministic):
    # The Hopper backward's dropout variant at head dim 64 (40 and 59 padded to it) takes
    # 64-row steps (dQ split over 32-column halves of the head dim, K and V in 64-byte
    # swizzled shared memory), or 128 under the option sm90_bwd_short_steps=False (an
    # instantiation of its own, the other variants' steps there): the kernel that ran, and
    # out and the gradients against float64 with the same mask, by the error rule, with dQ in
    # any order and in the fixed one; the fixed order bitwise reproducible.
    kernel_opts(sm90_bwd_short_steps=short_steps)
    B, L, S, H, HKV, D = shape[:6]
    Dv = shape[6] if len(shape) > 6 else D
    p_drop = 0.17
    g = torch.Generator().manual_seed(L * 5 + D)
    q, k, v = (torch.randn(B, n, h, d, generator=g).to("cuda", dtype).requires_grad_()
               for n, h, d in ((L, H, D), (S, HKV, D), (S, HKV, Dv)))
    out, _, rng = ops.fwd(q, k, v, None, False, window[0], window[1], True, 0.0, None, None,
                          p_drop, deterministic)
    seed, offset = (int(x) for x in rng.cpu())
    keep = _C.dropout_mask(seed, offset, B, H, L, S, p_drop)
    dout = torch.randn_like(out)
    bwd = [n for n in launched_kernels(lambda: torch.autograd.grad(out, (q, k, v), dout,
                                                                    retain_graph=True))
           if "flash_bwd_sm90_kernel" in n]
    want = {"dropout", "short_steps"} if short_steps else {"dropout"}
    assert bwd and all(sm90_variant_flags(n, "Sm90BwdTraits", shape=True) == want
                       for n in bwd), bwd
    if deterministic:
        first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    kw = dict(softmax_scale=None, causal=False, window_left=window[0], window_right=window[1],
              align_bottom_right=True, softcap=0.0)
    assert_error_rule_with_grads(
        (q, k, v), out, dtype,
        lambda q, k, v, dt: attention_ref(q, k, v, compute_dtype=dt, dropout_keep=keep,
                                          dropout_p=p_drop, **kw)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_kept_fraction_scaling_and_reproducibility(device):
    p_drop, B, H, L, S = 0.2, 2, 3, 64, 301
    # With v = 1 and uniform scores, out = (kept count / S) / P(kept) per row: its mean is 1.
    # P(kept) = 1 - p rounded to a multiple of 1/256 (0.80078125 here; csrc/dropout.h).
    q = torch.zeros(B, L, H, 8, device=device, dtype=LOW[device])
    v = torch.ones(B, S, H, 8, device=device, dtype=LOW[device])
    torch.manual_seed(7)
    out = flash_attn_func(q, q[:, :1].expand(B, S, H, 8), v, dropout_p=p_drop)
    rows = out[..., 0].float()
    n = B * H * L * S
    assert _C.dropout_scale(p_drop) == dropout_scale(p_drop) == 256 / round((1 - p_drop) * 256)
    keep_p = round((1 - p_drop) * 256) / 256
    kept = rows.sum().item() * keep_p * S
    sigma = math.sqrt(n * keep_p * (1 - keep_p))
    assert abs(kept - n * keep_p) < 5 * sigma + 0.01 * n * (device == "cuda")
    assert abs(rows.mean().item() - 1.0) < 0.02
    torch.manual_seed(7)
    again = flash_attn_func(q, q[:, :1].expand(B, S, H, 8), v, dropout_p=p_drop)
    assert torch.equal(out, again)
    different = flash_attn_func(q, q[:, :1].expand(B, S, H, 8), v, dropout_p=p_drop)
    assert not torch.equal(out, different)


@pytest.mark.parametrize("device,kernel,dtype", [
    (d, kn, dt) for d, kn in DEVICE_KERNELS
    for dt in ([torch.float32] if d == "cpu" else [torch.bfloat16, torch.float16])], ids=str)
def test_dropout_with_window_alibi_and_softcap(device, kernel, dtype, kernel_opts):
    # Dropout with every other modifier of the general variant at once (a window, ALiBi, softcap:
    # the score loops' copies with ALiBi and dropout), bf16 and fp16, top-left alignment with
    # L != S, GQA; on CUDA a generator offset above 2^32 (the Philox counter's high word), and on
    # an sm_90 build the Hopper kernels' general variant (named by explain).
    B, L, S, H, HKV, D, p_drop = 2, 77, 150, 4, 2, 64, 0.2
    if device == "cuda":
        kernel_opts(force_portable=kernel == "sm80")
        gen = torch.cuda.default_generators[torch.cuda.current_device()]
        gen.manual_seed(3)
        gen.set_offset(2**32 + 8)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, n, h, D, generator=g).to(device, dtype).requires_grad_()
               for n, h in ((L, H), (S, HKV), (S, HKV)))
    slopes = torch.rand(B, H, generator=g).to(device) * 0.3
    kw = dict(softmax_scale=None, causal=False, window_left=40, window_right=7,
              align_bottom_right=False, softcap=20.0)
    out, lse, rng = ops.fwd(q, k, v, kw["softmax_scale"], kw["causal"], kw["window_left"],
                            kw["window_right"], kw["align_bottom_right"], kw["softcap"], slopes,
                            None, p_drop)
    seed, offset = (int(x) for x in rng.cpu())
    if device == "cuda":
        assert offset >= 2**32
    if device == "cuda" and kernel == "auto" and ops.build_info()["sm90"] and \
            torch.cuda.get_device_capability() == (9, 0):
        plan = flash_attn_ext.explain(q, k, v, layout="blhd", window_size=(40, 7), softcap=20.0,
                                      alibi_slopes=slopes, dropout_p=p_drop)
        assert plan.kernel.startswith("sm90_") and plan.kernel.endswith("_general"), plan
    keep = _C.dropout_mask(seed, offset, B, H, L, S, p_drop)
    assert_error_rule_with_grads(
        (q, k, v), out, dtype,
        lambda q, k, v, dt: attention_ref(q, k, v, alibi_slopes=slopes, compute_dtype=dt,
                                          dropout_keep=keep, dropout_p=p_drop, **kw)[0])


def _philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC 2011) on 4 counter and 2 key words, as curand's."""
    m0, m1, w0, w1, mask = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF
    c, k = list(counter), list(key)
    for _ in range(10):
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & mask, (p0 >> 32) ^ c[3] ^ k[1], p0 & mask]
        k = [(k[0] + w0) & mask, (k[1] + w1) & mask]
    return c


def test_host_mask_follows_the_documented_rule():
    # csrc/dropout.h, written out independently: element (b, h, i, j) is byte dj of word di of
    # the Philox call for counter (offset + cell_col(j), row id of i's cell), key seed.
    seed, offset, B, H, L, S, p_drop = 0x1234_5678_9ABC, 77, 2, 3, 37, 45, 0.3
    keep = _C.dropout_mask(seed, offset, B, H, L, S, p_drop)
    threshold = round((1 - p_drop) * 256)
    assert _C.dropout_scale(p_drop) == 256 / threshold
    for b, h, i, j in itertools.product(range(B), range(H), range(L), range(S)):
        row_id = (b * H + h) * L + (i & ~9)
        block = offset + 4 * (j // 16) + (j % 8) // 2
        words = _philox4x32_10([block & 0xFFFFFFFF, block >> 32, row_id & 0xFFFFFFFF,
                                row_id >> 32], [seed & 0xFFFFFFFF, seed >> 32])
        di, dj = (i & 1) | ((i >> 2) & 2), (j & 1) | ((j >> 2) & 2)
        byte = (words[di] >> (8 * dj)) & 0xFF
        assert bool(keep[b, h, i, j]) == (byte < threshold), (b, h, i, j)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_p_rounding_edges(device):
    # P(kept) is 1 - dropout_p rounded to a multiple of 1/256: a dropout_p at or below 1/512
    # keeps everything unscaled (and draws nothing), one at or above 1 - 1/512 drops everything.
    assert _C.dropout_scale(0.0) == 1.0 and _C.dropout_scale(0.001) == 1.0
    assert _C.dropout_scale(0.5) == 2.0 and _C.dropout_scale(0.999) == 0.0
    q = torch.randn(1, 20, 2, 8).to(device, LOW[device])
    torch.manual_seed(0)
    out, _, rng = ops.fwd(q, q, q, None, False, -1, -1, True, 0.0, None, None, 0.001)
    assert torch.equal(out, ops.fwd(q, q, q)[0]) and rng.tolist() == [0, 0]
    out = ops.fwd(q, q, q, None, False, -1, -1, True, 0.0, None, None, 0.999)[0]
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_p_one_gives_zeros_as_the_sdpa_drop_in(dtype):
    # dropout_p = 1 drops every weight: flash_attn_func, its packed variants and
    # flash_attn_varlen_func answer zeros with zero gradients, as the SDPA drop-in, PyTorch's
    # SDPA and nn.Dropout(p=1.0) do (new-user trial: they raised); softmax_lse is the undropped
    # softmax's, as at every dropout_p; outside [0, 1] still raises.
    from flash_attn_ext import (
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
    )
    torch.manual_seed(0)
    q = torch.randn(2, 9, 4, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 11, 2, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 11, 2, 8, dtype=dtype, requires_grad=True)

    def assert_zeros_with_zero_grads(out, leaves, shape):
        assert out.shape == shape and out.dtype == dtype and (out == 0).all()
        for g in torch.autograd.grad(out, leaves, torch.randn_like(out)):
            assert torch.isfinite(g).all() and (g == 0).all()

    for causal in (False, True):
        out, lse, probs = flash_attn_func(q, k, v, 1.0, causal=causal, return_attn_probs=True)
        assert probs is None
        _, want = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
        assert torch.equal(lse, want) and torch.isfinite(lse).all()
        assert_zeros_with_zero_grads(out, (q, k, v), (2, 9, 4, 8))
    sdpa = scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=1.0,
                                        enable_gqa=True)
    assert torch.equal(sdpa.transpose(1, 2), flash_attn_func(q, k, v, dropout_p=1.0))
    qkv = torch.randn(2, 9, 3, 4, 16, dtype=dtype, requires_grad=True)
    assert_zeros_with_zero_grads(flash_attn_qkvpacked_func(qkv, 1.0), (qkv,), (2, 9, 4, 16))
    kv = torch.randn(2, 11, 2, 2, 16, dtype=dtype, requires_grad=True)
    assert_zeros_with_zero_grads(flash_attn_kvpacked_func(q, kv, 1.0), (q, kv), (2, 9, 4, 16))
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    qp, kp, vp = q[0], k[0], v[0]
    out, lse, _ = flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 5, 6, 1.0, causal=True,
                                         return_attn_probs=True)
    _, want, _ = flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 5, 6, causal=True,
                                        return_attn_probs=True)
    assert torch.equal(lse, want)
    assert_zeros_with_zero_grads(out, (q, k, v), (9, 4, 8))
    for bad in (1.0 + 1e-6, 2, -0.25, float("nan")):
        with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\], got"):
            flash_attn_func(q, k, v, dropout_p=bad)
        with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\], got"):
            flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 5, 6, bad)


def test_host_mask_statistics():
    keep = _C.dropout_mask(123, 0, 2, 4, 100, 1000, 0.25)
    frac = keep.float().mean().item()
    assert abs(frac - 0.75) < 5 * math.sqrt(0.25 * 0.75 / keep.numel())
    # Different rows, and different offsets, give different (independent-looking) masks.
    assert (keep[0, 0, 0] != keep[0, 0, 1]).any()
    other = _C.dropout_mask(123, 1000, 2, 4, 100, 1000, 0.25)
    assert abs((keep == other).float().mean().item() - (0.75**2 + 0.25**2)) < 0.01


def test_sdpa_dropout_is_fused_and_matches_reference():
    # The drop-in with dropout runs the fused op (no fallback) and draws the op's mask: the same
    # generator state gives the op's output, which is the reference with the host mask.
    policy.reset_fallback_counts()
    q = torch.randn(2, 4, 33, 16, requires_grad=True)
    torch.manual_seed(5)
    out = scaled_dot_product_attention(q, q, q, dropout_p=0.5, is_causal=True, strict=True)
    out.sum().backward()
    assert policy.fallback_counts() == {}
    qb = q.detach().transpose(1, 2)  # (B, L, H, D); L = S: top-left causal is bottom-right
    torch.manual_seed(5)
    op_out, rng = run_ours(qb, qb, qb, 0.5, True)
    assert torch.equal(out, op_out.transpose(1, 2))
    keep = _C.dropout_mask(*(int(x) for x in rng), 2, 4, 33, 33, 0.5)
    qd = qb.double().requires_grad_()
    ref = reference(qd, qd, qd, keep, 0.5, True, torch.float64)
    assert (out.double() - ref.transpose(1, 2)).abs().max().item() < 1e-5
    # the backward with the same cells dropped (q is q, k and v: three paths summed)
    ref.transpose(1, 2).sum().backward()
    assert (q.grad.double() - qd.grad.transpose(1, 2)).abs().max().item() < \
        1e-5 * max(1.0, qd.grad.abs().max().item())


def test_dropout_under_compile():
    torch._dynamo.reset()
    q = torch.randn(1, 40, 2, 16, requires_grad=True)
    f = torch.compile(lambda q: flash_attn_func(q, q, q, dropout_p=0.1), fullgraph=True)
    torch.manual_seed(0)
    out = f(q)
    compiled_grad, = torch.autograd.grad(out.sum(), q)
    torch.manual_seed(0)
    eager = flash_attn_func(q, q, q, dropout_p=0.1)
    assert torch.equal(out, eager)
    # the compiled backward regenerates the cells the eager one does
    eager_grad, = torch.autograd.grad(eager.sum(), q)
    torch.testing.assert_close(compiled_grad, eager_grad)


@pytest.mark.parametrize("packed", [False, True])
def test_two_dropout_calls_on_the_same_inputs_keep_two_masks_under_compile(packed):
    # AOTAutograd's common-subexpression pass merged two calls of the fwd op with identical
    # arguments in a training graph (it spares only aten's random ops): both outputs came from
    # one mask, and the compiled step differed from eager under the same seed.
    torch._dynamo.reset()
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)

    def attn(q):
        if packed:
            return flash_attn_ext.flash_attn_varlen_func(q, q, q, cu, cu, 23, 23, dropout_p=0.5)
        return flash_attn_func(q, q, q, dropout_p=0.5)

    def two_calls(q):
        return attn(q), attn(q)

    def step(fn):
        q = base.clone().requires_grad_()
        torch.manual_seed(11)
        a, b = fn(q)
        (a * 2 + b).sum().backward()
        return a, b, q.grad

    base = torch.randn(40, 2, 16) if packed else torch.randn(1, 40, 2, 16)
    a_ref, b_ref, dq_ref = step(two_calls)
    assert not torch.equal(a_ref, b_ref)
    a, b, dq = step(torch.compile(two_calls, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(b, b_ref)
    torch.testing.assert_close(dq, dq_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
def test_cuda_graph_capture_draws_fresh_masks_and_backward_regenerates_them():
    B, L, S, H, D, p_drop = 1, 64, 96, 2, 64, 0.25
    q = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16)
    static = {}

    def step():
        out, rng = run_ours(q, k, v, p_drop, False)
        static["out"], static["rng"] = out, rng
        static["grads"] = torch.autograd.grad(out, (q, k, v), dout)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        seed, offset = (int(x) for x in static["rng"].cpu())
        keep = _C.dropout_mask(seed, offset, B, H, L, S, p_drop)
        ref = reference(q.detach(), k.detach(), v.detach(), keep, p_drop, False, torch.float32)
        assert (static["out"].float() - ref).abs().max().item() < 3e-2
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref_g = torch.autograd.grad(reference(*leaves, keep, p_drop, False, torch.float32),
                                    leaves, dout.float())
        for a, b in zip(static["grads"], ref_g):
            assert (a.float() - b).abs().max().item() < 5e-2 * max(1.0, b.abs().max().item())
        results.append((offset, static["out"].clone()))
    assert results[0][0] != results[1][0]  # each replay advanced the generator's offset
    assert not torch.equal(results[0][1], results[1][1])


def test_dropout_under_vmap_follows_its_randomness_flag():
    # vmap's default randomness="error" refuses random ops, as for PyTorch's dropout; "same"
    # cannot be honoured (each sample draws its own mask); "different" runs, one mask each.
    q = torch.randn(2, 9, 4, 16).expand(3, 2, 9, 4, 16)
    k = v = torch.randn(2, 11, 4, 16)

    def f(a):
        return flash_attn_func(a, k, v, dropout_p=0.5)

    with pytest.raises(RuntimeError, match="randomness error mode"):
        torch.vmap(f)(q)
    with pytest.raises(NotImplementedError, match="randomness='same'"):
        torch.vmap(f, randomness="same")(q)
    out = torch.vmap(f, randomness="different")(q)
    assert not torch.equal(out[0], out[1])
    no_drop = torch.vmap(lambda a: flash_attn_func(a, k, v))(q)  # no randomness: no check
    assert torch.allclose(no_drop[0], flash_attn_func(q[0], k, v), atol=1e-6)
