"""``flash_attn_ext.patch()``: route ``torch.nn.functional.scaled_dot_product_attention`` to ours.

Modules that call ``F.scaled_dot_product_attention(...)`` (looked up at call time, as
``torch.nn.MultiheadAttention``'s fast path and most model code do) then run on flash_attn_ext.
Calls the drop-in cannot take (unknown keyword arguments, ranks below 3, nested tensors, key or
value broadcast against query: a batch or head count of 1 or fewer dimensions, which PyTorch's
function broadcasts; enable_gqa with key and value of different head counts; inside
torch.func's gradient transforms or forward-mode AD, which the drop-in refuses; in eager mode,
calls while the flash backend is disabled, e.g. under torch.nn.attention.sdpa_kernel pinning
the math backend) go to PyTorch's own function, reported like every fallback (warning once,
counted, an error in strict mode); so do non-tensor arguments, unreported (PyTorch's
TypeError, or torch.fx's tracing proxies).
Code that imported the function by name before patching keeps the original, and modules that
never call the function are not affected: ``nn.MultiheadAttention`` with ``need_weights=True``
(its default) computes the weights itself, and ``nn.TransformerEncoderLayer``'s native fast
path (eval mode, no grad) runs a fused kernel of its own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from . import policy
from ._call import check_transforms
from .planning import unfused
from .sdpa import scaled_dot_product_attention
from .unfused import TORCH_SDPA as _ORIGINAL

_ORIGINAL_NAME = "fallback:the original torch.nn.functional.scaled_dot_product_attention"


def _patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False, **kwargs):
    reason: Optional[str] = None
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        # PyTorch's function, unreported: it raises its TypeError for a list, and a tracer's
        # stand-in (torch.fx's Proxy) records the call as PyTorch's; the checks below read
        # tensor attributes.
        return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kwargs)
    if kwargs:
        reason = f"unsupported arguments {sorted(kwargs)}"
    elif not torch.compiler.is_compiling() and not torch.backends.cuda.flash_sdp_enabled():
        # Code that pins PyTorch's backends (sdpa_kernel([SDPBackend.MATH]) for a double
        # backward, say) keeps them.  (Eager only: Dynamo does not trace the flag's query.)
        reason = ("the flash backend is disabled (torch.nn.attention.sdpa_kernel without "
                  "SDPBackend.FLASH_ATTENTION, or torch.backends.cuda.enable_flash_sdp(False)): "
                  "PyTorch's function picks among the enabled backends")
    elif any(getattr(t, "is_nested", False) for t in (query, key, value)):
        reason = "nested (jagged) tensors: flash_attn_ext takes dense ones"
    elif query.dim() < 3:
        reason = f"query.dim()={query.dim()}: flash_attn_ext takes 3-D or higher inputs"
    elif _uneven_groups(query, key, value, enable_gqa):
        reason = (f"enable_gqa with key and value of different head counts "
                  f"({key.shape[-3]} and {value.shape[-3]}): flash_attn_ext takes one KV head "
                  f"count")
    elif _broadcasts(query, key, value, enable_gqa):
        reason = ("key or value broadcast against query (a batch or head count of 1, or fewer "
                  "dimensions): flash_attn_ext takes them expanded to query's batch and head "
                  "counts")
    else:
        reason = _refused_transform(query, key, value, attn_mask, dropout_p)
    if reason is not None:
        # (recorded as a plan too: last_plan() named the previous call's kernels after it)
        policy.record(unfused(_ORIGINAL_NAME, (reason,)), None)
        return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kwargs)
    return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                        dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                        enable_gqa=enable_gqa)


def _refused_transform(query, key, value, attn_mask, dropout_p) -> Optional[str]:
    """The drop-in's refusal of the active torch.func transform or forward-mode AD level
    (_call.check_transforms: gradient transforms, jvp, dropout under vmap(randomness='same')),
    or None; PyTorch's function takes such calls."""
    tensors = [t for t in (query, key, value, attn_mask) if isinstance(t, torch.Tensor)]
    try:
        check_transforms(*tensors, dropout_p=dropout_p if isinstance(dropout_p, float) else 0.0)
    except NotImplementedError as e:
        return str(e)
    return None


