"""The correct but unfused attention that serves calls no fused kernel takes (reported by
flash_attn_ext.policy), and PyTorch's own ``scaled_dot_product_attention`` as imported before
any patching (where patch() sends the calls the drop-in cannot take, and what unpatch()
restores)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import ops

__all__ = ["TORCH_SDPA", "visible_keys", "fallback_attention"]

# PyTorch's own function, captured before flash_attn_ext.patch() can replace it.
TORCH_SDPA = F.scaled_dot_product_attention


def visible_keys(rows: range, seqlen_q: int, seqlen_k: int, window_left: int, window_right: int,
                 align_bottom_right: bool, device) -> torch.Tensor:
    """(len(rows), seqlen_k) bool, True where key j is visible to query row i (the rule of
    docs/design.md section 2, and csrc/mask.h; causal already folded into window_right = 0)."""
    offset = seqlen_k - seqlen_q if align_bottom_right else 0
    i = torch.arange(rows.start, rows.stop, device=device)[:, None] + offset
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(len(rows), seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= j >= i - window_left
    if window_right >= 0:
        visible &= j <= i + window_right
    return visible


def alibi_bias(alibi_slopes: torch.Tensor, seqlen_q: int, seqlen_k: int,
               align_bottom_right: bool, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi as an additive bias: -slope * |i + offset - j|, (B or 1, H, seqlen_q, seqlen_k)
    in ``dtype`` for slopes of shape (H,) or (B, H) (FlashAttention-2's definition; the offset
    as visible_keys': seqlen_k - seqlen_q bottom-right aligned, else 0)."""
    offset = seqlen_k - seqlen_q if align_bottom_right else 0
    device = alibi_slopes.device
    i = torch.arange(seqlen_q, device=device, dtype=dtype)[:, None] + offset
    j = torch.arange(seqlen_k, device=device, dtype=dtype)[None, :]
    slopes = alibi_slopes.to(dtype)
    slopes = slopes[None] if slopes.dim() == 1 else slopes
    return -slopes[:, :, None, None] * (i - j).abs()


def fallback_attention(q, k, v, softmax_scale, window_left, window_right, align_bottom_right,
                       softcap, attn_bias=None, dropout_p=0.0, alibi_slopes=None):
    """Correct but unfused attention on q/k/v in (B, L, H, D) layout; returns (out, lse).

    Used only where no fused kernel exists (see flash_attn_ext.planning); follows the same
    semantics (diagonal offset, window, GQA, softcap, ALiBi, fully masked rows give out = 0 and
    lse = -inf) in float32 (float64 for float64 inputs), backward by PyTorch's autograd.  The
    probabilities are ``softmax`` (exp(s - max) / sum), not exp(s - lse): a row of huge finite
    scores (a mask of ``finfo(float32).min``) has an lse that cannot hold log(S) beside it, and
    exp(s - lse) would be 1 for every key there instead of 1/S.  Head dim 0 (PyTorch's answer:
    every score 0) needs no scale.
    """
    args = (q, k, v, softmax_scale, window_left, window_right, align_bottom_right, softcap,
            attn_bias, dropout_p, alibi_slopes)
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):  # (the products stay in `acc`)
            return _attention(*args)
    return _attention(*args)


def _attention(q, k, v, softmax_scale, window_left, window_right, align_bottom_right, softcap,
               attn_bias, dropout_p, alibi_slopes):
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // max(k.shape[2], 1)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    if k.shape[2] != q.shape[2]:  # (group 0 too: no query heads, an empty answer)
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(qh.to(acc), kh.to(acc).transpose(-1, -2)) * softmax_scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if window_left >= 0 or window_right >= 0:
        visible = visible_keys(range(seqlen_q), seqlen_q, seqlen_k, window_left, window_right,
                               align_bottom_right, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_bias is not None and attn_bias.dtype == torch.bool:  # a mask: True = attend
        scores = scores.masked_fill(~attn_bias, float("-inf"))
    elif attn_bias is not None:
        scores = scores + attn_bias.to(acc)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, seqlen_q, seqlen_k, align_bottom_right, acc)
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key (every score -inf; NaN is not -inf and stays NaN): zeros.
    empty = (scores == float("-inf")).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    out = torch.matmul(probs, vh.to(acc)).to(q.dtype).transpose(1, 2)
    return out, lse.to(ops.lse_dtype(q.dtype))
