"""Which kernels serve a call: the :class:`Plan`, and the process's kernel options.

On the CPU one kernel family serves every floating dtype.  On CUDA the choice is made by one
C++ rule, ``csrc/kernel_select.h`` (docs/design.md section 4), which the CUDA glue
obeys on every launch; this module asks the same rule (``_C.select_cuda_kernels``) with the same
inputs and only formats its answer, so ``explain()`` and ``last_plan()`` name exactly the
kernels that run.  Nothing here restates a C++ formula.

Tracing: under ``torch.compile`` the rule is called through
``torch.compiler.assume_constant_result`` with plain Python values, so Dynamo evaluates it once
while tracing and never traces into the pybind function (which would break the graph).  Sizes
and strides are not passed then: the rule decides only what cannot depend on them (whether a
fused kernel serves the call, which is all a traced call needs), and the op applies the whole
rule with the real sizes when it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator, Optional

import torch

from . import ops

__all__ = ["Plan", "FALLBACK", "plan", "score_mods", "kernel_options", "MAX_HEAD_DIM",
           "SM90_MAX_ROWS"]

FALLBACK = "fallback:flash_attn_ext.unfused (unfused float32/float64 math)"
MAX_HEAD_DIM = ops._C.max_head_dim  # the largest head dim the kernels instantiate
SM90_MAX_ROWS = ops._C.sm90_max_rows  # the Hopper kernel's 32-bit row bound (pack_gqa.h)

_DTYPE_NAMES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16",
                torch.bfloat16: "bf16"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernels that serve a call.

    Attributes:
        kernel: forward kernel name, e.g. ``"cpu_flash_fwd_fp32"``, ``"sm90_fwd_hdim128_bf16"``,
            or :data:`FALLBACK`.
        backward_kernel: backward kernel name, or :data:`FALLBACK`.
        fused: True when a flash_attn_ext kernel serves the forward.
        reasons: why no fused kernel serves the forward (empty when ``fused``).
        backward_fused: True when a fused kernel serves the backward too.
        backward_reasons: why not (empty when ``backward_fused``).
        notes: why a fused but slower kernel serves the call, e.g. the portable sm80 forward on
            an sm_90 GPU (empty when the fastest kernel for the GPU serves it).
    """

    kernel: str
    backward_kernel: str
    fused: bool
    reasons: tuple = ()
    backward_fused: bool = True
    backward_reasons: tuple = ()
    notes: tuple = ()

    def __str__(self) -> str:
        text = self.kernel if self.fused else f"{self.kernel}, because: " + "; ".join(self.reasons)
        if self.backward_fused or not self.fused:
            text = f"{text} (backward: {self.backward_kernel})" if self.fused else text
        else:
            text = (f"{text} (backward: {self.backward_kernel}, because: "
                    + "; ".join(self.backward_reasons) + ")")
        return text + "".join(f"; note: {n}" for n in self.notes)


def unfused(kernel: str, reasons: tuple) -> Plan:
    """The plan of a call that no fused kernel serves, forward or backward (the backward is the
    fallback's own autograd)."""
    return Plan(kernel, kernel, False, reasons, backward_fused=False, backward_reasons=reasons)


# ---------------------------------------------------------------------------------------------
# Kernel options: the one user-facing switch (FLASH_ATTN_EXT_KERNEL=sm80, read once, here, at
# import) and the experimental variants that compare kernels in one build (tests, benchmarks,
# dev/ab).  They live in C++ (kernel_select.h: KernelOptions), which the glue reads per call.

KERNEL_ENV = "FLASH_ATTN_EXT_KERNEL"
# The options as the plan cache's key (the rule reads them in C++): the same options, the same
# cached plans, also after a kernel_options block has set and restored them.
_options_key: tuple = ()


def _read_kernel_env() -> None:
    value = os.environ.get(KERNEL_ENV, "")
    if value not in ("", "auto", "sm80"):
        raise ValueError(f"{KERNEL_ENV} must be 'auto' or 'sm80', got {value!r}")
    set_kernel_options(force_portable=value == "sm80")


