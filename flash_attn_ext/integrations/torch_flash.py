"""flash_attn_ext as PyTorch's flash attention implementation.

PyTorch (2.11 and later) lets a library take over the CUDA kernels of its flash attention ops:
``torch.nn.attention.register_flash_attention_impl(name, register_fn=...)`` names a provider,
``activate_flash_attention_impl(name)`` calls its ``register_fn``, which registers kernels for
``aten._flash_attention_forward`` / ``_backward``, ``aten._flash_attention_forward_no_dropout_
inplace`` and ``aten._scaled_dot_product_flash_attention`` / ``_backward`` under the CUDA
dispatch key, and ``restore_flash_attention_impl()`` removes them.  Every call PyTorch sends to
those ops then runs on our kernels: ``F.scaled_dot_product_attention`` where SDPA picks its
FLASH backend, and code that calls the ops itself (``torch.nn.attention.varlen``, context
parallelism's ring attention).

``import flash_attn_ext`` registers the provider ``"flash_attn_ext"`` (registration only);
activation is the user's explicit choice, as PyTorch asks of providers::

    torch.nn.attention.activate_flash_attention_impl("flash_attn_ext")

Contracts kept (the ops' schemas, ``torch/_C/_VariableFunctions``; their meta kernels stay
PyTorch's, so ``torch.compile`` sees the same shapes): ``_flash_attention_*`` take
(B, L, H, D) tensors, ``_scaled_dot_product_flash_attention*`` (B, H, L, D), outputs laid out
as the op's meta kernel says (they differ between torch versions; a copy where our kernels'
layout differs, see _as_meta_lays_out); ``is_causal`` and windows bottom-right aligned as in
PyTorch's own flash kernel (FlashAttention-2: query i of L sees key j <= i + S - L; SDPA sends
only square causal calls to flash, where the alignments agree); one head dim for q, k and v
(the meta kernels give the output the query's); ``logsumexp`` (B, H, L) float32, +inf for
rows of a call without keys, as PyTorch's; GQA with fewer key/value heads.  Dropout uses our
kernels' Philox mask (docs/reference.md): the (seed, offset) pair travels from the forward to
the backward in PyTorch's own rng outputs (``rng_state``, uint64 (2,), or ``philox_seed`` /
``philox_offset`` where the op's schema has those), so the backward regenerates the forward's
mask.

Variable-length batches (``cum_seq_q``/``cum_seq_k``: ``torch.nn.attention.varlen.varlen_attn``
and ``varlen_attn_out``) run on our ``fwd_varlen``/``bwd_varlen`` ops (:mod:`flash_attn_ext.
varlen`): q (total_q, H, D) and k, v (total_k, H_kv, D) read in place by the int32 offsets,
causal and windows bottom-right per sequence (FlashAttention-2's, as PyTorch's kernel),
``logsumexp`` (H, total_q) float32 with +inf for rows that see no key, ``seqused_k`` in the
forward (PyTorch's ``varlen_attn`` refuses it with autograd; the backward op has no such
argument).  These calls are not planned, so ``last_plan()`` does not change.

A call we do not serve raises ``RuntimeError`` naming what is unsupported, as PyTorch's own
FA3/FA4 providers do: only one of ``cum_seq_q``/``cum_seq_k``, paged KV (``block_table``),
ALiBi (the backward ops carry no slopes, so a backward would silently drop them),
``return_debug_mask``, and whatever the kernel rule refuses (``flash_attn_ext.explain`` says
why).  Each dense call is recorded as any other (``flash_attn_ext.last_plan()``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch.library import Library

from .. import ops, planning, policy, varlen

__all__ = ["NAME", "register_flash_impl", "register_kernels"]

NAME = "flash_attn_ext"

def register_flash_impl() -> bool:
    """Registers the provider ``"flash_attn_ext"`` with ``torch.nn.attention``'s flash
    attention registry (done by ``import flash_attn_ext``); False where this torch has no
    registry (before 2.11).  Activation stays explicit."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        return False
    attention.register_flash_attention_impl(NAME, register_fn=_activate)
    return True


@dataclasses.dataclass
class _Handle:
    """What activation keeps alive: the library of kernel registrations (removed with it)."""
    library: Optional[Library]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
        self.library = None


