"""Which kernel serves a call, why a fused kernel was not used, and strict mode.

The no-silent-slow-path rule (DESIGN.md section 4): every call is planned here.  A call that no
fused flash_attn_ext kernel can serve runs on a correct fallback (PyTorch's own
``scaled_dot_product_attention``), and then

* a warning names the reason, once per reason per process;
* ``fallback_counts()`` counts it;
* strict mode turns it into a :class:`FallbackError` instead.  Strict mode is on when the call
  passes ``strict=True``, after ``set_strict(True)``, or with the environment variable
  ``FLASH_ATTN_EXT_STRICT=1``.

``explain(...)`` (in the package root) returns the :class:`Plan` without running anything.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import warnings
from typing import Optional

import torch

from . import ops

__all__ = ["FallbackError", "Plan", "plan", "set_strict", "strict_enabled", "fallback_counts",
           "reset_fallback_counts", "last_plan", "FALLBACK"]

FALLBACK = "fallback:torch.nn.functional.scaled_dot_product_attention"
MAX_HEAD_DIM = 256  # the largest head dim the kernels instantiate (csrc/checks.h)

_DTYPE_NAMES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16",
                torch.bfloat16: "bf16"}


class FallbackError(RuntimeError):
    """Raised in strict mode when a call cannot run on a fused flash_attn_ext kernel."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernels that serve a call.

    Attributes:
        kernel: forward kernel name, e.g. ``"cpu_flash_fwd_fp32"``, or :data:`FALLBACK`.
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


def _unfused(kernel: str, reasons: tuple) -> Plan:
    """The plan of a call that no fused kernel serves, forward or backward (the backward is the
    fallback's own autograd)."""
    return Plan(kernel, kernel, False, reasons, backward_fused=False, backward_reasons=reasons)


_strict_override: Optional[bool] = None
_counts: collections.Counter = collections.Counter()
_warned: set = set()
_last_plan: Optional[Plan] = None


def set_strict(enabled: Optional[bool]) -> None:
    """Turns strict mode on or off for this process; ``None`` defers to FLASH_ATTN_EXT_STRICT."""
    global _strict_override
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_strict takes True, False or None, got {enabled!r}")
    _strict_override = enabled


def _check_strict(strict) -> None:
    """ValueError unless a call's ``strict`` is True, False or None (a string like "no" is not
    taken as True)."""
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"strict must be True, False or None, got {strict!r}")


