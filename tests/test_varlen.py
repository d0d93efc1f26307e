"""Packed sequences (flash_attn_varlen_func, the fwd_varlen / bwd_varlen ops): on the CPU each
sequence against a float64 reference of its own attention, forward and backward; the dense
kernels' answer for equal lengths (dropout included); the checks; torch.compile.  On CUDA (the
portable kernels) the same geometry in bf16/fp16 under the error rule, and the dense portable
kernels' bits for equal lengths, dropout included."""

import re
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flash_attn_ext
from flash_attn_ext import _C, flash_attn_func, flash_attn_varlen_func
from flash_attn_ext.varlen import fwd_varlen_op
from reference import (
    assert_bwd_fake_strides_match,
    assert_error_rule,
    assert_lse_infinities,
    attention_ref,
    fuzz_settings,
    launched_kernels,
    sm90_variant_flags,
)

HAS_CUDA = torch.cuda.is_available() and flash_attn_ext.ops.build_info()["cuda"]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(lens_q, lens_k, heads, heads_kv, d, dv, dtype, tail=(0, 0)):
    """Packed q/k/v (requiring grad) with `tail` extra rows past the last sequence."""
    cq, ck = _offsets(lens_q), _offsets(lens_k)
    q = torch.randn(int(cq[-1]) + tail[0], heads, d, dtype=dtype, requires_grad=True)
    k = torch.randn(int(ck[-1]) + tail[1], heads_kv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(int(ck[-1]) + tail[1], heads_kv, dv, dtype=dtype, requires_grad=True)
    return q, k, v, cq, ck


def _used_rows(ck, used):
    """The packed key rows that seqused_k leaves in use (the first used[b] keys of sequence b)
    and their offsets once gathered: (index of those rows, offsets), for a reference over the
    used keys alone."""
    index = torch.cat([torch.arange(int(ck[b]), int(ck[b]) + n, dtype=torch.long)
                       for b, n in enumerate(used)])
    return index, _offsets(used)


def _sequence_kw(b, slopes, keeps, kw):
    """attention_ref's arguments for sequence b: its ALiBi slopes ((H,) shared or row b of (B,
    H)) and its dropout mask (``keeps[b]``, with kw's dropout_p), beside kw's others."""
    kw = dict(kw, alibi_slopes=None if slopes is None else
              (slopes if slopes.dim() == 1 else slopes[b]))
    if keeps is not None:
        kw["dropout_keep"] = keeps[b]
    else:
        kw.pop("dropout_p", None)
    return kw


def _per_sequence(q, k, v, cq, ck, dout, keeps=None, **kw):
    """The reference: each sequence on its own (float64), outputs and gradients scattered back
    into packed tensors (rows outside every sequence: 0).  ``keeps``: each sequence's dropout
    mask (_dropout_keeps), kw's dropout_p its rate."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    slopes = kw.pop("alibi_slopes", None)
    for b in range(len(cq) - 1):
        rq, rk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if rq.stop == rq.start:
            continue
        o, seq_lse = attention_ref(leaves[0][rq][None], leaves[1][rk][None],
                                   leaves[2][rk][None], **_sequence_kw(b, slopes, keeps, kw))
        out[rq], lse[:, rq] = o[0], seq_lse[0]
    grads = torch.autograd.grad(out, leaves, dout.double(), allow_unused=True) \
        if out.requires_grad else (None,) * 3  # (no sequence has a query row)
    return out, lse, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def _low_per_sequence(q, k, v, cq, ck, dtype, slopes=None, keeps=None, **kw):
    """PyTorch's answer in ``dtype`` (the error rule's yardstick), each sequence on its own, on
    the CPU, scattered into a packed tensor (rows outside every sequence: 0); returns it and
    the leaves it was computed from, for its gradients."""
    leaves = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    low = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=dtype)
    for b in range(len(cq) - 1):
        rq, rk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if rq.stop == rq.start:
            continue
        o, _ = attention_ref(leaves[0][rq][None], leaves[1][rk][None], leaves[2][rk][None],
                             compute_dtype=dtype, **_sequence_kw(b, slopes, keeps, kw))
        low[rq] = o[0]
    return low, leaves


def _rng_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _dropout_keeps(q, k, v, cq, ck, kw, state):
    """The dropout masks that a flash_attn_varlen_func call with ``kw`` (dropout_p > 0) drew,
    per sequence ((1, H, len_q, len_k) bool): the fwd_varlen op, run again from the generator
    ``state`` that the call started from (_rng_state), gives the call's (seed, offset), and
    _C.dropout_mask regenerates each sequence's mask at its packed rows (csrc/dropout.h)."""
    if q.device.type == "cuda":
        torch.cuda.set_rng_state(state, q.device)
    else:
        torch.set_rng_state(state)
    lens_q, lens_k = (cu.diff().tolist() for cu in (cq, ck))
    wl, wr = kw.get("window_size", (-1, -1))
    _, _, rng = fwd_varlen_op(q.detach(), k.detach(), v.detach(), cq.to(q.device),
                              ck.to(q.device), max(lens_q), max(lens_k), kw.get("softmax_scale"),
                              bool(kw.get("causal", False)), wl, wr,
                              float(kw.get("softcap", 0.0)), kw.get("alibi_slopes"),
                              float(kw["dropout_p"]), None, False)
    seed, offset = (int(x) for x in rng.cpu())
    return [_C.dropout_mask(seed, offset, 1, q.shape[1], lq, lk, kw["dropout_p"],
                            packed_start=int(cq[b]))
            for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]


def _low_grads(low, leaves, dout, dtype):
    """Gradients of ``low`` (from _low_per_sequence) for ``dout``, zeros where none flows."""
    grads = torch.autograd.grad(low, leaves, dout.cpu(), allow_unused=True)
    return [torch.zeros_like(t, dtype=dtype) if g is None else g for g, t in zip(grads, leaves)]


CASES = [dict(), dict(causal=True), dict(window_size=(3, 2)), dict(causal=True, softcap=5.0),
         dict(alibi="head"), dict(alibi="batch_head", causal=True),
         dict(causal=True, dropout_p=0.17)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_sequence_is_its_own_attention_float64(case):
    # Sequences of lengths 5, 0, 17, 9 queries / 7, 3, 17, 4 keys (L < S, zero-length, L = S,
    # L > S: causal or a window leaves its first rows without keys), GQA, Ev != E, rows past
    # the last offset.
    case = dict(case)
    lens_q, lens_k = [5, 0, 17, 9], [7, 3, 17, 4]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, 16, 8, torch.float64, tail=(2, 3))
    alibi = case.pop("alibi", None)
    slopes = None if alibi is None else \
        torch.rand(*((4,) if alibi == "batch_head" else ()), 4, dtype=torch.float64)
    state = _rng_state(q.device)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                         alibi_slopes=slopes, return_attn_probs=True, **case)
    # (dropout: each sequence's mask at its packed rows, the kernels' numbering)
    keeps = _dropout_keeps(q, k, v, cq, ck, case, state) if "dropout_p" in case else None
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wl, wr = case.pop("window_size", (-1, -1))
    ref, ref_lse, ref_grads = _per_sequence(q, k, v, cq, ck, dout, keeps=keeps, window_left=wl,
                                            window_right=wr, alibi_slopes=slopes, **case)
    assert (out - ref).abs().max().item() < 1e-12
    finite = torch.isfinite(ref_lse)
    assert_lse_infinities(lse, ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-12
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < 1e-11
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # the tail: left alone
    assert torch.equal(grads[1][-3:], torch.zeros_like(grads[1][-3:]))


@pytest.mark.parametrize("causal", [False, True])
def test_offsets_may_start_past_row_0_float64(causal):
    # cu_seqlens_q[0] / cu_seqlens_k[0] > 0 (a new-user question: FlashAttention-2's docs start
    # them at 0): the sequences are read at their offsets, the rows before the first offset are
    # left as those past the last are (out 0, softmax_lse -inf, zero gradients), and keys before
    # the first key offset get zero gradients.
    torch.manual_seed(11)
    q = torch.randn(20, 4, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(15, 2, 16, dtype=torch.float64, requires_grad=True) for _ in "kv")
    cq = torch.tensor([3, 8, 17], dtype=torch.int32)
    ck = torch.tensor([2, 9, 13], dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, 9, 7, causal=causal,
                                         return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_lse, ref_grads = _per_sequence(q, k, v, cq, ck, dout, causal=causal)
    assert (out - ref).abs().max().item() < 1e-12
    assert_lse_infinities(lse, ref_lse)
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-12
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < 1e-11
    for rows in (slice(0, 3), slice(17, 20)):
        assert torch.equal(out[rows], torch.zeros_like(out[rows]))
        assert bool((lse[:, rows] == float("-inf")).all())
        assert torch.equal(grads[0][rows], torch.zeros_like(grads[0][rows]))
    for rows in (slice(0, 2), slice(13, 15)):
        assert torch.equal(grads[1][rows], torch.zeros_like(grads[1][rows]))
        assert torch.equal(grads[2][rows], torch.zeros_like(grads[2][rows]))


def _lse_gradient_case(device, dtype):
    """Packed q/k/v (lengths with an empty sequence, L > S causal rows that see no key, GQA, a
    tail) on `device`, and the gradients of out . dout + lse . dlse from our kernels, from the
    float64 per-sequence reference and from the same reference in ``dtype`` (PyTorch's answer
    in that precision: the error rule's yardstick) (dlse zero on rows without keys, where lse
    = -inf)."""
    torch.manual_seed(3)
    lens_q, lens_k = [5, 0, 70, 9], [7, 3, 64, 4]
    q64, k64, v64, cq, ck = _packed(lens_q, lens_k, 4, 2, 64, 64, torch.float64, tail=(2, 3))
    q, k, v = (t.detach().to(device, dtype).requires_grad_() for t in (q64, k64, v64))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq.to(device), ck.to(device), max(lens_q),
                                         max(lens_k), causal=True, return_attn_probs=True)
    dout = torch.randn(out.shape, dtype=torch.float64)
    _, ref_lse, _ = _per_sequence(q, k, v, cq, ck, dout, causal=True)
    dlse = torch.randn(lse.shape, dtype=torch.float64) * torch.isfinite(ref_lse)
    grads = torch.autograd.grad((out, lse), (q, k, v),
                                (dout.to(device, dtype), dlse.to(device, lse.dtype)))
    def reference(compute_dtype):
        leaves = [t.detach().cpu().to(compute_dtype).requires_grad_() for t in (q, k, v)]
        ref_out = torch.zeros(out.shape, dtype=compute_dtype)
        ref_lse = torch.zeros(lse.shape, dtype=compute_dtype)
        for b in range(len(lens_q)):
            rq, rk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
            if rq.stop > rq.start:
                o, seq_lse = attention_ref(leaves[0][rq][None], leaves[1][rk][None],
                                           leaves[2][rk][None], causal=True,
                                           compute_dtype=compute_dtype)
                ref_out[rq] = o[0]
                ref_lse[:, rq] = torch.where(torch.isfinite(seq_lse[0]), seq_lse[0], 0.0)
        return torch.autograd.grad((ref_out, ref_lse), leaves,
                                   (dout.to(compute_dtype), dlse.to(compute_dtype)))
    return grads, reference(torch.float64), reference(dtype)


def test_softmax_lse_is_differentiable_float64():
    # FlashAttention-2's varlen softmax_lse carries a gradient (e.g. to merge partial
    # attention results); it enters the backward folded into delta.
    grads, ref_grads, _ = _lse_gradient_case("cpu", torch.float64)
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < 1e-11
    # Only softmax_lse used: out's gradient is None, not an error.
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float64)
    _, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, return_attn_probs=True)
    dq, = torch.autograd.grad(lse.sum(), (q,))
    assert torch.isfinite(dq).all() and dq.abs().max().item() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_under_the_error_rule(dtype):
    lens = [33, 130, 1]
    q, k, v, cq, ck = _packed(lens, lens, 2, 2, 40, 40, dtype)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 130, 130, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _, ref_grads = _per_sequence(q, k, v, cq, ck, dout, causal=True)
    low, leaves = _low_per_sequence(q, k, v, cq, ck, dtype, causal=True)
    for b in range(len(lens)):
        rows = slice(int(cq[b]), int(cq[b + 1]))
        assert_error_rule(out[rows][None], low[rows][None], ref[rows][None], 2.0, "out")
    for name, g, lo, r in zip(("dq", "dk", "dv"), grads, _low_grads(low, leaves, dout, dtype),
                              ref_grads):
        assert_error_rule(g, lo, r, 3.0, name)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_equal_lengths_are_the_dense_batch_dropout_included(dropout_p):
    # The packed dropout row id start * H + h * L + i is the dense (b * H + h) * L + i, so the
    # same seed drops the same elements; the same kernel gives the same bits.
    q, k, v = (torch.randn(3, 37, 4, 16, requires_grad=True) for _ in "qkv")
    _assert_packed_equal_lengths_are_dense(q, k, v, torch.randn(3, 37, 4, 16), dropout_p)


