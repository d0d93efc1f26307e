"""flash_attn_with_kvcache: on the CPU the in-place append, rotary embeddings, per-entry lengths,
left padding and batch indices, against a float64 reference of each entry's attention; on CUDA
the same call against the CPU's answer."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flash_attn_ext
from flash_attn_ext import flash_attn_with_kvcache
from reference import assert_lse_infinities, attention_ref, fuzz_settings

HAS_CUDA = torch.cuda.is_available() and flash_attn_ext.ops.build_info()["cuda"]


def _rotary_ref(x, cos, sin, positions, interleaved):
    """The rotary embedding written out per channel pair (FlashAttention's definition)."""
    out = x.clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            c, s = cos[positions[b][i]], sin[positions[b][i]]
            for j in range(half):
                a, bb = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
                x1, x2 = x[b, i, :, a], x[b, i, :, bb]
                out[b, i, :, a] = x1 * c[j] - x2 * s[j]
                out[b, i, :, bb] = x1 * s[j] + x2 * c[j]
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
@pytest.mark.parametrize("layout", ["plain", "leftpad", "batch_idx"])
def test_append_then_attend_matches_each_entry(causal, rotary, layout):
    torch.manual_seed(0)
    batch, seqlen_q, new, cache_len, heads, heads_k, d = 3, 2, 2, 24, 4, 2, 16
    f64 = torch.float64
    q = torch.randn(batch, seqlen_q, heads, d, dtype=f64)
    k, v = (torch.randn(batch, new, heads_k, d, dtype=f64) for _ in "kv")
    k_cache, v_cache = (torch.randn(batch + 1, cache_len, heads_k, d, dtype=f64) for _ in "kv")
    seqlens = torch.tensor([5, 0, 17], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 7], dtype=torch.int32) if layout == "leftpad" else None
    idx = torch.tensor([2, 0, 3]) if layout == "batch_idx" else None
    cos = sin = None
    if rotary is not None:
        angles = torch.rand(cache_len, 4, dtype=f64) * 6
        cos, sin = angles.cos(), angles.sin()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    entries = idx if idx is not None else torch.arange(batch)
    positions = seqlens.long()[:, None] + torch.arange(new)
    k_rot = k if cos is None else _rotary_ref(k, cos, sin, positions, rotary == "interleaved")
    for b in range(batch):
        want_k[entries[b], seqlens[b]:seqlens[b] + new] = k_rot[b]
        want_v[entries[b], seqlens[b]:seqlens[b] + new] = v[b]
    q_rot = q if cos is None else _rotary_ref(
        q, cos, sin, positions if causal else seqlens.long()[:, None].expand(batch, seqlen_q),
        rotary == "interleaved")

    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cache_batch_idx=idx, cache_leftpad=leftpad, causal=causal,
        rotary_interleaved=rotary == "interleaved", return_softmax_lse=True)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # appended in place
    assert lse.shape == (batch, heads, seqlen_q)
    for b in range(batch):
        lo = 0 if leftpad is None else int(leftpad[b])
        hi = int(seqlens[b]) + new
        ref, ref_lse = attention_ref(q_rot[b:b + 1], want_k[entries[b]][None, lo:hi],
                                     want_v[entries[b]][None, lo:hi], causal=causal)
        assert (out[b] - ref[0]).abs().max().item() < 1e-12
        assert (lse[b] - ref_lse[0]).abs().max().item() < 1e-12


def test_without_new_keys_a_full_cache_by_default():
    q = torch.randn(2, 1, 2, 8)
    k_cache, v_cache = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    out = flash_attn_with_kvcache(q, k_cache, v_cache)
    ref, _ = attention_ref(q, k_cache, v_cache)
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_errors_name_the_rule():
    q = torch.randn(1, 1, 2, 8)
    k_cache, v_cache = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    new = torch.randn(1, 2, 2, 8)
    with pytest.raises(ValueError, match="cache_seqlens \\+ seqlen_new must be in"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=3)
    with pytest.raises(ValueError, match="k and v must be given together"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new)
    # New keys without cache_seqlens: the missing argument named (new-user trial: the message
    # was about cache_seqlens + seqlen_new, an argument the call did not pass; on CUDA the rows
    # came back NaN); a new k that is not a tensor named (was an AttributeError).
    with pytest.raises(ValueError, match="k and v .* need cache_seqlens.*got cache_seqlens=None"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        flash_attn_with_kvcache(q, k_cache, v_cache, [1.0], new, cache_seqlens=1)
    with pytest.raises(ValueError, match="block_table must be"):
        flash_attn_with_kvcache(q, k_cache, v_cache, block_table=torch.zeros(1, 1))
    # Lists for rotary tables and slopes named (were AttributeErrors).
    table = [[1.0] * 4] * 8
    with pytest.raises(TypeError, match="rotary_cos must be a torch.Tensor, got list"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, rotary_cos=table,
                                rotary_sin=torch.zeros(8, 4), cache_seqlens=1)
    with pytest.raises(TypeError, match="rotary_sin must be a torch.Tensor, got list"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, rotary_cos=torch.ones(8, 4),
                                rotary_sin=table, cache_seqlens=1)
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor, got list"):
        flash_attn_with_kvcache(q, k_cache, v_cache, alibi_slopes=[0.5, 0.25])
    # Integer rotary tables were taken as they were (a table of 0s and 1s; new-user trial).
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be floating tensors, "
                                         "got torch.int32 and torch.int32"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=1,
                                rotary_cos=torch.ones(8, 2, dtype=torch.int32),
                                rotary_sin=torch.zeros(8, 2, dtype=torch.int32))
    # One table without the other, and two tables too wide, each named by its own rule (the
    # second said "must be given together"; a new-user finding).
    with pytest.raises(ValueError, match=r"must be given together, got \(8, 2\) and None"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=1,
                                rotary_cos=torch.ones(8, 2))
    wide = torch.ones(8, q.shape[-1])
    with pytest.raises(ValueError, match=r"must both be \(seqlen_ro, rotary_dim / 2\) with "
                                         r"rotary_dim <= head_dim"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=1,
                                rotary_cos=wide, rotary_sin=wide)
    # num_splits as a NumPy int or a 0-d tensor, as the other numbers (was a ValueError).
    ref = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3)
    for num_splits in (np.int64(2), torch.tensor(2)):
        assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3,
                                                   num_splits=num_splits), ref)
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, num_splits=2.5)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(num_heads,\) = "
                                         r"\(2,\) or \(batch, num_heads\) = \(1, 2\), got \[3\]"):
        flash_attn_with_kvcache(q, k_cache, v_cache, alibi_slopes=torch.ones(3))
    with pytest.raises(NotImplementedError, match="runs on CPU and CUDA tensors"):
        flash_attn_with_kvcache(q.to("meta"), k_cache.to("meta"), v_cache.to("meta"))
    # (a length tensor on the meta device has no values to read: named, not PyTorch's copy
    # error)
    for name in ("cache_seqlens", "cache_leftpad", "cache_batch_idx"):
        kw = dict(cache_seqlens=2)
        kw[name] = torch.zeros(1, dtype=torch.int32, device="meta")
        with pytest.raises(ValueError, match=f"{name} must be on q's device \\(cpu\\) or on "
                                             f"the CPU, got meta"):
            flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    # Head counts and head dims named by the cache, not by the kernels' dense k.
    with pytest.raises(ValueError, match=r"q.shape\[2\]=3 and num_heads_k k_cache.shape\[2\]=2"):
        flash_attn_with_kvcache(torch.randn(1, 1, 3, 8), k_cache, v_cache)
    with pytest.raises(ValueError, match=r"k_cache.shape\[3\] \(head_dim\) must equal q.shape"):
        flash_attn_with_kvcache(torch.randn(1, 1, 2, 16), k_cache, v_cache)


