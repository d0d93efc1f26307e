"""Packed sequences: FlashAttention-2's ``flash_attn_varlen_func`` on the
``torch.ops.flash_attn_ext.fwd_varlen`` / ``bwd_varlen`` ops.

A batch of sequences of different lengths, concatenated without padding: q (total_q, H, D),
k (total_k, H_kv, D), v (total_k, H_kv, Dv); sequence b is rows ``cu_seqlens_q[b] ..
cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` of k and v (int32
offsets). Each sequence attends only to its own keys, with FlashAttention-2's semantics (causal
and windows bottom-right aligned per sequence). The kernels are the dense ones, reading each
sequence in place by its offsets: the CPU kernels (csrc/cpu/varlen_cpu.h); on an H200 (sm_90)
the Hopper forward's varlen instantiation for plain attention (causal, windows and GQA
included; its tiles come from a table of every sequence's query blocks that the host builds
from the offsets, heaviest first) and the Hopper backward's (head dims up to 256, deterministic
too; its CTAs from a table of every sequence's key blocks); elsewhere, and with
softcap, ALiBi or dropout, the portable kernels (kernels/sm80, block_info.h's SeqInfo).  Sequences
stay apart: no value of one (NaN and inf included) reaches another's output.  The offsets are
checked on the host: offsets on a CUDA device are copied there once per call, forward and
backward together (one synchronisation); offsets given on the CPU cost none.  Not capturable
in a CUDA graph either way (a clear error).

This module registers the ops' fake kernels (torch.compile); their autograd is in C++
(csrc/autograd.cpp: backward by the ``bwd_varlen`` op, recomputation from out and softmax_lse;
no double backward).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from . import ops, planning, policy
from ._call import (
    autocast,
    check_alibi,
    check_bool,
    check_devices,
    check_flags,
    check_scale,
    check_seqlen,
    check_softcap,
    dropped,
    kernel_dropout,
)

__all__ = ["flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func"]

fwd_varlen_op = torch.ops.flash_attn_ext.fwd_varlen.default
bwd_varlen_op = torch.ops.flash_attn_ext.bwd_varlen.default


def _check_offsets_device(q, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """The kernels' rule (csrc/varlen_checks.h: check_packed), in the fake kernels too: a call
    with an offset tensor on another device (e.g. meta beside CPU tensors) dispatches to the
    fake kernel, which would otherwise return uninitialised memory."""
    where = cu_seqlens_q.device
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("seqused_k", seqused_k)):
        if t is not None and (t.device != where or t.device not in (q.device,
                                                                     torch.device("cpu"))):
            same = "" if t is cu_seqlens_q else f", as cu_seqlens_q ({where})"
            raise ValueError(f"{name} must be on q's device ({q.device}) or on the CPU{same}, "
                             f"got {t.device}")


@torch.library.register_fake("flash_attn_ext::fwd_varlen")
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale=None, causal=False, window_left=-1, window_right=-1,
                     softcap=0.0, alibi_slopes=None, dropout_p=0.0, seqused_k=None,
                     deterministic=False):
    _check_offsets_device(q, cu_seqlens_q, cu_seqlens_k, seqused_k)
    check_devices(q, ("k", k), ("v", v), ("alibi_slopes", alibi_slopes))
    total_q, heads, _ = q.shape
    out = q.new_empty((total_q, heads, v.shape[-1]))
    softmax_lse = q.new_empty((heads, total_q), dtype=ops.lse_dtype(q.dtype))
    return out, softmax_lse, q.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("flash_attn_ext::bwd_varlen")
def _bwd_varlen_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, rng_state, softmax_scale=None, causal=False, window_left=-1,
                     window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     seqused_k=None, dsoftmax_lse=None, deterministic=False):
    _check_offsets_device(q, cu_seqlens_q, cu_seqlens_k, seqused_k)
    check_devices(q, ("dout", dout), ("k", k), ("v", v), ("out", out),
                  ("softmax_lse", softmax_lse), ("alibi_slopes", alibi_slopes),
                  ("dsoftmax_lse", dsoftmax_lse))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _offsets_on_host(q, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """The offsets (and seqused_k) of a CUDA call as one host copy: one synchronisation, after
    which the forward and the backward op read them without another (the ops take offsets on
    the CPU for a CUDA call and upload them from pinned memory).  Anything the ops would refuse
    (another device, dtype or rank) is passed on as it is, for the op to name."""
    parts = [cu_seqlens_q, cu_seqlens_k] + ([seqused_k] if seqused_k is not None else [])
    # (while a CUDA graph is captured the op refuses the call by name; a copy here would fail
    # first, with PyTorch's message)
    if not q.is_cuda or any(t.device != q.device or t.dtype != torch.int32 or t.dim() != 1
                            for t in parts):
        return cu_seqlens_q, cu_seqlens_k, seqused_k
    if not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
        return cu_seqlens_q, cu_seqlens_k, seqused_k
    host = torch.cat(parts).cpu()
    pieces = host.split([t.numel() for t in parts])
    return pieces[0], pieces[1], pieces[2] if seqused_k is not None else None


def record_plan(q, k, v, softmax_scale, unequal_tiles: bool, mods: int, deterministic: bool,
                strict, note: Optional[str] = None) -> None:
    """Records the plan of a packed call (``flash_attn_ext.last_plan()``): the kernels the
    varlen ops run, as the rule (csrc/kernel_select.h, ``packed``) picks them.  A call that no
    kernel serves is not recorded: the op refuses it (NotImplementedError, ValueError), there
    is no fallback.  ``note``: why the call came here (the KV-cache route), added to the
    plan's notes."""
    if torch.compiler.is_compiling() or \
            not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return  # (recorded by eager calls only, as the other calls; the op names a bad shape)
    p = planning.plan(q, k, v, softmax_scale, mods, unequal_tiles=unequal_tiles,
                      deterministic=deterministic, packed=True)
    if not p.fused:
        return
    if note is not None:
        p = dataclasses.replace(p, notes=p.notes + (note,))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    policy.record(p, strict, needs_grad)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Optional[torch.Tensor] = None,
                           seqused_k: Optional[torch.Tensor] = None, *,
                           strict: Optional[bool] = None):
    """Attention over packed sequences, FlashAttention-2's ``flash_attn_varlen_func``.

    Args:
        q: (total_q, num_heads, head_dim); k: (total_k, num_heads_k, head_dim); v: (total_k,
            num_heads_k, head_dim_v). float32, float64, float16 or bfloat16 (CPU). num_heads
            a multiple of num_heads_k (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 offsets, non-decreasing from >= 0;
            sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q (keys:
            cu_seqlens_k). Zero-length sequences are allowed; rows past the last offset are
            left alone (out 0, zero gradients). On q's device (FlashAttention-2's way) or,
            with seqused_k, all on the CPU. The offsets are checked and the kernels' tables
            built on the host: offsets on a CUDA device are copied to the host once per call
            (one synchronisation, forward and backward together); offsets on the CPU cost
            none (they are uploaded on the call's stream), which is the faster way to call
            it many times with the same sequences (every layer of a model).
        max_seqlen_q, max_seqlen_k: at least the longest sequence's length.
        dropout_p, softmax_scale (default 1 / sqrt(head_dim)), causal, window_size, softcap,
            alibi_slopes ((num_heads,) or (batch, num_heads) float): as
            :func:`flash_attn_ext.flash_attn_func`, per sequence (dropout_p = 1 gives out =
            0, zero gradients and the undropped softmax_lse); causal and windows aligned
            bottom-right within each sequence (query i of a sequence of L queries and S keys
            sees key j <= i + S - L).
        deterministic: bitwise-reproducible gradients (also under
            ``torch.use_deterministic_algorithms(True)``). The CPU backward and CUDA's portable
            one always are; on sm_90 the default is the Hopper backward, whose dQ is added in
            the order the CTAs get there (its last bits vary from run to run), and with
            ``deterministic=True`` in a fixed order (each sequence's key blocks the highest
            first).
        return_attn_probs: also return softmax_lse (num_heads, total_q), differentiable
            (its gradient enters the backward folded into delta = rowsum(dO * O)), and, as
            FlashAttention-2 does for testing only, None for the probabilities.
        block_table: paged KV (not supported yet: NotImplementedError).
        seqused_k: (batch,) int32, optional, on the offsets' device: sequence b uses only
            its first seqused_k[b] keys (causal alignment over those), as FlashAttention's;
            the others get zero gradients.
        strict: (keyword only) raise :class:`flash_attn_ext.FallbackError` instead of falling
            back to an unfused path (default: ``FLASH_ATTN_EXT_STRICT``), as
            :func:`flash_attn_ext.flash_attn_func`'s.  No call of this function falls back
            today: every call runs on the packed-sequence kernels, or raises
            NotImplementedError (on CUDA, where none serves it), so strict mode changes
            nothing here; the value is checked as there (True, False or None).

    Returns:
        out (total_q, num_heads, head_dim_v), or (out, softmax_lse, None).

    Raises:
        TypeError: q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k or alibi_slopes not a
            tensor (e.g. a list of offsets).
        NotImplementedError: block_table; on CUDA, a GPU or build without the kernels (naming
            the reason).
        ValueError: bad shapes, dtypes (on CUDA: float16 and bfloat16 only), offsets (naming
            the argument and the rule); k, v or alibi_slopes not on q's device; flags as
            flash_attn_func checks them (causal a bool, window_size a pair of ints, dropout_p
            in [0, 1], strict True, False or None, ...); alibi_slopes requiring grad.
        RuntimeError: on CUDA, while the stream captures a CUDA graph.
    """
    if block_table is not None:
        raise NotImplementedError("flash_attn_varlen_func: block_table (paged KV) is not "
                                  "supported yet")
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k)):
        if not isinstance(t, torch.Tensor) and (t is not None or name != "seqused_k"):
            # (the op's schema would name no argument)
            raise TypeError(f"flash_attn_varlen_func: {name} must be a torch.Tensor"
                            f"{' (int32, batch + 1 offsets)' if name[0] == 'c' else ''}, got "
                            f"{type(t).__name__}")
    # The flags as flash_attn_func checks them (a string "False" would be taken as True).
    causal = check_bool(causal, "causal")  # (a NumPy bool too, as FlashAttention-2 takes it)
    window_size, dropout_p = check_flags(causal, window_size, dropout_p)
    dropout_p, drop_all = kernel_dropout(dropout_p)  # (1: zeros, as flash_attn_func's)
    softmax_scale = check_scale(softmax_scale, "softmax_scale")
    softcap = check_softcap(softcap)
    deterministic = check_bool(deterministic, "deterministic")
    return_attn_probs = check_bool(return_attn_probs, "return_attn_probs")
    check_alibi(alibi_slopes, q)  # (a list named, not an AttributeError)
    check_devices(q, ("k", k), ("v", v))
    q, k, v = autocast(q, k, v)  # (as flash_attn_func: SDPA's autocast rule)
    policy.check_strict(strict)  # (no fallback to refuse: see the docstring)
    max_seqlen_q = check_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = check_seqlen(max_seqlen_k, "max_seqlen_k")
    window_left, window_right = (int(w) for w in window_size)
    record_plan(q, k, v, softmax_scale, causal or window_left >= 0 or window_right >= 0,
                planning.score_mods(softcap, dropout_p, None, alibi_slopes), deterministic,
                strict)
    cu_seqlens_q, cu_seqlens_k, seqused_k = _offsets_on_host(q, cu_seqlens_q, cu_seqlens_k,
                                                             seqused_k)
    # (max_seqlen_q / _k as check_seqlen returns them: an int, or under torch.compile possibly
    # a SymInt, e.g. from .item() of the offsets, which the op's SymInt arguments take)
    out, softmax_lse, _ = fwd_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, softmax_scale, bool(causal),
                                        window_left, window_right, float(softcap), alibi_slopes,
                                        float(dropout_p), seqused_k, bool(deterministic))
    out = dropped(out, drop_all)
    return (out, softmax_lse, None) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor,
                                     max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1),
                                     softcap: float = 0.0,
                                     alibi_slopes: Optional[torch.Tensor] = None,
                                     deterministic: bool = False,
                                     return_attn_probs: bool = False, *,
                                     strict: Optional[bool] = None):
    """FlashAttention-2's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` (total, 3, num_heads,
    head_dim), q, k and v read in place (strided views, no copy; their gradients land in one
    (total, 3, num_heads, head_dim) gradient); the same offsets for queries and keys. Otherwise
    :func:`flash_attn_varlen_func` (arguments, returns, errors)."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, num_heads, head_dim), got "
                         f"{tuple(qkv.shape)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                  max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, strict=strict)


def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor,
                                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Tuple[int, int] = (-1, -1),
                                    softcap: float = 0.0,
                                    alibi_slopes: Optional[torch.Tensor] = None,
                                    deterministic: bool = False,
                                    return_attn_probs: bool = False, *,
                                    strict: Optional[bool] = None):
    """FlashAttention-2's ``flash_attn_varlen_kvpacked_func``: ``kv`` (total_k, 2,
    num_heads_k, head_dim), k and v read in place. Otherwise :func:`flash_attn_varlen_func`."""
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, num_heads_k, head_dim), got "
                         f"{tuple(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, strict=strict)