def test_dropout_mask_of_a_packed_sequence_numbers_its_rows_from_its_start():
    # The testing aid's mask of one packed sequence (rows from packed_start * H + h * L_b,
    # csrc/dropout.h) is the dense batch's entry b for equal lengths (packed_start = b * L);
    # another start draws other bits.
    dense = _C.dropout_mask(5, 12, 3, 4, 37, 29, 0.3)
    for b in range(3):
        packed = _C.dropout_mask(5, 12, 1, 4, 37, 29, 0.3, packed_start=37 * b)
        assert torch.equal(packed[0], dense[b]), b
    assert not torch.equal(_C.dropout_mask(5, 12, 1, 4, 37, 29, 0.3, packed_start=1)[0],
                           dense[0])
    with pytest.raises(Exception, match=r"packed_start = 0\) needs batch = 1, got 2"):
        _C.dropout_mask(5, 12, 2, 4, 37, 29, 0.3, packed_start=0)


def _assert_packed_equal_lengths_are_dense(q, k, v, dout, dropout_p):
    """A causal batch (B, L, H, D) packed as B sequences of length L gives the dense call's
    out and gradients bit for bit, with the same generator state (dropout included)."""
    batch, seqlen, heads, dim = q.shape
    torch.manual_seed(5)
    dense = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)
    dense_grads = torch.autograd.grad(dense, (q, k, v), dout)
    cu = _offsets([seqlen] * batch).to(q.device)
    torch.manual_seed(5)
    packed = flash_attn_varlen_func(*(t.reshape(batch * seqlen, heads, dim) for t in (q, k, v)),
                                    cu, cu, seqlen, seqlen, dropout_p=dropout_p, causal=True)
    assert torch.equal(packed.reshape(batch, seqlen, heads, dim), dense)
    grads = torch.autograd.grad(packed, (q, k, v), dout.reshape(batch * seqlen, heads, dim))
    for g, w in zip(grads, dense_grads):
        assert torch.equal(g, w)


