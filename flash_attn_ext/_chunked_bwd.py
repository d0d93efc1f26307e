"""Backward of flash_attn_ext::fwd in plain PyTorch ops, chunked over query rows.

The CUDA backward until its fused kernel exists: it recomputes P = exp(scale * q k^T - lse)
chunk by chunk from the saved softmax_lse (the same recomputation as FlashAttention-2,
arXiv:2307.08691, Algorithm 2, with D = rowsum(dO * O)), so memory is O(chunk * seqlen_k) per
step, never the whole (seqlen_q x seqlen_k) matrix at once.  It is slower than a fused kernel and
is reported as a fallback by ``flash_attn_ext.explain`` (strict mode refuses it).
"""

from __future__ import annotations

import math

import torch

# Bytes of fp32 scores per chunk: bounds the working set of one step.
_CHUNK_BYTES = 1 << 28


def chunked_bwd(dout, q, k, v, out, softmax_lse, rng_state, softmax_scale=None, causal=False,
                window_left=-1, window_right=-1, align_bottom_right=True, softcap=0.0,
                alibi_slopes=None, attn_bias=None, dropout_p=0.0, deterministic=False,
                bias_requires_grad=False):
    from . import dispatch

    dispatch.note_fallback(dispatch.CUDA_BACKWARD_REASON, dispatch.CHUNKED_BWD)
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    group = heads // heads_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    right = 0 if causal else window_right

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kf = k.to(acc).permute(0, 2, 1, 3)  # (B, Hkv, S, D)
    vf = v.to(acc).permute(0, 2, 1, 3)
    dq = torch.zeros(batch, seqlen_q, heads, head_dim, device=q.device, dtype=acc)
    dk = torch.zeros(batch, heads_kv, seqlen_k, head_dim, device=q.device, dtype=acc)
    dv = torch.zeros(batch, heads_kv, seqlen_k, head_dim_v, device=q.device,
                     dtype=acc)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, L, H)
    chunk = max(16, min(max(seqlen_q, 1), _CHUNK_BYTES // max(1, 4 * batch * heads * seqlen_k)))
    for i0 in range(0, seqlen_q, chunk):
        rows = slice(i0, min(i0 + chunk, seqlen_q))
        c = rows.stop - rows.start

        # (B, c, H, d) -> (B, Hkv, G, c, d)
        qc, doc = (t[:, rows].to(acc).reshape(batch, c, heads_kv, group, -1).permute(0, 2, 3, 1, 4)
                   for t in (q, dout))
        s = torch.einsum("bkgcd,bksd->bkgcs", qc, kf) * scale
        if softcap > 0:
            t = torch.tanh(s / softcap)
            s = softcap * t
        visible = dispatch.visible_keys(range(rows.start, rows.stop), seqlen_q, seqlen_k,
                                        window_left, right, align_bottom_right, q.device)
        lse_c = softmax_lse[:, :, rows].reshape(batch, heads_kv, group, c, 1)
        p = torch.exp(s - lse_c).masked_fill(~visible, 0.0)
        p = torch.where(torch.isinf(lse_c), torch.zeros_like(p), p)
        dv += torch.einsum("bkgcs,bkgcd->bksd", p, doc)
        dp = torch.einsum("bkgcd,bksd->bkgcs", doc, vf)
        delta_c = delta[:, rows].reshape(batch, c, heads_kv, group).permute(0, 2, 3, 1)
        ds = p * (dp - delta_c.unsqueeze(-1))
        if softcap > 0:
            ds = ds * (1 - t * t)
        dq_c = torch.einsum("bkgcs,bksd->bkgcd", ds, kf) * scale
        dq[:, rows] = dq_c.permute(0, 3, 1, 2, 4).reshape(batch, c, heads, head_dim)
        dk += torch.einsum("bkgcs,bkgcd->bksd", ds, qc) * scale
    return (dq.to(q.dtype), dk.permute(0, 2, 1, 3).to(k.dtype).contiguous(),
            dv.permute(0, 2, 1, 3).to(v.dtype).contiguous(), q.new_empty((0,)))
