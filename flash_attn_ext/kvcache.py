"""Inference with a KV cache: FlashAttention-2's ``flash_attn_with_kvcache``.

New keys/values are appended into the cache in place, q and the new keys optionally get a rotary
embedding, and q attends to each batch entry's cached keys.

On CUDA (fp16/bf16, one head_dim that is a multiple of 8 up to 256, caches readable in place,
softmax_scale > 0, no gradient wanted, and above head dim 64 a GPU with ~140 KB of shared
memory per block: _decode_refusal) the call runs on the decode kernels (csrc/kernels/sm80/
flash_decode_kernel.cuh): split-KV with an LSE-combining kernel, the query heads of a GQA group
packed into one tile, the cache read in place (contiguous entries, ``cache_batch_idx``, or pages
of any size through ``block_table``), the append and the new keys' rotary embedding in one
kernel.  The lengths, entries and pages are read on the device only, so a call never waits for
the GPU and can be captured in a CUDA graph; values there that break a rule (a length outside
the cache, an index out of range) make that batch row's out and softmax_lse NaN instead of
raising (values given as Python ints are checked on the host).  Other calls, and every CPU call,
run on the packed-sequence kernels (flash_attn_ext.varlen) over the cache in place, with the
values checked on the host (a CUDA call then synchronises).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import ops, policy
from ._call import (
    as_number,
    check_alibi,
    check_bool,
    check_devices,
    check_flags,
    check_scale,
    check_softcap,
    check_tensors,
    check_transforms,
)
from .planning import MAX_HEAD_DIM, Plan, score_mods
from .varlen import fwd_varlen_op, record_plan

__all__ = ["flash_attn_with_kvcache"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """x (B, L, H, D) with its first 2 * cos.shape[1] channels rotated by the angles of rows
    ``positions`` (B, L) of cos/sin (seqlen_ro, rotary_dim / 2): pairs (2i, 2i + 1) when
    interleaved (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX), as FlashAttention's
    apply_rotary_emb."""
    half = cos.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos[positions][:, :, None].to(acc)  # (B, L, 1, half)
    s = sin[positions][:, :, None].to(acc)
    rot = x[..., :2 * half].to(acc)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([out.to(x.dtype), x[..., 2 * half:]], dim=-1)


def _int32(value, batch: int, device, name: str, *, read_values: bool = True) -> torch.Tensor:
    """value (an int, or an int32 / int64 tensor of shape (batch,) or ()) as a contiguous
    (batch,) int32 tensor on device; anything else raises ValueError naming it, on every route
    (a list or a NumPy array was taken on the CPU and refused by the CUDA decode route).  int64
    values outside int32 raise ValueError where read_values (which reads a device tensor's
    values on the host); without it they are clamped, for the decode kernels to refuse (NaN
    rows), so that nothing waits for the GPU."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        kind = type(value).__name__ if type(value).__module__ == "builtins" else \
            f"{type(value).__module__}.{type(value).__name__}"
        raise ValueError(f"{name} must be an int or a (batch,) = ({batch},) int32 or int64 "
                         f"tensor, got {kind}")
    if isinstance(value, int):
        if not -2**31 <= value < 2**31:
            raise ValueError(f"{name} must fit in int32, got {value}")
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    if value.device.type not in ("cpu", torch.device(device).type):  # (e.g. meta: no values)
        raise ValueError(f"{name} must be on q's device ({device}) or on the CPU, got "
                         f"{value.device}")
    if value.dtype not in (torch.int32, torch.int64) or value.dim() > 1 or \
            (value.dim() == 1 and value.numel() != batch):
        raise ValueError(f"{name} must be an int or a (batch,) = ({batch},) int32 or int64 "
                         f"tensor, got {value.dtype} of shape {tuple(value.shape)}")
    if value.dtype == torch.int64 and value.numel():
        if not read_values:
            value = value.clamp(-2**31, 2**31 - 1)
        elif bool(((value < -2**31) | (value >= 2**31)).any()):  # (the cast would wrap it)
            raise ValueError(f"{name} must fit in int32, got {value.tolist()}")
    return value.to(device=device, dtype=torch.int32).expand(batch).contiguous()


_DECODE_DTYPES = (torch.float16, torch.bfloat16)


@torch.library.register_fake("flash_attn_ext::fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, cache_seqlens, cache_batch_idx=None,
                      cache_leftpad=None, block_table=None, seqlen_new=0, rotary_rows=0,
                      seqlen_ro=-1, softmax_scale=None, causal=False, window_left=-1,
                      window_right=-1, softcap=0.0, alibi_slopes=None, num_splits=0):
    check_devices(q, ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                  ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                  ("block_table", block_table), ("alibi_slopes", alibi_slopes))
    batch, seqlen_q, heads, _ = q.shape
    return (q.new_empty((batch, seqlen_q, heads, v_cache.shape[3])),
            q.new_empty((batch, heads, seqlen_q), dtype=torch.float32))


