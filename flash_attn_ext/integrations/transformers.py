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

``import flash_attn_ext`` registers it by itself, in either import order: at once if transformers'
model code (``transformers.modeling_utils``, where the names are looked up) is already
imported, else as soon as it is (:func:`register_when_imported`).  The same kernels are also
registered as ``attn_implementation="fae_sdpa"`` (SDPA's conventions), for the few models that
treat any "flash" name specially; see :func:`register_transformers`.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
import weakref
from typing import Optional

import torch

from .._call import check_flags
from ..sdpa import attend, beyond_kernels, to_bshd

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
        dropout: attention dropout probability on the weights (in the kernels).
        scaling: softmax scale (default 1/sqrt(E)).
        is_causal: as transformers' SDPA path: causal only when there is no mask and L > 1.
        **kwargs: read where they change the result: ``softcap`` (Gemma-2 style logit
            soft-capping, in the kernels), ``position_bias`` (T5-style additive bias, folded
            into the mask as transformers' SDPA path does), ``cu_seq_lens_q/k`` (sequences
            packed into one row, which models hand FlashAttention-named implementations
            instead of a mask: the packed-sequence kernels (``flash_attn_varlen_func``,
            causal bottom-right within each sequence, so that no token attends across
            sequences; ``max_length_q/k`` read when given), except on CUDA for a single
            sequence, which runs as one call with a block-diagonal mask
            (``benchmarks/bench_packed.py`` measures both routes; ``docs/perf/training.md``
            says why the rule stands).  Packing described only by ``position_ids`` (what
            ``DataCollatorWithFlattening`` produces: one row, positions restarting at 0 for
            each sequence) is read as FlashAttention-2's integration reads it, when there is
            no mask, one row and as many keys as queries: sequences start where the position
            is 0, and the call takes the ``cu_seq_lens`` route (transformers' mask functions
            do not turn such positions into a mask when the model has a cache, as in training
            mode with the default ``use_cache``, so without this the sequences attended to
            each other).  The positions are copied to the host once per tensor and version,
            on CUDA a synchronisation per forward pass; under ``torch.compile`` they cannot be
            read there.  With a mask as well (under ``torch.compile`` transformers passes its
            causal mask; sliding-window models their window's) the mask is narrowed to the
            sequences of ``cu_seq_lens_q/k`` or ``position_ids`` on the device
            (_within_sequences), compiled too.  Head dims beyond the kernels: the unfused
            math, a reported fallback (sdpa.attend).  ``s_aux`` (attention sinks) is
            refused.  Others (caches, ``sliding_window``, which the mask already encodes) do
            not change the result.

    Returns:
        (attn_output (B, L, H, Ev), None): no attention weights are ever materialised.

    Raises:
        ValueError: ``output_attentions=True``.
        NotImplementedError: attention sinks (``s_aux``).
    """
    from transformers.integrations.sdpa_attention import create_position_bias_mask

    if kwargs.get("output_attentions", False):
        raise ValueError("flash_attn_ext does not return attention weights "
                         "(output_attentions=True); use attn_implementation='eager' for that")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("flash_attn_ext does not implement attention sinks (s_aux, "
                                  "e.g. GPT-OSS); use attn_implementation='eager'")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(is_causal and query.shape[2] > 1)
    if attention_mask is None and not _packed(kwargs):
        offsets = _offsets_from_positions(query, key, kwargs.get("position_ids"))
        if offsets is not None:
            kwargs = dict(kwargs, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets)
    if attention_mask is None and _packed(kwargs):
        several = kwargs["cu_seq_lens_q"].numel() > 2  # (a shape: no device sync)
        if query.shape[0] == 1 and kwargs.get("position_bias") is None and \
                (query.device.type == "cpu" or several) and \
                not beyond_kernels(query, value):
            return _varlen_forward(query, key, value, kwargs, dropout, scaling, causal), None
        attention_mask = _packed_sequence_mask(query, key, kwargs, causal)
    elif attention_mask is not None:
        # A mask as well as packed sequences (under torch.compile transformers passes its
        # causal mask, sliding-window models their window's): the sequences must still not
        # attend to each other, so the mask is narrowed to them (the offsets ignored, they
        # did: new-user trial).
        attention_mask = _within_sequences(attention_mask, query, key, kwargs, causal)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal,
                                                   query, key)
        is_causal = False
    _, dropout = check_flags(is_causal, (-1, -1), dropout, causal_name="is_causal")
    q, k, v = to_bshd(query, key, value, enable_gqa=True)
    # (head dims beyond the kernels: the unfused math, a reported fallback, as in the drop-in)
    out = attend(q, k, v, query, key, attention_mask, dropout, is_causal, scaling,
                 float(kwargs.get("softcap") or 0.0), None)
    return out, None


def _packed(kwargs) -> bool:
    return kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None


def _within_sequences(mask, query, key, kwargs, causal: bool) -> torch.Tensor:
    """transformers' ``mask`` (bool or additive, broadcastable to (B, H, L, S)) narrowed to
    the packed sequences: those of ``cu_seq_lens_q/k`` (_packed_sequence_mask), or of a single
    row's ``position_ids`` (a sequence starts at every position 0; computed on the device, so
    also under torch.compile, where _offsets_from_positions cannot read them).  The mask as
    it is where neither describes packed sequences (or its shape is not (.., L or 1, S))."""
    if mask.shape[-1] != key.shape[2] or mask.shape[-2] not in (1, query.shape[2]):
        return mask
    if _packed(kwargs):
        same = _packed_sequence_mask(query, key, kwargs, causal)
    else:
        pos = kwargs.get("position_ids")
        if not _one_packable_row(query, key, pos):
            return mask
        seq = torch.cumsum(pos.reshape(-1).to(mask.device) == 0, 0)  # (the sequence of each)
        same = seq[:, None] == seq[None, :]
    if mask.dtype == torch.bool:
        return mask & same
    return mask.masked_fill(~same, torch.finfo(mask.dtype).min)


def _packed_sequence_mask(query, key, kwargs, causal: bool) -> torch.Tensor:
    """(L, S) bool mask from ``cu_seq_lens_q/k``: True where query and key are in the same
    packed sequence and, with ``causal``, the key is visible bottom-right within it (key
    position <= query position + its keys - its queries, FlashAttention's varlen rule; one
    top-left triangle over the whole packed matrix is wrong when q and k are packed
    differently)."""
    dev = query.device
    cu_q = kwargs["cu_seq_lens_q"].to(dev, torch.int64)
    cu_k = kwargs["cu_seq_lens_k"].to(dev, torch.int64)
    rows = torch.arange(query.shape[2], device=dev)
    cols = torch.arange(key.shape[2], device=dev)
    seg_q = torch.searchsorted(cu_q[1:], rows, right=True)
    seg_k = torch.searchsorted(cu_k[1:], cols, right=True)
    mask = seg_q[:, None] == seg_k[None, :]
    if causal:
        last = len(cu_q) - 1  # (rows and keys past the last offset: their own segment)
        sq, sk = seg_q.clamp(max=last - 1), seg_k.clamp(max=last - 1)
        pos_q, pos_k = rows - cu_q[sq], cols - cu_k[sk]
        offset = (cu_k[sq + 1] - cu_k[sq]) - (cu_q[sq + 1] - cu_q[sq])
        mask &= pos_k[None, :] <= (pos_q + offset)[:, None]
    return mask


# The host copies of the offsets transformers hands every layer of a forward pass: the same
# tensor objects for all layers, so one copy (on CUDA one synchronisation) serves them all.
# Keyed by the tensor objects (id, checked against a weak reference, so a dead tensor's
# reused id never matches) and their version counters, so that an in-place change of either
# is seen; a few entries (the passes in flight).  Not for inference tensors (no version
# counter) and not while torch.compile traces (the copy is then part of the graph).  Writes
# that bypass the version counter (through `.data`, or a NumPy array sharing the storage) are
# not seen: transformers builds these tensors afresh for every batch.
_host_offsets_cache: dict = {}
_positions_cache: dict = {}  # (_offsets_from_positions's, by the same rules)
_HOST_OFFSETS_ENTRIES = 8


def _per_version(cache: dict, tensors: tuple, compute):
    """compute(), or its value from ``cache`` while the same tensor objects at the same
    versions ask again (the rules above; keyed by the first tensor)."""
    cacheable = not (torch.compiler.is_compiling() or any(t.is_inference() for t in tensors))
    versions = tuple(t._version for t in tensors) if cacheable else None
    if cacheable:
        hit = cache.get(id(tensors[0]))
        if hit is not None and all(ref() is t for ref, t in zip(hit[0], tensors)) and \
                hit[1] == versions:
            return hit[2]
    value = compute()
    if cacheable:
        cache.pop(id(tensors[0]), None)
        while len(cache) >= _HOST_OFFSETS_ENTRIES:
            cache.pop(next(iter(cache), None), None)
        cache[id(tensors[0])] = (tuple(weakref.ref(t) for t in tensors), versions, value)
    return value


def _host_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple:
    """cu_seq_lens_q/k as int32 CPU tensors (flash_attn_varlen_func then synchronises
    nowhere), copied from the device at most once per pair of tensors and versions."""
    def copy():
        host = torch.cat([cu_q.to(cu_k.device, torch.int32), cu_k.to(torch.int32)]).cpu()
        return host[:cu_q.numel()], host[cu_q.numel():]

    return _per_version(_host_offsets_cache, (cu_q, cu_k), copy)


def _one_packable_row(query, key, position_ids) -> bool:
    """Whether ``position_ids`` may describe sequences packed into the call's row: a tensor of
    one position per query, one row, and as many keys as queries (not a cache's earlier keys),
    at least two of them."""
    return isinstance(position_ids, torch.Tensor) and query.shape[0] == 1 and \
        query.shape[2] >= 2 and key.shape[2] == query.shape[2] and \
        position_ids.numel() == query.shape[2]


def _offsets_from_positions(query, key, position_ids) -> Optional[torch.Tensor]:
    """int32 CPU offsets of the sequences packed into one row that ``position_ids`` describes
    (a sequence starts at every position 0, and at the row's start), as FlashAttention-2's
    transformers integration derives them; None when the row is not packed (its positions
    are consecutive), when there is more than one row, when queries and keys differ in length
    (a cache's earlier keys), or under ``torch.compile`` (the values cannot be read there).
    The host copy is made once per tensor and version (every layer of a forward pass gets the
    same tensor)."""
    if not _one_packable_row(query, key, position_ids) or torch.compiler.is_compiling():
        return None

    def offsets():
        pos = position_ids.reshape(-1).cpu()
        if torch.equal(pos, torch.arange(pos.numel(), dtype=pos.dtype) + pos[0]):
            return None
        starts = (pos == 0).nonzero().flatten()
        if starts.numel() == 0 or starts[0] != 0:
            starts = torch.cat([torch.zeros(1, dtype=starts.dtype), starts])
        return torch.cat([starts, torch.tensor([pos.numel()])]).to(torch.int32)

    return _per_version(_positions_cache, (position_ids,), offsets)


def _varlen_forward(query, key, value, kwargs, dropout, scaling, causal) -> torch.Tensor:
    """One packed row (batch 1) as packed sequences (flash_attn_varlen_func): each sequence
    attends to its own keys, causal bottom-right within it; (1, L, H, Ev).  The longest
    lengths come from ``max_length_q/k`` when transformers passes them (its data collator
    does), else from the offsets.  The offsets go to the kernels as host copies, one per
    forward pass (``_host_offsets``)."""
    from ..varlen import flash_attn_varlen_func

    cu_q, cu_k = _host_offsets(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])

    def longest(cu, given):
        if given is not None:
            return int(given)
        return int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, H, E)
    out = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, longest(cu_q, kwargs.get("max_length_q")),
        longest(cu_k, kwargs.get("max_length_k")), dropout_p=float(dropout),
        softmax_scale=scaling, causal=causal, softcap=float(kwargs.get("softcap") or 0.0))
    return out[None]


_registered_flash_names: set = set()

# The second name: transformers reads any name containing "flash" as a kernel with flash-attn's
# varlen API, and some models (vision towers such as Pixtral's) then drop the attention mask and
# describe packed images only through their own position ids.  Under a name without "flash"
# (and with "sdpa", so transformers checks the model supports SDPA-style attention) every model
# hands us the same masks as attn_implementation="sdpa".
SDPA_NAME = "fae_sdpa"


def register_transformers(name: str = NAME) -> None:
    """Registers our attention with transformers under ``name`` (default ``"flash_attn_ext"``)
    and, by default, also under ``"fae_sdpa"``.

    * ``attn_implementation="flash_attn_ext"``: transformers treats every name containing
      "flash" as a kernel with flash-attn's API: a model is created without trying to preload
      a flash-attn package for it (this function wraps transformers' preloader so that it skips
      exactly the names registered here), and models that special-case FlashAttention may pass
      packed sequences as ``cu_seq_lens_q/k`` instead of a mask, which
      :func:`attention_forward` runs on the packed-sequence kernels (``flash_attn_varlen_func``;
      a single sequence on CUDA as one call with a block-diagonal mask).  A few models drop the
      mask and describe packing in their own way (Pixtral's vision tower): use the second name.
    * ``attn_implementation="fae_sdpa"``: the same kernels under SDPA's conventions; every model
      that supports ``"sdpa"`` hands us exactly the masks it hands SDPA.  One difference from
      ``"sdpa"``: a row packed by ``position_ids`` keeps its sequences apart (as under the first
      name; ``"sdpa"`` lets them attend to each other where transformers' mask functions leave
      packing alone).

    Raises:
        ImportError: transformers is not installed (tested with transformers 5.17).
    """
    from transformers import AttentionInterface, modeling_utils
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    names = [name] + ([SDPA_NAME] if name == NAME else [])
    for n in names:
        AttentionInterface.register(n, attention_forward)
        AttentionMaskInterface.register(n, sdpa_mask)
    flash_names = [n for n in names if "flash" in n]
    if not flash_names:
        return
    _registered_flash_names.update(flash_names)
    _refuse_models_without_the_interface(modeling_utils.PreTrainedModel)
    preload = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if preload is not None and not getattr(preload, "_flash_attn_ext_guard", False):
        def lazy_import_flash_attention(implementation, *args, **kwargs):
            if implementation in _registered_flash_names:
                return (None, None, None, None, None), None
            return preload(implementation, *args, **kwargs)

        lazy_import_flash_attention._flash_attn_ext_guard = True
        modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


def _refuse_models_without_the_interface(model_class) -> None:
    """Wraps transformers' check of a model's attn_implementation so that our "flash" names are
    refused where the model does not support SDPA-style attention (``_supports_sdpa`` False:
    Bloom, CodeGen, MPT, XGLM, GPT-J, ... compute attention in their own code).  transformers
    checks a registered name only where it is "sdpa"-like or flash-attn's own
    (``flash_attention_N``), so it accepted ours for any model: our kernels never ran, and the
    model's own attention got the boolean masks of our registered mask function as if they
    were additive (wrong answers, NaN; GPT-J and GPT-Neo a bare KeyError).  "fae_sdpa" gets
    transformers' own refusal for such models already."""
    check = getattr(model_class, "get_correct_attn_implementation", None)
    if check is None or getattr(check, "_flash_attn_ext_guard", False):
        return

    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        chosen = check(self, requested_attention, *args, **kwargs)
        base = chosen.split("|")[-1] if isinstance(chosen, str) else chosen
        if base in _registered_flash_names and not getattr(self, "_supports_sdpa", False):
            raise ValueError(
                f"{type(self).__name__} does not support attn_implementation={chosen!r}: it "
                f"computes attention in its own code, not through transformers' attention "
                f"interface (it supports no 'sdpa' either), so flash_attn_ext's kernels would "
                f"never run and its attention would get masks of another convention; use "
                f"attn_implementation='eager' (or flash_attn_ext.patch() for code that calls "
                f"torch.nn.functional.scaled_dot_product_attention)")
        return chosen

    get_correct_attn_implementation._flash_attn_ext_guard = True
    get_correct_attn_implementation.__doc__ = check.__doc__
    model_class.get_correct_attn_implementation = get_correct_attn_implementation


_MODEL_CODE = "transformers.modeling_utils"  # where attn_implementation names are looked up


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """An import hook that registers our names right after ``transformers.modeling_utils`` has
    executed, so that ``import flash_attn_ext`` before ``import transformers`` (isort's order)
    works like the other order.  It finds the module with the other finders and only wraps its
    loader; it removes itself once it has fired."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODEL_CODE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader, self)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader, hook):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self._hook in sys.meta_path:
            sys.meta_path.remove(self._hook)
        try:
            register_transformers()
        except Exception as e:  # never break the user's import of transformers
            warnings.warn(f"flash_attn_ext could not register with transformers ({e!r}); call "
                          "flash_attn_ext.register_transformers() to see the error", stacklevel=2)

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self._loader, name)


def register_when_imported() -> None:
    """Registers with transformers now if its model code is imported, else as soon as it is.

    Called by ``import flash_attn_ext``; installs at most one import hook (a
    ``sys.meta_path`` finder that only wraps the loader of ``transformers.modeling_utils``).
    """
    if _MODEL_CODE in sys.modules:
        register_transformers()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
