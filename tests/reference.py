"""Plain softmax(q k^T * scale + mask) v, the reference every kernel is compared with.

Inputs in flash layout (B, L, H, D).  ``compute_dtype`` picks the precision: float64 for the
"true" answer, the input's own dtype for "what PyTorch gets in the same low precision" (the
yardstick of the error rule in DEVELOPERS.md).
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, window_left: int, window_right: int,
                 align_bottom_right: bool, device="cpu") -> torch.Tensor:
    """(L, S) bool, True where key j is visible to query i (DESIGN.md section 2)."""
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


def attention_ref(q, k, v, *, softmax_scale: Optional[float] = None, causal=False,
                  window_left=-1, window_right=-1, align_bottom_right=True, softcap=0.0,
                  compute_dtype=torch.float64):
    """Returns (out (B, L, H, Dv), lse (B, H, L)) computed in ``compute_dtype``, differentiable."""
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
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = ~visible.any(dim=-1)  # rows that see no key: out = 0 (DESIGN.md section 2)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty[:, None], 0.0)
    out = torch.einsum("bhls,bshd->blhd", probs, vc)
    return out, lse


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, NaN-aware (any NaN gives inf)."""
    d = (a.double() - b.double()).abs()
    if d.numel() == 0:
        return 0.0
    if torch.isnan(d).any():
        return float("inf")
    return d.max().item()


# Absolute slack of the error rule per dtype: roughly a few ulps at magnitude 1.
SLACK = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_error_rule(ours, low, true, factor: float, what: str):
    """ours - true must be at most factor * (low - true) + slack (DEVELOPERS.md error rule)."""
    assert not torch.isnan(ours).any(), f"{what}: NaN in result"
    ours_err, low_err = max_err(ours, true), max_err(low, true)
    bound = factor * low_err + SLACK[ours.dtype]
    assert ours_err <= bound, (f"{what}: error {ours_err:.3e} > {factor} x PyTorch's "
                               f"{low_err:.3e} + {SLACK[ours.dtype]:.0e}")
