"""``explain()``: which kernel would serve attention on given tensors, and why, without
running it (the plan the call itself would record; see flash_attn_ext.planning)."""

from __future__ import annotations

import torch

from . import ops
from ._call import (
    autocast,
    check_alibi,
    check_bool,
    check_flags,
    check_scale,
    check_softcap,
    check_tensors,
    kernel_dropout,
)
from .planning import Plan, plan, score_mods
from .policy import check_strict
from .sdpa import (
    _checked_to_bshd,
    _grouped_3d,
    beyond_kernels,
    check_fallback_inputs,
    check_sdpa_flags,
    flatten_batch_dims,
    mask_to_bias,
    to_bshd,
)
from .varlen import explain_packed

__all__ = ["explain"]


# The keywords each layout's function takes (besides the tensors and enable_gqa).
_CALL_KEYWORDS = {
    "bhld": frozenset({"attn_mask", "dropout_p", "is_causal", "scale", "strict"}),
    "blhd": frozenset({"dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                       "alibi_slopes", "deterministic", "return_softmax_lse",
                       "return_attn_probs", "strict"}),
    # flash_attn_varlen_func's (packed sequences)
    "thd": frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                      "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                      "deterministic", "return_attn_probs", "block_table", "seqused_k",
                      "strict"}),
}
_THD_REQUIRED = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


# The packed-sequence and KV-cache functions' own arguments (layout="thd" explains the former;
# flash_attn_with_kvcache's calls are not explained: last_plan() names the kernels after it).
_PACKED_KEYWORDS = frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                              "block_table", "seqused_k", "cache_seqlens", "cache_batch_idx",
                              "cache_leftpad", "rotary_cos", "rotary_sin", "rotary_interleaved",
                              "num_splits", "k_cache", "v_cache"})


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
            layout: str = "bhld", enable_gqa: bool = False, **call_kwargs) -> Plan:
    """Says which kernel would serve attention on these tensors, without running the kernels
    (with ``layout="thd"`` and a ``block_table`` the pages are still gathered into a copy, as
    the call gathers them: that copy's memory and time).

    Args:
        query, key, value: tensors in ``layout``: ``"bhld"`` (N, H, L, E) as
            scaled_dot_product_attention takes them (default; (N, L, E) and (N, ..., H, L, E)
            too, explained as the one call on the flattened batch that it runs),
            ``"blhd"`` (N, L, H, E) as flash_attn_func takes them, or ``"thd"``: packed
            sequences as flash_attn_varlen_func takes them, q (total_q, H, E), k and v
            (total_k, H_kv, E / Ev), with that function's arguments as keywords
            (``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q`` and ``max_seqlen_k``
            required; ``causal``, ``softcap``, ``alibi_slopes``, ``dropout_p``,
            ``seqused_k``, ``block_table``, ``deterministic``, ...): the Plan that call records
            in last_plan(), kernels named ``..._varlen`` (on sm_90 the Hopper varlen
            instantiations, ``..._varlen_softcap``, ``..._varlen_alibi`` or
            ``..._varlen_dropout`` for one of those alone; two of them together the portable
            kernels, with the rule's note).  The call's checks run, its op's included: the
            offsets are read on the host as the call reads them (on a GPU one copy, a
            synchronisation), and a block_table's pages are gathered into a copy as the
            call gathers them.  Under torch.autocast, in the dtype the call runs in.
        layout: see above.
        enable_gqa: allow H_kv < H, as scaled_dot_product_attention's argument (False by
            default, as there: a call with H_kv < H without it raises ``ValueError``, and so
            does its explanation); ``"blhd"`` always allows it, as flash_attn_func does.
        **call_kwargs: the call's other arguments (is_causal, scale, ...), so that a call can be
            explained as written; on sm_90 GPUs softcap, a boolean attn_mask, alibi_slopes
            or dropout_p alone picks the Hopper kernels' variant for it (``..._softcap``,
            ``..._mask``, ``..._alibi``, ``..._dropout``), a float mask or several of them
            together their general variant (``..._general``), and ``deterministic=True`` (with
            ``layout="blhd"``, as flash_attn_func takes it; in either layout
            torch.use_deterministic_algorithms(True)) adds a note where the CUDA backward's dQ
            becomes bitwise reproducible: added in a fixed order on the Hopper backward, a
            separate dQ kernel on the 8-warp portable one.

    Returns:
        A :class:`Plan`: ``kernel`` (e.g. ``"cpu_flash_fwd_fp32"``), ``backward_kernel``,
        ``fused`` and ``reasons`` (why it falls back, empty when fused), ``backward_fused``
        and ``backward_reasons`` (the same for the backward), ``notes`` (why a fused but
        slower kernel serves the call, or how its dQ is formed).  ``strict=True`` (or strict
        mode set) does not make it raise: a fallback's Plan is returned, ``fused`` False,
        where the call raises ``FallbackError`` with its ``reasons``.

    Raises:
        NotImplementedError: ``"thd"`` on CUDA where no kernel serves the call (the call's
            error, with the rule's reasons); forward-mode AD or torch.func's transforms
            active, as the call.
        ValueError: unknown layout; otherwise the ValueError the call itself raises, with its
            message (the call's checks, in its order: e.g. head dims outside 1..256 with
            ``"blhd"``, which flash_attn_func refuses, while the SDPA drop-in runs them on
            the unfused math, which the plan names as a fallback).
        TypeError: an argument that the layout's function does not take (e.g. a misspelt
            ``is_casual``; flash_attn_varlen_func's own arguments, such as ``cu_seqlens_q``,
            outside ``"thd"`` and flash_attn_with_kvcache's in any layout, with a pointer to
            ``layout="thd"`` and ``last_plan()``, which names the kernels after the call); a
            missing required argument of ``"thd"``; a tensor argument that is not a tensor,
            as the call.
    """
    if layout not in _CALL_KEYWORDS:
        raise ValueError(f"layout must be 'bhld', 'blhd' or 'thd', got {layout!r}")
    unknown = set(call_kwargs) - _CALL_KEYWORDS[layout]
    if unknown:
        function = {"bhld": "scaled_dot_product_attention", "blhd": "flash_attn_func",
                    "thd": "flash_attn_varlen_func"}[layout]
        packed = sorted(unknown & _PACKED_KEYWORDS)
        hint = (f" ({packed} belong to flash_attn_varlen_func, explained with layout='thd', or "
                f"flash_attn_with_kvcache, which explain() does not plan: run that call and read "
                f"flash_attn_ext.last_plan(), which names its kernels)" if packed else "")
        raise TypeError(f"explain() got keyword arguments that {function} (layout={layout!r}) "
                        f"does not take: {sorted(unknown)}{hint}")
    if layout == "thd":
        missing = [name for name in _THD_REQUIRED if name not in call_kwargs]
        if missing:
            raise TypeError(f"explain(layout='thd') needs flash_attn_varlen_func's required "
                            f"arguments {list(_THD_REQUIRED)} as keywords, missing: {missing}")
        # (enable_gqa: H_kv < H is always allowed, as flash_attn_varlen_func allows it)
        return explain_packed(query, key, value, **call_kwargs)
    # The SDPA drop-in checks its own tensor rules (dtype, devices, ...) once more where the
    # kernels' checks raise, and raises the broken rule's error first (sdpa.py): so does this.
    reached = []
    try:
        return _explain_call(query, key, value, layout, enable_gqa, call_kwargs, reached)
    except ValueError:
        if reached:
            _checked_to_bshd(*reached[0])
        raise


