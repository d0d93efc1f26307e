"""The one call path under both public faces (flash_attn_func, scaled_dot_product_attention):
argument checks, autocast, plan, record (the no-silent-fallback rule), run."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as fwad

from . import ops, planning, policy, unfused


def check_tensors(*named: Tuple[str, object]) -> None:
    """TypeError naming the first (name, value) whose value is not a torch.Tensor; ValueError
    for a nested tensor (the kernels' functions read dense strides: the op's own error named
    nothing but the op)."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            hint = (": pack the sequences into one (total, heads, head_dim) tensor and call "
                    "flash_attn_varlen_func with cu_seqlens, or call "
                    "torch.nn.functional.scaled_dot_product_attention"
                    if name in ("q", "k", "v", "qkv", "kv") else "; pass a dense tensor")
            raise ValueError(f"{name} is a nested tensor, which flash_attn_ext's functions do "
                             f"not take{hint}")


def check_devices(q: torch.Tensor, *named: Tuple[str, Optional[torch.Tensor]]) -> None:
    """ValueError naming the first (name, tensor) not on q's device (None skipped).  A call
    that mixes devices must say so: with a meta tensor among CPU ones PyTorch dispatches it to
    the fake kernel, which returns uninitialised memory of the right shape."""
    for name, t in named:
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")


def check_transforms(*tensors: torch.Tensor, dropout_p: float = 0.0) -> None:
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
    forward_mode = NotImplementedError(
        "flash_attn_ext does not support forward-mode AD (torch.func.jvp, "
        "torch.autograd.forward_ad): its tangent would be silently zero; use reverse mode "
        "(loss.backward(), torch.autograd.grad)")
    for t in tensors:
        if dual and fwad.unpack_dual(t).tangent is not None:
            raise forward_mode
        if torch._C._functorch.is_gradtrackingtensor(t):
            from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
            # (torch.func.jvp wraps its primals like grad does: name what it is)
            if retrieve_current_functorch_interpreter().key() == \
                    torch._C._functorch.TransformType.Jvp:
                raise forward_mode
            raise NotImplementedError(
                "flash_attn_ext does not support torch.func's gradient transforms (grad, vjp, "
                "jacrev, jacfwd, hessian); use torch.autograd.grad or loss.backward()")


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


def run_dtypes(tensors: Tuple[torch.Tensor, ...], names: Tuple[str, ...]) -> list:
    """The dtypes the call's q, k and v run in (after autocast's casts; under torch.autocast
    PyTorch's function takes, e.g., a float32 query with bfloat16 key and value: all run in
    bfloat16).  ValueError unless they are one, naming the dtypes passed (``names``: the
    caller's argument names) and, where autocast changed them, the cast ones."""
    dtypes = [autocast_dtype(t) or t.dtype for t in tensors]
    if not dtypes[0] == dtypes[1] == dtypes[2]:
        cast = "" if dtypes == [t.dtype for t in tensors] else \
            f" (under torch.autocast: {dtypes[0]}, {dtypes[1]} and {dtypes[2]})"
        got = ", ".join(f"{n}.dtype={t.dtype}" for n, t in zip(names, tensors))
        raise ValueError(f"{names[0]}, {names[1]} and {names[2]} must have the same dtype, got "
                         f"{got}{cast}")
    return dtypes


def autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    # (autocast off on q's device, k and v there too: the common case, checked at once;
    # is_cuda/is_cpu are cheaper than device.type)
    device = "cuda" if q.is_cuda else "cpu" if q.is_cpu else None
    if (device is not None and not torch.is_autocast_enabled(device)
            and k.is_cuda == q.is_cuda and v.is_cuda == q.is_cuda
            and k.is_cpu == q.is_cpu and v.is_cpu == q.is_cpu):
        return q, k, v

    # (checked here, naming the dtypes passed: the op would name only the cast ones)
    dtypes = run_dtypes((q, k, v), ("q", "k", "v"))
    return tuple(t if t.dtype == dtype else t.to(dtype) for t, dtype in zip((q, k, v), dtypes))