def test_a_cache_of_no_heads_is_refused_by_its_own_rule():
    # k_cache with no key/value heads was reported as a GQA divisibility error ("q.shape[2]=0
    # and num_heads_k k_cache.shape[2]=0" for q of no heads too); q of no heads against a cache
    # with heads gives an empty output (and appends), as in flash_attn_func.
    import re

    empty = torch.zeros(2, 8, 0, 16)
    new = torch.ones(2, 1, 0, 16)
    for heads in (0, 4):
        q = torch.randn(2, 1, heads, 16)
        for kv in ((), (new, new)):
            with pytest.raises(ValueError, match=re.escape(
                    f"k_cache.shape[2] (num_heads_k) must be >= 1, got 0 (q.shape[2]={heads} "
                    f"query heads)")):
                flash_attn_with_kvcache(q, empty, empty.clone(), *kv, cache_seqlens=3)
    k_cache, v_cache = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    new = torch.ones(2, 1, 2, 16)
    out, lse = flash_attn_with_kvcache(torch.randn(2, 1, 0, 16), k_cache, v_cache, new, new,
                                       cache_seqlens=3, return_softmax_lse=True)
    assert out.shape == (2, 1, 0, 16) and lse.shape == (2, 0, 1)
    assert torch.equal(k_cache[:, 3], new[:, 0]) and torch.equal(v_cache[:, 3], new[:, 0])
    assert flash_attn_ext.flash_attn_func(torch.randn(2, 1, 0, 16), k_cache,
                                          v_cache).shape == (2, 1, 0, 16)


def test_bad_appends_and_indices_raise_before_writing():
    # What indexing would otherwise accept silently (a batch-1 k broadcast into every entry, a
    # negative cache_batch_idx wrapping around, a dtype cast) or report without naming the
    # argument: each raises ValueError naming it, and the caches are left untouched.
    q = torch.randn(2, 1, 4, 32)
    k_cache, v_cache = torch.zeros(2, 8, 2, 32), torch.zeros(2, 8, 2, 32)
    new = torch.randn(2, 3, 2, 32)
    cases = [
        (dict(k=new[:1], v=new[:1], cache_seqlens=1), "k must be \\(batch, seqlen_new"),
        (dict(k=torch.randn(2, 3, 4, 32), v=new, cache_seqlens=1), "k must be"),
        (dict(k=new, v=torch.randn(2, 3, 2, 16), cache_seqlens=1), "v must be"),
        (dict(k=new.half(), v=new, cache_seqlens=1), "k must have k_cache's dtype"),
        (dict(k=new, v=new, cache_seqlens=1, cache_batch_idx=torch.tensor([0, -1])),
         "cache_batch_idx entries must be in \\[0, 2\\)"),
        (dict(cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)),
         "cache_batch_idx entries must be in \\[0, 2\\)"),
        (dict(k=new, v=new, cache_seqlens=1, cache_batch_idx=torch.tensor([1, 1])),
         "cache_batch_idx entries must be distinct"),
        (dict(k=new, v=new, cache_seqlens=torch.tensor([2**32 + 1, 1])),
         "cache_seqlens must fit in int32"),
        (dict(cache_batch_idx=torch.tensor([0.0, 1.0])), "cache_batch_idx must be"),
        (dict(k=new, v=new, cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32)),
         "cache_seqlens must be >= 0"),
        (dict(k=new, v=new, cache_seqlens=1, rotary_cos=torch.ones(16, 20),
              rotary_sin=torch.ones(16, 20)), "rotary_dim <= head_dim"),
        (dict(k=new, v=new, cache_seqlens=1, rotary_cos=torch.ones(2, 8),
              rotary_sin=torch.ones(2, 8)), "seqlen_ro"),
        (dict(k=new, v=new, cache_seqlens=1, rotary_cos=torch.ones(16, 8)), "together"),
        (dict(k=new, v=new, cache_seqlens=1, num_splits=-1), "num_splits must be an int >= 0"),
        (dict(k=new, v=new, cache_seqlens=1, num_splits=2.0), "num_splits must be an int"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        assert not k_cache.any() and not v_cache.any(), kwargs


def test_strict_is_taken_as_flash_attn_func_takes_it():
    # flash_attn_with_kvcache lacked flash_attn_func's strict= (new-user trial).  No call of it
    # falls back (the CUDA decode kernels or the packed-sequence kernels serve every call, or it
    # raises), so strict=True, and strict mode set for the process, leave the answer and the
    # append as they are, with no warning and nothing counted; the value is checked by
    # flash_attn_func's rule (policy.check_strict), before anything is appended.
    import re
    import warnings

    from flash_attn_ext import policy
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    cache = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)

    def call(**kw):
        k_cache, v_cache = (c.clone() for c in cache)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, causal=True,
                                      **kw)
        return out, k_cache, v_cache

    want = call()
    policy.reset_fallback_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for strict in (None, False, True):
            assert all(torch.equal(a, b) for a, b in zip(call(strict=strict), want))
        policy.set_strict(True)
        try:
            assert all(torch.equal(a, b) for a, b in zip(call(), want))
        finally:
            policy.set_strict(None)
    assert policy.fallback_counts() == {}
    for bad in ("no", 1):
        k_cache, v_cache = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
        with pytest.raises(ValueError, match=re.escape(
                f"strict must be True, False or None, got {bad!r}")):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, strict=bad)
        assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("flags,match", [
    (dict(causal="False"), "causal must be a bool, got 'False'"),
    (dict(window_size=[2.7, 0]), "window_size must be a pair of ints"),
    (dict(softcap="1"), "softcap must be a number"),
    (dict(rotary_interleaved=None), "rotary_interleaved must be a bool"),
    (dict(return_softmax_lse="yes"), "return_softmax_lse must be a bool"),
    (dict(alibi_slopes=torch.ones(2, requires_grad=True)), "alibi_slopes requires grad")])
