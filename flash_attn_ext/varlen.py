"""Packed sequences: FlashAttention-2's ``flash_attn_varlen_func`` on the
``torch.ops.flash_attn_ext.fwd_varlen`` / ``bwd_varlen`` ops.

A batch of sequences of different lengths, concatenated without padding: q (total_q, H, D),
k (total_k, H_kv, D), v (total_k, H_kv, Dv); sequence b is rows ``cu_seqlens_q[b] ..
cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` of k and v (int32
offsets). Each sequence attends only to its own keys, with FlashAttention-2's semantics (causal
and windows bottom-right aligned per sequence). The kernels are the dense ones, reading each
sequence in place by its offsets: the CPU kernels (csrc/cpu/varlen_cpu.h); on an H200 (sm_90)
the Hopper forward's varlen instantiations for plain attention (causal, windows and GQA
included) and for softcap, ALiBi or dropout alone (their tiles come from a table of every
sequence's query blocks that the host builds from the offsets, by sequence) and the Hopper
backward's (head dims up to 256, deterministic too; its CTAs from a table of every sequence's
key blocks); elsewhere, and with two of softcap, ALiBi and dropout together, the portable
kernels (kernels/sm80, block_info.h's SeqInfo).  Sequences
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
    check_tensors,
    check_transforms,
    dropped,
    kernel_dropout,
)
from .planning import Plan

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
    if q.dim() != 3:  # (the op's words: unpacking the shape said "too many values to unpack")
        raise ValueError(f"q must have 3 dimensions (total_q, num_heads, head_dim) for packed "
                         f"sequences, got q.dim()={q.dim()} with shape {list(q.shape)}")
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
    return _packed_grad_like(q), _packed_grad_like(k), _packed_grad_like(v)


def _packed_grad_like(t: torch.Tensor) -> torch.Tensor:
    """An empty gradient of the packed (total, heads, d) tensor t, laid out as the bwd_varlen
    op's device kernels lay out dq, dk, dv (inductor asserts the fake kernel's strides against
    theirs): ``zeros_like`` of the tensor they compute on, t with a batch dimension of 1
    (csrc/varlen_checks.h), a contiguous copy where t's last dimension is not contiguous
    (``last_dim_contiguous``), and on CUDA also where its strides or start are not whole
    16-byte chunks (``kernel_ready``, whose copies are contiguous).  So a dense t keeps its
    strides (a head-major q, (heads, total, d) transposed, got contiguous ones here, and a
    compiled backward failed inductor's stride assertion)."""
    if not (t.stride(-1) == 1 or t.size(-1) <= 1):
        t = t.contiguous()
    t = t.unsqueeze(0)
    if t.device.type == "cuda" and not ops._cuda_kernel_ready(t):
        return t.new_empty(t.shape[1:])
    return torch.empty_like(t).squeeze(0)


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
    pieces = _to_host(parts)
    return pieces[0], pieces[1], pieces[2] if seqused_k is not None else None


def _to_host(tensors):
    """The tensors (int32, any shapes) with those on a device copied to the host in one copy:
    one wait for the GPU, however many there are."""
    on_device = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    if not on_device:
        return list(tensors)
    copied = torch.cat([tensors[i].flatten() for i in on_device]).cpu().split(
        [tensors[i].numel() for i in on_device])
    out = list(tensors)
    for i, c in zip(on_device, copied):
        out[i] = c.view(tensors[i].shape)
    return out


def _gather_pages(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k):
    """Paged keys and values (FlashAttention's ``block_table``) as packed sequences: k, v of
    shape (num_blocks, page_size, num_heads_k, head_dim), sequence b's key j at page
    ``block_table[b, j // page_size]``, row ``j % page_size``, its length ``cu_seqlens_k[b + 1]
    - cu_seqlens_k[b]`` (only the differences of cu_seqlens_k count).  Returns (k, v,
    cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k) for the varlen op: each sequence's
    pages (the first ceil(max_seqlen_k / page_size) slots of its row) gathered into a copy
    (autograd carries the gradients back into the pages, summed where sequences share a page),
    ``seqused_k`` the lengths (or the caller's seqused_k, at most them).  Only the slots of
    pages a sequence uses must hold page indices (the others may hold anything, e.g. -1).
    Eager calls check the values on the host: the offsets, seqused_k and the table are copied
    there together (on CUDA one wait for the GPU, the one the offsets' copy costs anyway: the
    op then gets host offsets); under torch.compile the checks run on the device
    (``torch._assert_async``); while a CUDA graph is captured not at all (the op refuses the
    call by name)."""
    check_tensors(("block_table", block_table))
    max_seqlen_k = check_seqlen(max_seqlen_k, "max_seqlen_k")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"with block_table, {name} must be pages of shape (num_blocks, "
                             f"page_size, num_heads_k, head_dim), got {tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3] or k.shape[1] == 0:
        raise ValueError(f"with block_table, k and v must be pages of one (num_blocks, "
                         f"page_size >= 1, num_heads_k) shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 1:
            raise ValueError(f"{name} must be a (batch + 1,) int32 tensor, got {t.dtype} of "
                             f"shape {tuple(t.shape)}")
    batch = cu_seqlens_k.numel() - 1
    if cu_seqlens_q.numel() != batch + 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or \
            block_table.shape[0] != batch or block_table.device != k.device:
        raise ValueError(f"block_table must be a (batch, max_num_blocks) = ({batch}, ...) int32 "
                         f"tensor on k's device ({k.device}), got {block_table.dtype} of shape "
                         f"{tuple(block_table.shape)} on {block_table.device}")
    if seqused_k is not None and (seqused_k.dtype != torch.int32 or seqused_k.dim() != 1 or
                                  seqused_k.numel() != batch):
        raise ValueError(f"seqused_k must be a (batch,) = ({batch},) int32 tensor, got "
                         f"{seqused_k.dtype} of shape {tuple(seqused_k.shape)}")
    num_blocks, page = k.shape[0], k.shape[1]
    # The slots a sequence of at most max_seqlen_k keys can use: the copy has no more rows
    # (tables sized for the longest context would otherwise be copied whole).
    slots = min(block_table.shape[1], max(0, -(-max_seqlen_k // page)))
    table = block_table[:, :slots]
    capacity = slots * page
    if batch * capacity >= 2**31:
        raise ValueError(f"block_table: the gathered copy of batch * ceil(max_seqlen_k / "
                         f"page_size) * page_size = {batch * capacity} rows exceeds int32 "
                         f"offsets")
    compiling = torch.compiler.is_compiling()
    # Eager calls check the values on the host (not while a CUDA graph is captured: the op
    # refuses the call by name; nor on meta tensors, which have none).
    check_on_host = not compiling and q.device.type != "meta" and \
        cu_seqlens_k.device.type != "meta" and \
        not (q.is_cuda and torch.cuda.is_current_stream_capturing())
    table_checked = table
    if check_on_host:  # (offsets, seqused_k and the table in one copy)
        cu_seqlens_q, cu_seqlens_k, table_checked, *rest = _to_host(
            [cu_seqlens_q, cu_seqlens_k, table] + ([seqused_k] if seqused_k is not None
                                                   else []))
        seqused_k = rest[0] if rest else None
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    used = lengths if seqused_k is None else seqused_k
    if compiling or check_on_host:
        # (on the host for eager calls, on the table's device under torch.compile)
        where = table_checked.device
        lengths_w, used_w = lengths.to(where), used.to(where)
        in_use = torch.arange(slots, device=where) < \
            ((lengths_w.long() + page - 1) // page)[:, None]
        bad_page = in_use & ((table_checked < 0) | (table_checked >= num_blocks))
    if compiling:
        torch._assert_async(~bad_page.any() & (lengths_w >= 0).all() &
                            (lengths_w <= capacity).all() & (used_w >= 0).all() &
                            (used_w <= lengths_w).all(),
                            "flash_attn_varlen_func: block_table, cu_seqlens_k, max_seqlen_k or "
                            "seqused_k break the paging rules (run the call eagerly for the "
                            "message)")
    elif check_on_host:
        if bool((lengths < 0).any()):
            raise ValueError(f"cu_seqlens_k must be non-decreasing, got {cu_seqlens_k.tolist()}")
        longest = int(lengths.max()) if batch else 0
        if longest > max_seqlen_k:
            raise ValueError(f"max_seqlen_k={max_seqlen_k} is shorter than the longest sequence "
                             f"({longest})")
        if longest > block_table.shape[1] * page:
            b = int(torch.argmax(lengths))
            raise ValueError(f"block_table has {block_table.shape[1]} slots of {page} keys per "
                             f"sequence, but sequence {b} has {longest} keys (cu_seqlens_k)")
        if bool(bad_page.any()):
            at = tuple(bad_page.nonzero()[0].tolist())
            raise ValueError(f"block_table entries must be page indices in [0, {num_blocks}) "
                             f"(k.shape[0]) where a sequence uses the page, got "
                             f"block_table[{at[0]}, {at[1]}]={int(table_checked[at])}")
        if seqused_k is not None and bool(((seqused_k < 0) | (seqused_k > lengths)).any()):
            raise ValueError(f"seqused_k must be in [0, each sequence's length] (cu_seqlens_k: "
                             f"{lengths.tolist()}), got {seqused_k.tolist()}")
    if num_blocks:
        pages = table.long().clamp(0, num_blocks - 1)
        k = k[pages].reshape(batch * capacity, *k.shape[2:])
        v = v[pages].reshape(batch * capacity, *v.shape[2:])
    else:  # (no pages: every length is 0, checked above)
        k = k.new_zeros((batch * capacity, *k.shape[2:]))
        v = v.new_zeros((batch * capacity, *v.shape[2:]))
    cu = torch.arange(batch + 1, dtype=torch.int32, device=cu_seqlens_k.device) * capacity
    return k, v, cu_seqlens_q, cu, used.to(torch.int32), capacity


def packed_plan(q, k, v, softmax_scale, unequal_tiles: bool, mods: int, deterministic: bool,
                note: Optional[str] = None) -> Optional[Plan]:
    """The plan of a packed call as :func:`record_plan` records it, or None where it records
    none: the kernels the varlen ops run, as the rule (csrc/kernel_select.h, ``packed``) picks
    them.  A call that no kernel serves has none: the op refuses it (NotImplementedError,
    ValueError), there is no fallback.  On meta tensors (no kernel; the op's fake kernel gives
    the shapes) the plan is flash_attn_func's there: the fallback, "device type 'meta' has no
    flash_attn_ext kernel".  ``note``: why the call came here (the KV-cache route, a
    block_table's copy), added to the plan's notes."""
    # (eager calls only, as the other calls; q, k, v read by their shapes, as plan() reads them:
    # the op has checked them, and tests stand in CUDA-like descriptions)
    if torch.compiler.is_compiling() or not all(len(t.shape) == 3 for t in (q, k, v)):
        return None
    p = planning.plan(q, k, v, softmax_scale, mods, unequal_tiles=unequal_tiles,
                      deterministic=deterministic, packed=True)
    # (a meta call ran, on the fake kernel: reported as flash_attn_func reports its meta
    # calls, which run the unfused math on meta tensors; it left last_plan() naming an earlier
    # call's kernels, a new-user finding)
    if not p.fused and q.device.type != "meta":
        return None
    if note is not None:
        p = dataclasses.replace(p, notes=p.notes + (note,))
    return p


def _plan_flags(causal, window_left, window_right, softcap, dropout_p,
                alibi_slopes) -> Tuple[bool, int]:
    """What a packed call's plan depends on besides the tensors: whether its tiles are unequal
    work (causal or a window) and its score modifiers (planning.score_mods)."""
    return (causal or window_left >= 0 or window_right >= 0,
            planning.score_mods(softcap, dropout_p, None, alibi_slopes))


def record_plan(q, k, v, softmax_scale, unequal_tiles: bool, mods: int, deterministic: bool,
                strict, note: Optional[str] = None) -> None:
    """Records the plan of a packed call (``flash_attn_ext.last_plan()``) after its op ran:
    :func:`packed_plan`'s, where it has one (on meta tensors a fallback: warned once, counted,
    refused in strict mode, as flash_attn_func's there)."""
    p = packed_plan(q, k, v, softmax_scale, unequal_tiles, mods, deterministic, note)
    if p is None:
        return
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    policy.record(p, strict, needs_grad)


def _pages_note(block_table, k) -> Optional[str]:
    """The plan's note on a block_table call's copy (k: the gathered keys), or None."""
    return None if block_table is None else (f"block_table: the pages used gathered into a copy "
                                             f"of {k.shape[0]} key rows before the kernels run")


def _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
             return_attn_probs, block_table, seqused_k, strict):
    """flash_attn_varlen_func's own checks, in its order, before its op's (explain() of a packed
    call runs them too, so that a bad argument raises the call's error); returns the
    arguments as the op takes them: (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
    dropout_p, drop_all, deterministic, return_attn_probs), k and v the pages' gathered copy
    with ``block_table``, q, k and v cast under torch.autocast."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k)):
        if not isinstance(t, torch.Tensor) and (t is not None or name != "seqused_k"):
            # (the op's schema would name no argument)
            raise TypeError(f"flash_attn_varlen_func: {name} must be a torch.Tensor"
                            f"{' (int32, batch + 1 offsets)' if name[0] == 'c' else ''}, got "
                            f"{type(t).__name__}")
    check_tensors(("q", q), ("k", k), ("v", v))  # (nested tensors)
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
    # (torch.func's gradient transforms and forward-mode AD: the same refusal as
    # flash_attn_func's, not PyTorch's message about C++ autograd functions)
    check_transforms(q, k, v, *(t for t in (alibi_slopes,) if t is not None),
                     dropout_p=dropout_p)
    if block_table is not None:  # (before autocast: only the pages used are cast)
        _check_offsets_device(q, cu_seqlens_q, cu_seqlens_k, seqused_k)
        k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k = _gather_pages(
            q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k)
    q, k, v = autocast(q, k, v)  # (as flash_attn_func: SDPA's autocast rule)
    policy.check_strict(strict)  # (no fallback to refuse: see the docstring)
    max_seqlen_q = check_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = check_seqlen(max_seqlen_k, "max_seqlen_k")
    window_left, window_right = (int(w) for w in window_size)
    return (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window_left, window_right, softcap, dropout_p, drop_all,
            deterministic, return_attn_probs)


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
            cu_seqlens_k). Zero-length sequences are allowed; rows before the first offset
            (cu_seqlens_q[0] > 0) and past the last are left alone (out 0, softmax_lse -inf,
            zero gradients). On q's device (FlashAttention-2's way) or on the CPU, the
            offsets and seqused_k on the same one. They are checked and the kernels' tables
            built on the host: offsets on a CUDA device are copied to the host once per call
            (one synchronisation, forward and backward together); offsets on the CPU cost
            none (they are uploaded on the call's stream), which is the faster way to call
            it many times with the same sequences (every layer of a model).
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence's length (so >= 0).
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
        block_table: (batch, max_num_blocks) int32 on k's device, or None: paged KV, as
            FlashAttention's: k (num_blocks, page_size, num_heads_k, head_dim) and v
            (num_blocks, page_size, num_heads_k, head_dim_v) are pages (any page_size >= 1),
            sequence b's key j at page block_table[b, j // page_size], row j % page_size, and
            only the differences of cu_seqlens_k count (the lengths).  Only the slots of pages
            a sequence uses must hold page indices (the others may hold anything, e.g. -1).
            The pages a call uses are gathered into a copy (batch * ceil(max_seqlen_k /
            page_size) * page_size rows) before the kernels run; gradients reach the pages
            (summed where sequences share one).  The table, the offsets and seqused_k are
            checked on the host, copied there together: on CUDA one wait for the GPU per call,
            also with offsets on the CPU (the table is read); under torch.compile on the device
            (``torch._assert_async``).
        seqused_k: (batch,) int32, optional, on the offsets' device: sequence b uses only
            its first seqused_k[b] keys (causal alignment over those), as FlashAttention's;
            the others get zero gradients.
        strict: (keyword only) raise :class:`flash_attn_ext.FallbackError` instead of falling
            back to an unfused path (default: ``FLASH_ATTN_EXT_STRICT``), as
            :func:`flash_attn_ext.flash_attn_func`'s.  No call of this function falls back
            today: every call runs on the packed-sequence kernels, or raises
            NotImplementedError (on CUDA, where none serves it), so strict mode changes
            nothing here, except on meta tensors, which no kernel takes: as flash_attn_func's
            meta calls, they are reported as a fallback (warned once, counted,
            ``FallbackError`` in strict mode) and get the shapes of the output; the value is
            checked as there (True, False or None).

    Returns:
        out (total_q, num_heads, head_dim_v), or (out, softmax_lse, None). A row that sees no
        key (a zero-length key sequence, a window that leaves none, rows outside every
        sequence) gives out 0 and softmax_lse -inf (FlashAttention-2 writes +inf there).

    Raises:
        TypeError: q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table or
            alibi_slopes not a tensor (e.g. a list of offsets).
        NotImplementedError: on CUDA, a GPU or build without the kernels (naming the
            reason); forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) and
            torch.func's gradient transforms (grad, vjp, jacrev), as flash_attn_func.
        ValueError: bad shapes, dtypes (on CUDA: float16 and bfloat16 only), offsets (naming
            the argument and the rule), max_seqlen_q / max_seqlen_k not an int, negative or
            below the longest sequence's length, a block_table that does not fit its pages or the
            lengths (naming the entry); k, v or alibi_slopes not on q's device; flags as
            flash_attn_func checks them (causal a bool, window_size a pair of ints, dropout_p
            in [0, 1], strict True, False or None, ...); alibi_slopes requiring grad.
        RuntimeError: on CUDA, while the stream captures a CUDA graph.
    """
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
     causal, window_left, window_right, softcap, dropout_p, drop_all, deterministic,
     return_attn_probs) = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                   softcap, alibi_slopes, deterministic, return_attn_probs,
                                   block_table, seqused_k, strict)
    cu_seqlens_q, cu_seqlens_k, seqused_k = _offsets_on_host(q, cu_seqlens_q, cu_seqlens_k,
                                                             seqused_k)
    # (max_seqlen_q / _k as check_seqlen returns them: an int, or under torch.compile possibly
    # a SymInt, e.g. from .item() of the offsets, which the op's SymInt arguments take)
    out, softmax_lse, _ = fwd_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, softmax_scale, bool(causal),
                                        window_left, window_right, float(softcap), alibi_slopes,
                                        float(dropout_p), seqused_k, bool(deterministic))
    # (recorded once the op has checked the shapes and offsets: a call it refuses never ran)
    record_plan(q, k, v, softmax_scale,
                *_plan_flags(causal, window_left, window_right, softcap, dropout_p,
                             alibi_slopes), deterministic, strict,
                note=_pages_note(block_table, k))
    out = dropped(out, drop_all)
    return (out, softmax_lse, None) if return_attn_probs else out


def explain_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                   softcap=0.0, alibi_slopes=None, deterministic=False,
                   return_attn_probs=False, block_table=None, seqused_k=None, *,
                   strict=None) -> Plan:
    """``explain(q, k, v, layout="thd", ...)``: the plan that flash_attn_varlen_func records
    for these arguments (last_plan() after the call), without running the kernels.  The
    call's checks in its order: its own (:func:`_checked`, with a block_table the pages'
    copy too, as the call gathers them), then its op's (the C++ checks of the fwd_varlen op,
    or on meta tensors those of its fake kernel, which the call reaches there), so that a bad
    argument raises the call's error; on CUDA the NotImplementedError of a call that no kernel
    serves.  In strict mode a meta call's fallback Plan is returned where the call raises
    FallbackError, as explain() does for the other layouts."""
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
     causal, window_left, window_right, softcap, dropout_p, _, deterministic,
     _) = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table, seqused_k, strict)
    op_args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
               bool(causal), window_left, window_right, float(softcap), alibi_slopes,
               float(dropout_p), seqused_k)
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in op_args):
        _fwd_varlen_fake(*op_args)  # (the dispatcher sends such a call to the fake kernel)
    else:
        ops._C.check_varlen_args(*op_args)
    unequal_tiles, mods = _plan_flags(causal, window_left, window_right, softcap, dropout_p,
                                      alibi_slopes)
    p = packed_plan(q, k, v, softmax_scale, unequal_tiles, mods, deterministic,
                    note=_pages_note(block_table, k))
    if p is None:  # (the CUDA op's refusal, with the rule's reasons: csrc/cuda/flash_cuda.cu)
        reasons = planning.plan(q, k, v, softmax_scale, mods, unequal_tiles=unequal_tiles,
                                deterministic=deterministic, packed=True).reasons
        raise NotImplementedError(f"no flash_attn_ext CUDA kernel serves this call: "
                                  f"{'; '.join(reasons)}")
    return p


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
    check_tensors(("qkv", qkv))
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
    check_tensors(("kv", kv))
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, num_heads_k, head_dim), got "
                         f"{tuple(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, strict=strict)