def _compile_case(device):
    """Two packed sequences (9 / 12 and 20 keys) on device, with gradients wanted."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, cq, ck = _packed([9, 20], [12, 20], 2, 1, 16, 16, dtype)
    q, k, v = (t.detach().to(device).requires_grad_() for t in (q, k, v))
    torch._dynamo.reset()
    return q, k, v, cq.to(device), ck.to(device)


def _assert_same_as_eager(out, q, k, v, cq, ck):
    """out and its gradients equal to the eager call's (CUDA: dQ within 1e-2, as the Hopper
    backward adds it in any order)."""
    want = flash_attn_varlen_func(q, k, v, cq, ck, 20, 20, causal=True)
    assert torch.equal(out, want)
    tol = 0 if q.device.type == "cpu" else 1e-2
    for g, w in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                    torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device and a CUDA build"))])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_fullgraph_forward_and_backward(device, backend):
    # (On CUDA the traced call copies the offsets to the host once, as in eager mode.)
    q, k, v, cq, ck = _compile_case(device)
    f = torch.compile(flash_attn_varlen_func, fullgraph=True, backend=backend)
    _assert_same_as_eager(f(q, k, v, cq, ck, 20, 20, causal=True), q, k, v, cq, ck)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device and a CUDA build"))])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_with_max_seqlen_from_the_offsets(device, backend):
    # FlashAttention-2's idiom inside a compiled function: max_seqlen = the longest length from
    # cu_seqlens by .item(), a data-dependent SymInt under torch.compile (with
    # capture_scalar_outputs), which the ops' int arguments refused ("Expected a value of type
    # 'int' ... found type 'SymInt'", new-user trial); they take SymInt now.
    q, k, v, cq, ck = _compile_case(device)

    def f(q, k, v, cq, ck):
        max_q, max_k = ((c[1:] - c[:-1]).max().item() for c in (cq, ck))
        return flash_attn_varlen_func(q, k, v, cq, ck, max_q, max_k, causal=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = torch.compile(f, fullgraph=True, backend=backend)(q, k, v, cq, ck)
    _assert_same_as_eager(out, q, k, v, cq, ck)


def _packed_laid_out(layout, total, heads, d, device="cpu", dtype=torch.float32):
    """A (total, heads, d) tensor of random values (requiring grad) in one of the layouts
    callers hand flash_attn_varlen_func: contiguous; head-major, (heads, total, d) transposed
    (e.g. unpadded from a (B, H, L, D) projection); sliced from a wider head dim (not dense);
    every other element of the last dimension."""
    if layout == "contiguous":
        t = torch.randn(total, heads, d, device=device, dtype=dtype)
    elif layout == "head_major":
        t = torch.randn(heads, total, d, device=device, dtype=dtype).transpose(0, 1)
    elif layout == "sliced":
        t = torch.randn(total, heads, d + 3, device=device, dtype=dtype)[..., :d]
    else:
        t = torch.randn(total, heads, 2 * d, device=device, dtype=dtype)[..., ::2]
    return t.requires_grad_()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device and a CUDA build"))])
@pytest.mark.parametrize("layout", ["contiguous", "head_major", "sliced", "strided_last_dim"])
def test_bwd_fake_gives_the_real_gradient_strides_when_compiled(device, layout):
    # The bwd_varlen fake kernel gave dq, dk, dv contiguous strides where the CPU kernel lays
    # them out like q, k, v (zeros_like): a compiled backward of q, k, v in a head-major layout
    # failed inductor's stride assertion ("expected size 9==9, stride 16==32 at dim=0 ... from
    # a incorrect fake (aka meta) kernel"; new-user trial).
    # (on CUDA the glue copies tensors whose strides or start are not whole 16-byte chunks:
    # "sliced" and "strided_last_dim" at head dim 16)
    cq, ck = _offsets([4, 5]), _offsets([6, 3])
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (_packed_laid_out(layout, n, h, 16, device, dtype)
               for n, h in ((9, 2), (9, 1), (9, 1)))
    out, lse, rng = fwd_varlen_op(q, k, v, cq, ck, 5, 6, None, True)
    args = (torch.randn_like(out), q, k, v, out, lse, cq, ck, 5, 6, rng, None, True)
    assert_bwd_fake_strides_match(flash_attn_ext.varlen.bwd_varlen_op, args)
    torch._dynamo.reset()
    f = torch.compile(flash_attn_varlen_func, fullgraph=True, backend="inductor")
    got = f(q, k, v, cq, ck, 5, 6, causal=True)
    want = flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v)),
                    torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_double_backward_is_a_clear_error():
    # The varlen ops' autograd (C++, as the dense ops'): a gradient of the gradient is refused
    # by name, not computed as if the backward were constant.
    q, k, v, cq, ck = _packed([9, 20], [12, 20], 2, 1, 16, 16, torch.float64)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 20, 20, causal=True)
    dq, = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        dq.sum().backward()


def test_opcheck():
    q, k, v, cq, ck = _packed([9, 20], [12, 20], 2, 1, 16, 8, torch.float32)
    torch.library.opcheck(flash_attn_ext.varlen.fwd_varlen_op,
                          (q, k, v, cq, ck, 20, 20, None, True, -1, -1, 0.0, None, 0.0))


@pytest.mark.parametrize("case,match", [
    ("int64", "1-D int32 tensor"), ("decreasing", "non-decreasing"), ("past_end", "exceeds"),
    ("short_max", "shorter than the longest"), ("lengths", "same length"),
    ("rank", "3 dimensions"), ("alibi", "alibi_slopes must have shape")])
def test_bad_packing_is_a_clear_error(case, match):
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    args = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=6, max_seqlen_k=6)
    slopes = None
    if case == "int64":
        args["cu_seqlens_q"] = cq.long()
    elif case == "decreasing":
        args["cu_seqlens_q"] = torch.tensor([0, 7, 6], dtype=torch.int32)
    elif case == "past_end":
        args["cu_seqlens_k"] = torch.tensor([0, 4, 11], dtype=torch.int32)
    elif case == "short_max":
        args["max_seqlen_q"] = 5
    elif case == "lengths":
        args["cu_seqlens_k"] = torch.tensor([0, 10], dtype=torch.int32)
    elif case == "rank":
        q = q[None]
    else:
        slopes = torch.ones(3, 2)
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, k, v, alibi_slopes=slopes, **args)


def _paged(lens_k, page, heads_kv, d, dtype, gen, shared=False):
    """Pages holding each sequence's keys and values in a shuffled order, unused slots -1:
    (k_pages, v_pages, block_table, rows) with rows(b) the (len_k, heads_kv, d) index of
    sequence b's keys in the pages (for the contiguous reference).  ``shared``: sequence 1
    reads sequence 0's first page as its own first page (a prefix shared by reference)."""
    slots = max(1, max((n + page - 1) // page for n in lens_k))
    count = sum((n + page - 1) // page for n in lens_k) + 2  # (two pages nobody reads)
    order = torch.randperm(count, generator=gen)
    k_pages = torch.randn(count, page, heads_kv, d, generator=gen, dtype=dtype)
    v_pages = torch.randn(count, page, heads_kv, d, generator=gen, dtype=dtype)
    table = torch.full((len(lens_k), slots), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens_k):
        for j in range((n + page - 1) // page):
            table[b, j] = order[used]
            used += 1
    if shared and len(lens_k) > 1 and lens_k[0] and lens_k[1]:
        table[1, 0] = table[0, 0]

    def rows(b):
        j = torch.arange(lens_k[b])
        return table[b].long()[j // page], j % page
    return k_pages, v_pages, table, rows


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device and a CUDA build"))])
@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(window_size=(5, 2)),
                                  dict(seqused=True), dict(shared=True, causal=True)], ids=str)
def test_block_table_reads_paged_keys_as_the_packed_sequences(page, case, device):
    # FlashAttention's paged KV in flash_attn_varlen_func: k and v as pages, block_table the
    # pages of each sequence (it raised NotImplementedError).  Against the same call on the
    # keys gathered into packed sequences by hand: out, softmax_lse and the gradients of q and
    # of the pages (summed where two sequences share a page); lengths 0 and 1, GQA.  float64
    # on the CPU (equal to rounding), bf16 on CUDA (the same kernels on the same keys: a wrong
    # page or row would be off by O(1)).
    case = dict(case)
    gen = torch.Generator().manual_seed(page)
    lens_q, lens_k = [3, 5, 0, 1, 7], [9, 17, 4, 0, 6]
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    k_pages, v_pages, table, rows = _paged(lens_k, page, 2, 16, torch.float64, gen,
                                           shared=case.pop("shared", False))
    seqused = torch.tensor([9, 11, 0, 0, 6], dtype=torch.int32) if case.pop("seqused", False) \
        else None
    cq, ck = _offsets(lens_q), _offsets(lens_k)
    q = torch.randn(int(cq[-1]), 4, 16, generator=gen, dtype=torch.float64)
    dout = torch.randn(int(cq[-1]), 4, 16, generator=gen, dtype=torch.float64)
    q, dout, k_pages, v_pages = (t.to(device, dtype) for t in (q, dout, k_pages, v_pages))
    table = table.to(device)
    if seqused is not None:
        seqused = seqused.to(device)
    cq, ck = cq.to(device), ck.to(device)

    def run(paged):
        leaves = [t.clone().requires_grad_() for t in (q, k_pages, v_pages)]
        if paged:
            k, v, table_arg = leaves[1], leaves[2], table
        else:  # the same keys, gathered by hand into packed sequences
            k = torch.cat([leaves[1][rows(b)] for b in range(len(lens_k))])
            v = torch.cat([leaves[2][rows(b)] for b in range(len(lens_k))])
            table_arg = None
        out, lse, _ = flash_attn_varlen_func(leaves[0], k, v, cq, ck, max(lens_q),
                                             max(lens_k), return_attn_probs=True,
                                             block_table=table_arg, seqused_k=seqused, **case)
        return (out, lse) + torch.autograd.grad(out, leaves, dout, allow_unused=True)

    ours, ref = run(True), run(False)
    tol = 1e-12 if device == "cpu" else 2e-2
    for name, a, b in zip(("out", "lse", "dq", "dk_pages", "dv_pages"), ours, ref):
        b = torch.zeros_like(a) if b is None else b
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=name)


def test_block_table_errors_name_the_rule():
    gen = torch.Generator().manual_seed(0)
    k_pages, v_pages, table, _ = _paged([5, 7], 4, 2, 8, torch.float32, gen)
    q = torch.randn(4, 2, 8)
    cq, ck = _offsets([2, 2]), _offsets([5, 7])

    def call(**kw):
        args = dict(q=q, k=k_pages, v=v_pages, cu_seqlens_q=cq, cu_seqlens_k=ck,
                    max_seqlen_q=2, max_seqlen_k=7, block_table=table)
        args.update(kw)
        return flash_attn_varlen_func(**args)

    call()
    with pytest.raises(ValueError, match="block_table must be a \\(batch, max_num_blocks\\) "
                                         "= \\(2, ...\\) int32"):
        call(block_table=table.long())
    bad = table.clone()
    bad[1, 1] = 99
    with pytest.raises(ValueError, match=r"page indices in \[0, 6\).*block_table\[1, 1\]=99"):
        call(block_table=bad)
    bad = table.clone()
    bad[0, 1] = -1  # (slot 1 of sequence 0 holds keys 4..: used)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]=-1"):
        call(block_table=bad)
    with pytest.raises(ValueError, match="2 slots of 4 keys per sequence, but sequence 1 has "
                                         "9 keys"):
        call(cu_seqlens_k=_offsets([5, 9]), max_seqlen_k=9)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        call(cu_seqlens_k=torch.tensor([0, 5, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_k=6 is shorter"):
        call(max_seqlen_k=6)
    with pytest.raises(ValueError, match=r"seqused_k must be in \[0, each sequence's length\] "
                                         r"\(cu_seqlens_k: \[5, 7\]\), got \[5, 8\]"):
        call(seqused_k=torch.tensor([5, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seqused_k must be in \[0"):
        call(seqused_k=torch.tensor([-1, 2], dtype=torch.int32))
    # (a review: these were converted or failed with PyTorch's messages)
    for bad in (torch.tensor([2.7, 3.0]), torch.tensor([2, 3]), torch.tensor([2, 3, 1],
                                                                              dtype=torch.int32)):
        with pytest.raises(ValueError, match="seqused_k must be a \\(batch,\\) = \\(2,\\) "
                                             "int32 tensor"):
            call(seqused_k=bad)
    with pytest.raises(ValueError, match="cu_seqlens_k must be on q's device"):
        call(cu_seqlens_k=ck.to("meta"))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must both have batch "
                                         "\\+ 1 entries"):
        call(cu_seqlens_q=_offsets([2, 1, 1]))
    with pytest.raises(ValueError, match="k must be pages of shape"):
        call(k=k_pages[0])
    with pytest.raises(TypeError, match="block_table must be a torch.Tensor"):
        call(block_table=[[0, 1], [2, 3]])


def test_block_table_copies_only_the_slots_max_seqlen_k_needs_and_takes_empty_pools(
        monkeypatch):
    # A table sized for the longest context (vLLM's) is cut to ceil(max_seqlen_k / page_size)
    # slots before the copy; a pool of no pages serves sequences of no keys (it raised
    # IndexError: a review).
    gen = torch.Generator().manual_seed(2)
    k_pages, v_pages, table, _ = _paged([5, 7], 4, 2, 8, torch.float64, gen)
    wide = torch.cat([table, torch.full((2, 1000), -1, dtype=torch.int32)], 1)
    q = torch.randn(4, 2, 8, dtype=torch.float64)
    cq, ck = _offsets([2, 2]), _offsets([5, 7])
    seen = {}
    real = flash_attn_ext.varlen.fwd_varlen_op

    def spy(q, k, *args):
        seen["rows"] = k.shape[0]
        return real(q, k, *args)

    with monkeypatch.context() as patched:
        patched.setattr(flash_attn_ext.varlen, "fwd_varlen_op", spy)
        out = flash_attn_varlen_func(q, k_pages, v_pages, cq, ck, 2, 7, block_table=wide)
    assert seen["rows"] == 2 * 8  # (2 slots of 4 keys per sequence, not 1002)
    torch.testing.assert_close(out, flash_attn_varlen_func(q, k_pages, v_pages, cq, ck, 2, 7,
                                                           block_table=table))
    empty = k_pages[:0]
    out = flash_attn_varlen_func(q, empty, empty, cq, _offsets([0, 0]), 2, 0,
                                 block_table=torch.full((2, 1), -1, dtype=torch.int32))
    assert torch.equal(out, torch.zeros_like(out))


def test_block_table_under_compile():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    k_pages, v_pages, table, _ = _paged([5, 7], 4, 2, 8, torch.float32, gen)
    q = torch.randn(4, 2, 8)
    cq, ck = _offsets([2, 2]), _offsets([5, 7])

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cq, ck, 2, 7, causal=True, block_table=table)

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(
        q, k_pages, v_pages), f(q, k_pages, v_pages))


def test_meta_tensors_get_the_fake_kernels_shapes():
    q, k, v, cq, ck = _packed([4], [4], 2, 2, 8, 8, torch.float32)
    # Meta tensors (torch.compile's tracing): the fake kernel's shapes.
    meta = [t.detach().to("meta") for t in (q, k, v)]
    with pytest.warns(UserWarning, match="'meta' has no flash_attn_ext kernel"):
        assert flash_attn_varlen_func(*meta, cq, ck, 4, 4).shape == (4, 2, 8)


def test_a_q_of_another_rank_is_named_by_the_fake_kernel_too():
    # The fake kernel unpacked q.shape into three names, so a 4-D q (e.g. a (1, total, H, D)
    # batch left in place) under torch.compile, on meta tensors and in explain() of a meta
    # call failed with "too many values to unpack (expected 3)", naming neither q nor the
    # rule (new-user trial); eager CPU calls name both (the op's own check).
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    q, k, v = q.detach()[None], k.detach(), v.detach()
    rule = r"q must have 3 dimensions \(total_q, num_heads, head_dim\) for packed sequences, " \
        r"got q.dim\(\)=4 with shape \[1, 10, 2, 8\]"
    with pytest.raises(ValueError, match=rule):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, 6)  # (the op's check: the same words)
    meta = [t.to("meta") for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=rule):
            flash_attn_varlen_func(*meta, cq, ck, 6, 6)
        with pytest.raises(ValueError, match=rule):
            flash_attn_ext.explain(*meta, layout="thd", cu_seqlens_q=cq, cu_seqlens_k=ck,
                                   max_seqlen_q=6, max_seqlen_k=6)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=rule):
        torch.compile(flash_attn_varlen_func, fullgraph=True, backend="aot_eager")(
            q, k, v, cq, ck, 6, 6)


@pytest.mark.usefixtures("clean_policy")
def test_meta_calls_are_reported_as_the_dense_calls_are():
    # A packed call on meta tensors recorded nothing (last_plan() still named an earlier call's
    # kernels) and warned of nothing, where flash_attn_func's meta call is a reported fallback
    # (new-user trial): both now report the same plan, warn, count it and refuse it in strict
    # mode; the offsets may be on the CPU or meta.
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    meta = [t.detach().to("meta") for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flash_attn_ext.flash_attn_func(*(t[None] for t in meta))
        dense = flash_attn_ext.last_plan()
        flash_attn_ext.reset_fallback_counts()
        for offsets in ((cq, ck), (cq.to("meta"), ck.to("meta"))):
            flash_attn_varlen_func(q, k, v, cq, ck, 6, 6)  # (a CPU call first: recorded)
            out = flash_attn_varlen_func(*meta, *offsets, 6, 6, causal=True)
            assert out.shape == (10, 2, 8) and out.device.type == "meta"
            assert flash_attn_ext.last_plan() == dense and not dense.fused
    assert flash_attn_ext.fallback_counts() == {"; ".join(dense.reasons): 2}
    with pytest.raises(flash_attn_ext.FallbackError, match="'meta' has no flash_attn_ext"):
        flash_attn_varlen_func(*meta, cq, ck, 6, 6, strict=True)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_uses_the_first_keys_of_each_sequence(causal):
    # Sequence b sees only its first seqused_k[b] keys (causal aligned over those); the unused
    # keys get zero gradients.
    lens_q, lens_k, used = [6, 9, 3], [10, 9, 12], [4, 9, 0]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 2, 1, 16, 16, torch.float64)
    seqused_k = torch.tensor(used, dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 9, 12, causal=causal, seqused_k=seqused_k)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # The reference: the same call with each sequence's keys cut to the used ones.
    keep, cu_used = _used_rows(ck, used)
    k_cut, v_cut = k.detach()[keep].requires_grad_(), v.detach()[keep].requires_grad_()
    q_ref = q.detach().requires_grad_()
    ref, _, ref_grads = _per_sequence(q_ref, k_cut, v_cut, cq, cu_used, dout, causal=causal)
    assert (out - ref).abs().max().item() < 1e-12
    assert (grads[0] - ref_grads[0]).abs().max().item() < 1e-11
    for g, r in zip(grads[1:], ref_grads[1:]):
        assert (g[keep] - r).abs().max().item() < 1e-11
        unused = torch.ones(g.shape[0], dtype=torch.bool)
        unused[keep] = False
        assert torch.equal(g[unused], torch.zeros_like(g[unused]))
    with pytest.raises(ValueError, match=r"seqused_k\[0\]=11 must be in \[0, 10\]"):
        flash_attn_varlen_func(q, k, v, cq, ck, 9, 12,
                               seqused_k=torch.tensor([11, 0, 0], dtype=torch.int32))


def test_packed_variants_read_in_place_and_match():
    from flash_attn_ext import flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func

    cu = _offsets([7, 12])
    qkv = torch.randn(19, 3, 2, 16, requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 12, causal=True)
    q, k, v = (qkv[:, i].detach().clone().requires_grad_() for i in range(3))
    want = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True)
    assert torch.equal(out, want)
    (grad,) = torch.autograd.grad(out.sum(), qkv)
    for i, g in enumerate(torch.autograd.grad(want.sum(), (q, k, v))):
        assert torch.equal(grad[:, i], g)
    kv = torch.stack([k.detach(), v.detach()], 1)
    assert torch.equal(flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 12, 12, causal=True), want)
    with pytest.raises(ValueError, match="qkv must have shape"):
        flash_attn_varlen_qkvpacked_func(qkv[:, :2], cu, 12)


def test_offsets_that_are_not_tensors_are_a_type_error_naming_them():
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor .* got list"):
        flash_attn_varlen_func(q, k, v, [0, 4, 10], ck, 6, 6)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor .* got tuple"):
        flash_attn_varlen_func(q, k, v, cq, (0, 4, 10), 6, 6)
    with pytest.raises(TypeError, match="seqused_k must be a torch.Tensor, got list"):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, seqused_k=[4, 6])
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got list"):
        flash_attn_ext.flash_attn_varlen_qkvpacked_func([q], cq, 6)
    # (slopes as a list: named, as flash_attn_func names them; was an AttributeError)
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor, got list"):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, alibi_slopes=[0.5, 0.25])


def test_tensors_on_another_device_are_named():
    # A meta tensor among CPU ones dispatched the op to its fake kernel, which returned
    # uninitialised memory without an error (new-user trial); now named before the op.
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    for kw, name in ((dict(k=k.to("meta")), "k"), (dict(v=v.to("meta")), "v")):
        args = dict(q=q, k=k, v=v) | kw
        with pytest.raises(ValueError, match=f"{name} must be on q's device \\(cpu\\), got meta"):
            flash_attn_varlen_func(args["q"], args["k"], args["v"], cq, ck, 6, 6)
    with pytest.raises(ValueError, match="alibi_slopes must be on cpu, got meta"):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, alibi_slopes=torch.rand(2, device="meta"))
    # The op called directly with a meta tensor reaches the fake kernel: named there too.
    with pytest.raises(ValueError, match="k must be on q's device"):
        torch.ops.flash_attn_ext.fwd_varlen(q, k.to("meta"), v, cq, ck, 6, 6)