def as_number(x, name: str = "the argument"):
    """``x`` as a Python number when it is a real number PyTorch's function accepts in its
    place (a NumPy scalar, a 0-d real tensor); anything else unchanged, bools included, for the
    checks to refuse.  A 0-d tensor that requires grad (with grad enabled) raises ValueError
    naming ``name``: its value is read as a number, so it would get no gradient, silently."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 and x.dtype != torch.bool and not x.is_complex():
            if x.requires_grad and torch.is_grad_enabled():
                raise ValueError(f"{name} is a tensor that requires grad, but flash_attn_ext "
                                 f"takes it as a number and computes no gradient for it; pass "
                                 f"a float (or {name}.detach())")
            return x.item()
        return x
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, int, float)):
        return int(x) if isinstance(x, numbers.Integral) else float(x)
    return x


_FLOAT32_MAX = torch.finfo(torch.float32).max


def check_scale(scale, name: str) -> Optional[float]:
    """A softmax scale as the kernels take it: None, or a real number representable in float32
    (a Python or NumPy number or a 0-d real tensor, as PyTorch accepts; |scale| <= 3.4e38, the
    kernels' rule, checked here so that the error names the caller's argument); ValueError
    otherwise (bools included)."""
    if scale is None:
        return None
    scale = as_number(scale, name)
    # (Comparisons rather than math.isfinite: under torch.compile a symbolic scale, e.g. with
    # dynamic=True, traces through them and not through math.isfinite.)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymFloat)) or \
            not -math.inf < scale < math.inf:
        raise ValueError(f"{name} must be a finite number or a 0-d real tensor (None: "
                         f"1/sqrt(head_dim)), got {scale!r}")
    if not -_FLOAT32_MAX <= scale <= _FLOAT32_MAX:
        raise ValueError(f"{name} must be finite and representable in float32 (|{name}| <= "
                         f"{_FLOAT32_MAX:.4g}), got {scale!r}")
    return float(scale)


def check_softcap(softcap) -> float:
    """``softcap`` as a float (a Python or NumPy number or a 0-d real tensor); ValueError
    otherwise (bools refused); the kernels check its range."""
    softcap = as_number(softcap, "softcap")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, torch.SymFloat)):
        raise ValueError(f"softcap must be a number (0 = off), got {softcap!r}")
    return float(softcap)


def check_alibi(alibi_slopes, q: torch.Tensor) -> None:
    """ops.check_alibi_slopes (the op's rule: shape (num_heads,) or (batch, num_heads), floating,
    q's device; ValueError; TypeError for a non-tensor), and no gradient wanted: none is
    computed for the slopes, as in FlashAttention-2, and a silently missing gradient would be a
    wrong answer."""
    if alibi_slopes is not None:
        check_tensors(("alibi_slopes", alibi_slopes))
    ops.check_alibi_slopes(alibi_slopes, q)
    check_alibi_grad(alibi_slopes)


def check_alibi_grad(alibi_slopes) -> None:
    """ValueError if the slopes want a gradient (none is computed, as in FlashAttention-2: a
    silently missing gradient would be a wrong answer)."""
    if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("alibi_slopes requires grad, but flash_attn_ext computes no gradient "
                         "for the slopes (as FlashAttention-2); pass alibi_slopes.detach()")


def check_seqlen(value, name: str) -> int:
    """``value``, a sequence length, as an int >= 0 (a Python integer, a NumPy one or a 0-d
    integer tensor); ValueError otherwise (bools, floats and strings refused: a float would be
    truncated; a negative length, whose error was the op's "is shorter than the longest
    sequence" naming no rule a length breaks)."""
    value = as_number(value, name)
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    # (the op's int is 64-bit; under torch.compile the value may be symbolic, where the
    # comparisons would be guards on data: the op checks it against the offsets there)
    if type(value) is int and not torch.compiler.is_compiling():
        if not -2**63 <= value < 2**63:
            raise ValueError(f"{name} must fit in int64, got {value}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (a length: at least the longest "
                             f"sequence's), got {value}")
    return value


def check_bool(value, name: str, numpy_bool: bool = True) -> bool:
    """``value`` as a Python bool: a bool, or with ``numpy_bool`` a NumPy bool (``np.True_``,
    which FlashAttention-2's functions take: their op's bool arguments do); ValueError
    otherwise, ints included (so that e.g. the string "no" is not taken as True).
    ``numpy_bool=False`` where PyTorch's scaled_dot_product_attention refuses NumPy bools
    (is_causal, enable_gqa)."""
    if isinstance(value, bool):
        return value
    if numpy_bool and type(value).__module__ == "numpy" and \
            type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r}")


def check_flags(causal, window_size, dropout_p,
                causal_name: str = "causal") -> Tuple[Tuple[int, int], float]:
    """Flag checks shared by flash_attn_func and scaled_dot_product_attention (ValueError);
    ``causal`` must be a bool here (flash_attn_func's callers take a NumPy bool through
    check_bool first).
    Returns (window_size, dropout_p) as Python ints and a float: NumPy scalars and 0-d tensors
    are taken where PyTorch and FlashAttention-2 take them (the op's schema would not).
    dropout_p is in [0, 1]: 1 gives zeros (:func:`kernel_dropout`)."""
    if not isinstance(causal, bool):
        raise ValueError(f"{causal_name} must be a bool, got {causal!r}")
    dropout_p = as_number(dropout_p, "dropout_p")
    if isinstance(window_size, (tuple, list)):
        window_size = tuple(as_number(w) for w in window_size)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right), -1 = unbounded, "
                         f"got {window_size!r}")
    # (A symbolic dropout_p, torch.compile(dynamic=True) through nn.MultiheadAttention, passes
    # the comparisons and becomes a float, a guard, as a symbolic scale does in check_scale.)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, torch.SymFloat)) \
            or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    for side, w in zip(("window_left", "window_right"), window_size):
        if w < -1:
            raise ValueError(f"{side} must be >= -1 (-1 = unbounded), got {w} "
                             f"(window_size={window_size!r})")
    if any(w > 2**63 - 1 for w in window_size):
        raise ValueError(f"window_size sides must fit in int64 (-1, or any length >= seqlen_q + "
                         f"seqlen_k, means unbounded), got {window_size!r}")
    return (int(window_size[0]), int(window_size[1])), float(dropout_p)


