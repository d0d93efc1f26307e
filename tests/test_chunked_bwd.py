"""The chunked PyTorch backward (the CUDA backward until its fused kernel exists) on the CPU."""

import pytest
import torch

import flash_attn_ext._chunked_bwd as chunked
from flash_attn_ext import ops


@pytest.mark.parametrize("causal,window,br,softcap", [
    (False, (-1, -1), True, 0.0), (True, (-1, -1), True, 0.0), (True, (-1, -1), False, 2.0),
    (False, (3, 2), True, 0.0), (True, (-1, -1), True, 0.0)])
def test_chunked_bwd_equals_fused_cpu_bwd(monkeypatch, causal, window, br, softcap):
    monkeypatch.setattr(chunked, "_CHUNK_BYTES", 4 * 2 * 4 * 23 * 5)  # several chunks
    q = torch.randn(2, 37, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 23, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 23, 2, 8, dtype=torch.float64)
    if br and causal:  # L > S bottom-right: fully masked rows too
        q = torch.randn(2, 37, 4, 16, dtype=torch.float64)
    args = (None, causal, window[0], window[1], br, softcap)
    out, lse, rng = ops.fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    fused = ops.bwd_op(dout, q, k, v, out, lse, rng, *args)
    ours = chunked.chunked_bwd(dout, q, k, v, out, lse, rng, *args)
    for a, b in zip(fused[:3], ours[:3]):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-12