def test_flags_are_checked_as_flash_attn_func_checks_them(flags, match):
    q = torch.randn(1, 3, 2, 16)
    k_cache, v_cache = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, **flags)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_cache_lengths_take_one_set_of_types_on_every_route(device):
    # cache_seqlens and cache_leftpad: an int, or an int32 / int64 tensor of shape (batch,) or
    # () (new-user trial: a list or a NumPy array was taken on the CPU and refused by the CUDA
    # decode route, and int16 was refused as "not an integer tensor").  bf16 on CUDA takes the
    # decode route, the CPU the packed-sequence one.
    np = pytest.importorskip("numpy")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(2, 1, 2, 16, device=device, dtype=dtype)
    k_cache, v_cache = (torch.randn(2, 8, 2, 16, device=device, dtype=dtype) for _ in "kv")
    want = flash_attn_with_kvcache(q, k_cache, v_cache,
                                   cache_seqlens=torch.tensor([5, 5], dtype=torch.int32))
    for good in (5, torch.tensor(5), torch.tensor([5, 5]), torch.tensor([5, 5], device=device),
                 torch.tensor([5, 5], dtype=torch.int32, device=device)):
        got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=good)
        assert torch.equal(got, want), good
    for name in ("cache_seqlens", "cache_leftpad"):
        kw = dict(cache_seqlens=5) if name == "cache_leftpad" else {}
        for bad, what in (([5, 5], "list"), ((5, 5), "tuple"), (np.array([5, 5]), "numpy.ndarray"),
                          (np.int64(5), "numpy.int64"), (True, "bool"), (5.0, "float"),
                          (torch.tensor([5, 5], dtype=torch.int16), "torch.int16 of shape"),
                          (torch.tensor([5.0, 5.0]), "torch.float32 of shape")):
            with pytest.raises(ValueError, match=f"{name} must be an int or a \\(batch,\\) = "
                                                 f"\\(2,\\) int32 or int64 tensor, got {what}"):
                flash_attn_with_kvcache(q, k_cache, v_cache, **{name: bad}, **kw)


def test_bad_caches_and_shared_pages_raise_naming_them():
    # Raw reshape/index errors before; a shared page appended to by two rows lost one's k/v.
    q = torch.randn(2, 1, 2, 16)
    k_cache, v_cache = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    with pytest.raises(ValueError, match="v_cache must match k_cache"):
        flash_attn_with_kvcache(q, k_cache, torch.zeros(2, 7, 2, 16))
    with pytest.raises(ValueError, match="k_cache needs an entry per batch row"):
        flash_attn_with_kvcache(q, k_cache[:1], v_cache[:1])
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        flash_attn_with_kvcache([q], k_cache, v_cache)
    with pytest.raises(TypeError, match="block_table must be a torch.Tensor, got list"):
        flash_attn_with_kvcache(q, k_cache, v_cache, block_table=[[0], [1]])
    with pytest.raises(TypeError, match="cache_batch_idx must be a torch.Tensor, got int"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=1)
    # (a string was PyTorch's "new(): invalid data type 'str'")
    with pytest.raises(ValueError, match="cache_seqlens must be an int or a .* got str"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens="3")
    new = torch.randn(2, 1, 2, 16)
    with pytest.raises(ValueError, match="map to the same page row"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=3,
                                block_table=torch.zeros(2, 1, dtype=torch.int32))
    assert not k_cache.any() and not v_cache.any()


def test_appending_into_an_expanded_cache_raises():
    # An expanded cache shares memory between entries: the append wrote entry 0's and entry
    # 1's keys into one row, and entry 1 attended to entry 0's key (new-user trial).
    base = torch.zeros(1, 10, 1, 4, dtype=torch.float64)
    new = torch.randn(2, 1, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"k_cache has a dimension of stride 0"):
        flash_attn_with_kvcache(torch.randn(2, 1, 1, 4, dtype=torch.float64),
                                base.expand(2, 10, 1, 4), torch.zeros(2, 10, 1, 4,
                                                                      dtype=torch.float64),
                                new, new, cache_seqlens=torch.tensor([2, 5], dtype=torch.int32))
    assert not base.any()
    # Reading an expanded cache (no append) is fine.
    out = flash_attn_with_kvcache(torch.randn(2, 1, 1, 4, dtype=torch.float64),
                                  base.expand(2, 10, 1, 4), base.expand(2, 10, 1, 4))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_q_gets_its_gradient(interleaved):
    # q was rotated under torch.no_grad: its gradient was dropped without a word, and with
    # only q requiring grad the output had none (new-user trial).
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    k_cache, v_cache = torch.randn(2, 10, 2, 8, dtype=torch.float64), \
        torch.randn(2, 10, 2, 8, dtype=torch.float64)
    angles = torch.rand(12, 2, dtype=torch.float64)
    kw = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=interleaved,
              cache_seqlens=torch.tensor([3, 6], dtype=torch.int32), causal=True)
    assert torch.autograd.gradcheck(
        lambda q: flash_attn_with_kvcache(q, k_cache, v_cache, **kw), (q,))


