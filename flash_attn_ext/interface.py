"""FlashAttention-style API in (batch, seqlen, num_heads, head_dim) layout."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ._call import (
    check_alibi,
    check_bool,
    check_flags,
    check_scale,
    check_softcap,
    check_tensors,
    run,
)

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"]


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_softmax_lse: bool = False,
    strict: Optional[bool] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention, computed the FlashAttention way, in (batch, seqlen, num_heads, head_dim).

    out = softmax(q k^T * softmax_scale + mask) v, computed tile by tile with the online softmax
    (Dao et al. 2022, arXiv:2205.14135, Algorithm 1; FlashAttention-2, arXiv:2307.08691,
    Algorithm 1): the (seqlen_q x seqlen_k) score matrix is never stored, memory is O(seqlen).
    The backward recomputes the probabilities from q, k and softmax_lse (Algorithm 2).

    Args:
        q: (batch, seqlen_q, num_heads, head_dim).
        k: (batch, seqlen_k, num_heads_k, head_dim); num_heads must be a multiple of num_heads_k
            (GQA/MQA: query head h reads key/value head h // (num_heads / num_heads_k); K/V are
            never repeated in memory).
        v: (batch, seqlen_k, num_heads_k, head_dim_v); head_dim_v may differ from head_dim.
            Any batch/seqlen/head strides; the last dimension should be contiguous (else copied).
            dtypes: float32, float64, float16, bfloat16 on CPU; float16, bfloat16 on CUDA.
            head_dim and head_dim_v: 1 to 256.
        dropout_p: dropout probability on the attention weights (after the softmax), inside
            the kernels with a counter-based Philox4x32-10 mask drawn from PyTorch's generator
            (``torch.manual_seed`` reproduces it; CUDA-graph capture works) and regenerated,
            not stored, by the backward.  An element is kept with probability 1 - dropout_p
            rounded to a multiple of 1/256 (an 8-bit threshold, as FlashAttention-2's) and
            then scaled by the inverse of that probability, so the expectation is exact;
            ``flash_attn_ext._C.dropout_scale(dropout_p)`` gives the scale
            (csrc/dropout.h).
            Applied whenever > 0, also in eval mode: pass 0.0 there.  dropout_p = 1 drops
            every weight, as PyTorch's scaled_dot_product_attention and nn.Dropout(p=1.0):
            out is 0 with zero gradients (the kernels run without dropout and out is
            multiplied by 0, so a NaN or inf in it stays NaN, and dq / dk are NaN there, as
            in PyTorch's SDPA); softmax_lse is the undropped
            softmax's, as at every dropout_p (a loss on it still reaches q and k).
        softmax_scale: multiplies q k^T; default 1 / sqrt(head_dim).
        causal: mask with bottom-right alignment (FlashAttention >= 2.1): query i sees key j
            when j <= i + seqlen_k - seqlen_q.  A bool (a NumPy bool too, as FlashAttention-2
            takes it; so for deterministic, return_attn_probs and return_softmax_lse).
        window_size: (left, right) sliding window, bottom-right aligned: query i sees key j when
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 = no limit.
            With causal=True, right is 0.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before the softmax.
        alibi_slopes: ALiBi (Press et al. 2022, arXiv:2108.12409) as FlashAttention-2 defines
            it: (num_heads,) or (batch, num_heads) slopes (float32; other floating dtypes are
            converted) add -slope * |i + seqlen_k - seqlen_q - j| to the scores of query i
            and key j, after softcap.  softmax_lse includes it (FlashAttention-2's causal
            kernels add only slope * j, which softmax cancels but softmax_lse does not).  No
            gradient flows to the slopes: slopes that require grad raise ValueError.  Their
            values are not read on the host (that would synchronise with the GPU and break CUDA
            graph capture), so a NaN or infinite slope is not refused: its head's output is
            then NaN or meaningless.
        deterministic: with True (or under torch.use_deterministic_algorithms(True)) gradients
            are bitwise reproducible run to run.  With False, the CUDA backwards that add dq
            into an fp32 buffer from many CTAs do so in the order the CTAs get there (faster;
            dq's last bits vary with the summation order): the Hopper backward on sm_90
            (every variant up to head dim 128: masks, softcap, ALiBi, dropout; plain
            attention, a boolean mask alone, dropout alone, softcap alone and ALiBi alone at
            256), and plain attention on the 8-warp portable kernels.  With True the Hopper
            backward adds in a fixed order (0.86-1.02x its default speed on an H200 at head
            dims up to 128, 0.80-0.91x at 256), and the 8-warp kernels take a separate dq
            kernel (0.64-0.78x).  The 4-warp kernels and the CPU are reproducible either way.
        return_attn_probs: FlashAttention-2's argument (its 11th positional one, as here), for
            code written against it: with True the call returns (out, softmax_lse, None); the
            attention probabilities are never stored, so the third item is None.
        return_softmax_lse: (keyword only) also return softmax_lse: (out, softmax_lse).
        strict: raise :class:`flash_attn_ext.FallbackError` instead of falling back to an
            unfused path (default: ``FLASH_ATTN_EXT_STRICT``).

    Returns:
        out (batch, seqlen_q, num_heads, head_dim_v) in q's dtype; with return_softmax_lse also
        softmax_lse (batch, num_heads, seqlen_q), float32 (float64 for float64 inputs), the
        natural-log log-sum-exp of each row's scaled scores.  Rows that see no key get out = 0,
        softmax_lse = -inf and zero gradients.  softmax_lse is differentiable: a loss term on
        it (e.g. merging attention chunks) reaches q, k (and a float mask) exactly; the
        backward folds it into delta = rowsum(dO * O) - dlse.  With return_attn_probs:
        (out, softmax_lse, None).

    Raises:
        ValueError: wrong ranks, mismatched batch/heads/head_dim, head_dim outside 1..256,
            num_heads not a multiple of num_heads_k, dtype/device mismatch or unsupported dtype,
            window sides < -1, non-finite softmax_scale, softcap < 0, dropout_p outside [0, 1],
            alibi_slopes of another shape or device, not floating, or requiring grad.
        NotImplementedError: forward-mode AD (torch.func.jvp) and torch.func gradient
            transforms.
        FallbackError: in strict mode, when no fused kernel serves the call.
    """
    check_tensors(("q", q), ("k", k), ("v", v))
    causal = check_bool(causal, "causal")  # (a NumPy bool too, as FlashAttention-2 takes it)
    window_size, dropout_p = check_flags(causal, window_size, dropout_p)
    softmax_scale = check_scale(softmax_scale, "softmax_scale")
    softcap = check_softcap(softcap)
    deterministic = check_bool(deterministic, "deterministic")
    return_softmax_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    return_attn_probs = check_bool(return_attn_probs, "return_attn_probs")
    check_alibi(alibi_slopes, q)
    out, softmax_lse = run(q, k, v, softmax_scale=softmax_scale, causal=causal,
                           window_left=int(window_size[0]), window_right=int(window_size[1]),
                           align_bottom_right=True, softcap=softcap,
                           dropout_p=float(dropout_p),
                           deterministic=deterministic, strict=strict,
                           alibi_slopes=alibi_slopes)
    if return_attn_probs:
        return out, softmax_lse, None
    return (out, softmax_lse) if return_softmax_lse else out


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0,
                              softmax_scale: Optional[float] = None, causal: bool = False,
                              window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[torch.Tensor] = None,
                              deterministic: bool = False, return_attn_probs: bool = False,
                              *, return_softmax_lse: bool = False,
                              strict: Optional[bool] = None):
    """FlashAttention-2's ``flash_attn_qkvpacked_func``: ``qkv`` (batch, seqlen, 3, num_heads,
    head_dim), q, k and v read in place (strided views, no copy; their gradients land in one
    gradient of qkv's shape). Otherwise :func:`flash_attn_func` (arguments, returns, errors).

    Raises:
        TypeError: qkv not a tensor.
        ValueError: qkv not of shape (batch, seqlen, 3, num_heads, head_dim); as
            :func:`flash_attn_func`.
    """
    check_tensors(("qkv", qkv))
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be a tensor of shape (batch, seqlen, 3, num_heads, "
                         f"head_dim), got {_shape(qkv)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, return_softmax_lse=return_softmax_lse,
                           strict=strict)


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[torch.Tensor] = None,
                             deterministic: bool = False, return_attn_probs: bool = False,
                             *, return_softmax_lse: bool = False,
                             strict: Optional[bool] = None):
    """FlashAttention-2's ``flash_attn_kvpacked_func``: ``kv`` (batch, seqlen_k, 2,
    num_heads_k, head_dim), k and v read in place. Otherwise :func:`flash_attn_func`.

    Raises:
        TypeError: kv not a tensor.
        ValueError: kv not of shape (batch, seqlen_k, 2, num_heads_k, head_dim); as
            :func:`flash_attn_func`.
    """
    check_tensors(("kv", kv))
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be a tensor of shape (batch, seqlen_k, 2, num_heads_k, "
                         f"head_dim), got {_shape(kv)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                           return_softmax_lse=return_softmax_lse, strict=strict)


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