def _uneven_groups(query, key, value, enable_gqa) -> bool:
    """Whether enable_gqa groups query's heads over key and value with different head counts
    (each dividing query's), which PyTorch's function takes and the drop-in refuses
    (ValueError: one KV head count, as FlashAttention's).  query, key and value are tensors
    and query has 3 or more dimensions (_patched's earlier checks)."""
    if not (enable_gqa is True and key.dim() == query.dim() == value.dim()):
        return False
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    return hk != hv and hk > 0 and hv > 0 and hq % hk == 0 and hq % hv == 0


def _broadcasts(query, key, value, enable_gqa) -> bool:
    """Whether key or value differ from query in rank or in their dimensions before (S, E) in a
    way PyTorch's function broadcasts (a batch or head count of 1, fewer dimensions), which the
    drop-in refuses (ValueError).  Grouped heads with enable_gqa are the drop-in's own; shapes
    that do not broadcast either stay with it, for its error.  query, key and value are tensors
    (_patched's first check)."""
    lead_q = tuple(query.shape[:-2])
    for t in (key, value):
        lead = tuple(t.shape[:-2])
        if lead == lead_q:
            continue
        # With enable_gqa the head counts need not broadcast (PyTorch's rule: key's divides
        # query's): only the dimensions before the heads are compared then.
        grouped = enable_gqa and lead and lead_q and lead[-1] > 0 and lead_q[-1] % lead[-1] == 0
        if grouped and t.dim() == query.dim() and lead[:-1] == lead_q[:-1]:
            continue  # (heads grouped: the drop-in's rule)
        mine, theirs = (lead[:-1], lead_q[:-1]) if grouped else (lead, lead_q)
        try:
            if torch.broadcast_shapes(mine, theirs) == torch.Size(theirs):
                return True
        except RuntimeError:
            pass  # (not PyTorch's broadcast either: the drop-in's error)
    return False


_patched.__doc__ = _ORIGINAL.__doc__
# TorchScript cannot run Python: a scripted module that calls the function while patched gets
# PyTorch's own operator (without this it failed on the patched function and left a
# half-compiled class behind that broke later scripting).
torch.jit._builtins._register_builtin(_patched, "aten::scaled_dot_product_attention")

_active: list = []  # live patch handles, in the order they were made
_lock = threading.Lock()  # patch handles made and undone from several threads


class _Patch(contextlib.AbstractContextManager):
    """One patch: the function stays ours while any handle is live, whatever order they are
    undone in; the last undo restores what was there before the first.  Entering a handle
    (``with``) makes it live again if it was undone, so a handle can be reused."""

    def __init__(self) -> None:
        self._apply()

    def _apply(self) -> None:
        with _lock:
            if self in _active:
                return
            if not _active:
                _Patch._before = F.scaled_dot_product_attention
            _active.append(self)
            F.scaled_dot_product_attention = _patched

    def __enter__(self) -> _Patch:
        self._apply()
        return self

    def undo(self) -> None:
        """Ends this handle (idempotent); the last live handle restores the original."""
        with _lock:
            if self in _active:
                _active.remove(self)
                if not _active:
                    F.scaled_dot_product_attention = _Patch._before

    def __exit__(self, *exc) -> None:
        self.undo()


def patch() -> _Patch:
    """Routes ``torch.nn.functional.scaled_dot_product_attention`` to flash_attn_ext.

    Use as a context manager (``with flash_attn_ext.patch(): model(x)``), or call it and later
    ``.undo()`` (or :func:`unpatch`).  Returns the patch handle.  Handles may be made and undone
    from several threads.  ``torch.jit.script`` compiles the call to PyTorch's own operator
    (TorchScript cannot run Python).
    """
    return _Patch()


def unpatch() -> None:
    """Ends every patch and restores PyTorch's own ``scaled_dot_product_attention``."""
    with _lock:
        _active.clear()
        F.scaled_dot_product_attention = _ORIGINAL


def is_patched() -> bool:
    """Whether ``torch.nn.functional.scaled_dot_product_attention`` is ours right now."""
    return F.scaled_dot_product_attention is _patched
