"""Plain softmax(q k^T * scale + mask) v, the reference every kernel is compared with.

Inputs in flash layout (B, L, H, D).  ``compute_dtype`` picks the precision: float64 for the
"true" answer, the input's own dtype for "what PyTorch gets in the same low precision" (the
yardstick of the error rule in DEVELOPERS.md).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, window_left: int, window_right: int,
                 align_bottom_right: bool, device="cpu") -> torch.Tensor:
    """(L, S) bool, True where key j is visible to query i (docs/design.md section 2)."""
    offset = seqlen_k - seqlen_q if align_bottom_right else 0
    i = torch.arange(seqlen_q, device=device)[:, None] + offset
    j = torch.arange(seqlen_k, device=device)[None, :]
    right = 0 if causal else window_right
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= j >= i - window_left
    if right >= 0:
        visible &= j <= i + right
    return visible


def alibi_ref(alibi_slopes, seqlen_q: int, seqlen_k: int, align_bottom_right: bool, dtype):
    """ALiBi as FlashAttention-2 defines it, as a (B or 1, H, L, S) bias in ``dtype``: score
    (i, j) of head h gets -slope[(b,) h] * |i + S - L - j| (bottom-right; top-left: |i - j|)."""
    slopes = alibi_slopes.detach().to(dtype)
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0)
    offset = seqlen_k - seqlen_q if align_bottom_right else 0
    i = torch.arange(seqlen_q, device=slopes.device)[:, None]
    j = torch.arange(seqlen_k, device=slopes.device)[None, :]
    dist = (i + offset - j).abs().to(dtype)  # (integers: exact)
    return -slopes[:, :, None, None] * dist


def dropout_scale(dropout_p: float) -> float:
    """The scale of kept elements, 1 / P(kept), P(kept) = t / 256 with t the integer nearest to
    (1 - dropout_p) * 256, ties to even (csrc/dropout.h); 0 when nothing is kept."""
    t = round((1.0 - dropout_p) * 256)  # Python rounds ties to even, as the kernels' nearbyint
    return 256.0 / t if t > 0 else 0.0


def additive(attn_bias, dtype):
    """attn_bias in ``dtype``: a boolean mask (True = attend) as 0 / -inf, a float bias as it is
    (its gradient kept)."""
    if attn_bias.dtype == torch.bool:
        return torch.zeros(attn_bias.shape, dtype=dtype, device=attn_bias.device).masked_fill(
            ~attn_bias, float("-inf"))
    return attn_bias.to(dtype)


def attention_ref(q, k, v, *, softmax_scale: Optional[float] = None, causal=False,
                  window_left=-1, window_right=-1, align_bottom_right=True, softcap=0.0,
                  attn_bias=None, alibi_slopes=None, compute_dtype=torch.float64,
                  return_probs=False, dropout_keep=None, dropout_p=0.0):
    """Returns (out (B, L, H, Dv), lse (B, H, L)) computed in ``compute_dtype``, differentiable
    (and the probabilities (B, H, L, S) with ``return_probs``).  ``dropout_keep``: the (B, H, L,
    S) bool mask of kept weights applied to P before P V, as the kernels do, the kept ones scaled
    by the kernels' 1 / P(kept) (dropout_scale below: 1 - dropout_p rounded to a multiple of
    1/256, csrc/dropout.h).  ``alibi_slopes``: (H,) or (B, H), see alibi_ref."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qc, kc, vc = (x.to(compute_dtype) for x in (q, k, v))
    kc = kc.repeat_interleave(group, dim=2)
    vc = vc.repeat_interleave(group, dim=2)
    scores = torch.einsum("blhd,bshd->bhls", qc, kc) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_mask(seqlen_q, seqlen_k, causal, window_left, window_right,
                           align_bottom_right, q.device)
    if attn_bias is not None:
        scores = scores + additive(attn_bias, compute_dtype)
    if alibi_slopes is not None:
        scores = scores + alibi_ref(alibi_slopes, seqlen_q, seqlen_k, align_bottom_right,
                                    compute_dtype)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows that see no key: out = 0 and no gradient (docs/design.md section 2).  Their scores are
    # replaced before the softmax so that its backward does not turn them into NaN.
    empty = (torch.isinf(lse) & (lse < 0)).unsqueeze(-1)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    weights = probs
    if dropout_keep is not None:
        weights = probs * dropout_keep.to(probs.device) * dropout_scale(dropout_p)
    out = torch.einsum("bhls,bshd->blhd", weights, vc)
    return (out, lse, probs) if return_probs else (out, lse)


