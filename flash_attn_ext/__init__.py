"""flash_attn_ext: exact, IO-aware attention (FlashAttention) as PyTorch custom ops.

Public API:
    flash_attn_func                 (batch, seqlen, num_heads, head_dim) layout, FlashAttention's
    flash_attn_varlen_func          packed sequences (total, num_heads, head_dim), cu_seqlens
    flash_attn_with_kvcache         attention against a KV cache, appended in place
    scaled_dot_product_attention    drop-in for torch.nn.functional.scaled_dot_product_attention
    explain                         which kernel serves a call, and why a fused one does not
    FallbackError, set_strict       the no-silent-fallback rule (FLASH_ATTN_EXT_STRICT=1)
    patch / unpatch                 route torch.nn.functional.scaled_dot_product_attention to ours
    register_transformers           attn_implementation="flash_attn_ext" in Hugging Face models
    (torch.nn.attention)            activate_flash_attention_impl("flash_attn_ext"): PyTorch's
                                    flash attention ops on our kernels (integrations.torch_flash)
    kernel_options                  the kernel variants a process uses (tests, comparisons)

Ops: torch.ops.flash_attn_ext.fwd / bwd (see flash_attn_ext.ops).  Modules, by layer:
interface / sdpa (the two public faces) over _call (one call path), planning (which kernel:
csrc/kernel_select.h's rule), policy (strict mode, counters, warnings), unfused (the fallback),
explain, patching, integrations.
"""

from __future__ import annotations

from . import ops
from ._version import __version__
from .explain import explain
from .integrations import register_flash_impl, register_transformers, register_when_imported
from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .kvcache import flash_attn_with_kvcache
from .patching import is_patched, patch, unpatch
from .planning import Plan, kernel_options, set_kernel_options
from .policy import FallbackError, fallback_counts, last_plan, reset_fallback_counts, set_strict
from .sdpa import scaled_dot_product_attention, to_bshd
from .varlen import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = ["__version__", "flash_attn_func", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_with_kvcache",
           "scaled_dot_product_attention", "explain",
           "FallbackError", "Plan", "set_strict", "fallback_counts", "reset_fallback_counts",
           "last_plan", "ops", "patch", "unpatch", "is_patched", "register_transformers",
           "kernel_options", "set_kernel_options", "to_bshd"]

# attn_implementation="flash_attn_ext" in transformers, whichever of the two is imported first.
register_when_imported()
# The provider "flash_attn_ext" of torch.nn.attention.activate_flash_attention_impl (registered
# only: activation is the user's choice).
register_flash_impl()
