"""Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` ((B, H, L, E) layout)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import ops, planning, policy, unfused
from ._call import (
    autocast_dtype,
    check_bool,
    check_flags,
    check_scale,
    dropped,
    kernel_dropout,
    run,
    run_dtypes,
)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    strict: Optional[bool] = None,
) -> torch.Tensor:
    """PyTorch's ``scaled_dot_product_attention``, computed by the flash_attn_ext kernels.

    Same arguments, semantics and result as ``torch.nn.functional.scaled_dot_product_attention``
    for what it accepts; the inputs are read as strided views (no copies) and computed by the
    FlashAttention algorithm (arXiv:2205.14135 Algorithm 1, arXiv:2307.08691): exact attention
    with O(L) memory.

    Args:
        query: (N, H, L, E) or (N, L, E); or (N, ..., H, L, E), the leading dimensions (the
            same in key and value) flattened into one batch dimension (as PyTorch's takes
            them, without broadcasting between query, key and value).
        key: (N, H_kv, S, E) or (N, S, E), N (and every leading dimension) equal to query's:
            a batch or head count of 1 is not broadcast (PyTorch's function broadcasts it:
            here a ValueError; expand it first).
        value: (N, H_kv, S, Ev) or (N, S, Ev).  H must equal H_kv unless ``enable_gqa``, in which
            case H must be a multiple of H_kv.  E and Ev: 1 to 256 in the kernels (larger
            ones run the unfused math, reported as a fallback).  dtypes as in
            :func:`flash_attn_ext.flash_attn_func`.
        attn_mask: boolean (True = attend) or additive float mask, broadcastable to
            (N, H, L, S) ((N, L, S) for 3-D inputs, (H, L, S) for 3-D inputs grouped with
            enable_gqa, (N, ..., H, L, S) with more leading dimensions; a ValueError names the
            mask's shape and that one). Applied inside
            the fused kernels (CPU and CUDA) tile by tile; a float mask that requires grad
            gets one (that gradient needs an fp32 (N, H, L, S) buffer).
            Rows the mask empties give 0 (as PyTorch 2.13 on the CPU).
        dropout_p: dropout on the attention weights, as in PyTorch (applied whenever > 0;
            1.0 gives zeros; see :func:`flash_attn_ext.flash_attn_func` for the generator).
        is_causal: top-left aligned causal mask, exactly ``torch.tril(ones(L, S))`` as in PyTorch
            (rows of query i see keys j <= i; with L > S the last rows see all keys).  With an
            attn_mask too, both apply (the mask's scores where the causal mask lets them
            through), as PyTorch's fused CPU kernel computes it (its documentation calls the
            combination an error, and its math backend raises).
        scale: multiplies q k^T; default 1 / sqrt(E).
        enable_gqa: allow H_kv < H (grouped-query attention).  3-D inputs whose first sizes
            differ are grouped as heads then, (H, L, E) against (H_kv, S, E), as PyTorch's
            function groups dimension -3.
        strict: raise instead of falling back to an unfused path (see
            :func:`flash_attn_ext.explain`).

    Gradients are bitwise reproducible under ``torch.use_deterministic_algorithms(True)``
    (read at each call; see ``deterministic`` in :func:`flash_attn_ext.flash_attn_func`).

    Returns:
        (N, H, L, Ev) (or (N, L, Ev), or (N, ..., H, L, Ev)) in query's dtype, a transposed view
        of a (N, L, H, Ev) buffer.

    Raises:
        ValueError: ranks below 3, mismatched shapes (leading dimensions too), H not a
            multiple of H_kv (or H != H_kv without enable_gqa), an attn_mask of fewer than 2
            dimensions or of a floating dtype other than float32 and query's (as PyTorch),
            and the errors of flash_attn_func, except that E or Ev of 0 or above 256 runs the
            unfused float32 math of :mod:`flash_attn_ext.unfused` (answering E = 0 with the
            mean of the visible values and Ev = 0 with an empty tensor, as PyTorch), reported
            as a fallback.
        FallbackError: in strict mode, when no fused kernel serves the call.
    """
    # (a string "no" would be taken as True; NumPy bools refused, as PyTorch's function does)
    check_bool(enable_gqa, "enable_gqa", numpy_bool=False)
    if isinstance(query, torch.Tensor) and query.dim() > 4:
        query, key, value, attn_mask, lead = flatten_batch_dims(query, key, value, attn_mask)
        out = scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                           scale, enable_gqa, strict=strict)
        return out.reshape(*lead, *out.shape[1:])
    if _grouped_3d(query, key, value, enable_gqa, attn_mask):
        # PyTorch's function groups dimension -3 as the heads: 3-D inputs with enable_gqa and
        # other leading sizes are (H, L, E) against (H_kv, S, E), one batch.  A mask of up to 3
        # dimensions broadcasts against (1, H, L, S) as against (H, L, S).
        out = scaled_dot_product_attention(query.unsqueeze(0), key.unsqueeze(0),
                                           value.unsqueeze(0), attn_mask, dropout_p, is_causal,
                                           scale, enable_gqa, strict=strict)
        return out.squeeze(0)
    scale = check_scale(scale, "scale")
    dropout_p = check_sdpa_flags(dropout_p, is_causal)
    q, k, v = to_bshd(query, key, value, enable_gqa)
    try:
        out = attend(q, k, v, query, key, attn_mask, dropout_p, is_causal, scale, 0.0, strict)
    except ValueError:
        # The fast path of to_bshd leaves devices and dtype support to the kernels' checks,
        # whose errors name flash_attn_func's q, k and v: where one of the drop-in's own rules
        # is broken, its error (naming query, key and value) instead; free on success.
        _checked_to_bshd(query, key, value, enable_gqa)
        raise
    out = out.transpose(1, 2)
    return out.squeeze(1) if query.dim() == 3 else out


def _grouped_3d(query, key, value, enable_gqa, attn_mask) -> bool:
    """Whether 3-D query, key and value with enable_gqa differ in their first size (query's a
    multiple of key's and value's, and their other sizes agree): PyTorch's heads and KV heads
    of one batch.  ValueError then for an attn_mask that does not broadcast to the attention's
    (H, L, S), as PyTorch's function says, named in those terms (the call runs on (1, H, L,
    E), against which a mask of more than 3 dimensions would also broadcast).  Other 3-D
    calls with enable_gqa and different first sizes break a rule that _checked_to_bshd names
    in the caller's (H, L, E) terms."""
    if enable_gqa is not True or not all(isinstance(t, torch.Tensor) and t.dim() == 3
                                         for t in (query, key, value)):
        return False
    h, h_k, h_v = query.shape[0], key.shape[0], value.shape[0]
    grouped = (h_k == h_v and h_k != h and h_k > 0 and h % h_k == 0
               and key.shape[1] == value.shape[1] and query.shape[2] == key.shape[2])
    if grouped and isinstance(attn_mask, torch.Tensor) and attn_mask.dim() >= 2:
        check_mask_shape(attn_mask, tuple(query.shape[:-1]) + (key.shape[-2],), "(H, L, S)")
    return grouped


