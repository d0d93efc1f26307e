"""The no-silent-slow-path rule (docs/design.md section 4): strict mode, counters,
warn-once.

Every call is planned (flash_attn_ext.planning).  A call that no fused flash_attn_ext kernel can
serve runs on a correct fallback (flash_attn_ext.unfused), and then

* a warning names the reason, once per reason per process;
* ``fallback_counts()`` counts it;
* strict mode turns it into a :class:`FallbackError` instead.  Strict mode is on when the call
  passes ``strict=True``, after ``set_strict(True)``, or with the environment variable
  ``FLASH_ATTN_EXT_STRICT=1`` (read once, at import).
"""

from __future__ import annotations

import collections
import os
import sys
import warnings
from typing import Optional

import torch

from .planning import FALLBACK, Plan

__all__ = ["FallbackError", "set_strict", "strict_enabled", "fallback_counts",
           "reset_fallback_counts", "last_plan", "record", "remember", "note_fallback"]


class FallbackError(RuntimeError):
    """Raised in strict mode when a call cannot run on a fused flash_attn_ext kernel."""


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


def check_strict(strict) -> None:
    """ValueError unless a call's ``strict`` is True, False or None (a string like "no" is not
    taken as True)."""
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"strict must be True, False or None, got {strict!r}")


def _read_strict_env() -> bool:
    """FLASH_ATTN_EXT_STRICT, read once when flash_attn_ext is imported: 1/true/yes/on (strict)
    or 0/false/no/off/unset; any other value raises ValueError (it must not quietly leave strict
    mode off)."""
    raw = os.environ.get("FLASH_ATTN_EXT_STRICT", "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"FLASH_ATTN_EXT_STRICT must be 1, true, yes or on (strict) or 0, false, "
                     f"no, off or unset (not strict), got {raw!r}")


_env_strict: bool = _read_strict_env()


def strict_enabled(strict: Optional[bool] = None) -> bool:
    """Whether a fallback raises: the call's ``strict``, else ``set_strict``, else
    FLASH_ATTN_EXT_STRICT as it was when flash_attn_ext was imported."""
    check_strict(strict)
    if strict is not None:
        return strict
    if _strict_override is not None:
        return _strict_override
    return _env_strict


def fallback_counts() -> dict:
    """How many calls fell back, per reason, since the process started (or the last reset)."""
    return dict(_counts)


def reset_fallback_counts() -> None:
    """Clears the fallback counters and the warn-once memory."""
    _counts.clear()
    _warned.clear()


def last_plan() -> Optional[Plan]:
    """The plan of the most recent eager call that got past its argument checks.  A call that
    raises on a bad argument (the kernels' op's own checks included) leaves it as it was: it
    never describes a call that did not run.  A call whose fallback strict mode refuses is
    recorded (``FallbackError``): its plan, whose reasons the error names, as ``explain()``
    returns it.  Calls inside torch.compile are not recorded (``explain()`` gives their plan;
    strict mode still refuses their fallbacks when traced)."""
    return _last_plan


def remember(p: Plan) -> None:
    """Makes ``p`` the plan last_plan() returns, for an eager call (see :func:`record`)."""
    global _last_plan
    if not torch.compiler.is_compiling():
        # Not while tracing: inside activation checkpointing (a higher-order op) dynamo refuses
        # the write to a module global, and fullgraph=True would fail.
        _last_plan = p


def record(p: Plan, strict: Optional[bool], needs_grad: bool = False,
           remember_now: bool = True) -> None:
    """Applies the no-silent-fallback rule to a plan that is about to run.

    A forward fallback is noted here.  A backward fallback is noted by the backward itself when
    it runs (eagerly) or is traced (torch.compile, through the bwd op's fake kernel); here, with
    ``needs_grad``, strict mode only refuses it early, before any work.
    ``remember_now=False``: the call's op has still to check its arguments (a fused call is
    recorded before its op runs, so that strict mode refuses before any work), and the caller
    calls :func:`remember` once the op has returned, so that a call the op refuses is not
    last_plan(); a plan that strict mode refuses here is remembered all the same.
    """
    check_strict(strict)
    if remember_now:
        remember(p)
    if not p.fused:
        note_fallback("; ".join(p.reasons),
                      p.kernel if p.kernel.startswith("fallback:") else FALLBACK, strict)
    elif needs_grad and not p.backward_fused and strict_enabled(strict) \
            and not torch.compiler.is_compiling():
        remember(p)  # (refused: named by last_plan() as a refused forward fallback is)
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
        # At the caller's line, as warnings.warn(stacklevel=...) would put it, but with a
        # registry of its own: Python's per-line memory (the "default" action) would hide the
        # warning again after reset_fallback_counts(), which promises it anew.  The user's
        # filters ("ignore", "error", "once") still apply.
        frame = _caller_frame()
        warnings.warn_explicit(f"flash_attn_ext: falling back to {target} because {reason}. "
                               + _strict_hint(strict),
                               UserWarning, frame.f_code.co_filename, frame.f_lineno,
                               module=frame.f_globals.get("__name__"), registry={})


def _strict_hint(strict: Optional[bool]) -> str:
    """How to make a fallback an error, given what turned strict mode off (the variable alone
    read wrong when it was set and a call's strict=False or set_strict(False) overrode it: a
    new-user finding)."""
    if strict is False:
        return ("This call passed strict=False (strict=True makes this an error"
                + (", as FLASH_ATTN_EXT_STRICT=1 would without it)." if _env_strict else ")."))
    if _strict_override is False:
        return "set_strict(False) is in effect (set_strict(True) makes this an error)."
    return "Set FLASH_ATTN_EXT_STRICT=1 to make this an error."


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_frame():
    """The first frame outside flash_attn_ext: the line that called the attention (the depth
    from there to note_fallback differs by path: flash_attn_func, the SDPA drop-in, patch(),
    the backward); the outermost frame where every frame is ours (called from C++ alone, as
    autograd's engine may)."""
    frame = sys._getframe(1)
    while os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR) and \
            frame.f_back is not None:
        frame = frame.f_back
    return frame