def test_rotary_tables_need_rows_only_for_the_rotated_positions():
    # Without causal or a window every query is rotated at cache_seqlens: seqlen_ro =
    # cache_seqlens + 1 suffices for 4 queries; causal rotates query i at cache_seqlens + i.
    q = torch.randn(1, 4, 2, 32, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(1, 8, 2, 32, dtype=torch.float64) for _ in "kv")
    angles = torch.rand(7, 8, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=6)
    # (every query rotated at position 6, interleaved pairs: FlashAttention-2's default; the
    # cache's first 6 keys, which are not rotated without k and v)
    want, _ = attention_ref(_rotary_ref(q, cos, sin, [[6] * 4], True), k_cache[:, :6],
                            v_cache[:, :6])
    assert (out - want).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="cache_seqlens \\+ 4 = 10, got seqlen_ro = 7"):
        flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin,
                                cache_seqlens=6, causal=True)


@pytest.mark.parametrize("page", [1, 16, 48])
def test_paged_cache_equals_the_contiguous_one(page):
    # The same caches, once contiguous and once as shuffled pages of `page` rows (any size):
    # the same output, and the appended rows land in the right pages.
    torch.manual_seed(1)
    batch, blocks, heads_k, d = 2, 96 // page, 2, 8
    k_cache, v_cache = (torch.randn(batch, blocks * page, heads_k, d) for _ in "kv")
    perm = torch.randperm(batch * blocks)
    table = perm.reshape(batch, blocks).to(torch.int32)
    k_pages, v_pages = (torch.empty(batch * blocks, page, heads_k, d) for _ in "kv")
    k_pages[perm] = k_cache.reshape(batch * blocks, page, heads_k, d)
    v_pages[perm] = v_cache.reshape(batch * blocks, page, heads_k, d)
    q = torch.randn(batch, 3, 4, d)
    k, v = (torch.randn(batch, 3, heads_k, d) for _ in "kv")
    seqlens = torch.tensor([40, 93], dtype=torch.int32)
    want = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens, causal=True,
                                  block_table=table)
    assert torch.equal(out, want)
    assert torch.equal(k_pages[perm].reshape(k_cache.shape), k_cache)  # appended in place
    assert torch.equal(v_pages[perm].reshape(v_cache.shape), v_cache)
    with pytest.raises(ValueError, match="page indices"):
        flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table + 1000)
    bad = table.clone()
    bad[1, -1] = -1  # the first entry outside the range, named with its place and value
    last = table.shape[1] - 1
    with pytest.raises(ValueError,
                       match=rf"page indices in \[0, \d+\).*block_table\[1, {last}\]=-1"):
        flash_attn_with_kvcache(q, k_pages, v_pages, block_table=bad)
    # The caches' dtype is theirs to name (k and v are not given).
    with pytest.raises(ValueError, match=r"k_cache and v_cache must have q's dtype.*"
                                         r"k_cache.dtype=torch.float64"):
        flash_attn_with_kvcache(q, k_pages.double(), v_pages.double(), block_table=table)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
@pytest.mark.parametrize("layout", ["plain", "leftpad", "batch_idx", "paged"])
def test_cuda_call_equals_the_cpu_call(layout):
    # The CUDA call (bf16, the packed-sequence kernels) against the CPU's on the same bf16 values
    # in float32 (the CPU tests hold that one to a float64 reference): outputs within bf16
    # rounding (the CUDA call's rotated q and new k are rounded to bf16 before attention, the
    # float32 call's are not, so no tighter), the in-place appends (rotated in float32, each
    # product rounded as PyTorch rounds it, then rounded to bf16) within half a bf16 ulp of
    # the float32 call's.  Causal, interleaved rotary, GQA, head dim 64.
    torch.manual_seed(0)
    batch, seqlen_q, new, heads, heads_k, d, page = 3, 2, 3, 4, 2, 64, 16
    pages = 4 * batch + 1 if layout == "paged" else 0
    cache_shape = (pages, page, heads_k, d) if layout == "paged" else (batch + 1, 64, heads_k, d)
    bf = torch.bfloat16
    q = torch.randn(batch, seqlen_q, heads, d).to(bf)
    k, v = (torch.randn(batch, new, heads_k, d).to(bf) for _ in "kv")
    k_cache, v_cache = (torch.randn(cache_shape).to(bf) for _ in "kv")
    angles = torch.rand(64, 8) * 6
    kw = dict(cache_seqlens=torch.tensor([5, 0, 40], dtype=torch.int32), causal=True,
              rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=True,
              return_softmax_lse=True)
    if layout == "leftpad":
        kw["cache_leftpad"] = torch.tensor([2, 0, 7], dtype=torch.int32)
    if layout == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([2, 0, 3])
    if layout == "paged":
        kw["block_table"] = torch.randperm(pages)[:4 * batch].view(batch, 4).int()

    def call(device, dtype):
        cache = [c.to(device, dtype) for c in (k_cache, v_cache)]
        args = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        out, lse = flash_attn_with_kvcache(q.to(device, dtype), *cache, k.to(device, dtype),
                                           v.to(device, dtype), **args)
        return out.float().cpu(), lse.cpu(), [c.float().cpu() for c in cache]

    out_cpu, lse_cpu, cache_cpu = call("cpu", torch.float32)
    out_gpu, lse_gpu, cache_gpu = call("cuda", bf)
    assert (out_gpu - out_cpu).abs().max().item() < 3e-2
    assert (lse_gpu - lse_cpu).abs().max().item() < 1e-2
    for c_gpu, c_cpu in zip(cache_gpu, cache_cpu):  # the appends: rotated k rounded to bf16
        half_ulp = c_cpu.abs() * 2.0**-8  # (bf16: 8 significant bits)
        assert ((c_gpu - c_cpu).abs() <= half_ulp).all()