def test_alibi_slopes_of_the_wrong_length_name_the_call_s_batch():
    # (the message named the packed views' batch of 1, not the number of sequences)
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(num_heads,\) = "
                                         r"\(2,\) or \(batch, num_heads\) = \(2, 2\) with "
                                         r"batch = len\(cu_seqlens_q\) - 1, got \[3\]"):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, alibi_slopes=torch.rand(3))


def test_autocast_casts_packed_sequences_as_flash_attn_func():
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attn_varlen_func(q, k.bfloat16(), v, cq, ck, 6, 6)
    assert out.dtype == torch.bfloat16
    want = flash_attn_varlen_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), cq, ck, 6, 6)
    assert torch.equal(out, want)


@pytest.mark.parametrize("bad", [None, "6", 6.7, True])
def test_max_seqlen_must_be_an_int(bad):
    # None raised int()'s TypeError naming nothing, "6" was accepted and 6.7 truncated to 6
    # (new-user trial).
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match=f"max_seqlen_q must be an int, got {bad!r}"):
        flash_attn_varlen_func(q, k, v, cq, ck, bad, 6)
    with pytest.raises(ValueError, match=f"max_seqlen_k must be an int, got {bad!r}"):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, bad)
    ref = flash_attn_varlen_func(q, k, v, cq, ck, 6, 6)
    assert torch.equal(flash_attn_varlen_func(q, k, v, cq, ck, torch.tensor(6), 6), ref)


def test_max_seqlen_beyond_int64_is_a_clear_error():
    # 2**63 reached the op, whose argument parser said "Expected a value of type 'int' ...
    # but instead found type 'int'" (new-user trial).
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    for name, args in (("max_seqlen_q", (2**63, 6)), ("max_seqlen_k", (6, -2**63 - 1))):
        with pytest.raises(ValueError, match=f"{name} must fit in int64, got"):
            flash_attn_varlen_func(q, k, v, cq, ck, *args)


@pytest.mark.parametrize("bad", [-1, -6, torch.tensor(-2)])
def test_negative_max_seqlen_is_a_clear_error(bad):
    # max_seqlen_q=-1 was refused by the op as "max_seqlen_q=-1 is shorter than the longest
    # sequence (6)", naming no rule a length breaks (new-user trial); with block_table too.
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    value = int(bad)
    with pytest.raises(ValueError, match=rf"max_seqlen_q must be >= 0 \(a length: at least the "
                                         rf"longest sequence's\), got {value}$"):
        flash_attn_varlen_func(q, k, v, cq, ck, bad, 6)
    with pytest.raises(ValueError, match=rf"max_seqlen_k must be >= 0 .*got {value}$"):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, bad)
    pages = k.reshape(5, 2, 2, 8)
    table = torch.tensor([[0, 1, 2], [2, 3, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"max_seqlen_k must be >= 0 .*got {value}$"):
        flash_attn_varlen_func(q, pages, pages, cq, ck, 6, bad, block_table=table)
    # (0 is a length: the offsets' rule then names the longest sequence)
    with pytest.raises(ValueError, match=r"max_seqlen_q=0 is shorter than the longest sequence "
                                         r"\(6\)"):
        flash_attn_varlen_func(q, k, v, cq, ck, 0, 6)


def test_offsets_on_another_device_are_a_clear_error_not_uninitialised_memory():
    # An offset tensor on the meta device beside CPU tensors dispatches the ops to their fake
    # kernels, which returned uninitialised memory (new-user trial); they now apply the
    # kernels' device rule (on q's device or on the CPU) and name the tensor.
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    meta = torch.device("meta")
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be on q's device \(cpu\) or on "
                                         r"the CPU, got meta"):
        flash_attn_varlen_func(q, k, v, cq.to(meta), ck, 6, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be on .* as cu_seqlens_q \(cpu\), "
                                         r"got meta"):
        flash_attn_varlen_func(q, k, v, cq, ck.to(meta), 6, 6)
    with pytest.raises(ValueError, match="seqused_k must be on .* got meta"):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, 6,
                               seqused_k=torch.tensor([4, 6], dtype=torch.int32, device=meta))
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, return_attn_probs=True)[:2]
    g = torch.randn_like(out)
    with pytest.raises(ValueError, match="cu_seqlens_k must be on .* got meta"):
        torch.ops.flash_attn_ext.bwd_varlen(g, q, k, v, out, lse, cq, ck.to(meta), 6, 6,
                                            torch.zeros(2, dtype=torch.int64))
    # all on the meta device (shape inference) stays allowed
    qm, km, vm = (t.to(meta) for t in (q, k, v))
    out_m = torch.ops.flash_attn_ext.fwd_varlen(qm, km, vm, cq.to(meta), ck.to(meta), 6, 6)[0]
    assert out_m.shape == out.shape and out_m.device == meta


