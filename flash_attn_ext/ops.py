"""The ``torch.ops.flash_attn_ext`` ops: thin wrappers and fake (meta) kernels.

The ops themselves are defined in C++ (``csrc/ops.cpp``, ``TORCH_LIBRARY(flash_attn_ext, ...)``)
and implemented per device (``csrc/cpu``, ``csrc/cuda``), with their autograd in C++
(``csrc/autograd.cpp``: fwd's backward is the ``bwd`` op, recomputation from ``out`` and
``softmax_lse``, FlashAttention-2 Algorithm 2; ``bwd`` refuses double backward with a clear
error).  This module loads the compiled library and registers, next to thin wrappers, the fake
kernels, so that ``torch.compile`` and ``FakeTensor`` tracing know the output shapes.

Op layout is FlashAttention's: q (batch, seqlen_q, num_heads, head_dim), k
(batch, seqlen_k, num_heads_k, head_dim), v (batch, seqlen_k, num_heads_k, head_dim_v).
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    from . import _C
except ImportError as e:  # e.g. `import flash_attn_ext` from an unbuilt source checkout
    raise ImportError(
        "flash_attn_ext's compiled library (_C) could not be loaded: build it first (pip install "
        ". or make build, see README.md), or run from outside the source tree so that the "
        f"installed package is imported ({e})") from e

fwd_op = torch.ops.flash_attn_ext.fwd.default
bwd_op = torch.ops.flash_attn_ext.bwd.default


def _keep_random_calls_apart() -> None:
    """Stop AOTAutograd's common-subexpression pass from merging two fwd (or fwd_varlen) calls
    with identical arguments.  The pass spares only the aten random ops it lists (``rand_ops`` in
    ``torch._functorch.compile_utils``), not ops tagged ``nondeterministic_seeded`` as fwd is
    (its dropout mask comes from PyTorch's generator), so two dropout calls on the same inputs
    in one compiled training graph got one mask, and the second call's generator draw was
    lost (compiled differed from eager).  Listing the seeded ops there is what the pass does
    for ``aten.dropout``.  A PyTorch without that list (a private module) keeps the old behaviour;
    ``tests/test_dropout.py`` fails if this stops working."""
    try:
        from torch._functorch import compile_utils
    except ImportError:
        return
    rand_ops = getattr(compile_utils, "rand_ops", None)
    if not isinstance(rand_ops, list):
        return
    for packet in (torch.ops.flash_attn_ext.fwd, torch.ops.flash_attn_ext.fwd_varlen):
        if packet not in rand_ops:
            rand_ops.append(packet)


_keep_random_calls_apart()

# Read once: a constant for the dispatcher, so torch.compile never traces into the pybind call.
_BUILD_INFO = dict(_C.build_info())


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of softmax_lse for inputs of ``dtype``: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_alibi_slopes(alibi_slopes, q) -> None:
    """csrc/ops.cpp's rule for alibi_slopes, for the paths that do not reach it (fake kernels,
    the unfused path): None or a floating tensor on q's device of shape (num_heads,) or (batch,
    num_heads); ValueError otherwise.  A q of the wrong rank is left to q's own check."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor) or not alibi_slopes.is_floating_point():
        got = (f"dtype {alibi_slopes.dtype}" if isinstance(alibi_slopes, torch.Tensor)
               else type(alibi_slopes).__name__)
        raise ValueError(f"alibi_slopes must be a floating tensor (float32 as FlashAttention-2 "
                         f"takes it) or None, got {got}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on {q.device}, got {alibi_slopes.device}")
    if q.dim() != 4:
        return
    batch, heads = q.shape[0], q.shape[2]
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (num_heads,) = ({heads},) or (batch, "
                         f"num_heads) = ({batch}, {heads}), got {list(alibi_slopes.shape)}")


def _check_fake_args(q, k, v, attn_bias=None, **others):
    """The checks of csrc/ops.cpp that fake kernels can make (they serve torch.compile tracing
    and mixed meta/real calls, which never reach the C++ checks).  ``others``: the op's other
    tensor arguments by name (None where absent); every one must be on q's device, or a call
    mixing meta and real tensors would return meta-shaped garbage instead of an error."""
    for name, t in (("attn_bias", attn_bias),) + tuple(others.items()):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device} (the device of q)")
    check_alibi_slopes(others.get("alibi_slopes"), q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, num_heads, head_dim), "
                             f"got {name}.dim()={t.dim()} with shape {tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got q.device={q.device}, "
                         f"k.device={k.device}, v.device={v.device}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q, k and v must have the same floating dtype, got q.dtype={q.dtype}, "
                         f"k.dtype={k.dtype}, v.dtype={v.dtype}")


@torch.library.register_fake("flash_attn_ext::fwd")
def _fwd_fake(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1,
              align_bottom_right=True, softcap=0.0, alibi_slopes=None, attn_bias=None,
              dropout_p=0.0, deterministic=False):
    _check_fake_args(q, k, v, attn_bias, alibi_slopes=alibi_slopes)
    batch, seqlen_q, num_heads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, num_heads, v.shape[-1]))
    softmax_lse = q.new_empty((batch, num_heads, seqlen_q), dtype=lse_dtype(q.dtype))
    rng_state = q.new_empty((2,), dtype=torch.int64)
    return out, softmax_lse, rng_state


def _keeps_last_dim_innermost(t: torch.Tensor) -> bool:
    """Whether empty_like(t) has a unit-stride last dimension (new_output_like's test): no other
    dimension of size > 1 has a stride at or below the last one's (0: expanded)."""
    if not (t.size(-1) <= 1 or t.stride(-1) == 1):
        return False
    for d in range(t.dim() - 1):
        if t.size(d) > 1 and t.stride(d) <= 1:
            return False
    return True