@pytest.mark.parametrize("kw", [dict(cache_seqlens=torch.tensor([3, 7], dtype=torch.int32)),
                                dict(cache_seqlens=5, causal=True), dict(),
                                dict(cache_seqlens=torch.tensor([3, 7]), append=True,
                                     causal=True)],
                         ids=["tensor_lengths", "int_lengths", "full_cache", "append"])
def test_compiles_fullgraph_and_checks_when_the_graph_runs(kw):
    # The CPU route checks the lengths' values on the host, which Dynamo cannot trace
    # (new-user trial: fullgraph=True failed in every form); under torch.compile the call is
    # one opaque op that runs the checks when the graph runs: the same out, softmax_lse and
    # appended caches as eager, and a bad length still a ValueError naming it.
    torch.manual_seed(0)
    kw = dict(kw)
    append = kw.pop("append", False)
    k_cache, v_cache = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    q = torch.randn(2, 3, 4, 16)
    k, v = (torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)) if append else (None, None)

    def call(q, kc, vc):
        return flash_attn_with_kvcache(q, kc, vc, k, v, return_softmax_lse=True, **kw)

    eager_caches = (k_cache.clone(), v_cache.clone())
    eager = call(q, *eager_caches)
    compiled_caches = (k_cache.clone(), v_cache.clone())
    compiled = torch.compile(call, fullgraph=True)(q, *compiled_caches)
    for a, b in zip(eager + eager_caches, compiled + compiled_caches):
        assert torch.equal(a, b)
    bad = torch.compile(lambda q: flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([3, 40])), fullgraph=True)
    with pytest.raises(ValueError, match="cache_seqlens \\+ seqlen_new must be in"):
        bad(q)


def test_compiled_with_a_gradient_runs_eagerly_and_fullgraph_says_why():
    # With a gradient wanted the call cannot be the checked op (no autograd formula), and its
    # host checks cannot be traced: a graph break, the gradient equal to eager's; under
    # fullgraph=True Dynamo's refusal names the reason, not a data-dependent guard on
    # `(seqlens < 0).any()` (which the caller never wrote).
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    lens = torch.tensor([5, 17], dtype=torch.int32)
    q = torch.randn(2, 3, 4, 16, requires_grad=True)

    def call(q):
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)

    (eager,) = torch.autograd.grad(call(q).square().sum(), q)
    torch._dynamo.reset()
    (compiled,) = torch.autograd.grad(torch.compile(call)(q).square().sum(), q)
    assert eager.abs().sum() > 0 and torch.equal(eager, compiled)
    torch._dynamo.reset()  # (else the frame compiled with its graph break is reused)
    with pytest.raises(Exception, match="checks cache_seqlens, cache_leftpad, cache_batch_idx "
                                        "and block_table on the host"):
        torch.compile(call, fullgraph=True)(q)


def test_nothing_is_written_before_every_argument_is_checked():
    # New keys and values were appended into the cache before the attention op checked
    # softcap, softmax_scale, the slopes' shape or the head dim (new-user trial): an error
    # came back with the cache already changed.
    q, new = torch.randn(2, 1, 4, 40), torch.randn(2, 1, 2, 40)
    lens = torch.tensor([3, 10], dtype=torch.int32)
    for kw, match in ((dict(softcap=-1.0), "softcap must be finite and >= 0"),
                      (dict(softmax_scale=1e300), "softmax_scale must be finite and "
                                                  "representable in float32"),
                      (dict(alibi_slopes=torch.rand(3)), "alibi_slopes must have shape")):
        k_cache, v_cache = torch.zeros(2, 32, 2, 40), torch.zeros(2, 32, 2, 40)
        with pytest.raises(ValueError, match=match):
            flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=lens, **kw)
        assert not k_cache.any() and not v_cache.any(), kw
    # (the head dim named in the caller's terms: q.shape[3], not the packed view's q.size(2))
    big = torch.zeros(1, 8, 1, 300)
    with pytest.raises(ValueError, match=r"head_dim \(q.shape\[3\]\) must be between 1 and "
                                         r"256, got 300"):
        flash_attn_with_kvcache(torch.randn(1, 1, 1, 300), big, big.clone(),
                                torch.randn(1, 1, 1, 300), torch.randn(1, 1, 1, 300),
                                cache_seqlens=0)
    assert not big.any()


def test_tensors_on_another_device_are_named():
    # A meta cache beside a CPU q came back as a CPU tensor of uninitialised memory (the fake
    # kernel served the mixed call); meta block tables and rotary tables raised PyTorch's
    # internal errors (new-user trial).
    q, new = torch.randn(2, 1, 4, 40), torch.randn(2, 1, 2, 40)
    k_cache = torch.randn(2, 9, 2, 40)
    with pytest.raises(ValueError, match="k_cache must be on q's device \\(cpu\\), got meta"):
        flash_attn_with_kvcache(q, k_cache.to("meta"), k_cache.to("meta"))
    pages = torch.randn(4, 4, 2, 40)
    with pytest.raises(ValueError, match="block_table must be on q's device"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=2,
                                block_table=torch.zeros(2, 2, dtype=torch.int32, device="meta"))
    table = torch.ones(64, 8, device="meta")
    with pytest.raises(ValueError, match="rotary_cos must be on q's device"):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), new, new, cache_seqlens=3,
                                rotary_cos=table, rotary_sin=table)