def set_kernel_options(**options) -> dict:
    """Sets kernel options for this process; returns the previous values of those named.

    ``force_portable`` (bool): the portable sm80 kernels on every GPU (as
    ``FLASH_ATTN_EXT_KERNEL=sm80``).  Experimental variants, to compare kernels in one build:
    ``sm90_pack_gqa`` ("auto", "on", "off"), ``sm90_schedule`` ("auto", "dynamic", "static",
    "tile"), ``sm90_section_pairs`` (int >= 0, 0: the launcher's choice), ``sm90_row_shift``,
    ``sm90_direct_epilogue``, ``bwd_atomic_dq``, ``sm90_bias_blocks``, ``exact_rows_always``
    (bools), ``sm90_bwd`` ("auto": the Hopper backward where it measures faster, "on":
    wherever it applies, "off"), ``sm90_fma_exp2`` ("auto", 0, 2 or 4: of every 8 columns of
    scores, how many the Hopper forward's softcap variant at head dim 64 exponentiates on the
    FMA pipe instead of the MUFU unit), ``sm90_per_score_consumers`` ("auto", 2 or 3: consumer
    warpgroups of the Hopper forward's ALiBi and dropout variants at head dim 64; "auto": ALiBi
    3, dropout 2), ``sm90_alibi_fold`` (bool: the Hopper forward's ALiBi
    variant at head dim 64 with its term in the Q K^T GEMM under a causal mask),
    ``sm90_narrow_tiles`` (bool: the Hopper forward's softcap and ALiBi variants at head dim 64
    with 96-key tiles instead of their default 128), ``sm90_bwd_short_steps`` (bool, on by
    default: the Hopper backward's dropout variant at head dim 64, dense calls, with 64-row
    steps; off: 128, as its other variants there),
    ``sm90_varlen_sections`` (bool, on by default: the Hopper forward's tiles of packed
    sequences by sequence in sections of heads; off: by weight alone, the heads fastest),
    ``sm90_mask_rows`` (bool, on by default: the Hopper forward's mask variant at head dim 64
    masks the rows of a boolean mask that are key intervals by comparisons in mixed blocks;
    off: it reads the mask's bytes there), ``sm90_mask_cols`` (bool, on by default: the Hopper
    backward's mask variant at head dims 64 and 128 masks a thread's keys that are row
    intervals of a boolean mask with a value per row and key by comparisons in mixed steps;
    off: it reads the mask's bytes there),
    ``decode_row_lanes`` ("auto", 2, 4 or 8: lanes per
    cache row in the decode kernel's copies at head dim 64), ``decode_pdl`` (bool: the decode
    call's combine kernel launched as a programmatic dependent of its attention kernel),
    ``decode_contiguous_loads`` (bool: the decode kernel's loads from a contiguous cache by
    row offsets alone, else through the paged cache's per-row lookup),
    ``decode_combine_splits`` ("auto", 4, 8 or 16: splits one warp of the decode combine reads
    before a row's splits are spread over more warps), ``decode_block_rows`` ("auto", 16 or
    32: query rows one decode CTA takes at head dims up to 128), ``decode_ctas_per_sm``
    ("auto", 1, 2, 3 or 4: decode CTAs per SM the split heuristic takes as resident, to trim
    a partial last wave; "auto" asks the kernel's occupancy).
    csrc/kernel_select.h says what each does.  Raises ``ValueError`` for an unknown option or a
    bad value (nothing is changed then).
    """
    global _options_key
    before = ops._C.kernel_options()
    unknown = set(options) - set(before)
    if unknown:
        raise ValueError(f"unknown kernel options {sorted(unknown)} (known: {sorted(before)})")
    ops._C.set_kernel_options(options)
    _options_key = tuple(sorted({**before, **options}.items()))
    return {name: before[name] for name in options}


@contextlib.contextmanager
def kernel_options(**options) -> Iterator[dict]:
    """Context manager: :func:`set_kernel_options` for the ``with`` block, then the previous
    values back.  Yields all current options."""
    before = set_kernel_options(**options)
    try:
        yield ops._C.kernel_options()
    finally:
        set_kernel_options(**before)


# ---------------------------------------------------------------------------------------------
# The GPU, as the rule reads it.  assume_constant_result: evaluated once while torch.compile
# traces (the compiled graph does not re-read them).