def _activate() -> _Handle:
    """Registers the CUDA kernels, after checking that this build and every visible GPU can
    serve plain calls: once SDPA has chosen FLASH it cannot fall back, so activating where our
    rule refuses would turn working calls into errors."""
    build = ops.build_info()
    if not build["cuda"]:
        raise RuntimeError("activate_flash_attention_impl('flash_attn_ext'): this build of "
                           "flash_attn_ext has no CUDA kernels")
    for index in range(torch.cuda.device_count()):
        q = torch.empty(1, 128, 1, 128, device=f"cuda:{index}", dtype=torch.bfloat16)
        p = planning.plan(q, q, q)
        if not p.fused:
            raise RuntimeError(f"activate_flash_attention_impl('flash_attn_ext'): GPU {index} "
                               f"({torch.cuda.get_device_name(index)}) is not served: "
                               f"{'; '.join(p.reasons)}")
    return _Handle(register_kernels("CUDA"))


def register_kernels(dispatch_key: str) -> Library:
    """Registers our kernels for the aten flash attention ops under ``dispatch_key``; returns
    the Library (its ``_destroy()`` removes them).  Activation uses "CUDA"; the tests also
    register them for "CPU" (where PyTorch has no kernels for these ops) to run PyTorch's own
    autograd formulas through them."""
    lib = Library("aten", "IMPL", dispatch_key)
    # The ops PyTorch's own FA3/FA4 providers take over.
    impls = {"_flash_attention_forward": _flash_forward,
             "_flash_attention_forward_no_dropout_inplace": _flash_forward_inplace,
             "_flash_attention_backward": _flash_backward,
             "_scaled_dot_product_flash_attention": _sdpa_forward,
             "_scaled_dot_product_flash_attention_backward": _sdpa_backward}
    for name, impl in impls.items():
        if hasattr(torch.ops.aten, name):  # (torch 2.11 has no no_dropout_inplace op)
            lib.impl(name, impl, dispatch_key)
    return lib


# ---------------------------------------------------------------------------------------------
# The rng outputs: ours is int64 (seed, offset); PyTorch's schemas name them rng_state (uint64
# (2,)) and unused (uint64 ()), or philox_seed and philox_offset (uint64 () each).

def _split_rng(op) -> bool:
    names = [r.name for r in op._schema.returns]
    return "philox_seed" in names


def _rng_outputs(rng: torch.Tensor, split: bool):
    bits = rng.view(torch.uint64)
    if split:
        return bits[0], bits[1]
    return bits, torch.zeros((), dtype=torch.uint64, device=rng.device)


def _rng_input(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    if first.dim() == 1 and first.numel() == 2:
        return first.view(torch.int64)
    return torch.cat([first.reshape(1).view(torch.int64), second.reshape(1).view(torch.int64)])


# ---------------------------------------------------------------------------------------------
# Output layouts as PyTorch's meta kernel for the op gives them (they differ between torch
# versions: 2.13's SDPA flash output is a (B, L, H, D) buffer seen as (B, H, L, D), 2.11's a
# contiguous (B, H, L, D) tensor).  torch.compile plans with the meta kernel's strides and
# inductor checks them, so a tensor our kernels laid out otherwise is copied into them.

def _key(value):
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype)
    return value


@functools.lru_cache(maxsize=1024)
def _meta_strides(op, args: tuple, kwargs: tuple) -> tuple:
    def meta(value):
        if isinstance(value, tuple) and value and value[0] == "T":
            return torch.empty_strided(value[1], value[2], dtype=value[3], device="meta")
        return value
    results = op(*map(meta, args), **{k: meta(v) for k, v in kwargs})
    return tuple((tuple(r.shape), r.stride()) if isinstance(r, torch.Tensor) else None
                 for r in results)


def _as_meta_lays_out(op, args, kwargs, results) -> tuple:
    """``results`` with each tensor in the strides PyTorch's meta kernel gives (a copy only
    where ours differ)."""
    layouts = _meta_strides(op, tuple(map(_key, args)),
                            tuple((k, _key(v)) for k, v in sorted(kwargs.items())))
    fixed = []
    for r, layout in zip(results, layouts):
        # (Only where the meta kernel's shape is ours: some take Ev = E, which ours need not.)
        if isinstance(r, torch.Tensor) and layout is not None and layout[0] == tuple(r.shape) \
                and r.numel() > 1 and r.stride() != layout[1]:
            r = torch.empty_strided(r.shape, layout[1], dtype=r.dtype, device=r.device).copy_(r)
        fixed.append(r)
    return tuple(fixed)