def _explain_call(query, key, value, layout, enable_gqa, call_kwargs, reached) -> Plan:
    """explain's checks and plan in the call's order; appends the SDPA layout's tensors to
    ``reached`` once its fast tensor checks passed (as the call's try block begins there)."""
    attn_mask = call_kwargs.get("attn_mask")
    causal = call_kwargs.get("causal", call_kwargs.get("is_causal", False))
    window = call_kwargs.get("window_size", (-1, -1))
    dropout_p = call_kwargs.get("dropout_p", 0.0)
    strict = call_kwargs.get("strict")
    # The call's checks in the call's order (each function's own, then run()'s), so that a
    # call with several bad arguments is explained with the error the call raises first.
    if layout == "bhld":  # scaled_dot_product_attention's
        check_bool(enable_gqa, "enable_gqa", numpy_bool=False)
        if isinstance(query, torch.Tensor) and query.dim() > 4:  # one call on the flattened batch
            query, key, value, attn_mask, _ = flatten_batch_dims(query, key, value, attn_mask)
        if _grouped_3d(query, key, value, enable_gqa, attn_mask):  # (H, L, E), one batch
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        scale = check_scale(call_kwargs.get("scale"), "scale")
        dropout_p = check_sdpa_flags(dropout_p, causal)
        q, k, v = to_bshd(query, key, value, enable_gqa)
        reached.append((query, key, value, enable_gqa))
        # (head dims outside the kernels': the unfused math, without the kernels' checks; the
        # call checks devices and the dtype, then the mask, then records that fallback, strict
        # or not: sdpa.attend's order)
        kernel_checks = not beyond_kernels(q, v)
        if not kernel_checks:
            check_fallback_inputs(query, key, value, q.dtype)
        if attn_mask is not None:  # checked against the call's (N, H, L, S), as the call does
            mask_to_bias(attn_mask, query, key)
        if not kernel_checks:
            check_strict(strict)
        query, key, value = q, k, v
    else:  # flash_attn_func's
        check_tensors(("q", query), ("k", key), ("v", value))
        causal = check_bool(causal, "causal")  # (a NumPy bool too, as flash_attn_func's)
        window, dropout_p = check_flags(causal, window, dropout_p)
        scale = check_scale(call_kwargs.get("softmax_scale"), "softmax_scale")
        kernel_checks = True
    softcap = check_softcap(call_kwargs.get("softcap", 0.0))
    deterministic = check_bool(call_kwargs.get("deterministic", False), "deterministic")
    if layout == "blhd":
        for flag in ("return_softmax_lse", "return_attn_probs"):
            check_bool(call_kwargs.get(flag, False), flag)
    alibi_slopes = call_kwargs.get("alibi_slopes")
    check_alibi(alibi_slopes, query)
    dropout_p, _ = kernel_dropout(dropout_p)  # (1: the kernels run without dropout)
    wl, wr = window
    query, key, value = autocast(query, key, value)  # (the dtypes the call runs in, as run())
    p = plan(query, key, value, scale,
             score_mods(softcap, float(dropout_p), attn_mask, alibi_slopes),
             unequal_tiles=causal or wl >= 0 or wr >= 0,
             deterministic=deterministic)
    if kernel_checks:
        # run(): a fused call records its plan (strict checked) before the kernels' op checks
        # its arguments; a fallback checks them first, as the op would (_call.run).
        if p.fused:
            check_strict(strict)
        ops.check_args(query, key, value, scale, causal, wl, 0 if causal else wr, softcap,
                       float(dropout_p))
        if not p.fused:
            check_strict(strict)
    if p.kernel == "none":  # not one of the four float dtypes: a call raises
        raise ValueError("; ".join(p.reasons))
    return p