@torch.compiler.assume_constant_result
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


@torch.compiler.assume_constant_result
def _smem_per_block(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


# What a call adds to plain attention, bit by bit as csrc/kernel_select.h's ScoreMod: the rule
# sends each to the kernels that take it (the Hopper kernels' general variant: softcap, a bias
# and ALiBi, with dropout or not; their dropout variant: dropout alone; the portable ones:
# everything, the bias's gradient too).
SOFTCAP, BIAS, DROPOUT, BIAS_GRAD, ALIBI, MASK = 1, 2, 4, 8, 16, 32


def score_mods(softcap: float, dropout_p: float, attn_bias: Optional[torch.Tensor],
               alibi_slopes: Optional[torch.Tensor] = None) -> int:
    """The ScoreMod bits of a call (0: plain attention); BIAS_GRAD where the bias requires
    grad while autograd records, MASK beside BIAS where it is a boolean mask."""
    # A dropout_p that rounds to 0 drops nothing (csrc/dropout.h's dropout_active: the kept
    # fraction is (1 - dropout_p) * 256 to the nearest integer, ties to even as Python's round,
    # over 256); the kernels then run without dropout, so the plan must not name their general
    # variant for it.  (Plain Python, which torch.compile traces, rather than a call into _C.)
    dropping = dropout_p > 0 and round((1.0 - dropout_p) * 256) < 256
    mods = ((SOFTCAP if softcap > 0 else 0) | (DROPOUT if dropping else 0)
            | (ALIBI if alibi_slopes is not None else 0))
    if attn_bias is not None:
        mods |= BIAS | (MASK if attn_bias.dtype == torch.bool else 0)
        if attn_bias.requires_grad and torch.is_grad_enabled():
            mods |= BIAS_GRAD
    return mods


@functools.lru_cache(maxsize=4096)
def _cuda_plan(build: tuple, device: tuple, dtype: str, softmax_scale: Optional[float],
               head_dim: int, head_dim_v: int, layout: Optional[tuple], mods: int,
               unequal_tiles: bool, deterministic: bool, options: tuple,
               packed: bool = False) -> Plan:
    """The rule's answer as a Plan (cached: it depends on nothing but these values;
    ``options`` stands for the process's kernel options, which the rule reads)."""
    del options
    cuda, sm90, archs = build
    fused, reasons, forward, backward, notes = ops._C.select_cuda_kernels(
        {"cuda": cuda, "sm90": sm90, "cuda_archs": archs}, device, dtype, softmax_scale,
        head_dim, head_dim_v, None if layout is None else list(layout), mods,
        unequal_tiles, deterministic, packed)
    if not fused:
        return unfused(FALLBACK, tuple(reasons))
    return Plan(forward, backward, True, notes=tuple(notes))


@torch.compiler.assume_constant_result
def _cuda_plan_traced(*args) -> Plan:
    """_cuda_plan while torch.compile traces: evaluated on the spot, the result a constant."""
    return _cuda_plan(*args)


def _pinned(size) -> int:
    """A head dim as a Python int.  While Dynamo traces with dynamic shapes it may be symbolic
    (and isinstance cannot tell there): a binary search by comparisons pins it (each one a guard,
    as Dynamo installs for a static size), since the kernel instantiation, and so the plan,
    depends on it.  On a plain int the comparisons are constant and install nothing."""
    if not torch.compiler.is_compiling():
        return int(size)
    lo, hi = 0, MAX_HEAD_DIM + 1  # (callers have refused larger head dims)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if size >= mid:
            lo = mid
        else:
            hi = mid
    return lo


def _layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: bool = False) -> tuple:
    """Sizes then strides of q, k and v, as the rule takes them.  ``packed``: q, k, v of a
    varlen call, (total, heads, head_dim), described as the varlen ops describe them to the
    rule (csrc/varlen_checks.h): (1, total, heads, head_dim), a tensor whose last dimension is
    not contiguous as its contiguous copy."""
    if not packed:
        return (*q.shape, *q.stride(), *k.shape, *k.stride(), *v.shape, *v.stride())
    out = ()
    for t in (q, k, v):
        total, heads, dim = t.shape
        strides = tuple(t.stride())
        if not (strides[2] == 1 or dim <= 1):
            strides = (heads * dim, dim, 1)  # (the op's contiguous copy)
        out += (1, total, heads, dim, total * strides[0], *strides)  # (as unsqueeze(0))
    return out


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         softmax_scale: Optional[float] = None, mods: int = 0,
         run_dtype: Optional[torch.dtype] = None, unequal_tiles: bool = False,
         deterministic: bool = False, packed: bool = False) -> Plan:
    """Plans a call on q/k/v in (batch, seqlen, num_heads, head_dim) layout.

    ``mods``: what the call adds to plain attention (score_mods: softcap, an attn_mask/
    attn_bias, dropout, the bias's gradient, ALiBi); ``run_dtype``: the
    dtype the call runs in when it differs from q's (torch.autocast); ``unequal_tiles``: a causal
    mask or a window (the Hopper forward's schedule); ``deterministic``: the call asks for
    bitwise-reproducible gradients (torch.use_deterministic_algorithms(True) counts too);
    ``packed``: a varlen call, q, k, v of shape (total, heads, head_dim) (the rule's
    packed-sequence kernels).
    """
    q_dtype = run_dtype or q.dtype
    dtype = _DTYPE_NAMES.get(q_dtype)
    if dtype is None:
        return unfused("none", (f"q.dtype={q_dtype} is not float16, bfloat16, float32 or "
                                "float64: no kernel or fallback takes it",))
    # (0-d tensors: no head dim; the callers' rank checks name them after this plan)
    head_dim, head_dim_v = (int(t.shape[-1]) if len(t.shape) else 0 for t in (q, v))
    if max(head_dim, head_dim_v) > MAX_HEAD_DIM or min(head_dim, head_dim_v) == 0:
        return unfused(FALLBACK, (f"head_dim={head_dim}, head_dim_v={head_dim_v}: the kernels "
                                  f"take head dims 1 to {MAX_HEAD_DIM}",))
    device = q.device.type
    if device == "cpu":
        return _CPU_PLANS[dtype, bool(packed)]
    if device != "cuda":
        return unfused(FALLBACK, (f"device type {device!r} has no flash_attn_ext kernel",))
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _plan_cuda(q, k, v, index, dtype, softmax_scale, mods, unequal_tiles, deterministic,
                      packed)