def test_shape_errors_name_the_packed_dimensions():
    # The rules are the dense ones, but the message names the dimension of the (total, H, D)
    # tensor the caller passed (a dense (1, total, H, D) view's numbers confused them).
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 4, 2, 8, 8, torch.float32)
    heads3 = torch.randn(10, 3, 8)
    cases = [((q, k, heads3), r"same number of heads, got k.size\(1\)=2, v.size\(1\)=3"),
             ((q, heads3, heads3), r"q.size\(1\)=4 and num_heads_k k.size\(1\)=3"),
             ((q, k, torch.randn(9, 2, 8)), r"same total_k, got k.size\(0\)=10, v.size\(0\)=9"),
             ((q, torch.randn(10, 2, 4), v),
              r"k.size\(2\) \(head_dim\) must equal q.size\(2\)=8, got 4"),
             ((torch.randn(10, 4, 300), torch.randn(10, 2, 300), torch.randn(10, 2, 300)),
              r"head_dim must be between 1 and 256, got q.size\(2\)=300")]
    for (qq, kk, vv), match in cases:
        with pytest.raises(ValueError, match=match):
            flash_attn_varlen_func(qq, kk, vv, cq, ck, 6, 6)


@pytest.mark.parametrize("flags,match", [
    (dict(causal="False"), "causal must be a bool, got 'False'"),
    (dict(window_size=(1.9, 0)), "window_size must be a pair of ints"),
    (dict(window_size=5), "window_size must be a pair of ints"),
    (dict(dropout_p="x"), "dropout_p must be a number"),
    (dict(softmax_scale="x"), "softmax_scale must be a finite number"),
    (dict(return_attn_probs="yes"), "return_attn_probs must be a bool"),
    (dict(alibi_slopes=torch.ones(2, requires_grad=True)), "alibi_slopes requires grad")])
def test_flags_are_checked_as_flash_attn_func_checks_them(flags, match):
    # A string "False" for causal was taken as True (bool("False")), a fractional window
    # truncated: each is the ValueError flash_attn_func gives.
    q, k, v, cq, ck = _packed([4, 6], [4, 6], 2, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, **flags)


def test_strict_is_taken_as_flash_attn_func_takes_it():
    # flash_attn_varlen_func lacked flash_attn_func's strict= (new-user trial).  No call of it
    # falls back (every call runs on the packed-sequence kernels, or raises), so strict=True,
    # and strict mode set for the process, leave the answer as it is, with no warning and
    # nothing counted; the value is checked by flash_attn_func's rule (policy.check_strict).
    from flash_attn_ext import policy
    q, k, v, cq, ck = _packed([4, 6], [5, 3], 2, 2, 8, 8, torch.float32)
    want = flash_attn_varlen_func(q, k, v, cq, ck, 6, 5, causal=True)
    policy.reset_fallback_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for strict in (None, False, True):
            got = flash_attn_varlen_func(q, k, v, cq, ck, 6, 5, causal=True, strict=strict)
            assert torch.equal(got, want)
        policy.set_strict(True)
        try:
            assert torch.equal(flash_attn_varlen_func(q, k, v, cq, ck, 6, 5, causal=True), want)
        finally:
            policy.set_strict(None)
    assert policy.fallback_counts() == {}
    for bad in ("no", 1):
        message = re.escape(f"strict must be True, False or None, got {bad!r}")
        with pytest.raises(ValueError, match=message):
            flash_attn_varlen_func(q, k, v, cq, ck, 6, 5, strict=bad)
        with pytest.raises(ValueError, match=message):  # (the same rule)
            flash_attn_func(q[None, :4], k[None, :5], v[None, :5], strict=bad)


def _cuda_case_under_the_error_rule(lens_q, lens_k, heads, heads_kv, d, dtype, case,
                                    tail=(0, 0), grads=True):
    """Packed sequences on the CUDA kernels against the float64 reference of each sequence, out
    and softmax_lse (and the gradients) under the error rule, with PyTorch's error in ``dtype``
    sequence by sequence as the yardstick; rows past the last offset left alone.  Returns the
    names of the CUDA kernels the forward launched and those the backward launched (empty
    without ``grads``)."""
    case = dict(case)
    variant = _variant_of(case)
    q64, k64, v64, cq, ck = _packed(lens_q, lens_k, heads, heads_kv, d, d, torch.float64,
                                    tail=tail)
    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in (q64, k64, v64))
    alibi = case.pop("alibi", None)
    slopes = None if alibi is None else \
        torch.rand(*((len(lens_q),) if alibi == "batch_head" else ()), heads,
                   dtype=torch.float64)
    gpu = dict(alibi_slopes=None if slopes is None else slopes.float().cuda(), **case)
    result = {}

    def run():
        result["out"], result["lse"], _ = flash_attn_varlen_func(
            q, k, v, cq.cuda(), ck.cuda(), max(lens_q), max(lens_k), return_attn_probs=True,
            **gpu)
    state = _rng_state(q.device)
    names = launched_kernels(run)
    # The recorded plan names the forward that ran (varlen calls recorded none before).
    plan = flash_attn_ext.last_plan()
    hopper = any("flash_fwd_sm90_kernel" in n for n in names)
    assert plan.fused and plan.kernel.startswith("sm90_fwd" if hopper else "sm80_fwd"), (
        plan, names)
    varlen_name = "_varlen_" + variant if variant else "_varlen"
    assert plan.kernel.endswith(varlen_name) == hopper, (plan, names)
    # (dropout: each sequence's mask, from the (seed, offset) the call drew)
    keeps = _dropout_keeps(q, k, v, cq, ck, gpu, state) if "dropout_p" in case else None
    out, lse = result["out"], result["lse"]
    dout = torch.randn_like(out)
    wl, wr = case.pop("window_size", (-1, -1))
    ref_kw = dict(window_left=wl, window_right=wr, **case)
    true, true_lse, true_grads = _per_sequence(q.cpu(), k.cpu(), v.cpu(), cq, ck, dout.cpu(),
                                               keeps=keeps, alibi_slopes=slopes, **ref_kw)
    # PyTorch's error in the same precision, sequence by sequence (the rule's yardstick).
    low, leaves = _low_per_sequence(q, k, v, cq, ck, dtype, slopes, keeps=keeps, **ref_kw)
    assert_error_rule(out.cpu(), low, true, 2.0, "out")
    finite = torch.isfinite(true_lse)
    assert_lse_infinities(lse, true_lse)
    assert (lse.cpu().double()[finite] - true_lse[finite]).abs().max().item() < 1e-3
    if tail[0]:
        assert torch.equal(out[-tail[0]:], torch.zeros_like(out[-tail[0]:]))  # left alone
    bwd_names = []
    if grads:
        def backward():
            result["grads"] = torch.autograd.grad(out, (q, k, v), dout)
        bwd_names = launched_kernels(backward)
        hopper_bwd = any("flash_bwd_sm90_kernel" in n for n in bwd_names)
        assert plan.backward_kernel.startswith("sm90_bwd" if hopper_bwd else "sm80_bwd"), (
            plan, bwd_names)
        ours = result["grads"]
        for name, g, lo, t in zip(("dq", "dk", "dv"), ours,
                                  _low_grads(low, leaves, dout, dtype), true_grads):
            assert_error_rule(g.cpu(), lo, t, 3.0, name)
        if tail[1]:
            assert torch.equal(ours[1][-tail[1]:], torch.zeros_like(ours[1][-tail[1]:]))
        if tail[0]:
            assert torch.equal(ours[0][-tail[0]:], torch.zeros_like(ours[0][-tail[0]:]))
    return names, bwd_names


def _on_sm90():
    info = flash_attn_ext.ops.build_info()
    return (HAS_CUDA and info.get("sm90", False)
            and torch.cuda.get_device_capability() == (9, 0))


def _variant_of(case):
    """The one score modifier of a case ("softcap", "alibi" or "dropout"), whose Hopper varlen
    variant runs it, or "" for plain attention."""
    mods = [name for name, key in (("softcap", "softcap"), ("alibi", "alibi"),
                                   ("dropout", "dropout_p")) if case.get(key)]
    assert len(mods) <= 1, case
    return mods[0] if mods else ""


def _varlen_flags(variant):
    return {"varlen", variant} - {""}


def _varlen_sm90(name, variant=""):
    """Whether ``name`` is the Hopper forward's varlen instantiation (plain attention: causal
    and windows per sequence; kVarlen alone among its traits' flags), or with ``variant``
    ("softcap", "alibi", "dropout") its varlen one for that modifier alone (kVarlen and it)."""
    return sm90_variant_flags(name) == _varlen_flags(variant)


def _assert_hopper_varlen(names, bwd_names, case):
    """The forward kernels `names` launched are the Hopper varlen instantiation of the case's
    modifier (_variant_of), and so is one of the backward's `bwd_names`."""
    variant = _variant_of(case)
    hopper = [n for n in names if "flash_fwd_sm90_kernel" in n]
    assert hopper and all(_varlen_sm90(n, variant) for n in hopper), names
    assert _hopper_bwd_varlen(bwd_names, variant), bwd_names


def _hopper_bwd_varlen(names, variant=""):
    """Whether the Hopper backward's varlen instantiation (Sm90BwdTraits<..., kGeneral,
    kDropout, kMask, kVarlen, kSoftcap, kAlibi>: kVarlen alone), or with ``variant`` its
    varlen one for that modifier alone, ran."""
    return any("flash_bwd_sm90_kernel" in n
               and sm90_variant_flags(n, "Sm90BwdTraits") == _varlen_flags(variant)
               for n in names)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_each_sequence_under_the_error_rule(case, dtype, portable, kernel_opts):
    # The CPU test's geometry on the CUDA kernels, longer (several query and key blocks, partial
    # ones), head dim 40 (padded), GQA, rows past the last offset: on the kernels the
    # dispatcher picks (on an H200 the Hopper varlen forward for plain, causal and window
    # cases, its varlen softcap, ALiBi and dropout ones for those alone; dropout against each
    # sequence's regenerated mask) and on the portable ones.
    kernel_opts(force_portable=portable)
    names, bwd_names = _cuda_case_under_the_error_rule([5, 0, 200, 1, 130], [7, 3, 150, 9, 130],
                                                       4, 2, 40, dtype, case, tail=(2, 3))
    variant = _variant_of(case)
    hopper = not portable and _on_sm90()
    assert any(_varlen_sm90(n, variant) for n in names) == hopper, names
    assert any("flash_fwd_sm90_kernel" in n for n in names) == \
        any(_varlen_sm90(n, variant) for n in names), names
    # (the backward likewise: the Hopper varlen backward of the same variant)
    assert _hopper_bwd_varlen(bwd_names, variant) == hopper, bwd_names
    assert any("flash_bwd_sm90_kernel" in n for n in bwd_names) == hopper, bwd_names


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and a build with the Hopper "
                    "kernels")
