"""FlashAttention-style API in (batch, seqlen, num_heads, head_dim) layout."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple, Union

import torch
import torch.autograd.forward_ad as fwad

from . import dispatch, ops


def _check_transforms(*tensors: torch.Tensor, dropout_p: float = 0.0) -> None:
    """Refuse what the op's autograd registration cannot do, instead of answering wrongly."""
    if torch.compiler.is_compiling():
        return
    dual = fwad._current_level >= 0  # a tensor can carry a tangent only inside a dual level
    functorch = torch._C._functorch.peek_interpreter_stack() is not None
    if not dual and not functorch:
        return  # no forward-AD level and no functorch transform active: the common case
    if dropout_p > 0 and functorch:
        from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
        interpreter = retrieve_current_functorch_interpreter()
        randomness = getattr(interpreter, "randomness", lambda: "different")()
        # vmap runs the op once per sample (PyTorch's fallback, which warns): every sample
        # draws its own mask, which is vmap's randomness="different" and nothing else.
        if randomness == "error":
            raise RuntimeError(
                "vmap: called random operation while in randomness error mode (dropout_p > 0 "
                "in flash_attn_ext). Please use randomness='different' on vmap, or dropout_p=0")
        if randomness == "same":
            raise NotImplementedError(
                "flash_attn_ext: dropout under vmap(randomness='same') is not supported: each "
                "sample draws its own mask (use randomness='different')")
    for t in tensors:
        if dual and fwad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                "flash_attn_ext does not support forward-mode AD (torch.func.jvp, "
                "torch.autograd.forward_ad): its tangent would be silently zero; use reverse mode "
                "(loss.backward(), torch.autograd.grad)")
        if torch._C._functorch.is_gradtrackingtensor(t):
            raise NotImplementedError(
                "flash_attn_ext does not support torch.func.grad/jacrev/jacfwd (functorch "
                "gradient transforms); use torch.autograd.grad or loss.backward()")


def autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype a tensor of the call runs in under torch.autocast (None: its own).
    scaled_dot_product_attention is on autocast's lower-precision list: every floating input
    except float64 is cast to the autocast dtype (float64 stays, as in PyTorch)."""
    device = t.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if not t.is_floating_point() or t.dtype in (torch.float64, dtype):
        return None
    return dtype


def _autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    # (autocast off on q's device, k and v there too: the common case, checked at once;
    # is_cuda/is_cpu are cheaper than device.type)
    device = "cuda" if q.is_cuda else "cpu" if q.is_cpu else None
    if (device is not None and not torch.is_autocast_enabled(device)
            and k.is_cuda == q.is_cuda and v.is_cuda == q.is_cuda
            and k.is_cpu == q.is_cpu and v.is_cpu == q.is_cpu):
        return q, k, v

    def cast(t):
        dtype = autocast_dtype(t)
        return t if dtype is None else t.to(dtype)
    return cast(q), cast(k), cast(v)


def as_number(x):
    """``x`` as a Python number when it is a real number PyTorch's function accepts in its
    place (a NumPy scalar, a 0-d real tensor); anything else unchanged, bools included, for the
    checks to refuse."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 and x.dtype != torch.bool and not x.is_complex():
            return x.item()
        return x
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, int, float)):
        return int(x) if isinstance(x, numbers.Integral) else float(x)
    return x