@torch.library.register_fake("flash_attn_ext::kvcache_append")
def _kvcache_append_fake(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None,
                         block_table=None, rotary_cos=None, rotary_sin=None,
                         rotary_interleaved=True):
    return None


@torch.library.custom_op("flash_attn_ext::kvcache_checked", mutates_args=("k_cache", "v_cache"))
def _kvcache_checked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                     rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor],
                     cache_seqlens: Optional[torch.Tensor], cache_seqlens_int: Optional[int],
                     cache_batch_idx: Optional[torch.Tensor],
                     cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                     softmax_scale: Optional[float], causal: bool, window_left: int,
                     window_right: int, softcap: float, rotary_interleaved: bool,
                     alibi_slopes: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache's host-checked route as one opaque op, so that torch.compile
    traces through a call whose checks read the lengths' values (data-dependent for Dynamo):
    the call runs eagerly inside, with every check, when the graph runs.  No gradient."""
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
        cache_seqlens if cache_seqlens is not None else cache_seqlens_int, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, (window_left, window_right), softcap,
        rotary_interleaved, alibi_slopes, 0, True)
    return out.contiguous(), lse.contiguous()


@_kvcache_checked.register_fake
def _kvcache_checked_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                          cache_seqlens_int, cache_batch_idx, cache_leftpad, block_table,
                          softmax_scale, causal, window_left, window_right, softcap,
                          rotary_interleaved, alibi_slopes):
    batch, seqlen_q, heads, _ = q.shape
    return (q.new_empty((batch, seqlen_q, heads, v_cache.shape[3])),
            q.new_empty((batch, heads, seqlen_q), dtype=ops.lse_dtype(q.dtype)))


def _rotated_rows(seqlen_new: int, seqlen_q: int, local: bool) -> int:
    """Rotary rows a call uses past cache_seqlens: the new keys' positions, and the queries'
    (each its own with causal or a window, else all at cache_seqlens)."""
    return max(seqlen_new, seqlen_q if local else min(seqlen_q, 1))


def _in_place(t: torch.Tensor) -> bool:
    """Whether the CUDA decode kernels can read t (a cache) in place: a contiguous last
    dimension, strides of whole 16-byte chunks and a 16-byte aligned start (an allocation's
    start is; the glue checks the address itself)."""
    return t.stride(3) == 1 and t.storage_offset() % 8 == 0 and \
        all(t.shape[i] <= 1 or t.stride(i) % 8 == 0 for i in range(3))


# GPUs whose per-block shared memory (opt-in) holds the decode kernels above head dim 64 (up to
# 137 KB at head dim 256; csrc/kernels/sm80/flash_decode_kernel.cuh, DecodeTraits::kSmem):
# A100 and Orin (163 KB), H100/H200 and B200/B300 (227 KB); sm_86, sm_89 and sm_120 allow 99 KB.
_LARGE_SMEM_CAPABILITIES = {(8, 0), (8, 7), (9, 0), (10, 0), (10, 3)}


def _decode_refusal(q, k_cache, v_cache, k, v, alibi_slopes, softmax_scale,
                    rotary_cos) -> Optional[str]:
    """Why the CUDA decode kernels (split-KV, no host synchronisation) do not take the call,
    or None where they do: fp16 / bf16 on a GPU of compute capability 8.0 or newer (above
    head dim 64, one whose shared memory holds them), one head_dim (a multiple of 8, at most
    256) for q, k and v, caches readable in place, a positive softmax_scale, float32
    alibi_slopes on q's device, a non-empty rotary table, and no gradient wanted (the decode
    kernels have no backward).  The other calls run on the packed-sequence kernels (varlen),
    whose checks name what is wrong; the reason goes into the call's plan (last_plan)."""
    if q.device.type != "cuda":
        return "the decode kernels are CUDA kernels"
    if q.dtype not in _DECODE_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return (f"q.dtype={q.dtype}, k_cache.dtype={k_cache.dtype}, v_cache.dtype="
                f"{v_cache.dtype}: they take float16 or bfloat16, the caches in q's dtype")
    head_dim = q.shape[3]
    if k_cache.shape[3] != head_dim or v_cache.shape[3] != head_dim or head_dim % 8 or \
            head_dim > 256:
        return (f"head dims {head_dim} (q), {k_cache.shape[3]} (k_cache), {v_cache.shape[3]} "
                f"(v_cache): they take one head dim, a multiple of 8 up to 256")
    if not (_in_place(k_cache) and _in_place(v_cache)):
        return ("k_cache or v_cache cannot be read in place (they need a contiguous last "
                "dimension and strides and a start of whole 16-byte chunks)")
    capability = torch.cuda.get_device_capability(q.device)
    if capability[0] < 8 or (head_dim > 64 and capability not in _LARGE_SMEM_CAPABILITIES):
        return (f"compute capability {capability[0]}.{capability[1]} at head dim {head_dim} "
                f"(they need 8.0 or newer, and above head dim 64 ~140 KB of shared memory "
                f"per block)")
    if softmax_scale is not None and not softmax_scale > 0:
        # (the kernel's running maximum is on q.k, which a scale <= 0 reverses)
        return f"softmax_scale={softmax_scale}: they take a positive scale"
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or
                                     alibi_slopes.device != q.device):
        return (f"alibi_slopes of dtype {alibi_slopes.dtype} on {alibi_slopes.device}: they "
                f"take float32 slopes on q's device")
    if rotary_cos is not None and rotary_cos.shape[0] == 0:
        return "an empty rotary table"
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        return "a gradient is wanted (they have no backward)"
    return None