# ---------------------------------------------------------------------------------------------

def _refuse(op: str, **unsupported) -> None:
    given = [name for name, value in unsupported.items()
             if value is not None and value is not False]
    if given:
        raise RuntimeError(
            f"flash_attn_ext as PyTorch's flash attention ({op}): {', '.join(given)} not "
            "supported (restore_flash_attention_impl() returns to PyTorch's own kernel)")


def _window(size) -> int:
    return -1 if size is None else int(size)


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled()


def _check_value_head_dim(op: str, q, v) -> None:
    if v.shape[-1] != q.shape[-1]:
        raise RuntimeError(f"flash_attn_ext as PyTorch's flash attention ({op}): value head "
                           f"dim {v.shape[-1]} != query head dim {q.shape[-1]} not supported "
                           "(the op's meta kernel gives the output the query's head dim)")


def _forward(op: str, q, k, v, dropout_p: float, is_causal: bool, scale, window_left,
             window_right):
    """Our forward on (B, L, H, D) q/k/v with the aten ops' conventions; (out, lse, rng)."""
    wl, wr = _window(window_left), _window(window_right)
    p = planning.plan(q, k, v, scale, planning.score_mods(0.0, dropout_p, None),
                      unequal_tiles=is_causal or wl >= 0 or wr >= 0,
                      deterministic=_deterministic())
    if not p.fused:
        raise RuntimeError(f"flash_attn_ext as PyTorch's flash attention ({op}): no kernel "
                           f"serves this call: {'; '.join(p.reasons)}")
    _check_value_head_dim(op, q, v)
    out, lse, rng = ops.fwd_op(q, k, v, scale, is_causal, wl, wr, True, 0.0, None, None,
                               float(dropout_p), _deterministic())
    policy.record(p, None)  # (once the op ran: a call it refuses is not last_plan())
    if k.shape[1] == 0 or (is_causal and q.shape[1] > k.shape[1]) or wl >= 0 or wr >= 0:
        lse = _no_keys_plus_inf(lse)  # (only where a row can see no key: one more kernel)
    return out, lse, rng


def _no_keys_plus_inf(lse: torch.Tensor) -> torch.Tensor:
    """Rows that see no key: PyTorch's kernel's +inf, not our -inf (the backward reads either as
    "no probability")."""
    return lse.masked_fill_(lse == float("-inf"), float("inf"))


def _backward(dout, q, k, v, out, logsumexp, dropout_p, is_causal, rng, scale, window_left,
              window_right):
    dq, dk, dv, _ = ops.bwd_op(dout, q, k, v, out, logsumexp, rng, scale, is_causal,
                               _window(window_left), _window(window_right), True, 0.0, None,
                               None, float(dropout_p), _deterministic(), False, None)
    return dq, dk, dv


def _packed(op: str, cum_seq_q, cum_seq_k, seqused_k) -> bool:
    """Whether the call is a variable-length batch (both offsets given; the backward ops pass
    empty tensors for a dense call).  One offset alone, or ``seqused_k`` without offsets, is
    refused."""
    given = [t is not None and t.numel() > 0 for t in (cum_seq_q, cum_seq_k)]
    if given[0] != given[1]:
        raise RuntimeError(f"flash_attn_ext as PyTorch's flash attention ({op}): "
                           f"{'cum_seq_q' if given[0] else 'cum_seq_k'} given without "
                           f"{'cum_seq_k' if given[0] else 'cum_seq_q'} not supported")
    if not given[0] and seqused_k is not None:
        raise RuntimeError(f"flash_attn_ext as PyTorch's flash attention ({op}): seqused_k "
                           "without cum_seq_q/cum_seq_k not supported")
    return given[0]


def _forward_varlen(op: str, q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, scale, window_left, window_right, seqused_k):
    """Our varlen forward with the aten ops' conventions; (out, lse, rng)."""
    _check_value_head_dim(op, q, v)
    out, lse, rng = varlen.fwd_varlen_op(q, k, v, cum_seq_q, cum_seq_k, int(max_q), int(max_k),
                                         scale, bool(is_causal), _window(window_left),
                                         _window(window_right), 0.0, None, float(dropout_p),
                                         seqused_k)
    return out, _no_keys_plus_inf(lse), rng