def attend(q, k, v, query, key, attn_mask, dropout_p, is_causal, scale, softcap,
           strict) -> torch.Tensor:
    """run_sdpa, or where the head dims lie beyond the kernels (beyond_kernels) the unfused
    math, reported as a fallback (warned, counted, refused in strict mode); (B, L, H, Ev).
    Not PyTorch's function: for float32 with a mask its memory-efficient kernel answers rows
    of finfo.min with garbage."""
    if not beyond_kernels(q, v):
        return run_sdpa(q, k, v, query, key, attn_mask, dropout_p, is_causal, scale, softcap,
                        strict)
    # (devices, the dtype and the mask checked first: a bad one is the call's error, not a
    # fallback's)
    check_fallback_inputs(query, key, v, q.dtype)
    bias = None if attn_mask is None else mask_to_bias(attn_mask, query, key)
    policy.record(planning.plan(q, k, v), strict)
    dropout_p, drop_all = kernel_dropout(dropout_p)
    out, _ = unfused.fallback_attention(q, k, v, scale, -1, 0 if is_causal else -1, False,
                                        softcap, bias, dropout_p)
    return dropped(out, drop_all)


def check_fallback_inputs(query, key, value, dtype: torch.dtype) -> None:
    """The checks the unfused fallback needs that to_bshd's fast path leaves to the kernels'
    (ValueError): one device (a meta value beside CPU tensors ran the math on both and
    answered a meta tensor), then the dtype (check_sdpa_dtype)."""
    check_same_device(query, key, value)
    check_sdpa_dtype(query, dtype)