def abs_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| element by element in float64: an infinity where the other has the same one (an
    LSE of -inf, say) counts as exact, an infinity against anything else is an infinite error,
    NaN in either stays NaN."""
    assert a.shape == b.shape, f"compared tensors differ in shape: {a.shape} / {b.shape}"
    a, b = a.double(), b.double()
    return (a - b).abs().masked_fill(torch.isinf(a) & (a == b), 0.0)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two tensors of one shape (abs_err): NaN in either gives
    inf."""
    d = abs_err(a, b)
    if d.numel() == 0:
        return 0.0
    if torch.isnan(d).any():
        return float("inf")
    return d.max().item()


def assert_lse_infinities(lse: torch.Tensor, true_lse: torch.Tensor, what: str = "softmax_lse"):
    """softmax_lse finite exactly where the reference's is, and where it is not, equal to it
    (-inf for a row that sees no key): a NaN or +inf there fails, which a comparison of
    isfinite() alone lets through (NaN is not finite either)."""
    assert lse.shape == true_lse.shape, \
        f"{what}: shape {tuple(lse.shape)} / {tuple(true_lse.shape)}"
    lse, true_lse = lse.detach().cpu().double(), true_lse.detach().cpu().double()
    assert not torch.isnan(lse).any(), f"{what}: NaN"
    finite = torch.isfinite(true_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: finite where the reference is not"
    assert torch.equal(lse[~finite], true_lse[~finite]), \
        f"{what}: {lse[~finite].unique().tolist()} where the reference has " \
        f"{true_lse[~finite].unique().tolist()}"


def finite_abs_max(t: torch.Tensor) -> float:
    """Largest |t| over its finite elements (0 where there are none): the size of a reference
    that may hold -inf (an LSE) or nothing at all."""
    finite = t[torch.isfinite(t)]
    return finite.abs().max().item() if finite.numel() else 0.0


# Absolute slack of the error rule per dtype: a few ulps at magnitude 1.
SLACK = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def slack(true: torch.Tensor, dtype: torch.dtype) -> float:
    """The rule's small slack: SLACK, plus one ulp of the largest true value, because rounding
    the exact answer once to ``dtype`` already costs up to half an ulp.  For float16 / bfloat16
    SLACK is taken at the size of the largest true value where that is below 1 (a fixed 1.6e-2
    in bf16 was ~9x PyTorch's whole error for outputs of 0.35 at L = 1023, and let an output
    that dropped each row's last key pass), plus float32's SLACK for what the kernels' float32
    accumulators leave where the truth is ~0 (a gradient whose terms cancel).  float32's
    SLACK is that floor, not scaled by the true values: scaled, it failed where the truth is
    exactly 0 and nothing passes the cancellation (dq of an SDPA call with one query and one
    key: 2.7e-7 against a true 0, PyTorch's error 0)."""
    scale = finite_abs_max(true)
    if dtype in (torch.float16, torch.bfloat16):
        return SLACK[dtype] * min(1.0, scale) + SLACK[torch.float32] + \
            torch.finfo(dtype).eps * scale
    return SLACK[dtype] + torch.finfo(dtype).eps * scale


def grad_bound(true: torch.Tensor, dtype: torch.dtype, cancellation: float) -> float:
    """Largest error allowed to a gradient in ``dtype`` against its float64 truth ``true`` where
    the error rule (assert_error_rule) bounds nothing: huge scores, at which PyTorch's own
    low-precision computation overflows.  8 of the dtype's eps times the largest true value plus
    ``cancellation`` (cancellation_scale's entry for that gradient), plus slack(true, dtype).

    The cancellation term is there because such rows are nearly one-hot: dS = P (dP - D)
    cancels, and D = rowsum(dO * O) reads out rounded to the dtype, so dq and dk carry the
    dtype's eps times the cancelling terms' size, as in every FlashAttention backward and in
    PyTorch's own.  The factor 8 is an allowance of a few ulps for the roundings of the inputs,
    P, dS and the result, not a proven constant."""
    return 8 * torch.finfo(dtype).eps * (true.abs().max().item() + cancellation) \
        + slack(true, dtype)


def cancellation_scale(q, k, v, dout, *, per_element: bool = False, out=None, true_out=None,
                       **kw):
    """Magnitudes (for dq, dk) of the terms that cancel in FlashAttention's backward.

    dS = P * (dP - delta) with delta = rowsum(dO * O) (FlashAttention-2, Algorithm 2) equals
    PyTorch's P * (dP - rowsum(P * dP)) exactly, but in floating point it subtracts terms of size
    |dO| |V|: where the true gradient is ~0 (e.g. a row that sees a single key) the float32
    accumulator leaves eps32 * that size.  Returns max over rows of scale * sum_j |P| (|dO||V| +
    |delta|) |K| for dq, and the same over keys with |Q| for dk; for dv the sum of |P| |dO|
    (a sum's rounding error scales with the sum of its terms' magnitudes, not with the result);
    last, max |score|: P is recomputed as exp(score - lse) from a float32 lse, so its relative
    error is ~eps32 * |score|.

    ``per_element``: dq, dk and dv's terms as tensors of their shapes (on the CPU), each
    element its own row's and key's sums: (a) the cancelling terms above at the accumulator's
    eps; (b) what delta's own error moves the gradient by, computed rather than bounded: the
    kernels take delta from *their* out (``out``, rounded to the input dtype), delta' - delta
    = rowsum(dO (out - true_out)), and dS's error P (delta - delta') reaches dq as scale
    (delta - delta')_i sum_j P_ij K_j and dk likewise (with softcap's derivative), taken twice;
    (c) with fp16 / bf16 inputs, the rounding of P and dS to that dtype for the GEMMs (below).
    All in the unit the rule multiplies by (4 accumulator ulps).  ``true_out``: the float64
    output (with dropout, the dropped one; default: the reference's, with ``dropout_keep`` /
    ``dropout_p`` in ``kw`` if given).  The default form takes one maximum over all elements
    and bounds delta's term by the input dtype's eps times sum |dO| |O|; with fp16 / bf16
    inputs that made the bound 10-80x PyTorch's error and let a dq or dk 5% off pass, which
    the per-element form fails at unit-scale scores (at sharper ones 3x PyTorch's own bf16
    error is itself 20-25% of max |dq|).  The CPU tests and test_cuda / test_sm90's gradient
    grids use the per-element form; grad_bound's callers the default.
    """
    dbias_shape = kw.pop("_dbias_shape", None)  # (dbias_cancellation)
    ours_out = out
    with torch.no_grad():
        qd, kd, vd, dod = (t.detach().double() for t in (q, k, v, dout))
        group = qd.shape[2] // kd.shape[2]
        scale = kw.get("softmax_scale") or 1.0 / math.sqrt(qd.shape[-1])
        out, lse = attention_ref(qd, kd, vd, **kw)
        kk, vv = kd.repeat_interleave(group, 2), vd.repeat_interleave(group, 2)
        scores = torch.einsum("blhd,bshd->bhls", qd, kk) * scale
        dtanh = 1.0
        if kw.get("softcap", 0.0) > 0:
            scores = kw["softcap"] * torch.tanh(scores / kw["softcap"])
            dtanh = 1 - (scores / kw["softcap"]).square()
        if kw.get("attn_bias") is not None:
            scores = scores + additive(kw["attn_bias"].detach(), torch.float64)
        if kw.get("alibi_slopes") is not None:
            scores = scores + alibi_ref(kw["alibi_slopes"], qd.shape[1], kd.shape[1],
                                        kw.get("align_bottom_right", True), torch.float64)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        visible = visible_mask(qd.shape[1], kd.shape[1], kw.get("causal", False),
                               kw.get("window_left", -1), kw.get("window_right", -1),
                               kw.get("align_bottom_right", True), device=qd.device)
        probs = probs * visible
        dp_abs = torch.einsum("blhd,bshd->bhls", dod.abs(), vv.abs())
        delta_abs = (dod.abs() * out.abs()).sum(-1).transpose(1, 2).unsqueeze(-1)
        # delta = rowsum(dO * O) reads `out` rounded to the input dtype (as FlashAttention does):
        # in fp16/bf16 its error is that dtype's eps, not eps32; scale its term to match.
        ratio = 1.0
        if q.dtype in (torch.float16, torch.bfloat16) and not per_element:
            ratio = torch.finfo(q.dtype).eps / torch.finfo(torch.float32).eps
        a = probs * (dp_abs + ratio * delta_abs)
        if per_element:
            assert ours_out is not None, "per_element needs the kernels' out"
            moved = ((dod * (ours_out.detach().double().to(dod.device) - (
                true_out.detach().double().to(dod.device) if true_out is not None else
                out))).sum(-1)).transpose(1, 2)  # (B, H, L)
            pm = probs * dtanh * moved.unsqueeze(-1)  # (softcap's derivative 1 - t^2)
            b, s_k, hk, _ = kd.shape
            move_dq = scale * torch.einsum("bhls,bshd->blhd", pm, kk).abs()
            move_dk = (scale * torch.einsum("bhls,blhd->bshd", pm, qd)).reshape(
                b, s_k, hk, group, qd.shape[-1]).sum(3).abs()
            # (in the unit assert_error_rule multiplies by: 4 ulps of the accumulator)
            unit = 4 * torch.finfo(torch.float64 if q.dtype == torch.float64 else
                                   torch.float32).eps
            # With fp16 / bf16 inputs the kernels round P (for dV) and dS (for dQ, dK) to the
            # input dtype for their GEMMs: roundings of at most half an ulp each, whose sum over
            # a row's keys (a key's rows) has, if they are independent and uniform, a standard
            # deviation of eps / sqrt(12) times the root sum of squares of the terms; 2 eps
            # times it (~7 of those) per element: a statistical allowance, not a worst case (a
            # worst-case sum of |terms| grows with the row length where the result does with
            # its square root: at L = 1k it allowed 25% of dq).  A review measured it at most
            # 1.4% of max |grad| in bf16 against the rule's base of 2-25%.
            round_dq = round_dk = round_dv = 0.0
            if q.dtype in (torch.float16, torch.bfloat16):
                eps16 = torch.finfo(q.dtype).eps
                dp = torch.einsum("blhd,bshd->bhls", dod, vv)
                if kw.get("dropout_keep") is not None:  # dP of the kept weights, rescaled
                    dp = dp * kw["dropout_keep"].to(dp.device) * dropout_scale(kw["dropout_p"])
                ds_sq = (probs * dtanh * (dp - (dod * out).sum(-1).transpose(1, 2).unsqueeze(-1))
                         ).square()
                round_dq = 2 * eps16 * scale * torch.einsum("bhls,bshd->blhd", ds_sq,
                                                            kk.square()).sqrt()
                d, d_v = qd.shape[-1], dod.shape[-1]
                round_dk = 2 * eps16 * scale * torch.einsum(
                    "bhls,blhd->bshd", ds_sq, qd.square()).reshape(
                    b, s_k, hk, group, d).sum(3).sqrt()
                round_dv = 2 * eps16 * torch.einsum(
                    "bhls,blhd->bshd", probs.square(), dod.square()).reshape(
                    b, s_k, hk, group, d_v).sum(3).sqrt()
        if dbias_shape is not None:
            return a.sum_to_size(dbias_shape).max().item() if a.numel() else 0.0
        cdq = scale * torch.einsum("bhls,bshd->blhd", a, kk.abs())
        cdk = scale * torch.einsum("bhls,blhd->bshd", a, qd.abs())
        cdv = torch.einsum("bhls,blhd->bshd", probs, dod.abs())
        # dk/dv of a key/value head sum over the query heads of its GQA group.
        b, s, h, _ = cdk.shape
        cdk = cdk.reshape(b, s, h // group, group, cdk.shape[-1]).sum(3)
        cdv = cdv.reshape(b, s, h // group, group, cdv.shape[-1]).sum(3)
        finite = scores.masked_fill(~visible | ~torch.isfinite(scores), 0.0)
        score_mag = finite.abs().max().item() if finite.numel() else 0.0
        if per_element:
            cdq = cdq + (2 * move_dq + round_dq) / unit
            cdk = cdk + (2 * move_dk + round_dk) / unit
            cdv = cdv + round_dv / unit
            return tuple(t.cpu() for t in (cdq, cdk, cdv)) + (score_mag,)
        return tuple(t.max().item() if t.numel() else 0.0 for t in (cdq, cdk, cdv)) + (score_mag,)


def dbias_cancellation(q, k, v, dout, bias_shape, **kw) -> float:
    """cancellation_scale's term for the gradient of an additive bias of ``bias_shape``: dS =
    P (dP - delta) summed over the dimensions the bias broadcasts, its cancelling terms'
    magnitude sum P (|dO| |V| + |delta|) likewise."""
    return cancellation_scale(q, k, v, dout, _dbias_shape=tuple(bias_shape), **kw)


def assert_error_rule(ours, low, true, factor: float, what: str, cancellation=0.0,
                      score_scale: float = 0.0):
    """ours - true must be at most factor * (low - true) + slack (DEVELOPERS.md error rule).

    ``cancellation``, ``score_scale``: see cancellation_scale; they add 4 accumulator ulps of
    ``cancellation + score_scale * max|true|`` to the slack (the conditioning of the backward).
    A tensor ``cancellation`` (cancellation_scale's per_element form, of ours' shape) bounds
    each element by its own term.
    """
    assert not torch.isnan(ours).any(), f"{what}: NaN in result"
    ours_err, low_err = max_err(ours, true), max_err(low, true)
    assert math.isfinite(low_err), (
        f"{what}: PyTorch's {low.dtype} result is NaN or infinite where the float64 one is not: "
        "the rule bounds nothing there; give this case a bound of its own")
    acc_eps = torch.finfo(torch.float64 if ours.dtype == torch.float64 else torch.float32).eps
    magnitude = finite_abs_max(true)
    if isinstance(cancellation, torch.Tensor):
        assert cancellation.shape == ours.shape, (what, cancellation.shape, ours.shape)
        base = factor * low_err + slack(true, ours.dtype) + 4 * acc_eps * score_scale * magnitude
        bound = base + 4 * acc_eps * cancellation.double()
        err = abs_err(ours.detach().cpu(), true.detach().cpu())
        over = (err - bound).nan_to_num(float("inf"))
        worst = int(over.argmax()) if over.numel() else 0
        assert over.numel() == 0 or over.flatten()[worst] <= 0, (
            f"{what}: error {err.flatten()[worst]:.3e} at element {worst} > {factor} x PyTorch's "
            f"{low_err:.3e} + slack {base - factor * low_err:.1e} + cancellation "
            f"{4 * acc_eps * cancellation.flatten()[worst]:.1e} there (largest error "
            f"{ours_err:.3e})")
        return
    s = slack(true, ours.dtype) + 4 * acc_eps * (cancellation + score_scale * magnitude)
    bound = factor * low_err + s
    assert ours_err <= bound, (f"{what}: error {ours_err:.3e} > {factor} x PyTorch's "
                               f"{low_err:.3e} + slack {s:.1e}")


def assert_bwd_fake_strides_match(bwd_op, args) -> None:
    """The bwd op's fake (meta) kernel gives dq, dk, dv the strides the real kernel gives them
    (a size-1 dimension's stride is free): torch.compile's inductor asserts them at run time."""
    real = bwd_op(*args)[:3]
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = bwd_op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                        for a in args])[:3]
    for name, g, f in zip("qkv", real, fake):
        assert [st for st, n in zip(g.stride(), g.shape) if n > 1] == \
            [st for st, n in zip(f.stride(), f.shape) if n > 1], (name, g.stride(), f.stride())


def launched_kernels(fn) -> list:
    """Names of the CUDA kernels that ``fn`` launches (torch.profiler, demangled): which
    kernel a call ran, for the tests that assert it."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "_kernel" in e.name]


# The Hopper kernels' variant flags, in the order of their traits' bool template parameters
# (kernels/sm90/fwd_traits.h, bwd_traits.h).
SM90_FWD_FLAGS = ("packgqa", "general", "dropout", "mask", "varlen", "softcap", "alibi")
SM90_BWD_FLAGS = ("general", "dropout", "mask", "varlen", "softcap", "alibi", "short_steps")
# Flags of an instantiation's shape, not of its variant (Sm90BwdTraits::kShortSteps: the
# dropout variant's 64-row steps at head dim 64), which sm90_variant_flags leaves out unless
# asked for.
SM90_SHAPE_FLAGS = frozenset({"short_steps"})


def launched_fwd_traits(fn) -> tuple:
    """The template arguments of the first Hopper forward kernel that ``fn`` launches (its
    ``Sm90FwdTraits<...>``, each as the demangled name writes it: element type, head dim, key
    tile, stages, consumer warpgroups, the variant flags, the exp2 split), and that kernel's
    name, for the tests that assert a shape."""
    import re
    names = [n for n in launched_kernels(fn) if "flash_fwd_sm90" in n]
    assert names, "no Hopper forward kernel launched"
    m = re.search(r"Sm90FwdTraits<([^<>]*)>", names[0])
    assert m is not None, names[0]
    return [t.strip() for t in m.group(1).split(",")], names[0]


def sm90_variant_flags(name: str, traits: str = "Sm90FwdTraits", shape: bool = False) -> set:
    """The flags set in a launched Hopper kernel's name (a demangled ``traits<...>``
    instantiation): its bool template arguments by position, so that integer parameters
    before or after them (tile sizes, the forward's exp2 split) do not matter; the variant's
    flags, and with ``shape`` those of SM90_SHAPE_FLAGS too.  Empty when ``name`` is not such a
    kernel."""
    import re
    m = re.search(traits + r"<([^<>]*)>", name)
    if m is None:
        return set()
    bools = [t.strip() == "true" for t in m.group(1).split(",") if t.strip() in ("true", "false")]
    names = SM90_FWD_FLAGS if traits == "Sm90FwdTraits" else SM90_BWD_FLAGS
    assert len(bools) == len(names), (name, names)
    return {n for n, b in zip(names, bools) if b and (shape or n not in SM90_SHAPE_FLAGS)}


def fuzz_settings(ci_examples: int):
    """The hypothesis settings of the fuzz tests: in CI a fixed (derandomized) set of
    ``ci_examples`` examples; with FLASH_ATTN_EXT_FUZZ_EXAMPLES=N, N fresh ones to explore."""
    from hypothesis import HealthCheck, settings
    explore = int(os.environ.get("FLASH_ATTN_EXT_FUZZ_EXAMPLES", "0"))
    return settings(max_examples=explore or ci_examples, deadline=None, derandomize=not explore,
                    suppress_health_check=[HealthCheck.too_slow])