def _cuda_kernel_ready(t: torch.Tensor) -> bool:
    """Whether the CUDA glue computes on the 4-D t as it is (``kernel_ready``): a unit-stride
    head dim that is a multiple of 8, the other strides multiples of 8 elements and the start
    16-byte aligned.  Otherwise it computes on a contiguous copy (its zero-padded head dim
    sliced off afterwards), and the gradients it returns for t are contiguous."""
    return (t.stride(3) == 1 and t.size(3) % 8 == 0
            and all(t.stride(i) % 8 == 0 for i in range(3))
            and t.storage_offset() * t.element_size() % 16 == 0)


def _grad_like(t: torch.Tensor) -> torch.Tensor:
    """An empty gradient laid out as the bwd op's device kernels lay out dq, dk, dv: like the
    tensor they compute on (``new_output_like``: ``empty_like``, which keeps a dense tensor's
    strides), so that autograd keeps it as ``.grad`` without a copy.  That tensor is t itself
    where the kernels take t as it is, else a contiguous copy: on the CPU when t's last dimension
    is not contiguous (``last_dim_contiguous``), on CUDA when t's strides, head dim or address
    are not multiples of 8 elements / 16 bytes (``kernel_ready``; its zero-padded head dims are
    sliced off into a contiguous gradient).  torch.compile compares these strides with the real
    kernels' (inductor asserts them), so both must agree."""
    if t.device.type == "cuda":
        if not _cuda_kernel_ready(t):
            return t.new_empty(t.shape)
    elif not (t.stride(-1) == 1 or t.size(-1) <= 1):
        return t.new_empty(t.shape)  # (the kernel computes on a contiguous copy)
    # new_output_like: empty_like where that keeps the last dimension innermost (an expanded
    # tensor gets a contiguous buffer instead).
    return torch.empty_like(t) if _keeps_last_dim_innermost(t) else t.new_empty(t.shape)


@torch.library.register_fake("flash_attn_ext::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, rng_state, softmax_scale=None, causal=False,
              window_left=-1, window_right=-1, align_bottom_right=True, softcap=0.0,
              alibi_slopes=None, attn_bias=None, dropout_p=0.0, deterministic=False,
              bias_requires_grad=False, dsoftmax_lse=None):
    _check_fake_args(q, k, v, attn_bias, dout=dout, out=out, softmax_lse=softmax_lse,
                     rng_state=rng_state, alibi_slopes=alibi_slopes, dsoftmax_lse=dsoftmax_lse)
    if attn_bias is not None and bias_requires_grad:
        dbias = attn_bias.new_empty(attn_bias.shape)
    else:
        dbias = q.new_empty((0,))
    return _grad_like(q), _grad_like(k), _grad_like(v), dbias


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float] = None,
        causal: bool = False, window_left: int = -1, window_right: int = -1,
        align_bottom_right: bool = True, softcap: float = 0.0,
        alibi_slopes: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0, deterministic: bool = False):
    """Calls ``torch.ops.flash_attn_ext.fwd``; returns ``(out, softmax_lse, rng_state)``."""
    return fwd_op(q, k, v, softmax_scale, causal, window_left, window_right, align_bottom_right,
                  softcap, alibi_slopes, attn_bias, dropout_p, deterministic)


def check_args(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p):
    """Runs the fwd op's argument checks without computing anything (raises on bad input)."""
    _C.check_args(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p)


@torch.compiler.allow_in_graph
def check_args_traced(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                      dropout_p):
    """check_args inside torch.compile: Dynamo puts the call into its graph instead of tracing
    into the C++ (which would break the graph), so it runs on the fake tensors while the graph
    is traced and bad input raises then (wrapped in Dynamo's TorchRuntimeError); the traced
    graph keeps no trace of it, so it costs nothing per call.  Skipped where a size or stride
    is symbolic (dynamic shapes), which the C++ checks cannot read."""
    if q.dtype not in _FLOAT_DTYPES:  # (a dtype is never symbolic: checked with dynamic shapes)
        raise ValueError(f"q.dtype={q.dtype} is not supported on {q.device.type}: CPU takes "
                         f"float32, float64, float16 and bfloat16; CUDA takes float16 and "
                         f"bfloat16 (float32 and float64 through the unfused fallback)")
    tensors = (q, k, v)
    if any(isinstance(x, torch.SymInt) for t in tensors for x in (*t.shape, *t.stride())):
        return
    check_args(q, k, v, softmax_scale, causal, window_left, window_right, softcap, dropout_p)


def build_info() -> dict:
    """How the compiled library was built: version, CUDA on/off and CUDA archs; and
    ``cpu_bf16_dot``: whether bf16 CPU calls multiply their tiles as bf16 (AVX512-BF16 found on
    this CPU at import and FLASH_ATTN_EXT_CPU_BF16_DOT not 0/false/no/off, which keep the fp32
    tiles; 1/true/yes/on or unset leave it to the CPU, and any other value makes the import
    raise ValueError; P and dS then rounded to bf16 as on CUDA), else as fp32 tiles through
    sgemm; ``cpu_bf16_amx``: whether those bf16 tiles
    run on AMX (PyTorch's brgemm, where it can pack bf16 for AMX, and
    FLASH_ATTN_EXT_CPU_BF16_AMX not 0/false/no/off; other values raise ValueError)."""
    return dict(_BUILD_INFO)