def _plan_cuda(q, k, v, index: int, dtype: str, softmax_scale, mods, unequal_tiles,
               deterministic, packed: bool = False) -> Plan:
    """plan() of a call on CUDA device ``index`` (the path torch.compile traces for CUDA
    calls: tests/test_planning.py traces it on the CPU with the GPU's answers stood in)."""
    info = ops.build_info()
    build = (bool(info["cuda"]), bool(info["sm90"]), str(info.get("cuda_archs", "")))
    if not build[0]:
        gpu = (0, 0, 0)  # (a CPU build: the rule answers without asking the GPU)
    else:
        cap = _capability(index)
        gpu = (int(cap[0]), int(cap[1]), _smem_per_block(index))
    compiling = torch.compiler.is_compiling()
    args = (build, gpu, dtype, softmax_scale, _pinned(q.shape[-1]), _pinned(v.shape[-1]),
            # (traced: no sizes, so that the graph neither guards on them nor recompiles for
            # each; the op applies the whole rule with the real sizes when it runs)
            None if compiling else _layout(q, k, v, packed), int(mods), bool(unequal_tiles),
            bool(deterministic) or (not compiling and torch.are_deterministic_algorithms_enabled()),
            _options_key, bool(packed))
    return _cuda_plan_traced(*args) if compiling else _cuda_plan(*args)


# The CPU kernels' plan per dtype, built once (a plain dict, not functools.cache: Dynamo warns
# about every cache wrapper it traces through and ignores it anyway).
_CPU_PLANS = {(dtype, packed): Plan(f"cpu_flash_fwd_{dtype}{suffix}",
                                     f"cpu_flash_bwd_{dtype}{suffix}", True)
              for dtype in _DTYPE_NAMES.values()
              for packed, suffix in ((False, ""), (True, "_varlen"))}


_read_kernel_env()