@pytest.mark.parametrize("head_dim", [40, 59, 72, 128, 256])
@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(window_size=(50, 7)),
                                  dict(window_size=(50, 7), softcap=5.0),
                                  dict(causal=True, alibi="batch_head"),
                                  dict(window_size=(50, 7), alibi="head"),
                                  dict(causal=True, dropout_p=0.17)], ids=str)
def test_sm90_forward_takes_packed_sequences(case, head_dim):
    # Lengths 1, 17, 0, 113, 1023, 300 queries against 1, 40, 5, 113, 1000, 129 keys: a single
    # row, L < S, an empty sequence, L = S, several query blocks with a partial last one (192
    # rows at head dims up to 64, 128 above, and for dropout at 64 too; idle warpgroups), L > S
    # (causal rows that see nothing); GQA 6:2; rows past the last offset.  The forward is the
    # Hopper varlen kernel (with softcap, ALiBi (each sequence's slopes and bottom-right
    # offset) or dropout (each sequence's mask) its varlen one for that modifier), and so is
    # the backward (at 256 its step split by role, 64 keys per CTA).
    dtype = torch.bfloat16 if head_dim != 72 else torch.float16
    names, bwd_names = _cuda_case_under_the_error_rule([1, 17, 0, 113, 1023, 300],
                                                       [1, 40, 5, 113, 1000, 129], 6, 2,
                                                       head_dim, dtype, case, tail=(3, 2))
    _assert_hopper_varlen(names, bwd_names, case)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and a build with the Hopper "
                    "kernels")
@pytest.mark.parametrize("options", [dict(sm90_per_score_consumers=2),
                                     dict(sm90_per_score_consumers=3),
                                     dict(sm90_narrow_tiles=True), dict(sm90_alibi_fold=False),
                                     dict(sm90_fma_exp2=0)], ids=str)
@pytest.mark.parametrize("case", [dict(causal=True, alibi="batch_head"),
                                  dict(causal=True, dropout_p=0.17),
                                  dict(causal=True, softcap=5.0)], ids=str)
def test_sm90_varlen_takes_the_dense_shape_options_as_they_apply(case, options, kernel_opts):
    # The Hopper forward's experimental options at head dim 64: the shape options (the other
    # warpgroup count, 96-key tiles) change dense calls only, a packed call keeping its tile
    # table's block (the varlen instantiations compile that one shape); the ALiBi fold off
    # takes the term per score, the softcap exp2 split off the MUFU's exp2 alone.  Each on the
    # Hopper varlen kernels of the case's modifier, under the error rule.
    kernel_opts(**options)
    names, bwd_names = _cuda_case_under_the_error_rule([1, 17, 0, 113, 300], [1, 40, 5, 113, 129],
                                                       4, 2, 64, torch.bfloat16, case,
                                                       tail=(2, 1))
    _assert_hopper_varlen(names, bwd_names, case)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and a build with the Hopper "
                    "kernels")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(window_size=(50, 7)),
                                  dict(causal=True, dropout_p=0.17)], ids=str)
def test_sm90_varlen_forward_tile_orders_agree(case, head_dim, kernel_opts):
    # The Hopper varlen forward's tile order (sm90_varlen_sections: each sequence's query
    # blocks together in sections of heads; off: the heaviest blocks of all sequences first,
    # the heads fastest; sm90_section_pairs: other section sizes, one head to all of them)
    # changes which CTA takes a tile, not what it computes: out and LSE bitwise equal, with
    # uneven and empty sequences (the longest in the middle), GQA 6:2.  (The error rule holds
    # for the default order in the tests above.)
    lens_q, lens_k = [300, 0, 17, 1023, 1, 500], [129, 5, 40, 1000, 1, 700]
    q, k, v, cq, ck = (t.cuda() if isinstance(t, torch.Tensor) else t for t in
                       _packed(lens_q, lens_k, 6, 2, head_dim, head_dim, torch.bfloat16))
    q, k, v = (t.detach() for t in (q, k, v))
    outs = []
    for options in (dict(sm90_varlen_sections=True), dict(sm90_varlen_sections=False),
                    dict(sm90_section_pairs=1), dict(sm90_section_pairs=4),
                    dict(sm90_section_pairs=6)):
        kernel_opts(sm90_varlen_sections=True, sm90_section_pairs=0)
        kernel_opts(**options)
        torch.manual_seed(3)  # (the same dropout mask in every order)
        out, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                             return_attn_probs=True, **case)
        plan = flash_attn_ext.last_plan()
        assert plan.kernel.startswith("sm90_fwd") and "_varlen" in plan.kernel, plan
        outs.append((out, lse))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    assert not outs[0][0].isnan().any()


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and a build with the Hopper "
                    "kernels")
@pytest.mark.parametrize("variant", ["", "softcap", "alibi", "dropout"])
def test_sm90_varlen_many_sequences_and_seqused_k(variant, kernel_opts):
    # 300 sequences of 0-300 rows (many tiles per CTA, the dynamic schedule's longest-first
    # table; in the backward a table of key blocks, most CTAs a sequence's last), seqused_k
    # leaving some keys unused (their gradients zero), GQA 4:2, causal, plain and with softcap,
    # ALiBi ((B, H) slopes, each sequence's offset over its used keys) or dropout alone: the
    # Hopper varlen kernels and the portable ones each under the error rule against a float64
    # reference over the used keys (dropout: with each call's masks), forward and gradients.
    gen = torch.Generator().manual_seed(0)
    lens_q = torch.randint(0, 300, (300,), generator=gen).tolist()
    lens_k = torch.randint(1, 300, (300,), generator=gen).tolist()
    used = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lens_k]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, 128, 128, torch.bfloat16)
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    args = (q, k, v, cq.cuda(), ck.cuda(), max(lens_q), max(lens_k))
    slopes = torch.rand(300, 4, generator=gen, dtype=torch.float64) \
        if variant == "alibi" else None
    mods = dict(softcap=5.0 if variant == "softcap" else 0.0,
                dropout_p=0.17 if variant == "dropout" else 0.0,
                alibi_slopes=None if slopes is None else slopes.float().cuda())
    kw = dict(causal=True, seqused_k=torch.tensor(used, dtype=torch.int32).cuda(),
              return_attn_probs=True, **mods)
    result, keeps = {}, {}

    def run(key):
        def call():
            out, lse, _ = flash_attn_varlen_func(*args, **kw)
            result[key] = (out, lse, torch.autograd.grad(out, (q, k, v), dout))
        return call
    state = _rng_state(q.device)
    names = launched_kernels(run("hopper"))
    if variant == "dropout":  # (each call's masks, over the used keys)
        keeps["hopper"] = _dropout_keeps(q, k, v, cq, ck, kw, state)
    assert any(_varlen_sm90(n, variant) for n in names), names
    assert _hopper_bwd_varlen(names, variant), names
    kernel_opts(force_portable=True)
    state = _rng_state(q.device)
    names = launched_kernels(run("portable"))
    if variant == "dropout":
        keeps["portable"] = _dropout_keeps(q, k, v, cq, ck, kw, state)
    assert names and not any("_sm90_" in n for n in names), names
    kernel_opts(force_portable=False)
    # The reference over the used keys alone (each sequence's first used[b] keys).
    keep, cu_used = _used_rows(ck, used)
    q_ref, k_ref, v_ref = q.detach().cpu(), k.detach().cpu()[keep], v.detach().cpu()[keep]
    unused = torch.ones(k.shape[0], dtype=torch.bool)
    unused[keep] = False
    ref_kw = dict(causal=True, softcap=mods["softcap"], dropout_p=mods["dropout_p"])

    def reference(masks):
        true, true_lse, true_grads = _per_sequence(q_ref, k_ref, v_ref, cq, cu_used,
                                                   dout.cpu(), keeps=masks,
                                                   alibi_slopes=slopes, **ref_kw)
        low, leaves = _low_per_sequence(q_ref, k_ref, v_ref, cq, cu_used, torch.bfloat16,
                                        slopes, keeps=masks, **ref_kw)
        return true, true_lse, true_grads, low, _low_grads(low, leaves, dout, torch.bfloat16)
    shared = None if variant == "dropout" else reference(None)
    for key in ("hopper", "portable"):
        true, true_lse, true_grads, low, low_grads = shared or reference(
            [m[..., :n] for m, n in zip(keeps[key], used)])
        finite = torch.isfinite(true_lse)
        out, lse, grads = result[key]
        assert_error_rule(out.cpu(), low, true, 2.0, f"{key} out")
        assert_lse_infinities(lse, true_lse)
        assert (lse.cpu().double()[finite] - true_lse[finite]).abs().max().item() < 1e-3, key
        for name, g, lo, t in zip(("dq", "dk", "dv"), grads, low_grads, true_grads):
            g = g.cpu()
            if name != "dq":
                assert torch.equal(g[unused], torch.zeros_like(g[unused])), (key, name)
                g = g[keep]
            assert_error_rule(g, lo, t, 3.0, f"{key} {name}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
def test_cuda_softmax_lse_is_differentiable():
    grads, ref_grads, low_grads = _lse_gradient_case("cuda", torch.bfloat16)
    for name, g, lo, r in zip(("dq", "dk", "dv"), grads, low_grads, ref_grads):
        assert_error_rule(g.cpu(), lo, r, 3.0, name)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_cuda_equal_lengths_are_the_dense_portable_batch(dropout_p, kernel_opts):
    # Packed sequences run on the portable kernels: the dense call on the same kernels gives the
    # same bits, and with the same generator state drops the same elements (dropout.h).
    kernel_opts(force_portable=True)
    q, k, v = (torch.randn(3, 77, 4, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in "qkv")
    dout = torch.randn(3, 77, 4, 64, device="cuda", dtype=torch.bfloat16)
    _assert_packed_equal_lengths_are_dense(q, k, v, dout, dropout_p)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
def test_cuda_seqused_k_and_bad_input():
    lens_q, lens_k, used = [6, 90, 3], [10, 90, 12], [4, 70, 0]
    q64, k64, v64, cq, ck = _packed(lens_q, lens_k, 2, 1, 64, 64, torch.float64)
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (q64, k64, v64))
    seqused_k = torch.tensor(used, dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cq.cuda(), ck.cuda(), 90, 90, causal=True,
                                 seqused_k=seqused_k.cuda())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # The reference: each sequence against its used keys only (causal bottom-right over them),
    # out and the gradients of q and of the used keys under the error rule.
    keep = torch.cat([torch.arange(int(ck[b]), int(ck[b]) + used[b]) for b in range(3)])
    k_used, v_used = k.detach().cpu()[keep], v.detach().cpu()[keep]
    true, _, true_grads = _per_sequence(q.cpu(), k_used, v_used, cq, _offsets(used), dout.cpu(),
                                        causal=True)
    low, leaves = _low_per_sequence(q, k_used, v_used, cq, _offsets(used), torch.bfloat16,
                                    causal=True)
    assert_error_rule(out.cpu(), low, true, 2.0, "out")
    low_grads = _low_grads(low, leaves, dout, torch.bfloat16)
    for name, g, lo, t in zip(("dq", "dk", "dv"), grads, low_grads, true_grads):
        assert_error_rule(g.cpu() if name == "dq" else g.cpu()[keep], lo, t, 3.0, name)
    unused = torch.ones(k.shape[0], dtype=torch.bool)
    unused[keep] = False
    for g in grads[1:]:
        assert torch.equal(g[unused.cuda()], torch.zeros_like(g[unused.cuda()]))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be on q's device \(cuda:0\) or "
                       r"on the CPU, as cu_seqlens_q \(cpu\), got cuda:0"):
        flash_attn_varlen_func(q, k, v, cq, ck.cuda(), 90, 90)
    with pytest.raises(ValueError, match="seqused_k must be on q's device"):
        flash_attn_varlen_func(q, k, v, cq.cuda(), ck.cuda(), 90, 90, seqused_k=seqused_k)
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 7, 6, 99], dtype=torch.int32).cuda(),
                               ck.cuda(), 90, 90)
    with pytest.raises(ValueError, match="is not supported on"):
        flash_attn_varlen_func(q.float(), k.float(), v.float(), cq.cuda(), ck.cuda(), 90, 90)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