def test_a_dtype_the_kernels_refuse_is_refused_before_the_append():
    # An int32 (or complex, bool) q was refused by the attention op after k and v had been
    # appended (new-user trial), against the docstring's "before anything is appended".
    for dtype in (torch.int32, torch.complex64, torch.bool):
        k_cache, v_cache = (torch.zeros(1, 4, 2, 4, dtype=dtype) for _ in "kv")
        new = torch.ones(1, 1, 2, 4, dtype=dtype)
        with pytest.raises(ValueError, match=f"must be float16, bfloat16, float32 or float64, "
                                             f"got {dtype}"):
            flash_attn_with_kvcache(torch.ones(1, 1, 2, 4, dtype=dtype), k_cache, v_cache, new,
                                    new, cache_seqlens=1)
        assert not k_cache.any() and not v_cache.any(), dtype


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_appended_keys_and_values_get_their_gradient(rotary, paged):
    # k and v requiring grad got none (their append ran under torch.no_grad) while q's
    # gradient came back: a silently missing gradient (new-user trial).  Now they get the
    # gradient of the rows they are appended to, and the cache's overwritten rows get none:
    # the same gradients as attention over the caches with k and v written in out of place.
    torch.manual_seed(3)
    batch, new, cache_len, heads, heads_k, d = 2, 2, 8, 4, 2, 8
    f64 = torch.float64
    q = torch.randn(batch, new, heads, d, dtype=f64, requires_grad=True)
    k, v = (torch.randn(batch, new, heads_k, d, dtype=f64, requires_grad=True) for _ in "kv")
    k_base, v_base = (torch.randn(batch, cache_len, heads_k, d, dtype=f64) for _ in "kv")
    seqlens = torch.tensor([2, 5], dtype=torch.int32)
    kw = dict(cache_seqlens=seqlens, causal=True)
    if rotary:
        angles = torch.rand(cache_len, 2, dtype=f64) * 6
        kw.update(rotary_cos=angles.cos(), rotary_sin=angles.sin())

    def ours(q, k, v, k_base, v_base):
        k_cache, v_cache = k_base.clone(), v_base.clone()
        if not paged:
            return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
        # pages of 4 rows, entry b's at pages 2b + 1, 2b (reversed), each table padded with -1
        k_pages, v_pages = (c.reshape(batch, 2, 4, heads_k, d).flip(1).reshape(
            2 * batch, 4, heads_k, d) for c in (k_cache, v_cache))
        table = torch.tensor([[1, 0, -1], [3, 2, -1]], dtype=torch.int32)
        return flash_attn_with_kvcache(q, k_pages, v_pages, k, v, block_table=table, **kw)

    def reference(q, k, v, k_base, v_base):
        positions = seqlens.long()[:, None] + torch.arange(new)
        if rotary:
            k = _rotary_ref(k, kw["rotary_cos"], kw["rotary_sin"], positions, True)
            q = _rotary_ref(q, kw["rotary_cos"], kw["rotary_sin"], positions, True)
        at = (torch.arange(batch)[:, None].expand(batch, new), positions)
        k_all, v_all = k_base.index_put(at, k), v_base.index_put(at, v)
        outs = []
        for b in range(batch):
            n = int(seqlens[b]) + new
            o, _ = attention_ref(q[b:b + 1], k_all[b:b + 1, :n], v_all[b:b + 1, :n], causal=True)
            outs.append(o)
        return torch.cat(outs)

    dout = torch.randn(batch, new, heads, d, dtype=f64)
    leaves = (q, k, v, k_base.requires_grad_(), v_base.requires_grad_())
    got = torch.autograd.grad(ours(*leaves), leaves, dout)
    want = torch.autograd.grad(reference(*leaves), leaves, dout)
    for name, g, w in zip(("q", "k", "v", "k_cache", "v_cache"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("paged", [False, True])
def test_a_cache_that_requires_grad_gets_none_in_its_overwritten_rows(paged):
    # A cache computed from a tensor that requires grad, new k and v that do not: the
    # appended rows' gradient flowed back into the cache's history as if the old values had
    # been attended to (a silent wrong gradient; a new-user finding).  Now those rows get
    # none, the others theirs: the gradient of attention over the caches with k and v
    # written in out of place.
    torch.manual_seed(4)
    f64 = torch.float64
    batch, new, cache_len, heads, heads_k, d = 2, 3, 8, 4, 2, 8
    q = torch.randn(batch, 2, heads, d, dtype=f64)
    k, v = (torch.randn(batch, new, heads_k, d, dtype=f64) for _ in "kv")
    k_base, v_base = (torch.randn(batch, cache_len, heads_k, d, dtype=f64, requires_grad=True)
                      for _ in "kv")
    seqlens = torch.tensor([1, 5], dtype=torch.int32)
    k_cache, v_cache = k_base * 1.0, v_base * 1.0
    kw = {}
    if paged:  # (pages of 4 rows, entry b's at pages 2b + 1, 2b)
        k_cache, v_cache = (c.reshape(batch, 2, 4, heads_k, d).flip(1).reshape(
            2 * batch, 4, heads_k, d) for c in (k_cache, v_cache))
        kw["block_table"] = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **kw)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (k_base, v_base), dout)
    positions = seqlens.long()[:, None] + torch.arange(new)
    at = (torch.arange(batch)[:, None].expand(batch, new), positions)
    k_all, v_all = k_base.index_put(at, k), v_base.index_put(at, v)
    want = torch.cat([attention_ref(q[b:b + 1], k_all[b:b + 1, :int(seqlens[b]) + new],
                                    v_all[b:b + 1, :int(seqlens[b]) + new])[0]
                      for b in range(batch)])
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(got, torch.autograd.grad(want, (k_base, v_base), dout)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        assert not g[at].any()


def test_appending_into_a_leaf_cache_that_requires_grad_raises():
    # PyTorch refuses an in-place write into a leaf that requires grad; the append made it
    # under torch.no_grad, so an nn.Parameter passed as a cache changed without a word.
    q = torch.randn(1, 1, 2, 8)
    new = torch.randn(1, 1, 2, 8)
    for name in ("k_cache", "v_cache"):
        caches = {"k_cache": torch.zeros(1, 4, 2, 8), "v_cache": torch.zeros(1, 4, 2, 8)}
        caches[name].requires_grad_()
        with pytest.raises(ValueError, match=f"{name} is a leaf tensor that requires grad"):
            flash_attn_with_kvcache(q, caches["k_cache"], caches["v_cache"], new, new,
                                    cache_seqlens=1)
        assert not caches["k_cache"].any() and not caches["v_cache"].any()
        # Reading it (no append) is fine, and so is an append under torch.no_grad.
        flash_attn_with_kvcache(q, caches["k_cache"], caches["v_cache"], cache_seqlens=1)
        with torch.no_grad():
            flash_attn_with_kvcache(q, caches["k_cache"], caches["v_cache"], new, new,
                                    cache_seqlens=1)
        assert torch.equal(caches["k_cache"][0, 1], new[0, 0])


def test_cache_leftpad_past_cache_seqlens_raises():
    # The new keys are appended at cache_seqlens: a pad past it hid some or all of them (the
    # query saw no key and returned zeros; a new-user finding).  FlashAttention-2's rule is
    # cache_leftpad <= cache_seqlens.
    q = torch.randn(2, 1, 2, 8)
    k_cache, v_cache = torch.randn(2, 8, 2, 8), torch.randn(2, 8, 2, 8)
    new = torch.randn(2, 2, 2, 8)
    seqlens = torch.tensor([3, 4], dtype=torch.int32)
    for leftpad in ([4, 0], [0, 6], [-1, 0]):
        before = k_cache.clone()
        with pytest.raises(ValueError, match=r"cache_leftpad must be in \[0, cache_seqlens\]"):
            flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens,
                                    cache_leftpad=torch.tensor(leftpad, dtype=torch.int32))
        assert torch.equal(k_cache, before)  # (refused before the append)
    # At cache_seqlens exactly: the query sees the appended keys only.
    out = flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens,
                                  cache_leftpad=seqlens.clone())
    want = torch.cat([attention_ref(q[b:b + 1].double(), new[b:b + 1].double(),
                                    new[b:b + 1].double())[0] for b in range(2)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_block_table_slots_past_the_used_pages_may_hold_anything():
    # FlashAttention-2 reads only the pages cache_seqlens (+ seqlen_new) reach; tables padded
    # with -1 were refused (new-user trial).  A slot a row uses must still be a page.
    torch.manual_seed(2)
    k_pages, v_pages = torch.randn(12, 1, 2, 8, dtype=torch.float64), \
        torch.randn(12, 1, 2, 5, dtype=torch.float64)
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    padded = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -7]], dtype=torch.int32)
    full = torch.tensor([[0, 1, 2, 5], [3, 4, 6, 7]], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=padded)
    want = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=full)
    assert torch.equal(out, want)
    new = torch.randn(2, 1, 2, 8, dtype=torch.float64), torch.randn(2, 1, 2, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"where a row uses the page, got block_table\[1, 2\]=-1"):
        flash_attn_with_kvcache(q, k_pages, v_pages, *new,
                                cache_seqlens=torch.tensor([2, 2], dtype=torch.int32),
                                block_table=padded)  # (the appends reach slots 2 of both rows)