def check_same_device(query, key, value) -> None:
    """ValueError unless query, key and value are on one device."""
    if not key.device == value.device == query.device:
        raise ValueError(f"query, key and value must be on the same device, got query.device="
                         f"{query.device}, key.device={key.device}, value.device={value.device}")


def check_sdpa_dtype(query: torch.Tensor, dtype: torch.dtype) -> None:
    """ValueError unless ``dtype`` (query's, or what autocast runs the call in) is one of the
    four the drop-in takes: float8 counts as floating point but no route takes it (it ran
    unfused in float8 where the head dim sent the call to the fallback; a new-user finding)."""
    if dtype not in ops._FLOAT_DTYPES:
        raise ValueError(f"query.dtype={query.dtype} is not supported: query, key and value must "
                         f"be float32, float64, float16 or bfloat16 (CPU: all four; CUDA: "
                         f"float16 and bfloat16 on the kernels, float32 on a fallback)")


def beyond_kernels(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether E or Ev lies beyond the kernels' head dims (above planning.MAX_HEAD_DIM, or 0,
    where PyTorch still answers): the drop-in runs the unfused math then, as a fallback, without
    the kernels' argument checks (flash_attn_func raises ValueError instead)."""
    return max(q.shape[-1], v.shape[-1]) > planning.MAX_HEAD_DIM or \
        min(q.shape[-1], v.shape[-1]) == 0