@pytest.mark.parametrize("with_seqused_k", [False, True])
def test_cuda_offsets_synchronise_once_per_call_and_on_the_host_never(with_seqused_k):
    # Offsets on the GPU: one synchronisation for the forward and the backward together (the
    # host copy flash_attn_varlen_func makes once); offsets on the CPU: none (uploaded from
    # pinned memory).  Counted by PyTorch's sync debug mode, which flags every synchronising
    # CUDA call; the results are the same either way.
    lens_q, lens_k = [6, 90, 3, 40], [10, 90, 12, 40]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, 64, 64, torch.bfloat16, tail=(3, 3))
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    used = torch.tensor([10, 70, 0, 40], dtype=torch.int32) if with_seqused_k else None
    host = (cq, ck, used)
    device = tuple(None if t is None else t.cuda() for t in host)

    def run(cu_q, cu_k, seqused_k):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 90, 90, causal=True,
                                     seqused_k=seqused_k)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))
    reference = run(*device)
    run(*host)  # (first calls allocate pinned memory)
    torch.cuda.synchronize()
    for offsets, expected in ((device, 1), (host, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = run(*offsets)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught
                 if "called a synchronizing CUDA operation" in str(w.message)]
        assert len(syncs) == expected, syncs
        assert torch.equal(result[0], reference[0])
        for name, got, want in zip(("dq", "dk", "dv"), result[1:], reference[1:]):
            # (dQ: the Hopper backward adds it in any order)
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2, msg=name)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
@pytest.mark.parametrize("offsets_on_host", [False, True])
def test_cuda_paged_call_synchronises_once(offsets_on_host):
    # block_table on the GPU: its checks read it on the host, in the one copy that also takes
    # the offsets (and seqused_k), so a paged call waits for the GPU once, forward and
    # backward together, wherever the offsets are.
    gen = torch.Generator().manual_seed(3)
    lens_q, lens_k = [6, 30, 3], [10, 45, 12]
    k_pages, v_pages, table, _ = _paged(lens_k, 16, 2, 64, torch.float32, gen)
    k_pages, v_pages = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (k_pages, v_pages))
    table = table.cuda()
    cq, ck = _offsets(lens_q), _offsets(lens_k)
    if not offsets_on_host:
        cq, ck = cq.cuda(), ck.cuda()
    q = torch.randn(int(cq[-1]), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)

    def run():
        out = flash_attn_varlen_func(q, k_pages, v_pages, cq, ck, 30, 45, causal=True,
                                     block_table=table)
        return (out, *torch.autograd.grad(out, (q, k_pages, v_pages), dout))
    reference = run()  # (first calls allocate pinned memory)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught
             if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, syncs
    assert torch.equal(result[0], reference[0])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
@pytest.mark.parametrize("on_host", [False, True])
def test_cuda_capture_in_a_cuda_graph_is_a_clear_error(on_host):
    # The checks and tables are made on the host per call: a captured call would replay with
    # the offsets of its capture (offsets on the CPU upload nothing at replay), so capturing
    # is refused by name rather than failing in a copy or computing with stale offsets.
    q, k, v, cq, ck = _packed([5, 40], [7, 40], 2, 1, 64, 64, torch.bfloat16)
    q, k, v = (t.detach().cuda() for t in (q, k, v))
    offsets = (cq, ck) if on_host else (cq.cuda(), ck.cuda())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(graph):
            flash_attn_varlen_func(q, k, v, *offsets, 40, 40, causal=True)


def _hopper_deterministic_grads(grads, runs, variant=""):
    """grads(deterministic=True) on the Hopper varlen backward (its launched kernels; with
    ``variant`` its varlen one for that modifier), bitwise equal over `runs` calls; returns
    the first call's gradients."""
    result = {}
    names = launched_kernels(lambda: result.setdefault("first", grads(deterministic=True)))
    assert _hopper_bwd_varlen(names, variant), names
    for _ in range(runs - 1):
        again = grads(deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(again, result["first"]))
    return result["first"]


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and a build with the Hopper "
                    "kernels")
@pytest.mark.parametrize("case", ["waves", "dropped_blocks", "seqused_k"])
def test_sm90_varlen_deterministic_backward_order(case):
    # The fixed order's waits across CTAs: "waves" launches ~2,000 CTAs (an 8k causal
    # sequence among 40 short ones, 8 KV heads), far more than are resident at once, so a
    # table order in which a CTA waited for one launched after it would hang (the kernel
    # traps after a minute); "dropped_blocks": a window whose lowest key blocks no row sees
    # (no CTA, not counted); "seqused_k": key counts below the sequences' keys.  Bitwise
    # reproducible over 5 runs and the same as the default order up to dQ's summation order.
    torch.manual_seed(0)
    kw, used = dict(causal=True), None
    if case == "waves":
        lens_q = [8192] + [int(n) for n in torch.randint(1, 300, (40,))]
        lens_k, heads, heads_kv = lens_q, 16, 8
    elif case == "dropped_blocks":
        lens_q, lens_k, heads, heads_kv = [64, 30, 200], [700, 500, 200], 4, 2
        kw = dict(window_size=(100, 20))
    else:
        lens_q, lens_k, heads, heads_kv = [300, 129, 70], [400, 300, 70], 4, 4
        used = torch.tensor([350, 0, 64], dtype=torch.int32).cuda()
    q, k, v, cq, ck = _packed(lens_q, lens_k, heads, heads_kv, 128, 128, torch.bfloat16)
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def grads(**extra):
        out = flash_attn_varlen_func(q, k, v, cq.cuda(), ck.cuda(), max(lens_q), max(lens_k),
                                     seqused_k=used, **kw, **extra)
        return torch.autograd.grad(out, (q, k, v), dout)
    first = _hopper_deterministic_grads(grads, runs=5)
    for name, a, b in zip(("dq", "dk", "dv"), first, grads()):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and a build with the Hopper "
                    "kernels")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_varlen_sequences_stay_apart(head_dim):
    # The Hopper forward reads whole tiles: a sequence's last key tile and last query block run
    # into the next sequence.  NaN and inf there must not reach the first sequence's output
    # (its keys past the end are masked, their values zeroed before P V).  (That rows past a
    # sequence's end are not stored is what the tail rows of the tests above check.)
    lens = [100, 50, 7]
    q, k, v, cq, ck = _packed(lens, lens, 2, 2, head_dim, head_dim, torch.bfloat16)
    q, k, v = (t.detach().cuda() for t in (q, k, v))
    args = (cq.cuda(), ck.cuda(), max(lens), max(lens))
    clean = flash_attn_varlen_func(q, k, v, *args, return_attn_probs=True)
    for t in (q, k, v):
        t[100:150, 0] = float("nan")
        t[100:150, 1] = float("inf")
    names = launched_kernels(lambda: flash_attn_varlen_func(q, k, v, *args))
    assert any(_varlen_sm90(n) for n in names), names
    out, lse, _ = flash_attn_varlen_func(q, k, v, *args, return_attn_probs=True)
    assert torch.equal(out[:100], clean[0][:100]) and torch.equal(out[150:], clean[0][150:])
    assert torch.equal(lse[:, :100], clean[1][:, :100])
    assert torch.equal(lse[:, 150:], clean[1][:, 150:])
    # max_seqlen_q/k only bound the lengths from above: far larger ones change nothing.
    big = flash_attn_varlen_func(q, k, v, cq.cuda(), ck.cuda(), 10**9, 10**9)
    torch.testing.assert_close(big, out, rtol=0, atol=0, equal_nan=True)  # (NaN: the 2nd)
    # No sequence with a query row (rows past the last offset only): nothing to launch.
    none = torch.zeros(3, dtype=torch.int32, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(*leaves, none, ck[:3].cuda(), 1, 100,
                                         return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    # (and the backward: zero gradients, nothing to launch either)
    for g in torch.autograd.grad(out, leaves, torch.ones_like(out)):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and a build with the Hopper "
                    "kernels")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_varlen_backward_keeps_sequences_apart(head_dim, causal):
    # The Hopper backward reads whole tiles too: a sequence's last key block and last query
    # block run into the next sequence (or the rows past the last offset).  For each sequence,
    # NaN and inf in every other row of q, k, v and dout (tail rows included) must not reach
    # its gradients (rows past the end are zeroed in shared memory before the GEMMs: 0 * NaN
    # would carry them through P^T dO, dS^T Q and dS K).  Key lengths below and above 64 (one
    # or both consumer warpgroups' keys run past the end; at 256, 64 keys per CTA, one or two
    # blocks).  dK / dV are stored from registers
    # (the same bits as the clean call); dQ is added in any order (its last bits may differ,
    # so a tolerance).
    lens_q, lens_k = [100, 50, 7, 40], [90, 50, 30, 45]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, head_dim, head_dim, torch.bfloat16,
                              tail=(5, 5))
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    args = (cq.cuda(), ck.cuda(), max(lens_q), max(lens_k))

    def grads(q_in, k_in, v_in, d):
        out = flash_attn_varlen_func(q_in, k_in, v_in, *args, causal=causal)
        return torch.autograd.grad(out, (q_in, k_in, v_in), d)
    clean = grads(q, k, v, dout)
    for b in range(len(lens_q)):
        mine_q = slice(int(cq[b]), int(cq[b + 1]))
        mine_k = slice(int(ck[b]), int(ck[b + 1]))
        poisoned = []
        for t, mine in ((q, mine_q), (k, mine_k), (v, mine_k), (dout, mine_q)):
            bad = t.detach().clone()
            keep = bad[mine].clone()
            bad[:, 0] = float("nan")
            bad[:, 1] = float("inf")
            bad[mine] = keep
            poisoned.append(bad)
        pq, pk, pv, pd = poisoned
        pq, pk, pv = (t.requires_grad_() for t in (pq, pk, pv))
        result = {}
        names = launched_kernels(
            lambda r=result, t=(pq, pk, pv, pd): r.setdefault("g", grads(*t)))
        assert _hopper_bwd_varlen(names), names
        for name, c, g, mine in zip(("dq", "dk", "dv"), clean, result["g"],
                                    (mine_q, mine_k, mine_k)):
            assert torch.isfinite(g[mine]).all(), (b, name)
            if name == "dq":
                torch.testing.assert_close(g[mine], c[mine], atol=1e-2, rtol=1e-2)
            else:
                assert torch.equal(g[mine], c[mine]), (b, name)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and a build with the Hopper "
                    "kernels")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "causal_softcap", "causal_alibi",
                                  "causal_dropout"])