def _forward_any(op: str, q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                 scale, window_left, window_right, seqused_k):
    """The dense or the varlen forward, as the offsets say; (out, lse, rng)."""
    if _packed(op, cum_seq_q, cum_seq_k, seqused_k):
        return _forward_varlen(op, q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                               is_causal, scale, window_left, window_right, seqused_k)
    return _forward(op, q, k, v, dropout_p, is_causal, scale, window_left, window_right)


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                   window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
                   num_splits=None):
    _refuse("_flash_attention_forward", alibi_slopes=alibi_slopes, block_table=block_table,
            return_debug_mask=return_debug_mask)
    del num_splits  # (a hint)
    out, lse, rng = _forward_any("_flash_attention_forward", query, key, value, cum_seq_q,
                                 cum_seq_k, max_q, max_k, dropout_p, is_causal, scale,
                                 window_size_left, window_size_right, seqused_k)
    op = torch.ops.aten._flash_attention_forward.default
    results = (out, lse, *_rng_outputs(rng, _split_rng(op)), query.new_empty((0,)))
    return _as_meta_lays_out(op, (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                  dropout_p, is_causal, return_debug_mask),
                             {"scale": scale, "window_size_left": window_size_left,
                              "window_size_right": window_size_right}, results)


def _flash_forward_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                           dropout_p, is_causal, return_debug_mask, *, scale=None,
                           window_size_left=None, window_size_right=None, seqused_k=None,
                           alibi_slopes=None, block_table=None, num_splits=None):
    op = "_flash_attention_forward_no_dropout_inplace"
    _refuse(op, alibi_slopes=alibi_slopes, block_table=block_table,
            return_debug_mask=return_debug_mask, dropout_p=dropout_p != 0.0)
    del num_splits
    result, lse, _ = _forward_any(op, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                  0.0, is_causal, scale, window_size_left, window_size_right,
                                  seqused_k)
    if out.shape != result.shape or out.dtype != result.dtype or out.device != result.device:
        raise RuntimeError(f"flash_attn_ext as PyTorch's flash attention ({op}): out must be "
                           f"{tuple(result.shape)} {result.dtype} on {result.device}, got "
                           f"{tuple(out.shape)} {out.dtype} on {out.device}")
    # (Our kernels allocate their output; one copy.  Of a varlen call's, only the sequences'
    # rows: PyTorch's kernel leaves the rows past the last offset alone.)
    rows = int(cum_seq_q[-1]) if _packed(op, cum_seq_q, cum_seq_k, seqused_k) else out.shape[0]
    out[:rows].copy_(result[:rows])
    return lse


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                    max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                    window_size_left=None, window_size_right=None):
    rng = _rng_input(rng_state, unused)
    if _packed("_flash_attention_backward", cum_seq_q, cum_seq_k, None):
        grads = varlen.bwd_varlen_op(grad_out, query, key, value, out, logsumexp, cum_seq_q,
                                     cum_seq_k, max_q, max_k, rng, scale, is_causal,
                                     _window(window_size_left), _window(window_size_right), 0.0,
                                     None, float(dropout_p), None)
    else:
        grads = _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                          rng, scale, window_size_left, window_size_right)
    return _as_meta_lays_out(
        torch.ops.aten._flash_attention_backward.default,
        (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
         dropout_p, is_causal, rng_state, unused),
        {"scale": scale, "window_size_left": window_size_left,
         "window_size_right": window_size_right}, grads)


def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                  *, scale=None):
    _refuse("_scaled_dot_product_flash_attention", return_debug_mask=return_debug_mask)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, lse, rng = _forward("_scaled_dot_product_flash_attention", q, k, v, dropout_p,
                             is_causal, scale, None, None)
    op = torch.ops.aten._scaled_dot_product_flash_attention.default
    first, second = _rng_outputs(rng, _split_rng(op))
    results = (out.transpose(1, 2), lse, None, None, query.size(2), key.size(2), first, second,
               query.new_empty((0,)))
    return _as_meta_lays_out(op, (query, key, value, dropout_p, is_causal, return_debug_mask),
                             {"scale": scale}, results)


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                   max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    grads = _backward(*(t.transpose(1, 2) for t in (grad_out, query, key, value, out)),
                      logsumexp, dropout_p, is_causal, _rng_input(philox_seed, philox_offset),
                      scale, None, None)
    return _as_meta_lays_out(
        torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
        (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
         dropout_p, is_causal, philox_seed, philox_offset), {"scale": scale},
        tuple(g.transpose(1, 2) for g in grads))