def flatten_batch_dims(query, key, value, attn_mask):
    """scaled_dot_product_attention's (..., H, L, E) inputs with more than one leading (batch)
    dimension, as PyTorch's function takes them, as one call on (N, H, L, E): the leading
    dimensions (equal in query, key and value) flattened into one, attn_mask (checked against
    the call's own (..., H, L, S) shape, in the caller's terms) broadcast over them.  Returns
    (query, key, value, attn_mask, leading dimensions); out is given them back by the caller."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != query.dim() or t.shape[:-3] != query.shape[:-3]:
            raise ValueError(f"query, key and value must have the same leading (batch) "
                             f"dimensions before (H, L, E), got query {tuple(query.shape)} and "
                             f"{name} {tuple(t.shape)}")
    lead = query.shape[:-3]
    # (the count, not -1: a tensor with a 0 in H, L or E has no -1 to infer; PyTorch answers an
    # empty tensor there)
    n = math.prod(lead)
    # (anything else, and a mask of fewer than 2 dimensions, the call names)
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() >= 2:
        check_mask_shape(attn_mask, tuple(query.shape[:-1]) + (key.shape[-2],))
        if attn_mask.dim() > 3:
            mask = attn_mask.reshape((1,) * (query.dim() - attn_mask.dim()) + attn_mask.shape)
            attn_mask = mask.expand(*lead, *mask.shape[-3:]).reshape(n, *mask.shape[-3:])
    return (query.reshape(n, *query.shape[-3:]), key.reshape(n, *key.shape[-3:]),
            value.reshape(n, *value.shape[-3:]), attn_mask, lead)


def check_sdpa_flags(dropout_p, is_causal) -> float:
    """scaled_dot_product_attention's rules for its flags (ValueError): is_causal a bool;
    dropout_p a number in [0, 1] (NumPy scalars and 0-d tensors taken, as PyTorch takes them;
    1, everything dropped, gives zeros: _call.kernel_dropout).  (An attn_mask goes with either
    is_causal: with True both apply.)  Returns dropout_p as a float."""
    if type(dropout_p) is float and 0.0 <= dropout_p < 1.0 and type(is_causal) is bool:
        return dropout_p  # (the common case, without the general checks' cost)
    _, dropout_p = check_flags(is_causal, (-1, -1), dropout_p, causal_name="is_causal")
    return dropout_p


def run_sdpa(q, k, v, query, key, attn_mask, dropout_p, is_causal, scale, softcap,
             strict) -> torch.Tensor:
    """SDPA's conventions on the kernels: (B, L, H, E) views q/k/v of the SDPA-layout
    ``query``/``key`` (from :func:`to_bshd`), top-left causal, no window, ``attn_mask`` as an
    additive bias (:func:`mask_to_bias`); returns out (B, L, H, Ev).  Shared by
    :func:`scaled_dot_product_attention` and the transformers integration."""
    bias = None if attn_mask is None else mask_to_bias(attn_mask, query, key)
    out, _ = run(q, k, v, softmax_scale=scale, causal=is_causal, window_left=-1,
                 window_right=-1, align_bottom_right=False, softcap=softcap,
                 dropout_p=float(dropout_p), deterministic=False, strict=strict,
                 attn_bias=bias)
    return out


def mask_to_bias(attn_mask: torch.Tensor, query: torch.Tensor,
                 key: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SDPA's attn_mask as an additive bias broadcastable to (N, H, L, S).

    A boolean mask (True = attend) stays boolean: the kernels read it as it is (the CPU kernels
    and the Hopper kernels' mask variant, a byte per element) or as 0 / -inf in fp32 (the other
    CUDA kernels; csrc/ops.cpp's prepare_bias); a float mask is the bias itself (and gets a gradient
    if it requires one).  For 3-D inputs a 3-D (N, L, S) mask gets the head dimension.  With
    ``key`` (SDPA layout), the mask's shape is checked against the call's (N, H, L, S) here, in
    the caller's terms.
    """
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask must be on query's device {query.device}, got "
                         f"{attn_mask.device}")
    # Under torch.autocast PyTorch casts a float mask to the autocast dtype with q, k and v
    # (float64 stays); a float32 mask is kept as it is here, the more precise bias.
    mask_cast = autocast_dtype(attn_mask) if attn_mask.is_floating_point() else None
    if mask_cast is not None and attn_mask.dtype != torch.float32:
        attn_mask = attn_mask.to(mask_cast)
    if key is not None:
        if attn_mask.dim() < 2:
            raise ValueError(f"attn_mask must have at least 2 dimensions (L, S), got shape "
                             f"{tuple(attn_mask.shape)} (as "
                             "torch.nn.functional.scaled_dot_product_attention)")
        run_dtype = autocast_dtype(query) or query.dtype
        if attn_mask.is_floating_point() and attn_mask.dtype not in (torch.float32, run_dtype):
            under = "" if run_dtype == query.dtype else " under torch.autocast"
            raise ValueError(f"attn_mask.dtype={attn_mask.dtype}: a float mask must be "
                             f"float32 or query's dtype {run_dtype}{under} (as "
                             "torch.nn.functional.scaled_dot_product_attention)")
        check_mask_shape(attn_mask, tuple(query.shape[:-1]) + (key.shape[-2],))
    if attn_mask.dtype == torch.bool or attn_mask.is_floating_point():
        bias = attn_mask
    else:
        raise ValueError(f"attn_mask must be a bool or floating tensor, got dtype "
                         f"{attn_mask.dtype}")
    if query.dim() == 3 and bias.dim() == 3:
        bias = bias.unsqueeze(1)
    return bias


def check_mask_shape(attn_mask: torch.Tensor, full: tuple, dims: Optional[str] = None) -> None:
    """ValueError unless attn_mask broadcasts to the call's attention shape ``full``: (N, H, L,
    S), (N, L, S) for 3-D inputs, or (N, ..., H, L, S) with more leading dimensions, as the
    caller passed them; ``dims`` names them where the rank does not tell (3-D inputs grouped
    with enable_gqa: (H, L, S))."""
    # (m == 1 or m == f, not m in (1, f): under torch.compile with dynamic shapes, Dynamo
    # evaluates `int in (..., SymInt)` as False even where they are equal)
    ok = attn_mask.dim() <= len(full) and all(
        m == 1 or m == f for m, f in zip(reversed(attn_mask.shape), reversed(full)))
    if not ok:
        dims = dims or {3: "(N, L, S)", 4: "(N, H, L, S)"}.get(len(full), "(N, ..., H, L, S)")
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable "
                         f"to the attention's {dims} = {full}")