def test_gathered_caches_copy_only_the_rows_in_use():
    # cache_batch_idx and block_table gather each entry's rows into a copy; it copied the
    # whole capacity, so a table sized for the longest context made a call at 100 used keys
    # of 8192 ~250x slower than at 128 (a new-user finding).  Now only the rows in use (whole
    # pages): the same answer as the contiguous cache, leftpad and an append included.
    torch.manual_seed(0)
    batch, cap, heads_k, d, page = 3, 4096, 2, 16, 16
    q = torch.randn(batch, 2, 4, d)
    k_cache, v_cache = torch.randn(batch, cap, heads_k, d), torch.randn(batch, cap, heads_k, d)
    new_k, new_v = torch.randn(batch, 2, heads_k, d), torch.randn(batch, 2, heads_k, d)
    kw = dict(cache_seqlens=torch.tensor([5, 37, 0], dtype=torch.int32),
              cache_leftpad=torch.tensor([1, 30, 0], dtype=torch.int32), causal=True,
              return_softmax_lse=True)
    outs = []
    for layout in ("contiguous", "batch_idx", "paged"):
        kc, vc, extra = k_cache.clone(), v_cache.clone(), {}
        if layout == "batch_idx":
            extra["cache_batch_idx"] = torch.arange(batch, dtype=torch.int32)
        if layout == "paged":
            kc, vc = kc.view(-1, page, heads_k, d), vc.view(-1, page, heads_k, d)
            extra["block_table"] = torch.arange(batch * cap // page,
                                                dtype=torch.int32).view(batch, -1)
        outs.append(flash_attn_with_kvcache(q, kc, vc, new_k, new_v, **kw, **extra))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    assert torch.isfinite(outs[0][0]).all()


def test_plan_names_the_gathered_copy():
    # A paged cache or cache_batch_idx off the decode kernels (every CPU call) gathers the
    # rows used into a copy before the kernels run; the plan says so (a new-user finding: its
    # notes were empty), and a contiguous cache, read in place, adds no such note.  So does
    # flash_attn_varlen_func's block_table.
    cache = torch.randn(8, 16, 2, 16)
    q = torch.randn(2, 1, 4, 16)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=20, block_table=table)
    assert any("pages used gathered into a copy of 2 x 32 rows" in n
               for n in flash_attn_ext.last_plan().notes), flash_attn_ext.last_plan()
    flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=10,
                            cache_batch_idx=torch.tensor([3, 1]))
    assert any("entries used gathered into a copy of 2 x 10 rows" in n
               for n in flash_attn_ext.last_plan().notes), flash_attn_ext.last_plan()
    flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=10)
    assert not any("copy" in n for n in flash_attn_ext.last_plan().notes)
    qv = torch.randn(5, 4, 16)
    flash_attn_ext.flash_attn_varlen_func(
        qv, cache, cache, torch.tensor([0, 2, 5], dtype=torch.int32),
        torch.tensor([0, 20, 40], dtype=torch.int32), 3, 20, block_table=table)
    assert any("gathered into a copy of 64 key rows" in n
               for n in flash_attn_ext.last_plan().notes), flash_attn_ext.last_plan()


