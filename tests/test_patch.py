"""flash_attn_ext.patch(): existing modules that call F.scaled_dot_product_attention use ours."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import flash_attn_ext
from flash_attn_ext import dispatch


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, mask=None, dropout_p=0.0):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask,
                                             dropout_p=dropout_p, is_causal=mask is None)
        return out.transpose(1, 2).reshape(b, n, d)


def test_patch_routes_and_undoes():
    original = F.scaled_dot_product_attention
    model = TinyAttention()
    x = torch.randn(2, 11, 32)
    ref = model(x)
    with flash_attn_ext.patch():
        assert flash_attn_ext.is_patched()
        dispatch._last_plan = None
        out = model(x)
        assert flash_attn_ext.last_plan().kernel == "cpu_flash_fwd_fp32"
        mask = torch.rand(2, 1, 1, 11) > 0.3
        out_masked = model(x, mask=mask)
    assert F.scaled_dot_product_attention is original and not flash_attn_ext.is_patched()
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(out_masked, model(x, mask=mask), atol=1e-5)
    handle = flash_attn_ext.patch()
    assert flash_attn_ext.is_patched()
    handle.undo()
    assert F.scaled_dot_product_attention is original


def test_patch_falls_back_visibly_for_dropout():
    dispatch.reset_fallback_counts()
    model = TinyAttention()
    with flash_attn_ext.patch(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(1, 5, 32), dropout_p=0.1)
    assert any("dropout_p > 0" in str(w.message) for w in caught)
    with flash_attn_ext.patch(), pytest.raises(flash_attn_ext.FallbackError):
        dispatch.set_strict(True)
        try:
            model(torch.randn(1, 5, 32), dropout_p=0.1)
        finally:
            dispatch.set_strict(None)