def strict_enabled(strict: Optional[bool] = None) -> bool:
    """Whether a fallback raises: the call's ``strict``, else ``set_strict``, else the env var."""
    _check_strict(strict)
    if strict is not None:
        return strict
    if _strict_override is not None:
        return _strict_override
    raw = os.environ.get("FLASH_ATTN_EXT_STRICT", "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    # (an unknown value must not quietly leave strict mode off)
    raise ValueError(f"FLASH_ATTN_EXT_STRICT must be 1, true, yes or on (strict) or 0, false, "
                     f"no, off or unset (not strict), got {raw!r}")


def fallback_counts() -> dict:
    """How many calls fell back, per reason, since the process started (or the last reset)."""
    return dict(_counts)


def reset_fallback_counts() -> None:
    """Clears the fallback counters and the warn-once memory."""
    _counts.clear()
    _warned.clear()


def last_plan() -> Optional[Plan]:
    """The plan of the most recent eager call.  Calls inside torch.compile are not recorded
    (``explain()`` gives their plan; strict mode still refuses their fallbacks when traced)."""
    return _last_plan


@torch.compiler.assume_constant_result
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


@torch.compiler.assume_constant_result
def _smem_per_block(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


def arch_runs_on(archs: str, capability: tuple) -> bool:
    """Whether a build for TORCH_CUDA_ARCH_LIST-style ``archs`` (e.g. ``"8.0;9.0a"``) has code
    that runs on a GPU of ``capability``: machine code (SASS) for the same major version and a
    minor version not above the GPU's ("9.0a" counts only on 9.0 itself), or PTX ("+PTX") for a
    version not above the GPU's, which the driver compiles."""
    for token in archs.replace(" ", ";").split(";"):
        token = token.strip()
        if not token:
            continue
        ptx = token.endswith("+PTX")
        name = token[:-4] if ptx else token
        specific = name.endswith("a")
        try:
            major, minor = (int(x) for x in name.rstrip("a").split("."))
        except ValueError:
            continue
        if specific:
            if (major, minor) == tuple(capability):
                return True
        elif major == capability[0] and minor <= capability[1]:
            return True
        if ptx and not specific and (major, minor) <= tuple(capability):
            return True
    return False


def _sm80_smem_bytes(padded_dim: int) -> int:
    """Dynamic shared memory of the largest sm80 kernel for a padded head dim: the dK/dV kernel
    (csrc/kernels/sm80/flash_bwd_kernel.cuh, BwdTraits::kSmemDkdv: K, V of 64 keys, Q/dO
    double-buffered, two fp32 statistics per query row; 64 query rows per step up to head
    dim 128, 32 above).  The faster plain-attention kernels of flash_bwd_lean.cuh (up to 162 KB
    at head dims 64 and 128, 209 KB at 256) run only where the GPU allows them; elsewhere (e.g.
    sm_86 / sm_89, and sm_80 at head dim 256) the backward uses these, so this stays the
    requirement."""
    rows = 64 if padded_dim <= 128 else 32
    return (2 * 64 + 4 * rows) * padded_dim * 2 + 4 * rows * 4


KERNEL_ENV = "FLASH_ATTN_EXT_KERNEL"


def kernel_choice() -> str:
    """FLASH_ATTN_EXT_KERNEL: ``"auto"`` (default: the Hopper forward where it applies) or
    ``"sm80"`` (the portable CUDA kernels on every GPU).  The CUDA glue reads the same variable
    (csrc/cuda/flash_cuda.cu, force_portable); both look at it on sm_90 GPUs only, on every call
    (under torch.compile: when the call is traced)."""
    value = os.environ.get(KERNEL_ENV, "")
    if value not in ("", "auto", "sm80"):
        raise ValueError(f"{KERNEL_ENV} must be 'auto' or 'sm80', got {value!r}")
    return value or "auto"


def _lean_bwd_blockers(padded_dim: int, general: bool, allowed_smem: int) -> list:
    """Why the 8-warp backward kernels do not serve a CUDA call (launch_flash_bwd in
    csrc/kernels/sm80/flash_bwd_kernel.cuh applies the same rule); ``allowed_smem``: the GPU's
    opt-in shared memory per block (0 = unknown)."""
    why = []
    if general:
        why.append("softcap, attn_mask/attn_bias and dropout run on them")
    # (the glue's rule, csrc/params.h: lean_bwd_smem_bytes)
    need = ops._C.lean_bwd_smem_bytes(padded_dim)
    if 0 < allowed_smem < need:
        why.append(f"they need {need} bytes of shared memory per block, this GPU allows "
                   f"{allowed_smem}")
    return why


def deterministic_backward_note(p: Plan, deterministic: bool) -> Plan:
    """``p`` with a note where ``deterministic`` (the call's flag) or
    torch.use_deterministic_algorithms moves a CUDA backward off its faster dQ path: the 8-warp
    backward otherwise accumulates dQ in its dK/dV pass (fp32 bulk reductions on sm_90 up to
    head dim 128, atomics elsewhere: not bitwise reproducible); deterministic gradients take the
    separate dQ kernel, which recomputes S and dP (~0.75x the speed, measured at d = 64/128 on
    an H200)."""
    eight_warp = (p.fused and p.backward_fused and p.backward_kernel.startswith("sm80_bwd")
                  and not any("4-warp" in n for n in p.notes))
    if not (eight_warp and (deterministic or torch.are_deterministic_algorithms_enabled())):
        return p
    return dataclasses.replace(p, notes=p.notes + (
        "backward dQ on the separate dQ kernel, not accumulated in the dK/dV pass, because "
        "deterministic=True or torch.use_deterministic_algorithms(True): bitwise-reproducible "
        "gradients at ~0.75x the default backward's speed",))


def is_general(softcap: float, dropout_p: float, has_bias: bool) -> bool:
    """Whether a call needs the kernels' general variant (softcap, an attn_mask/attn_bias or
    dropout), which plan() reports and which picks the portable forward on sm_90."""
    return bool(softcap > 0 or dropout_p > 0 or has_bias)


def _sm90_blockers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, general: bool,
                   info: dict) -> list:
    """Why the Hopper forward (csrc/kernels/sm90) cannot serve a call on an sm_90 GPU (``info``:
    ops.build_info()); the same rule as use_sm90_fwd in csrc/cuda/flash_cuda.cu."""
    why = []
    if not info.get("sm90", False):
        why.append("this build has no Hopper kernels (they need 9.0a in TORCH_CUDA_ARCH_LIST "
                   "and the CUTLASS headers at build time: pip install --no-deps "
                   "nvidia-cutlass==4.2.0.0 and rebuild)")
    if kernel_choice() == "sm80":
        why.append(f"{KERNEL_ENV}=sm80")
    if general:
        why.append("softcap, attn_mask/attn_bias and dropout run on the sm80 kernel")
    if q.shape[1] == 0 or k.shape[1] == 0:
        why.append("an empty sequence")
    if max(q.shape[1], k.shape[1]) > SM90_MAX_ROWS:
        why.append(f"seqlen_q={q.shape[1]}, seqlen_k={k.shape[1]}: the Hopper kernel's row "
                   f"arithmetic is 32-bit (at most {SM90_MAX_ROWS})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # A broadcast (stride-0) dimension that the glue passes through as it is (it copies
        # tensors whose strides are not multiples of 8 elements) cannot be described to TMA.
        as_is = (t.stride(3) == 1 and t.shape[3] % 8 == 0
                 and all(t.stride(i) % 8 == 0 for i in range(3)))
        if as_is and any(t.shape[i] > 1 and t.stride(i) == 0 for i in range(3)):
            why.append(f"{name} has a broadcast (stride-0) dimension, which TMA cannot load")
    return why


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         softmax_scale: Optional[float] = None, general: bool = False,
         run_dtype: Optional[torch.dtype] = None) -> Plan:
    """Plans a call on q/k/v in (batch, seqlen, num_heads, head_dim) layout; ``general``: the
    call has a softcap, an attn_mask/attn_bias or dropout (every such setting runs on a fused
    kernel; on sm_90 they pick the portable forward); ``run_dtype``: the dtype the call runs in
    when it differs from q's (torch.autocast)."""
    device = q.device.type
    q_dtype = run_dtype or q.dtype
    dtype = _DTYPE_NAMES.get(q_dtype, str(q_dtype).replace("torch.", ""))
    reasons = []
    if q_dtype not in _DTYPE_NAMES:
        return _unfused("none",
                        (f"q.dtype={q_dtype} is not a floating dtype: no kernel or fallback "
                         "takes it",))
    head_dim = max(q.shape[-1], v.shape[-1])
    if head_dim > MAX_HEAD_DIM:
        return _unfused(FALLBACK,
                        (f"head_dim={q.shape[-1]}, head_dim_v={v.shape[-1]}: the kernels take "
                         f"head dims up to {MAX_HEAD_DIM}",))
    if device == "cpu":
        cpu_plan = _cpu_plans.get(dtype)
        if cpu_plan is None:
            cpu_plan = _cpu_plans[dtype] = Plan(f"cpu_flash_fwd_{dtype}",
                                                f"cpu_flash_bwd_{dtype}", True)
        return cpu_plan
    if device == "cuda":
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if torch.compiler.is_compiling():
            # (not renamed for packing here: that would guard the graph on seqlen_q; the
            # compiled call does not record its plan either)
            return _plan_cuda(q, k, v, softmax_scale, general, q_dtype, dtype, head_dim, index)
        # Eager calls: the plan depends on the tensors only through what the key holds (the
        # stride rule only when some stride is 0), so it is computed once per key.
        broadcast = 0 in q.stride() or 0 in k.stride() or 0 in v.stride()
        key = (index, q_dtype, q.shape[-1], v.shape[-1], general,
               softmax_scale if softmax_scale is not None and softmax_scale <= 0 else None,
               os.environ.get(KERNEL_ENV, ""), q.shape[1] == 0 or k.shape[1] == 0,
               max(q.shape[1], k.shape[1]) > SM90_MAX_ROWS)
        cached = None if broadcast else _cuda_plans.get(key)
        if cached is None:
            cached = _plan_cuda(q, k, v, softmax_scale, general, q_dtype, dtype, head_dim,
                                index)
            if not broadcast:
                _cuda_plans[key] = cached
        return _with_packing(cached, q, k)
    reasons.append(f"device type {device!r} has no flash_attn_ext kernel")
    return _unfused(FALLBACK, tuple(reasons))


_cuda_plans: dict = {}  # plan() of eager CUDA calls, by what the plan depends on
_cpu_plans: dict = {}  # plan() of CPU calls, by dtype name

PACK_GQA_ENV = "FLASH_ATTN_EXT_SM90_PACK_GQA"
SM90_MAX_ROWS = ops._C.sm90_max_rows  # the Hopper kernel's 32-bit row bound (pack_gqa.h)


def sm90_packs_gqa(seqlen_q: int, heads_q: int, heads_kv: int, padded_head_dim: int) -> bool:
    """Whether the Hopper forward packs the query heads of each GQA/MQA group into one tile
    (FlashAttention-3's PackGQA: tile rows are (position, head in group), so each K/V tile is
    read once per group instead of once per query head).

    FLASH_ATTN_EXT_SM90_PACK_GQA (experimental): ``auto`` (default) packs where it needs at
    most half the tiles of one tile per query head (192 query rows per tile at head dim 64,
    128 above), e.g. decoding and seqlen_q <= 64 with 4+ query heads per KV head (measured
    1.03-1.95x faster there; 0.7-0.98x at seqlen_q 128-512: benchmarks/bench_gqa.py);
    ``on`` packs every GQA/MQA call, ``off`` none.  The rule is the CUDA glue's, compiled from
    csrc/kernels/sm90/pack_gqa.h (``flash_attn_ext._C.sm90_pack_gqa``).  Packing has its own
    kernel instantiation (the name's ``_packgqa``).
    Raises ``ValueError`` for another value of the variable.
    """
    value = os.environ.get(PACK_GQA_ENV, "")
    if value not in ("", "auto", "on", "off"):
        raise ValueError(f"{PACK_GQA_ENV} must be 'auto', 'on' or 'off', got {value!r}")
    if value == "off":
        return False
    if value == "on":
        return ops._C.sm90_pack_gqa_possible(seqlen_q, heads_q, heads_kv)
    return ops._C.sm90_pack_gqa(seqlen_q, heads_q, heads_kv, padded_head_dim)


_packed_plans: dict = {}  # plan -> the same plan with the packed Hopper forward


def _with_packing(p: Plan, q: torch.Tensor, k: torch.Tensor) -> Plan:
    """``p``, with the Hopper forward named ``..._packgqa`` where it packs GQA query heads."""
    if q.shape[2] == k.shape[2] or not p.kernel.startswith("sm90_fwd"):
        return p  # (no GQA group: nothing to pack)
    padded = int(p.kernel.split("_hdim")[1].split("_")[0])
    if not sm90_packs_gqa(q.shape[1], q.shape[2], k.shape[2], padded):
        return p
    packed = _packed_plans.get(p)
    if packed is None:
        packed = _packed_plans[p] = dataclasses.replace(p, kernel=p.kernel + "_packgqa")
    return packed


def _plan_cuda(q, k, v, softmax_scale, general, q_dtype, dtype, head_dim, index) -> Plan:
    """plan() for a CUDA tensor on device ``index`` (see there)."""
    reasons = []
    info = ops.build_info()
    if not info["cuda"]:
        reasons.append("this build of flash_attn_ext has no CUDA kernels (built without "
                       "CUDA; see FLASH_ATTN_EXT_CUDA in README.md)")
    if q_dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"q.dtype={q_dtype}: the CUDA kernels take float16 and bfloat16 "
                       "(cast the inputs or use torch.autocast)")
    if softmax_scale is not None and softmax_scale <= 0:
        # The kernels track the running max on raw q.k and scale afterwards, which needs a
        # positive scale.
        reasons.append(f"softmax_scale={softmax_scale}: the CUDA kernels take a positive "
                       "scale")
    if not reasons:
        cap = _capability(index)
        archs = info.get("cuda_archs", "")
        if cap < (8, 0):
            reasons.append(f"GPU sm_{cap[0]}{cap[1]}: the CUDA kernels need sm_80 or newer")
        elif not arch_runs_on(archs, cap):
            reasons.append(f"GPU sm_{cap[0]}{cap[1]}: this build's CUDA code ({archs}) does "
                           "not run on it (rebuild with its arch in TORCH_CUDA_ARCH_LIST, or a "
                           "+PTX arch)")
    padded = 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)
    if not reasons:
        need, allowed = _sm80_smem_bytes(padded), _smem_per_block(index)
        if 0 < allowed < need:
            reasons.append(f"head_dim={head_dim}: the backward kernel needs {need} bytes of "
                           f"shared memory per block, this GPU allows {allowed} "
                           "(e.g. sm_86/sm_89)")
    if not reasons:  # pragma: no cover - needs a CUDA build
        forward, notes = f"sm80_fwd_hdim{padded}_{dtype}", []
        if cap == (9, 0):
            why = _sm90_blockers(q, k, v, general, info)
            if why:
                notes.append("forward on the portable sm80 kernel, not the Hopper one, because "
                             + "; ".join(why))
            else:
                forward = f"sm90_fwd_hdim{padded}_{dtype}"
        why = _lean_bwd_blockers(padded, general, allowed)
        if why:
            notes.append("backward on the 4-warp sm80 kernels, not the faster 8-warp ones, "
                         "because " + "; ".join(why))
        return Plan(forward, f"sm80_bwd_hdim{padded}_{dtype}", True, notes=tuple(notes))
    return _unfused(FALLBACK, tuple(reasons))