def check_scale(scale, name: str) -> Optional[float]:
    """A softmax scale as the kernels take it: None, or a finite real number (a Python or NumPy
    number or a 0-d real tensor, as PyTorch accepts); ValueError otherwise (bools included)."""
    if scale is None:
        return None
    scale = as_number(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{name} must be a finite number or a 0-d real tensor (None: "
                         f"1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def check_softcap(softcap) -> float:
    """ValueError unless ``softcap`` is a number (bools refused); the kernels check its range."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a number (0 = off), got {softcap!r}")
    return float(softcap)


def check_bool(value, name: str) -> bool:
    """ValueError unless ``value`` is a bool (so that e.g. the string "no" is not taken as True)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_flags(causal, window_size, dropout_p, causal_name: str = "causal") -> None:
    """Flag checks shared by flash_attn_func and scaled_dot_product_attention (ValueError)."""
    if not isinstance(causal, bool):
        raise ValueError(f"{causal_name} must be a bool, got {causal!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right), -1 = unbounded, "
                         f"got {window_size!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) \
            or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    for side, w in zip(("window_left", "window_right"), window_size):
        if w < -1:
            raise ValueError(f"{side} must be >= -1 (-1 = unbounded), got {w} "
                             f"(window_size={window_size!r})")
    if any(w > 2**63 - 1 for w in window_size):
        raise ValueError(f"window_size sides must fit in int64 (-1, or any length >= seqlen_q + "
                         f"seqlen_k, means unbounded), got {window_size!r}")


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: Optional[float],
        causal: bool, window_left: int, window_right: int, align_bottom_right: bool,
        softcap: float, dropout_p: float, deterministic: bool,
        strict: Optional[bool],
        attn_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plans and runs one attention call on (B, L, H, D) tensors; returns (out, softmax_lse).

    ``attn_bias``: additive float bias broadcastable to (B, H, L, S), or None.
    """
    _check_transforms(q, k, v, dropout_p=dropout_p)
    q, k, v = _autocast(q, k, v)
    p = dispatch.plan(q, k, v, softmax_scale,
                      dispatch.is_general(softcap, dropout_p, attn_bias is not None))
    if not torch.compiler.is_compiling():  # (only eager calls are recorded for last_plan())
        # last_plan() reports what explain() would: the backward's deterministic dQ path too.
        p = dispatch.deterministic_backward_note(p, deterministic)
    if not p.fused:
        # Same argument checks as the fused op, so bad input fails the same way on every path
        # (and is not reported as a fallback).
        check = ops.check_args_traced if torch.compiler.is_compiling() else ops.check_args
        check(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (attn_bias is not None and attn_bias.requires_grad))
    dispatch.record(p, strict, needs_grad)
    if p.fused:
        out, softmax_lse, _ = ops.fwd(q, k, v, softmax_scale, causal, window_left, window_right,
                                      align_bottom_right, softcap, None, attn_bias, dropout_p,
                                      deterministic)
        return out, softmax_lse
    return dispatch.fallback_attention(q, k, v, softmax_scale, window_left,
                                       0 if causal else window_right, align_bottom_right, softcap,
                                       attn_bias, dropout_p)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_softmax_lse: bool = False,
    *,
    return_attn_probs: bool = False,
    strict: Optional[bool] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention, computed the FlashAttention way, in (batch, seqlen, num_heads, head_dim).

    out = softmax(q k^T * softmax_scale + mask) v, computed tile by tile with the online softmax
    (Dao et al. 2022, arXiv:2205.14135, Algorithm 1; FlashAttention-2, arXiv:2307.08691,
    Algorithm 1): the (seqlen_q x seqlen_k) score matrix is never stored, memory is O(seqlen).
    The backward recomputes the probabilities from q, k and softmax_lse (Algorithm 2).

    Args:
        q: (batch, seqlen_q, num_heads, head_dim).
        k: (batch, seqlen_k, num_heads_k, head_dim); num_heads must be a multiple of num_heads_k
            (GQA/MQA: query head h reads key/value head h // (num_heads / num_heads_k); K/V are
            never repeated in memory).
        v: (batch, seqlen_k, num_heads_k, head_dim_v); head_dim_v may differ from head_dim.
            Any batch/seqlen/head strides; the last dimension should be contiguous (else copied).
            dtypes: float32, float64, float16, bfloat16 on CPU; float16, bfloat16 on CUDA.
            head_dim and head_dim_v: 1 to 256.
        dropout_p: dropout probability on the attention weights (after the softmax; kept
            weights are scaled by 1 / (1 - dropout_p)), inside the kernels with a counter-based
            Philox4x32-10 mask drawn from PyTorch's generator (``torch.manual_seed`` reproduces
            it; CUDA-graph capture works) and regenerated, not stored, by the backward.
            Applied whenever > 0, also in eval mode: pass 0.0 there.
        softmax_scale: multiplies q k^T; default 1 / sqrt(head_dim).
        causal: mask with bottom-right alignment (FlashAttention >= 2.1): query i sees key j
            when j <= i + seqlen_k - seqlen_q.
        window_size: (left, right) sliding window, bottom-right aligned: query i sees key j when
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 = no limit.
            With causal=True, right is 0.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before the softmax.
        alibi_slopes: not supported yet; must be None.
        deterministic: with True (or under torch.use_deterministic_algorithms(True)) gradients
            are bitwise reproducible run to run.  With False, plain attention (no softcap, mask
            or dropout) on CUDA's 8-warp backward kernels (every head dim on sm_90; up to 128
            on sm_80) uses FlashAttention-2's single backward kernel, which adds dq with fp32
            atomics (faster; dq's last bits vary with the summation order); everything else,
            and the CPU, is reproducible either way.
        return_softmax_lse: also return softmax_lse.
        return_attn_probs: FlashAttention-2's argument, for code written against it: with True
            the call returns (out, softmax_lse, None); the attention probabilities are never
            stored, so the third item is None.
        strict: raise :class:`flash_attn_ext.FallbackError` instead of falling back to an
            unfused path (default: ``FLASH_ATTN_EXT_STRICT``).

    Returns:
        out (batch, seqlen_q, num_heads, head_dim_v) in q's dtype; with return_softmax_lse also
        softmax_lse (batch, num_heads, seqlen_q), float32 (float64 for float64 inputs), the
        natural-log log-sum-exp of each row's scaled scores.  Rows that see no key get out = 0,
        softmax_lse = -inf and zero gradients.  softmax_lse is differentiable: a loss term on
        it (e.g. merging attention chunks) reaches q, k (and a float mask) exactly; the
        backward folds it into delta = rowsum(dO * O) - dlse.  With return_attn_probs:
        (out, softmax_lse, None).

    Raises:
        ValueError: wrong ranks, mismatched batch/heads/head_dim, head_dim outside 1..256,
            num_heads not a multiple of num_heads_k, dtype/device mismatch or unsupported dtype,
            window sides < -1, non-finite softmax_scale, softcap < 0, dropout_p outside [0, 1).
        NotImplementedError: alibi_slopes given (not implemented yet);
            forward-mode AD (torch.func.jvp) and torch.func gradient transforms.
        FallbackError: in strict mode, when no fused kernel serves the call.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_flags(causal, window_size, dropout_p)
    softmax_scale = check_scale(softmax_scale, "softmax_scale")
    softcap = check_softcap(softcap)
    check_bool(deterministic, "deterministic")
    check_bool(return_softmax_lse, "return_softmax_lse")
    check_bool(return_attn_probs, "return_attn_probs")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not implemented yet in flash_attn_ext; pass "
                                  "alibi_slopes=None")
    out, softmax_lse = run(q, k, v, softmax_scale=softmax_scale, causal=causal,
                           window_left=int(window_size[0]), window_right=int(window_size[1]),
                           align_bottom_right=True, softcap=softcap,
                           dropout_p=float(dropout_p),
                           deterministic=deterministic, strict=strict)
    if return_attn_probs:
        return out, softmax_lse, None
    return (out, softmax_lse) if return_softmax_lse else out
