"""Repro: an argument error raised by the C++ CPU kernel (used to debug a crash on one build)."""
import torch

import flash_attn_ext

q = torch.randn(1, 4, 2, 8)
try:
    flash_attn_ext.ops.fwd(q[0], q, q)
except ValueError as e:
    print("OK, raised:", str(e).splitlines()[0])