def test_sm90_varlen_deterministic_backward(head_dim, mask):
    # deterministic=True (and torch.use_deterministic_algorithms) keep the Hopper varlen
    # backward (with softcap, ALiBi or dropout its varlen one for that modifier), dQ added in a
    # fixed order (each sequence's key blocks the highest first): bitwise reproducible over 10
    # runs (dropout: each run from the same generator seed); the same gradients as the default
    # order up to the order of dQ's fp32 sums, and as a float64 reference per sequence.
    # Lengths: an empty sequence, some below one block, several key blocks (dQ waits across
    # blocks), GQA.
    lens_q, lens_k = [300, 0, 5, 129, 700, 64], [280, 7, 5, 200, 700, 64]
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, head_dim, head_dim, torch.bfloat16,
                              tail=(3, 3))
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    variant = mask.partition("_")[2]
    slopes = torch.rand(len(lens_q), 4, dtype=torch.float64) if variant == "alibi" else None
    kw = dict(causal=mask.startswith("causal"),
              window_size=(100, 20) if mask == "window" else (-1, -1),
              softcap=5.0 if variant == "softcap" else 0.0,
              dropout_p=0.17 if variant == "dropout" else 0.0,
              alibi_slopes=None if slopes is None else slopes.float().cuda())

    def grads(**extra):
        torch.cuda.manual_seed(1234)  # (dropout: the same mask in every run)
        out = flash_attn_varlen_func(q, k, v, cq.cuda(), ck.cuda(), max(lens_q), max(lens_k),
                                     **kw, **extra)
        return torch.autograd.grad(out, (q, k, v), dout)
    result = {"first": _hopper_deterministic_grads(grads, runs=10, variant=variant)}
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        names = launched_kernels(lambda: result.setdefault("global", grads()))
    finally:
        torch.use_deterministic_algorithms(old)
    assert _hopper_bwd_varlen(names, variant), names
    assert all(torch.equal(a, b) for a, b in zip(result["global"], result["first"]))
    default = grads()
    for name, a, b in zip(("dq", "dk", "dv"), result["first"], default):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2, msg=name)
    keeps = None
    if variant == "dropout":  # (the mask every run drew: the seed grads sets)
        torch.cuda.manual_seed(1234)
        keeps = _dropout_keeps(q, k, v, cq, ck, kw, _rng_state(q.device))
    wl, wr = kw["window_size"]
    ref_kw = dict(causal=kw["causal"], window_left=wl, window_right=wr, softcap=kw["softcap"],
                  dropout_p=kw["dropout_p"])
    _, _, ref = _per_sequence(q.cpu(), k.cpu(), v.cpu(), cq, ck, dout.cpu(), keeps=keeps,
                              alibi_slopes=slopes, **ref_kw)
    low, leaves = _low_per_sequence(q, k, v, cq, ck, q.dtype, slopes, keeps=keeps, **ref_kw)
    for name, a, lo, want in zip(("dq", "dk", "dv"), result["first"],
                                 _low_grads(low, leaves, dout, q.dtype), ref):
        assert_error_rule(a.cpu(), lo, want, 3.0, name)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_backward_op(deterministic):
    # FlashAttention-2's `deterministic` is a flag of the backward: the forward op carries it
    # (autograd sees only the op's inputs) and its autograd (C++) hands it to bwd_varlen,
    # which on an H200 adds dQ in a fixed order for it.  Seen below autograd, where the ops
    # are dispatched.
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.flash_attn_ext.bwd_varlen.default:
                seen.append(args[20] if len(args) > 20 else kwargs.get("deterministic", False))
            return func(*args, **kwargs)

    q, k, v, cq, ck = _packed([3, 5], [4, 6], 2, 1, 8, 8, torch.float64)
    with Spy():
        out = flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, causal=True,
                                     deterministic=deterministic)
        torch.autograd.grad(out.sum(), (q, k, v))
    assert seen == [deterministic]


@pytest.mark.parametrize("maxima", [(2**63 - 1, 10), (10, 2**63 - 1), (10**10, 10**10),
                                    (4096, 4096)])
def test_max_seqlen_far_above_the_longest_sequence_changes_nothing(maxima):
    # max_seqlen_q / max_seqlen_k only bound the longest sequence (FlashAttention-2 code often
    # passes a model's maximum length).  Near 2**63 the CPU kernels' tile counts overflowed:
    # the forward returned zeros, the backward wrong dq and dk; 10**10 ran for seconds
    # (new-user trial).  Now the same bits as the exact maxima, forward and gradients, CPU.
    torch.manual_seed(0)
    q, k, v, cq, ck = _packed([8, 0, 3], [10, 4, 7], 4, 2, 16, 16, torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cq, ck, *maxima, causal=True)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    want_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = flash_attn_varlen_func(*want_leaves, cq, ck, 8, 10, causal=True)
    want_grads = torch.autograd.grad(want, want_leaves, torch.ones_like(want))
    assert torch.equal(out, want) and want.abs().sum() > 0
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w)


@st.composite
def _packed_configs(draw):
    """A packed call: 1-5 sequences of 0-40 query and key rows, GQA, odd head dims, causal and
    windows, a softmax_scale, none, one or two of softcap, ALiBi ((H,) or (B, H) slopes) and
    dropout, seqused_k, rows past the last offset."""
    n = draw(st.integers(1, 5))
    lens_k = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    return dict(
        lens_q=draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)),
        lens_k=lens_k,
        used=draw(st.one_of(st.none(), st.tuples(*(st.integers(0, m) for m in lens_k)))),
        heads_kv=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.integers(1, 48)),
        head_dim_v=draw(st.integers(1, 48)),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (-1, -1), (0, 0), (5, 2), (-1, 3), (7, -1)])),
        softmax_scale=draw(st.sampled_from([None, None, 0.05, 1.3])),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.0, 2.0, 30.0])),
        alibi=draw(st.sampled_from([None, None, "head", "batch_head"])),
        dropout_p=draw(st.sampled_from([0.0, 0.0, 0.0, 0.2, 0.6])),
        tail=draw(st.tuples(st.integers(0, 3), st.integers(0, 3))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@fuzz_settings(120)
@given(_packed_configs())
def test_fuzz_packed_sequences_float64(c):
    # Random packings on the CPU kernels in float64 against each sequence's own float64
    # attention (over its used keys, with its slopes row, its bottom-right alignment and, with
    # dropout, its mask regenerated at its packed rows): out, softmax_lse and the gradients to
    # float64 rounding; rows outside every sequence and unused keys left alone (zeros).
    torch.manual_seed(c["seed"])
    lens_q, lens_k, heads = c["lens_q"], c["lens_k"], c["heads_kv"] * c["group"]
    q, k, v, cq, ck = _packed(lens_q, lens_k, heads, c["heads_kv"], c["head_dim"],
                              c["head_dim_v"], torch.float64, tail=c["tail"])
    slopes = None if c["alibi"] is None else torch.rand(
        *((len(lens_q),) if c["alibi"] == "batch_head" else ()), heads, dtype=torch.float64)
    used = None if c["used"] is None else list(c["used"])
    kw = dict(softmax_scale=c["softmax_scale"], causal=c["causal"], window_size=c["window"],
              softcap=c["softcap"], dropout_p=c["dropout_p"], alibi_slopes=slopes)
    state = _rng_state(q.device)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cq, ck, max(lens_q), max(lens_k), return_attn_probs=True,
        seqused_k=None if used is None else torch.tensor(used, dtype=torch.int32), **kw)
    keeps = _dropout_keeps(q, k, v, cq, ck, kw, state) if c["dropout_p"] > 0 else None
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout) if out.numel() else (None,) * 3
    # The reference over the used keys alone.
    keys, cu_ref = (torch.arange(k.shape[0]), ck) if used is None else _used_rows(ck, used)
    if keeps is not None and used is not None:
        keeps = [m[..., :n] for m, n in zip(keeps, used)]
    wl, wr = c["window"]
    ref, ref_lse, ref_grads = _per_sequence(
        q, k[keys], v[keys], cq, cu_ref, dout, keeps=keeps, softmax_scale=c["softmax_scale"],
        causal=c["causal"], window_left=wl, window_right=wr, softcap=c["softcap"],
        dropout_p=c["dropout_p"], alibi_slopes=slopes)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    assert_lse_infinities(lse, ref_lse)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-9, atol=1e-10)
    if grads[0] is None:
        return
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=1e-9, atol=1e-9, msg="dq")
    for name, g, r in zip(("dk", "dv"), grads[1:], ref_grads[1:]):
        unused = torch.ones(k.shape[0], dtype=torch.bool)
        unused[keys] = False
        assert torch.equal(g[unused], torch.zeros_like(g[unused])), name
        torch.testing.assert_close(g[keys], r, rtol=1e-9, atol=1e-9, msg=name)