def kernel_dropout(dropout_p: float) -> Tuple[float, bool]:
    """(the dropout_p the kernels run with, whether the call drops every weight) for a
    dropout_p that check_flags took ([0, 1]).  dropout_p = 1 drops every weight: PyTorch's
    scaled_dot_product_attention and nn.Dropout(p=1.0) answer zeros, and so does every function
    here, while the kernels take [0, 1).  Such a call runs the kernels without dropout and
    :func:`dropped` multiplies its out by 0: zeros, with zero gradients (a NaN or inf in out
    stays NaN, as in PyTorch's dropout); its softmax_lse is the undropped softmax's, as at every
    dropout_p (the kernels' own at dropout_p >= 1 - 1/512, where they drop every weight too)."""
    return (0.0, True) if dropout_p == 1.0 else (dropout_p, False)


def dropped(out: torch.Tensor, drop_all: bool) -> torch.Tensor:
    """out of a call, zeroed where it drops every weight (:func:`kernel_dropout`)."""
    return out * 0.0 if drop_all else out


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: Optional[float],
        causal: bool, window_left: int, window_right: int, align_bottom_right: bool,
        softcap: float, dropout_p: float, deterministic: bool,
        strict: Optional[bool],
        attn_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plans and runs one attention call on (B, L, H, D) tensors; returns (out, softmax_lse).

    ``attn_bias``: additive float bias or boolean mask (True = attend) broadcastable to
    (B, H, L, S), or None;
    ``alibi_slopes``: (H,) or (B, H) (checked by check_alibi), or None;
    ``dropout_p``: in [0, 1] (1: zeros, see :func:`kernel_dropout`).
    """
    dropout_p, drop_all = kernel_dropout(dropout_p)
    # (the mask and the slopes too: a tangent on them alone reached autograd's own error,
    # naming neither forward-mode AD nor flash_attn_ext; a new-user finding)
    check_transforms(q, k, v, *(t for t in (attn_bias, alibi_slopes) if t is not None),
                     dropout_p=dropout_p)
    q, k, v = autocast(q, k, v)
    p = planning.plan(q, k, v, softmax_scale,
                      planning.score_mods(softcap, dropout_p, attn_bias, alibi_slopes),
                      unequal_tiles=causal or window_left >= 0 or window_right >= 0,
                      deterministic=deterministic)
    if not p.fused:
        # Same argument checks as the fused op, so bad input fails the same way on every path
        # (and is not reported as a fallback).
        check = ops.check_args_traced if torch.compiler.is_compiling() else ops.check_args
        check(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (attn_bias is not None and attn_bias.requires_grad))
    # (a fused call's plan becomes last_plan() once its op has checked its arguments: a call
    # they refuse never ran)
    policy.record(p, strict, needs_grad, remember_now=not p.fused)
    if p.fused:
        out, softmax_lse, _ = ops.fwd(q, k, v, softmax_scale, causal, window_left, window_right,
                                      align_bottom_right, softcap, alibi_slopes, attn_bias,
                                      dropout_p, deterministic)
        policy.remember(p)
        return dropped(out, drop_all), softmax_lse
    out, softmax_lse = unfused.fallback_attention(q, k, v, softmax_scale, window_left,
                                                  0 if causal else window_right,
                                                  align_bottom_right, softcap, attn_bias,
                                                  dropout_p, alibi_slopes)
    return dropped(out, drop_all), softmax_lse