def record(p: Plan, strict: Optional[bool], needs_grad: bool = False) -> None:
    """Applies the no-silent-fallback rule to a plan that is about to run.

    A forward fallback is noted here.  A backward fallback is noted by the backward itself when
    it runs (eagerly) or is traced (torch.compile, through the bwd op's fake kernel); here, with
    ``needs_grad``, strict mode only refuses it early, before any work.
    """
    global _last_plan
    _check_strict(strict)
    if not torch.compiler.is_compiling():
        # Not while tracing: inside activation checkpointing (a higher-order op) dynamo refuses
        # the write to a module global, and fullgraph=True would fail.
        _last_plan = p
    if not p.fused:
        note_fallback("; ".join(p.reasons), FALLBACK, strict)
    elif needs_grad and not p.backward_fused and strict_enabled(strict) \
            and not torch.compiler.is_compiling():
        note_fallback("backward: " + "; ".join(p.backward_reasons), p.backward_kernel, strict)


def note_fallback(reason: str, target: str, strict: Optional[bool] = None) -> None:
    """Raises in strict mode; else counts the fallback and warns once per reason."""
    target = target.removeprefix("fallback:")
    if strict_enabled(strict):
        raise FallbackError(
            f"flash_attn_ext strict mode: no fused kernel serves this call ({reason}); it would "
            f"run on {target}")
    if torch.compiler.is_compiling():
        return  # noted again where it runs: the compiled graph calls the same op
    _counts[reason] += 1
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flash_attn_ext: falling back to {target} because {reason}. "
                      "Set FLASH_ATTN_EXT_STRICT=1 to make this an error.", stacklevel=4)