def _record_decode_plan(q, strict) -> None:
    """Records the decode route's plan (``flash_attn_ext.last_plan()``): the decode kernel's
    instantiation (csrc/kernels/sm80/flash_decode_launch.h: head dims padded to 64, 128 or
    256), which has no backward (the route takes no call that wants a gradient)."""
    if torch.compiler.is_compiling():
        return  # (as the other calls: recorded by eager calls only)
    head_dim = q.shape[3]
    padded = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    policy.record(Plan(f"sm80_decode_hdim{padded}_{dtype}", "none", True,
                       backward_fused=False,
                       backward_reasons=("the decode kernels have no backward: a call that "
                                         "wants a gradient runs on the packed-sequence "
                                         "kernels",)), strict)


def _decode(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
            rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, local,
            seqlen_cache):
    """flash_attn_with_kvcache on the CUDA decode kernels (kernels/sm80/
    flash_decode_kernel.cuh): the append and the attention read the lengths, entries and pages
    on the device, so nothing here waits for the GPU (CUDA-graph capturable).  Values that
    break a rule give NaN rows instead of an error (see flash_attn_with_kvcache)."""
    batch, seqlen_q = q.shape[:2]
    device = q.device
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        cache_seqlens = seqlen_cache
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool) and \
            not 0 <= cache_seqlens <= seqlen_cache - new:
        raise ValueError(f"cache_seqlens + seqlen_new must be in [0, seqlen_cache = "
                         f"{seqlen_cache}], got cache_seqlens={cache_seqlens} and "
                         f"seqlen_new={new}")
    if isinstance(cache_leftpad, int) and not isinstance(cache_leftpad, bool) and \
            isinstance(cache_seqlens, int) and not 0 <= cache_leftpad <= cache_seqlens:
        raise ValueError(f"cache_leftpad must be in [0, cache_seqlens] (the new keys are "
                         f"appended at cache_seqlens), got cache_leftpad={cache_leftpad} and "
                         f"cache_seqlens={cache_seqlens}")
    seqlens = _int32(cache_seqlens, batch, device, "cache_seqlens", read_values=False)
    entries = None if cache_batch_idx is None else \
        _int32(cache_batch_idx, batch, device, "cache_batch_idx", read_values=False)
    leftpad = None if cache_leftpad is None else \
        _int32(cache_leftpad, batch, device, "cache_leftpad", read_values=False)
    if block_table is not None:
        block_table = block_table.contiguous()
    rotary = rotary_cos is not None
    with torch.no_grad():
        if k is not None:
            torch.ops.flash_attn_ext.kvcache_append(
                k_cache, v_cache, k if k.stride(3) == 1 else k.contiguous(),
                v if v.stride(3) == 1 else v.contiguous(), seqlens, entries, block_table,
                rotary_cos, rotary_sin, rotary_interleaved)
        if rotary:
            # Positions past the table are clamped here and refused by the kernel (NaN rows).
            start = seqlens.long()[:, None]
            q_pos = start + torch.arange(seqlen_q, device=device) if local else \
                start.expand(batch, seqlen_q)
            q = _rotate(q, rotary_cos, rotary_sin,
                        q_pos.clamp(0, rotary_cos.shape[0] - 1), rotary_interleaved)
    out, lse = torch.ops.flash_attn_ext.fwd_kvcache(
        q, k_cache, v_cache, seqlens, entries, leftpad, block_table, new,
        _rotated_rows(new, seqlen_q, local) if rotary else 0,
        rotary_cos.shape[0] if rotary else -1, softmax_scale, bool(causal),
        int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes, num_splits)
    return (out, lse) if return_softmax_lse else out