def to_bshd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool):
    """Validates SDPA-layout tensors and returns (B, L, H, E) views of them (no copies); 3-D
    inputs with enable_gqa whose first sizes differ are heads, (H, L, E) against (H_kv, S, E),
    of one batch, as in scaled_dot_product_attention."""
    # Fast path (every call pays for this function: its checks once cost ~2 us of host time
    # per call): the rules of _checked_to_bshd for 4-D inputs in one expression; where it is
    # false, _checked_to_bshd checks them one by one and raises the broken rule's error.
    if (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and not (query.is_nested or key.is_nested or value.is_nested)):
        qs, ks, vs = query.shape, key.shape, value.shape
        n = len(qs)
        if (n == 4 and len(ks) == 4 and len(vs) == 4 and qs[0] == ks[0] == vs[0]
                and query.dtype == key.dtype == value.dtype
                and ks[2] == vs[2] and qs[3] == ks[3] and ks[1] == vs[1]
                and (qs[1] == ks[1] or (enable_gqa and ks[1] != 0 and qs[1] % ks[1] == 0))):
            return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    return _checked_to_bshd(query, key, value, enable_gqa)


def _checked_to_bshd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     enable_gqa: bool):
    """to_bshd with each rule checked in turn (its error names the rule)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise ValueError(f"{name} is a nested tensor, which flash_attn_ext does not take: "
                             "use torch.nn.functional.scaled_dot_product_attention (under "
                             "flash_attn_ext.patch() such calls go to it)")
        if t.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dimensions: (N, L, E), (N, H, L, E) "
                             f"or, in scaled_dot_product_attention, (N, ..., H, L, E); got "
                             f"{name}.dim()={t.dim()} with shape {tuple(t.shape)}")
        if t.dim() > 4:
            # (scaled_dot_product_attention flattens more leading dimensions when query has
            # them; here only the other two do)
            raise ValueError(f"{name} must have 3 (N, L, E) or 4 (N, H, L, E) dimensions here "
                             f"(more leading dimensions only in scaled_dot_product_attention, "
                             f"and in query, key and value alike), got {name}.dim()={t.dim()} "
                             f"with shape {tuple(t.shape)}")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError("query, key and value must have the same number of dimensions, got "
                         f"{query.dim()}, {key.dim()} and {value.dim()}")
    n = query.dim()  # messages use the caller's dimension numbers
    # 3-D inputs with enable_gqa whose first sizes differ are (H, L, E) against (H_kv, S, E),
    # one batch, as PyTorch's function groups dimension -3: the rules on heads apply to size(0)
    heads_first = n == 3 and enable_gqa is True and not (
        query.shape[0] == key.shape[0] == value.shape[0])
    if not heads_first and not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise ValueError("query, key and value must have the same batch size, got "
                         f"query.size(0)={query.shape[0]}, key.size(0)={key.shape[0]}, "
                         f"value.size(0)={value.shape[0]}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same sequence length, got "
                         f"key.size({n - 2})={key.shape[-2]}, value.size({n - 2})="
                         f"{value.shape[-2]}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same embedding size, got "
                         f"query.size({n - 1})={query.shape[-1]}, key.size({n - 1})="
                         f"{key.shape[-1]}")
    if n == 4 or heads_first:
        d = 1 if n == 4 else 0  # (the heads' dimension)
        heads, heads_kv = query.shape[d], key.shape[d]
        if key.shape[d] != value.shape[d]:
            raise ValueError(f"key and value must have the same number of heads, got "
                             f"key.size({d})={key.shape[d]}, value.size({d})={value.shape[d]}")
        if heads != heads_kv and not enable_gqa:
            raise ValueError(f"query has {heads} heads (query.size(1)) and key has {heads_kv} "
                             "(key.size(1)): they must be equal unless enable_gqa=True")
        if heads_kv == 0 and heads != 0:
            raise ValueError(f"key.size({d})=0 heads cannot serve query.size({d})={heads} heads")
        if heads_kv != 0 and heads % heads_kv != 0:
            raise ValueError(f"with enable_gqa, query.size({d})={heads} must be a multiple of "
                             f"key.size({d})={heads_kv}")
    dtypes = run_dtypes((query, key, value), ("query", "key", "value"))  # (one, after autocast)
    check_sdpa_dtype(query, dtypes[0])
    check_same_device(query, key, value)
    if query.dim() == 3:
        d = 0 if heads_first else 1  # (grouped: one batch of heads; else one head per batch)
        query, key, value = query.unsqueeze(d), key.unsqueeze(d), value.unsqueeze(d)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