def visible_keys(rows: range, seqlen_q: int, seqlen_k: int, window_left: int, window_right: int,
                 align_bottom_right: bool, device) -> torch.Tensor:
    """(len(rows), seqlen_k) bool, True where key j is visible to query row i (the rule of
    DESIGN.md section 2 and csrc/mask.h; causal already folded into window_right = 0)."""
    offset = seqlen_k - seqlen_q if align_bottom_right else 0
    i = torch.arange(rows.start, rows.stop, device=device)[:, None] + offset
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(len(rows), seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= j >= i - window_left
    if window_right >= 0:
        visible &= j <= i + window_right
    return visible


def fallback_attention(q, k, v, softmax_scale, window_left, window_right, align_bottom_right,
                       softcap, attn_bias=None, dropout_p=0.0):
    """Correct but unfused attention on q/k/v in (B, L, H, D) layout; returns (out, lse).

    Used only where no fused kernel exists (see :func:`plan`); follows the same semantics
    (diagonal offset, window, GQA, fully masked rows give out = 0 and lse = -inf).
    """
    if softcap > 0:
        raise NotImplementedError("softcap is not supported on the fallback path "
                                  f"({FALLBACK})")
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // max(k.shape[2], 1)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    if group > 1:
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(qh.to(acc), kh.to(acc).transpose(-1, -2)) * scale
    if window_left >= 0 or window_right >= 0:
        visible = visible_keys(range(seqlen_q), seqlen_q, seqlen_k, window_left, window_right,
                               align_bottom_right, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias.to(acc)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    out = torch.matmul(probs, vh.to(acc)).to(q.dtype).transpose(1, 2)
    return out, lse.to(ops.lse_dtype(q.dtype))