def flash_attn_with_kvcache(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
        rotary_cos: Optional[torch.Tensor] = None, rotary_sin: Optional[torch.Tensor] = None,
        cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
        cache_batch_idx: Optional[torch.Tensor] = None,
        cache_leftpad: Optional[torch.Tensor] = None,
        block_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
        causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
        rotary_interleaved: bool = True, alibi_slopes: Optional[torch.Tensor] = None,
        num_splits: int = 0, return_softmax_lse: bool = False, *,
        strict: Optional[bool] = None):
    """Attention of q against a KV cache, appending k/v first: FlashAttention-2's
    ``flash_attn_with_kvcache``, for inference.  (Gradients reach q and the cache's tensors
    through the attention as through :func:`flash_attn_varlen_func`, and k and v through the
    rows they are appended to, whose old values get none; the in-place copy into the caches
    itself is made under ``torch.no_grad``.)

    Args:
        q: (batch, seqlen_q, num_heads, head_dim).
        k_cache, v_cache: (batch_cache, seqlen_cache, num_heads_k, head_dim / head_dim_v),
            or with block_table (num_blocks, page_size, num_heads_k, ...): updated in place
            where k/v are given.  num_heads_k >= 1, a divisor of num_heads (GQA/MQA).
        k, v: (batch, seqlen_new, num_heads_k, head_dim / head_dim_v) or None: written into the
            cache at rows cache_seqlens[b] .. + seqlen_new (which must fit in seqlen_cache).
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) or None: q and the new k get the
            rotary embedding on their first rotary_dim channels at positions cache_seqlens[b] +
            i (causal or windowed calls; else every query at cache_seqlens[b]), as
            FlashAttention-2; floating tables (integer ones raise ValueError). Without k and v
            q alone is rotated (FlashAttention-2 refuses such a call). rotary_interleaved:
            pairs (2i, 2i + 1) (GPT-J) or halves (GPT-NeoX).
        cache_seqlens: int, or (batch,) int32 or int64 tensor (values within int32): each
            entry's cached length before the append (default: seqlen_cache, a full cache).
        cache_batch_idx: (batch,) int32 or int64 tensor, or None: the cache entry of each
            batch element (read in place by the decode kernel, else a copy of their used
            rows); new k/v are written to those entries in place, so they must then be
            distinct. An int is refused (TypeError): it would give every batch element one
            entry.
        cache_leftpad: int, (batch,) int32 or int64 tensor, or None: entry b's keys start at
            that row, at most cache_seqlens[b] (FlashAttention-2's rule).
        softmax_scale, causal (bottom-right over the used keys), window_size, softcap,
            alibi_slopes: as :func:`flash_attn_ext.flash_attn_func`.
        block_table: (batch, max_num_blocks) int32 or None: paged KV, entry b's cache is pages
            block_table[b, 0], block_table[b, 1], ... of k_cache/v_cache (any page size; read
            in place by the CUDA decode kernels, gathered into a copy on the other routes).
            Only the slots of pages a row uses (its rows cache_leftpad .. cache_seqlens +
            seqlen_new) must hold page indices; the others may hold anything (e.g. -1), as
            in FlashAttention-2.
        num_splits: split-KV on the CUDA decode kernels: the keys of each (batch row, KV
            head) split over this many CTAs (at most 256: larger values run as 256), 0 = a
            heuristic that fills the GPU (ignored on the other routes).
        return_softmax_lse: also return softmax_lse (batch, num_heads, seqlen_q).
        strict: (keyword only) raise :class:`flash_attn_ext.FallbackError` instead of falling
            back to an unfused path (default: ``FLASH_ATTN_EXT_STRICT``), as
            :func:`flash_attn_ext.flash_attn_func`'s.  No call of this function falls back
            today: every call runs on the CUDA decode kernels or the packed-sequence kernels
            (a slower fused route, not a fallback), or raises NotImplementedError, so strict
            mode changes nothing here; the value is checked as there (True, False or None).

    Returns:
        out (batch, seqlen_q, num_heads, head_dim_v), or (out, softmax_lse).

    Raises:
        NotImplementedError: q on a device other than CPU or CUDA (meta included); on CUDA,
            a GPU or build without the kernels (naming the reason); forward-mode AD and
            torch.func's gradient transforms, as flash_attn_func.
        TypeError: q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, alibi_slopes,
            block_table or cache_batch_idx not a tensor (naming it).
        ValueError: another tensor not on q's device (the lengths and indices may be on the
            CPU); k and v given while k_cache or v_cache is a leaf that requires grad (with
            grad mode on: PyTorch's rule for in-place writes); cache_leftpad outside [0,
            cache_seqlens]; shapes, head dims outside 1-256, a cache too short for the append, bad
            lengths, k and v without cache_seqlens (as FlashAttention-2: where to append
            them); flags that are not what flash_attn_func takes (e.g. causal not a bool,
            softcap < 0, strict not True, False or None); alibi_slopes requiring grad.  All of
            these before anything is appended to the cache.
            On the CUDA decode route, values held in CUDA tensors (cache_seqlens,
            cache_leftpad, cache_batch_idx, block_table) are not read on the host: a batch row
            whose values break these rules gets NaN out and softmax_lse rows instead, and two
            batch rows appending into one shared page row are not detected.
    """
    # The flags as flash_attn_func checks them (a string "False" would be taken as True).
    causal = check_bool(causal, "causal")  # (a NumPy bool too, as FlashAttention-2 takes it)
    window_size, _ = check_flags(causal, window_size, 0.0)
    softmax_scale = check_scale(softmax_scale, "softmax_scale")
    softcap = check_softcap(softcap)
    rotary_interleaved = check_bool(rotary_interleaved, "rotary_interleaved")
    return_softmax_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    policy.check_strict(strict)  # (no fallback to refuse: see the docstring)
    check_tensors(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    check_alibi(alibi_slopes, q)  # (a list named, not an AttributeError)
    if q.device.type not in ("cpu", "cuda"):  # (meta too: the length checks read values)
        raise NotImplementedError(
            f"flash_attn_with_kvcache runs on CPU and CUDA tensors, got q on {q.device}")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("q, k_cache and v_cache must have 4 dimensions (batch, seqlen, heads, "
                         f"head_dim), got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        check_tensors(("k", k), ("v", v))
        if cache_seqlens is None:
            # (FlashAttention-2 refuses it too: without it the cache counts as full, and on
            # CUDA the append would land past its end, its rows NaN)
            raise ValueError("k and v (new keys and values to append) need cache_seqlens, "
                             "each batch row's cache length before the append, got "
                             "cache_seqlens=None")
    batch, seqlen_q, heads, _ = q.shape
    device = q.device
    page = k_cache.shape[1]  # (paged: the page size; else the cache's length)
    heads_k, head_dim, head_dim_v = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must match k_cache in its first three dimensions (batch or "
                         f"pages, seqlen or page size, num_heads_k), got {tuple(v_cache.shape)} "
                         f"and {tuple(k_cache.shape)}")
    # (named here: the kernels' own checks see the cache as k, in its dense dimensions)
    if heads_k == 0:
        # (not the GQA rule's message, which is about divisibility: a cache of no heads holds no
        # keys, and the CUDA decode kernels refuse it too; q of no heads against heads_k >= 1
        # gives an empty output, as in flash_attn_func)
        raise ValueError(f"k_cache.shape[2] (num_heads_k) must be >= 1, got 0 (q.shape[2]="
                         f"{heads} query heads)")
    if heads % heads_k:
        raise ValueError(f"the number of query heads must be a multiple of the number of "
                         f"key/value heads (GQA/MQA), got num_heads q.shape[2]={heads} and "
                         f"num_heads_k k_cache.shape[2]={heads_k}")
    if q.shape[3] != head_dim:
        raise ValueError(f"k_cache.shape[3] (head_dim) must equal q.shape[3]={q.shape[3]}, got "
                         f"{head_dim}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache and v_cache must have q's dtype, got q.dtype={q.dtype}, "
                         f"k_cache.dtype={k_cache.dtype}, v_cache.dtype={v_cache.dtype}")
    if q.dtype not in ops._FLOAT_DTYPES:  # (the attention op's rule, before the append)
        raise ValueError(f"q, k_cache and v_cache must be float16, bfloat16, float32 or float64, "
                         f"got {q.dtype}")
    if block_table is None and cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache needs an entry per batch row of q (k_cache.shape[0] >= "
                         f"{batch}, or cache_batch_idx), got {k_cache.shape[0]}")
    if k is not None:
        if torch.is_grad_enabled():
            # PyTorch's rule for in-place writes: a leaf that requires grad is refused (an
            # nn.Parameter passed as a cache would change without a word).
            for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                if cache.requires_grad and cache.is_leaf:
                    raise ValueError(
                        f"{name} is a leaf tensor that requires grad: appending k and v would "
                        f"write into it in place, which PyTorch refuses for such a tensor; "
                        f"pass a copy ({name}.clone()) or {name}.detach(), or call under "
                        f"torch.no_grad()")
        # An expanded cache (a stride-0 dimension of size > 1) shares memory between entries
        # or rows: the append would write one location for several of them (PyTorch refuses
        # such writes).
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if any(st == 0 and n > 1 for st, n in zip(cache.stride(), cache.shape)):
                raise ValueError(f"{name} has a dimension of stride 0 (an expanded view, "
                                 f"strides {tuple(cache.stride())}): appending k and v would "
                                 f"write one memory location for several entries; pass a "
                                 f"cache that owns its memory (e.g. {name}.contiguous())")
        # Checked before anything is written: indexing would broadcast a new k of batch 1 into
        # every entry, or cast it to the cache's dtype, without a word.
        for name, t, cache, d in (("k", k, k_cache, head_dim), ("v", v, v_cache, head_dim_v)):
            want = (batch, k.shape[1] if k.dim() == 4 else "seqlen_new", heads_k, d)
            if t.dim() != 4 or tuple(t.shape) != want:
                raise ValueError(f"{name} must be (batch, seqlen_new, num_heads_k, head_dim) = "
                                 f"{want} (batch from q, heads and head dim from {name}_cache), "
                                 f"got {tuple(t.shape)}")
            if t.dtype != cache.dtype or t.device != cache.device:
                raise ValueError(f"{name} must have {name}_cache's dtype and device "
                                 f"({cache.dtype}, {cache.device}), got {t.dtype} on {t.device}")
    if rotary_cos is not None or rotary_sin is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if t is not None:
                check_tensors((name, t))
        shapes = (f"{None if rotary_cos is None else tuple(rotary_cos.shape)} and "
                  f"{None if rotary_sin is None else tuple(rotary_sin.shape)}")
        if rotary_cos is None or rotary_sin is None:
            raise ValueError(f"rotary_cos and rotary_sin must be given together, got {shapes}")
        # (one message for both rules named the first when only the second was broken: a
        # new-user finding)
        if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape or \
                2 * rotary_cos.shape[1] > head_dim:
            raise ValueError(
                "rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with "
                f"rotary_dim <= head_dim = {head_dim}, got {shapes}")
        if not (rotary_cos.is_floating_point() and rotary_sin.is_floating_point()):
            # (an integer table would be a table of 0s and 1s, silently)
            raise ValueError(f"rotary_cos and rotary_sin must be floating tensors, got "
                             f"{rotary_cos.dtype} and {rotary_sin.dtype}")
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with block_table (paged KV)")
        check_tensors(("block_table", block_table))
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or \
                block_table.shape[0] != batch:
            raise ValueError(f"block_table must be a (batch, max_num_blocks) = ({batch}, ...) "
                             f"int32 tensor, got {block_table.dtype} of shape "
                             f"{tuple(block_table.shape)}")
    if cache_batch_idx is not None:
        # (an int would pick one entry for all)
        check_tensors(("cache_batch_idx", cache_batch_idx))
    # Every tensor on q's device (the lengths and indices may also be on the CPU: _int32), and
    # every rule the kernels check, before anything is written into the cache.
    check_devices(q, ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                  ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                  ("block_table", block_table))
    # (torch.func's gradient transforms and forward-mode AD: flash_attn_func's refusal)
    check_transforms(*(t for t in (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                   alibi_slopes) if t is not None))
    for name, d in (("head_dim (q.shape[3])", head_dim), ("head_dim_v (v_cache.shape[3])",
                                                          head_dim_v)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if not softcap <= _FLOAT32_MAX or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    if softmax_scale is not None and not abs(softmax_scale) <= _FLOAT32_MAX:
        raise ValueError(f"softmax_scale must be finite and representable in float32, got "
                         f"{softmax_scale}")
    num_splits = as_number(num_splits, "num_splits")  # (a NumPy int or 0-d tensor, as others)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = heuristic), got {num_splits!r}")
    local = causal or window_size[0] >= 0 or window_size[1] >= 0
    seqlen_cache = page * (block_table.shape[1] if block_table is not None else 1)
    refusal = _decode_refusal(q, k_cache, v_cache, k, v, alibi_slopes, softmax_scale,
                              rotary_cos)
    if refusal is None:
        out = _decode(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                      cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                      window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                      return_softmax_lse, local, seqlen_cache)
        _record_decode_plan(q, strict)  # (once the ops ran: a call they refuse never did)
        return out
    if torch.compiler.is_compiling() and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        # (the checks below read values on the host; the opaque op below has no gradient, so
        # with one wanted the call runs eagerly: a graph break, which fullgraph=True refuses
        # with _eager_kvcache's reason rather than Dynamo's data-dependent-guard error)
        return _eager_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                              cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                              window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                              return_softmax_lse, strict=strict)
    if torch.compiler.is_compiling() and (cache_seqlens is None or isinstance(
            cache_seqlens, torch.Tensor) or type(cache_seqlens) is int):
        # (the checks below read values: under torch.compile the call is one opaque op that
        # runs them when the graph runs)
        tensor = isinstance(cache_seqlens, torch.Tensor)
        out, lse = torch.ops.flash_attn_ext.kvcache_checked(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens if tensor else None,
            None if tensor else cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
            softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
            float(softcap), bool(rotary_interleaved), alibi_slopes)
        return (out, lse) if return_softmax_lse else out
    seqlens = _int32(seqlen_cache if cache_seqlens is None else cache_seqlens, batch, device,
                     "cache_seqlens")
    leftpad = _int32(0 if cache_leftpad is None else cache_leftpad, batch, device,
                     "cache_leftpad")
    new = 0 if k is None else k.shape[1]
    if block_table is not None and block_table.numel():
        # Only the pages a row uses (rows leftpad .. cache_seqlens + seqlen_new) must exist:
        # FlashAttention-2 reads no other, so tables padded with e.g. -1 are valid (the CUDA
        # decode kernels check the pages they read, flash_decode_kernel.cuh).  (Lengths that
        # break their rules are refused below with their own message.)
        slot = torch.arange(block_table.shape[1], device=block_table.device)
        first = leftpad.long()[:, None] // page  # (block_table is on q's device, as these)
        end = (seqlens.long()[:, None] + new + page - 1) // page
        outside = ((block_table < 0) | (block_table >= k_cache.shape[0])) & \
            (slot >= first) & (slot < end)
        if bool(outside.any()):
            at = tuple(outside.nonzero()[0].tolist())
            raise ValueError(f"block_table entries must be page indices in [0, "
                             f"{k_cache.shape[0]}) (k_cache.shape[0]) where a row uses the "
                             f"page, got block_table[{', '.join(map(str, at))}]="
                             f"{int(block_table[at])}")
    if bool((seqlens < 0).any()):
        raise ValueError(f"cache_seqlens must be >= 0, got {seqlens.tolist()}")
    if bool((seqlens + new > seqlen_cache).any()):
        raise ValueError(f"cache_seqlens + seqlen_new must be in [0, seqlen_cache = "
                         f"{seqlen_cache}], got cache_seqlens={seqlens.tolist()} and "
                         f"seqlen_new={new}")
    rotated = _rotated_rows(new, seqlen_q, local)
    if rotary_cos is not None and batch and \
            bool((seqlens + rotated > rotary_cos.shape[0]).any()):
        raise ValueError(f"rotary_cos / rotary_sin need a row per rotated position, up to "
                         f"cache_seqlens + {rotated} = {int(seqlens.max()) + rotated}, got "
                         f"seqlen_ro = {rotary_cos.shape[0]}")
    if bool(((leftpad < 0) | (leftpad > seqlens)).any()):
        # (FlashAttention-2's rule: an entry's keys are rows cache_leftpad .. cache_seqlens
        # + seqlen_new with the new ones appended at cache_seqlens; a pad past that would
        # hide appended keys, all of them at seqlen_new rows past it, without a word)
        raise ValueError(f"cache_leftpad must be in [0, cache_seqlens] (the new keys are "
                         f"appended at cache_seqlens), got cache_leftpad={leftpad.tolist()} "
                         f"and cache_seqlens={seqlens.tolist()}")
    if cache_batch_idx is None:
        entries = torch.arange(batch, device=device)
    else:
        entries = _int32(cache_batch_idx, batch, device, "cache_batch_idx").long()
        if batch and bool(((entries < 0) | (entries >= k_cache.shape[0])).any()):
            # (a negative index would wrap around to another entry)
            raise ValueError(f"cache_batch_idx entries must be in [0, {k_cache.shape[0]}) "
                             f"(k_cache.shape[0]), got {entries.tolist()}")
        if k is not None and entries.unique().numel() != batch:
            raise ValueError(f"cache_batch_idx entries must be distinct when k and v are "
                             f"appended (two rows would write one entry), got {entries.tolist()}")
    rotary = rotary_cos is not None
    positions = seqlens.long()[:, None] + torch.arange(max(seqlen_q, new), device=device)
    # New keys and values whose gradient is wanted reach the attention as the rows they are
    # appended to (below), so that they get it (and the cache's overwritten rows none).
    # So do the cache's overwritten rows where the cache requires grad (a non-leaf): the rows
    # then hold the new values, and their gradient belongs to k and v, not to the cache's
    # history (it flowed there, a silent wrong gradient: a new-user finding).
    grad_new = k is not None and torch.is_grad_enabled() and any(
        t.requires_grad for t in (k, v, k_cache, v_cache))
    if k is not None and rotary:  # (once, with autograd: k's gradient flows through it)
        k = _rotate(k, rotary_cos, rotary_sin, positions[:, :new], rotary_interleaved)
    with torch.no_grad():
        if k is not None:
            # In place, each entry at its own length: (cache entry or page, row) per token.
            pos = positions[:, :new]
            if block_table is not None:
                where = (block_table.long().gather(1, pos // page), pos % page)
                if new and (where[0] * page + where[1]).unique().numel() != batch * new:
                    # (two rows' appends would land in one page row: one would be lost)
                    raise ValueError("block_table: the appended positions of two batch rows "
                                     "map to the same page row (shared pages must not be "
                                     "appended to)")
            else:
                where = (entries[:, None].expand(batch, new), pos)
            k_cache[where] = k.to(k_cache.dtype)
            v_cache[where] = v.to(v_cache.dtype)
    if rotary:  # (with autograd: q's gradient flows through its rotation)
        q_pos = positions[:, :seqlen_q] if local else \
            seqlens.long()[:, None].expand(batch, seqlen_q)
        q = _rotate(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
    # The cache as packed sequences: entry b's keys are rows b * seqlen_cache + leftpad[b] ..
    # of the (batch * seqlen_cache) rows, of which seqlens[b] + new - leftpad[b] are used.
    # Where entries or pages are gathered (a copy), seqlen_cache becomes the most rows any
    # entry uses (whole pages), not the capacity: a table sized for the longest context made
    # each call copy all of it, up to 250x a call's time at 100 used keys of 8192 (a new-user
    # finding).
    # (The contiguous cache without cache_batch_idx stays a view of all its rows: no copy.)
    used = int((seqlens + new).max()) if batch > 0 else 0
    if block_table is not None:  # (the pages gathered into each entry's cache: a copy)
        # (unused slots may hold anything: clamped, their rows are past the used ones)
        slots = min(block_table.shape[1], max(1, -(-used // page)))
        pages = block_table[:, :slots].long().clamp(0, k_cache.shape[0] - 1)
        seqlen_cache = slots * page
        kc, vc = (c[pages].flatten(1, 2) for c in (k_cache, v_cache))
    elif cache_batch_idx is not None:  # (a copy of each entry's used rows)
        seqlen_cache = min(seqlen_cache, max(1, used))
        kc, vc = (c[entries, :seqlen_cache] for c in (k_cache, v_cache))
    else:
        kc, vc = k_cache[:batch], v_cache[:batch]
    if grad_new:  # (the same values as the append wrote, now with k's and v's gradient)
        at = (torch.arange(batch, device=device)[:, None].expand(batch, new), positions[:, :new])
        kc = kc.index_put(at, k.to(kc.dtype))
        vc = vc.index_put(at, v.to(vc.dtype))
    rows = torch.arange(batch + 1, device=device, dtype=torch.int32) * seqlen_cache
    cu_k = torch.cat([rows[:-1] + leftpad, rows[-1:]])
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * seqlen_q
    longest_k = seqlen_cache + (int(leftpad.max()) if batch > 0 else 0)  # (cu_k's widest gap)
    q_packed = q.reshape(batch * seqlen_q, heads, q.shape[-1])
    kc = kc.reshape(batch * seqlen_cache, *kc.shape[2:])
    vc = vc.reshape(batch * seqlen_cache, *vc.shape[2:])
    notes = [] if q.device.type == "cpu" else [
        f"not on the decode kernels: {refusal}; the packed-sequence kernels serve it (the "
        f"values are checked on the host, which waits for the GPU)"]
    if block_table is not None or cache_batch_idx is not None:
        # (a cost the caller should see: reference.md measures it on the CPU)
        notes.append(f"the {'pages' if block_table is not None else 'entries'} used gathered "
                     f"into a copy of {batch} x {seqlen_cache} rows before the kernels run")
    out, lse, _ = fwd_varlen_op(
        q_packed, kc, vc, cu_q, cu_k, seqlen_q, longest_k,
        softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]), float(softcap),
        alibi_slopes, 0.0, seqlens + new - leftpad)
    record_plan(q_packed, kc, vc, softmax_scale, local,  # (once the op ran, as varlen's)
                score_mods(softcap, 0.0, None, alibi_slopes), False, strict,
                note="; ".join(notes) if notes else None)
    out = out.reshape(batch, seqlen_q, heads, out.shape[-1])
    if not return_softmax_lse:
        return out
    return out, lse.reshape(heads, batch, seqlen_q).transpose(0, 1)


# The call with a gradient wanted, under torch.compile: outside the graph (the host reads the
# lengths, indices and table to check them, and the checked op has no autograd formula).
_eager_kvcache = torch.compiler.disable(
    flash_attn_with_kvcache,
    reason="flash_attn_with_kvcache with a gradient wanted runs eagerly: it checks "
           "cache_seqlens, cache_leftpad, cache_batch_idx and block_table on the host, which "
           "torch.compile cannot trace (fullgraph=True cannot hold it; call it without a "
           "gradient, or outside the compiled region)")