@st.composite
def _kvcache_configs(draw):
    """A decode-shaped call: 1-3 batch rows, 1-5 queries, 0-4 appended keys (or none given),
    cached lengths, left padding, cache_batch_idx or paged caches (any page size), rotary
    (interleaved or halves, on some of the channels), GQA, odd head dims, causal and windows,
    softcap, ALiBi ((H,) or (B, H) slopes), a softmax_scale."""
    batch = draw(st.integers(1, 3))
    new = draw(st.sampled_from([None, 0, 1, 2, 4]))
    cache_len = draw(st.integers(max(new or 0, 1), 40))
    seqlens = draw(st.lists(st.integers(0, cache_len - (new or 0)), min_size=batch,
                            max_size=batch))
    return dict(
        batch=batch, seqlen_q=draw(st.integers(1, 5)), new=new, cache_len=cache_len,
        seqlens=seqlens,
        leftpad=draw(st.one_of(st.none(), st.tuples(*(st.integers(0, n) for n in seqlens)))),
        layout=draw(st.sampled_from(["plain", "batch_idx", "paged"])),
        page=draw(st.sampled_from([1, 3, 16])),
        heads_kv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.sampled_from([4, 8, 12, 40])),
        head_dim_v=draw(st.sampled_from([4, 8, 24])),
        rotary=draw(st.sampled_from([None, None, "interleaved", "halves"])),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (-1, -1), (3, 0), (2, 5), (-1, 2)])),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0])),
        alibi=draw(st.sampled_from([None, None, "head", "batch_head"])),
        softmax_scale=draw(st.sampled_from([None, None, 0.3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@fuzz_settings(100)
@given(_kvcache_configs())
def test_fuzz_kvcache_float64(c):
    # Random decode calls on the CPU in float64 against each batch row's own float64 attention
    # over its used cache rows (leftpad .. cache_seqlens + new, the new keys appended and,
    # with rotary, rotated at their positions; q rotated at cache_seqlens + i for causal or
    # windowed calls, else at cache_seqlens), with its slopes row: the caches appended in
    # place (the rest untouched), out and softmax_lse to float64 rounding.
    torch.manual_seed(c["seed"])
    f64, batch, new = torch.float64, c["batch"], c["new"]
    heads_kv, d, dv = c["heads_kv"], c["head_dim"], c["head_dim_v"]
    heads, cache_len = heads_kv * c["group"], c["cache_len"]
    q = torch.randn(batch, c["seqlen_q"], heads, d, dtype=f64)
    k = v = None
    if new is not None:
        k = torch.randn(batch, new, heads_kv, d, dtype=f64)
        v = torch.randn(batch, new, heads_kv, dv, dtype=f64)
    entries = batch + (1 if c["layout"] == "batch_idx" else 0)
    k_full = torch.randn(entries, cache_len, heads_kv, d, dtype=f64)
    v_full = torch.randn(entries, cache_len, heads_kv, dv, dtype=f64)
    seqlens = torch.tensor(c["seqlens"], dtype=torch.int32)
    leftpad = None if c["leftpad"] is None else torch.tensor(c["leftpad"], dtype=torch.int32)
    idx = torch.randperm(entries)[:batch] if c["layout"] == "batch_idx" else None
    cos = sin = None
    if c["rotary"] is not None:
        angles = torch.rand(cache_len + c["seqlen_q"], max(1, d // 4), dtype=f64) * 6
        cos, sin = angles.cos(), angles.sin()
    slopes = None if c["alibi"] is None else torch.rand(
        *((batch,) if c["alibi"] == "batch_head" else ()), heads, dtype=f64)
    # What the caches should hold after the append (entry-wise, contiguous).
    rows = idx if idx is not None else torch.arange(batch)
    local = c["causal"] or c["window"] != (-1, -1)
    want_k, want_v = k_full.clone(), v_full.clone()
    if new:
        positions = seqlens.long()[:, None] + torch.arange(new)
        k_rot = k if cos is None else _rotary_ref(k, cos, sin, positions,
                                                    c["rotary"] == "interleaved")
        for b in range(batch):
            want_k[rows[b], seqlens[b]:seqlens[b] + new] = k_rot[b]
            want_v[rows[b], seqlens[b]:seqlens[b] + new] = v[b]
    q_pos = seqlens.long()[:, None] + (torch.arange(c["seqlen_q"]) if local else 0)
    q_rot = q if cos is None else _rotary_ref(
        q, cos, sin, q_pos.expand(batch, c["seqlen_q"]), c["rotary"] == "interleaved")
    # The caches as the call takes them: contiguous, or shuffled pages of `page` rows.
    k_cache, v_cache, table = k_full, v_full, None
    if c["layout"] == "paged":
        page = c["page"]
        blocks = -(-cache_len // page)
        pad = blocks * page - cache_len

        def pages(x):
            x = torch.cat([x, torch.zeros(batch, pad, *x.shape[2:], dtype=f64)], 1)
            return x.reshape(batch * blocks, page, *x.shape[2:])
        perm = torch.randperm(batch * blocks)
        table = perm.reshape(batch, blocks).to(torch.int32)
        k_cache, v_cache = (torch.empty_like(pages(x)) for x in (k_full, v_full))
        k_cache[perm], v_cache[perm] = pages(k_full), pages(v_full)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cache_batch_idx=idx, cache_leftpad=leftpad, block_table=table,
        softmax_scale=c["softmax_scale"], causal=c["causal"], window_size=c["window"],
        softcap=c["softcap"], rotary_interleaved=c["rotary"] == "interleaved",
        alibi_slopes=slopes, return_softmax_lse=True)
    if table is not None:  # (back to entries, the padding rows dropped)
        k_cache = k_cache[perm].reshape(batch, -1, heads_kv, d)[:, :cache_len]
        v_cache = v_cache[perm].reshape(batch, -1, heads_kv, dv)[:, :cache_len]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    wl, wr = c["window"]
    for b in range(batch):
        lo = 0 if leftpad is None else int(leftpad[b])
        hi = int(seqlens[b]) + (new or 0)
        s = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        ref, ref_lse = attention_ref(q_rot[b:b + 1], want_k[rows[b]][None, lo:hi],
                                     want_v[rows[b]][None, lo:hi], causal=c["causal"],
                                     window_left=wl, window_right=wr, softcap=c["softcap"],
                                     softmax_scale=c["softmax_scale"], alibi_slopes=s)
        torch.testing.assert_close(out[b], ref[0], rtol=1e-9, atol=1e-10)
        assert_lse_infinities(lse[b], ref_lse[0])
        finite = torch.isfinite(ref_lse[0])
        torch.testing.assert_close(lse[b][finite], ref_lse[0][finite], rtol=1e-9, atol=1e-10)
