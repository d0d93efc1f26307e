"""Hugging Face transformers integration: ``attn_implementation="flash_attn_ext"``.

``register_transformers()`` registers our attention with transformers' ``AttentionInterface``
(the function every attention module of a model calls) and, under the same name, SDPA's mask
builder with ``AttentionMaskInterface``: models then hand us exactly the masks they hand SDPA
(``None`` for a plain causal batch, which runs with ``is_causal``; a boolean (B, 1, L, S) mask
when there is padding), so neither the causal nor the padding mask is dropped.

    import flash_attn_ext, transformers
    flash_attn_ext.register_transformers()
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="flash_attn_ext")

``import flash_attn_ext`` registers it by itself when transformers is already imported.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..sdpa import scaled_dot_product_attention

NAME = "flash_attn_ext"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs) -> tuple:
    """transformers' attention-function contract, computed by our fused kernels.

    Args:
        module: the calling attention module (read for ``is_causal`` when not passed).
        query: (B, H, L, E); key, value: (B, H_kv, S, E) / (B, H_kv, S, Ev), H a multiple of
            H_kv (GQA runs natively, K/V are never repeated).
        attention_mask: None, or the boolean/additive mask of transformers' SDPA mask builder,
            broadcastable to (B, H, L, S).
        dropout: attention dropout probability (must be 0.0 for now).
        scaling: softmax scale (default 1/sqrt(E)).
        is_causal: as transformers' SDPA path: causal only when there is no mask and L > 1.

    Returns:
        (attn_output (B, L, H, Ev), None): no attention weights are ever materialised.
    """
    if kwargs.get("output_attentions", False):
        raise ValueError("flash_attn_ext does not return attention weights "
                         "(output_attentions=True); use attn_implementation='eager' for that")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                       dropout_p=dropout, is_causal=is_causal, scale=scaling,
                                       enable_gqa=True)
    return out.transpose(1, 2), None


_registered_flash_names: set = set()


def register_transformers(name: str = NAME) -> None:
    """Registers ``attn_implementation=name`` (default ``"flash_attn_ext"``) with transformers.

    transformers (5.x) takes every implementation name that contains "flash" for a kernel with
    the flash-attn package's API and, when a model is created, tries to preload that package or a
    hub kernel of that name (``lazy_import_flash_attention``), which fails for us: our attention
    is a plain ``AttentionInterface`` function with nothing to preload.  For such names this
    function therefore wraps transformers' preloader so that it skips exactly the names
    registered here (and defers to the original for every other name).

    Raises:
        ImportError: transformers is not installed (tested with transformers 5.17).
    """
    from transformers import AttentionInterface, modeling_utils
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    if "flash" not in name:
        return
    _registered_flash_names.add(name)
    preload = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if preload is not None and not getattr(preload, "_flash_attn_ext_guard", False):
        def lazy_import_flash_attention(implementation, *args, **kwargs):
            if implementation in _registered_flash_names:
                return (None, None, None, None, None), None
            return preload(implementation, *args, **kwargs)

        lazy_import_flash_attention._flash_attn_ext_guard = True
        modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention
