"""flash_attn_with_kvcache on the CUDA decode kernels (split-KV, GQA rows packed, the cache read
in place, lengths read on the device): against a float32 reference of each batch row's
attention by the error rule, for every cache layout and flag; values that break a rule give NaN
rows and no memory error; no host synchronisation; CUDA-graph capture."""

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import flash_attn_with_kvcache
from reference import assert_error_rule, attention_ref, max_err, slack

HAS_CUDA = torch.cuda.is_available() and flash_attn_ext.ops.build_info()["cuda"]
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")

# (batch, seqlen_q, heads, heads_k, head_dim): GQA 4:1, MQA 32:1, rows past one tile, odd dims.
SHAPES = [(3, 1, 8, 2, 128), (2, 1, 32, 1, 64), (2, 3, 6, 3, 256), (3, 2, 4, 4, 40),
          (1, 1, 16, 8, 96), (2, 5, 12, 4, 72), (2, 1, 32, 1, 128)]
LAYOUTS = ["plain", "paged16", "paged48", "leftpad", "batch_idx"]
MODS = [{}, {"causal": True}, {"window_size": (5, 2)}, {"softcap": 30.0}, {"alibi": True},
        {"causal": True, "window_size": (40, 0)}]
SPLITS = [0, 1, 5]


def _cache(batch, cache_len, heads_k, d, dtype, layout, gen):
    """(k_cache, v_cache, kwargs, rows(b) -> (k, v) of entry b's cache as contiguous rows)."""
    kw = {}
    dense_k, dense_v = (torch.randn(batch + 1, cache_len, heads_k, d, generator=gen)
                        .to("cuda", dtype) for _ in "kv")
    entries = list(range(batch))
    if layout == "batch_idx":
        entries = [batch - b for b in range(batch)]  # reversed, entry 0 unused
        kw["cache_batch_idx"] = torch.tensor(entries, dtype=torch.int32, device="cuda")
    if layout.startswith("paged"):
        page = int(layout[5:])
        blocks = cache_len // page
        perm = torch.randperm(batch * blocks, generator=gen)
        k_pages, v_pages = (torch.empty(batch * blocks, page, heads_k, d, dtype=dtype,
                                        device="cuda") for _ in "kv")
        k_pages[perm.cuda()] = dense_k[:batch].reshape(batch * blocks, page, heads_k, d)
        v_pages[perm.cuda()] = dense_v[:batch].reshape(batch * blocks, page, heads_k, d)
        table = perm.view(batch, blocks).cuda()
        kw["block_table"] = table.to(torch.int32)
        # (read back through the table, so that a test that rewrites the pages in place sees
        # its own values)
        return k_pages, v_pages, kw, lambda b: (k_pages[table[b]].reshape(-1, heads_k, d),
                                                v_pages[table[b]].reshape(-1, heads_k, d))
    return dense_k, dense_v, kw, lambda b: (dense_k[entries[b]], dense_v[entries[b]])


# Every (shape, layout) once; flags, split counts and dtypes rotated through them so that each
# flag meets each split count and both dtypes.
CASES = [(i, shape, layout, MODS[i % len(MODS)], SPLITS[(i // 2) % len(SPLITS)],
          (torch.bfloat16, torch.float16)[(i // len(MODS)) % 2])
         for i, (shape, layout) in enumerate(itertools.product(SHAPES, LAYOUTS))]


@pytest.mark.parametrize("case,shape,layout,mods,num_splits,dtype", CASES)
def test_decode_matches_the_reference(case, shape, layout, mods, num_splits, dtype):
    batch, seqlen_q, heads, heads_k, d = shape
    gen = torch.Generator().manual_seed(1000 + case)
    cache_len = 336  # a multiple of both page sizes
    k_cache, v_cache, kw, rows = _cache(batch, cache_len, heads_k, d, dtype, layout, gen)
    q = torch.randn(batch, seqlen_q, heads, d, generator=gen).to("cuda", dtype)
    lens = torch.randint(0, cache_len + 1, (batch,), generator=gen)
    lens[0] = cache_len  # a full cache
    if batch > 2:
        lens[1] = 0  # an empty one
    leftpad = None
    if layout == "leftpad":
        leftpad = (lens * torch.rand(batch, generator=gen)).long()
        kw["cache_leftpad"] = leftpad.to(torch.int32).cuda()
    slopes = None
    if mods.get("alibi"):
        slopes = torch.rand(heads, generator=gen).cuda() * 0.3
    flags = dict(causal=mods.get("causal", False), window_size=mods.get("window_size", (-1, -1)),
                 softcap=mods.get("softcap", 0.0))
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens.to(torch.int32).cuda(), alibi_slopes=slopes,
        num_splits=num_splits, return_softmax_lse=True, **flags, **kw)
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
    ref_flags = dict(causal=flags["causal"], window_left=flags["window_size"][0],
                     window_right=flags["window_size"][1], softcap=flags["softcap"],
                     alibi_slopes=slopes)
    for b in range(batch):
        lo = 0 if leftpad is None else int(leftpad[b])
        kc, vc = rows(b)
        keys, values = kc[None, lo:int(lens[b])], vc[None, lo:int(lens[b])]
        true, true_lse = attention_ref(q[b:b + 1], keys, values, compute_dtype=torch.float32,
                                       **ref_flags)
        low, _ = attention_ref(q[b:b + 1], keys, values, compute_dtype=dtype, **ref_flags)
        assert_error_rule(out[b:b + 1], low.to(dtype), true, 2.0, f"out[{b}]")
        seen = torch.isfinite(true_lse)
        assert torch.equal(torch.isfinite(lse[b:b + 1]), seen), "rows that see no key: lse -inf"
        assert not torch.isnan(lse[b:b + 1]).any()
        if seen.any():
            assert (lse[b:b + 1][seen] - true_lse[seen]).abs().max().item() < 1e-2
        assert not out[b:b + 1][~seen.transpose(1, 2)].any(), "rows that see no key: zeros"


@pytest.mark.parametrize("layout", ["plain", "paged48", "leftpad", "batch_idx"])
@pytest.mark.parametrize("head_dim", [64, 40, 128, 256])
def test_load_forms_give_the_same_bits(layout, head_dim, kernel_opts):
    # The decode kernel's load forms (the option decode_row_lanes: 2, 4 or 8 lanes per cache
    # row at head dim 64; decode_contiguous_loads: a contiguous cache's rows by offsets alone
    # or through the paged cache's per-row lookup) change only which lane copies which 16
    # bytes from which address computation: the same bits, GQA and MQA, 1 and 3 query rows, a
    # cache length that ends mid-tile, head dim 40 padded.  Both CTA heights where the head dim
    # allows them (decode_block_rows: MQA at batch 2 takes 16 rows by the rule, so 32 is forced
    # to keep the 32-row form's loads, paged and contiguous, under test).
    gen = torch.Generator().manual_seed(3)
    cases = ((8, 2, 1, 1, 16), (32, 1, 3, 4, 16), (32, 1, 3, 4, 32))
    for heads, heads_k, seqlen_q, splits, block_rows in cases:
        k_cache, v_cache, kw, _ = _cache(2, 192, heads_k, head_dim, torch.bfloat16, layout, gen)
        if layout == "leftpad":
            kw["cache_leftpad"] = torch.tensor([3, 17], dtype=torch.int32, device="cuda")
        q = torch.randn(2, seqlen_q, heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
        lens = torch.tensor([187, 61], dtype=torch.int32, device="cuda")
        outs = []
        for lanes, contiguous in itertools.product((2, 4, 8), (True, False)):
            kernel_opts(decode_row_lanes=lanes, decode_contiguous_loads=contiguous,
                        decode_block_rows=block_rows)
            outs.append(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                num_splits=splits, causal=True,
                                                return_softmax_lse=True, **kw))
        for out, lse in outs[1:]:
            assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
        assert torch.isfinite(outs[0][0]).all()


def _skip_unless_decode_route(head_dim):
    """Skips a test that asserts the decode route where this GPU sends head dims above 64 to
    the packed-sequence kernels (kvcache._LARGE_SMEM_CAPABILITIES: the decode kernels need
    more shared memory per block than sm_86 / 89 / 120 give)."""
    capability = torch.cuda.get_device_capability()
    if head_dim > 64 and capability not in flash_attn_ext.kvcache._LARGE_SMEM_CAPABILITIES:
        pytest.skip(f"compute capability {capability} takes head dim {head_dim} on varlen")


def _assert_causal_entries(out, lse, q, lens, rows, what):
    """Each batch entry b of a causal decode call (out, lse) within the error rule of a float32
    reference over its first lens[b] cache rows (rows(b), as _cache gives), the LSE to fp32's."""
    for b in range(len(lens)):
        kc, vc = rows(b)
        keys, values = kc[None, :int(lens[b])], vc[None, :int(lens[b])]
        true, true_lse = attention_ref(q[b:b + 1], keys, values, causal=True,
                                       compute_dtype=torch.float32)
        low, _ = attention_ref(q[b:b + 1], keys, values, causal=True, compute_dtype=q.dtype)
        assert_error_rule(out[b:b + 1], low.to(q.dtype), true, 2.0, f"out[{b}], {what}")
        assert (lse[b:b + 1] - true_lse).abs().max().item() < 1e-4 * true_lse.abs().max()


@pytest.mark.parametrize("num_splits", [5, 40, 200])
def test_combine_spreads_match_the_reference(num_splits, kernel_opts):
    # The combine's warps per row (the option decode_combine_splits: 4, 8 or 16 splits one warp
    # reads before a row spreads over more warps) change only the order of its partial sums:
    # every value within the error rule of the reference, the LSE to fp32's; MQA with 32 query
    # heads and GQA, 1 and 2 query rows, a length that ends mid-split.
    _skip_unless_decode_route(128)
    gen = torch.Generator().manual_seed(26)
    dtype = torch.bfloat16
    for heads, heads_k, seqlen_q in ((32, 1, 1), (8, 2, 2)):
        k_cache, v_cache, kw, rows = _cache(2, 3328, heads_k, 128, dtype, "plain", gen)
        q = torch.randn(2, seqlen_q, heads, 128, generator=gen).to("cuda", dtype)
        lens = torch.tensor([3328, 2999])
        for per_warp in (4, 8, 16):
            kernel_opts(decode_combine_splits=per_warp)
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache,
                                               cache_seqlens=lens.to(torch.int32).cuda(),
                                               num_splits=num_splits, causal=True,
                                               return_softmax_lse=True)
            assert flash_attn_ext.last_plan().kernel.startswith("sm80_decode")
            _assert_causal_entries(out, lse, q, lens, rows, f"{per_warp} splits per warp")


@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
def test_block_rows_match_the_reference(head_dim, kernel_opts):
    # The option decode_block_rows (16 or 32 query rows per CTA where the head dim is at most
    # 128; 256 takes 16 whatever it says) changes which CTA computes which packed rows and, with
    # num_splits left to the heuristic, how many splits there are: each value within the error
    # rule of the reference, the LSE to fp32's.  MQA with 32 query heads (32 or 96 packed rows:
    # 2 or 6 CTAs of 16 per split, 1 or 3 of 32) and a GQA group of 8 with 3 query rows (24
    # rows: a partly filled block either way), a length that ends mid-tile.
    _skip_unless_decode_route(head_dim)
    gen = torch.Generator().manual_seed(31)
    dtype = torch.bfloat16
    for heads, heads_k, seqlen_q in ((32, 1, 1), (32, 1, 3), (16, 2, 3)):
        k_cache, v_cache, kw, rows = _cache(2, 1100, heads_k, head_dim, dtype, "plain", gen)
        q = torch.randn(2, seqlen_q, heads, head_dim, generator=gen).to("cuda", dtype)
        lens = torch.tensor([1100, 757])
        for block_rows in (16, 32):
            kernel_opts(decode_block_rows=block_rows)
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache,
                                               cache_seqlens=lens.to(torch.int32).cuda(),
                                               causal=True, return_softmax_lse=True)
            assert flash_attn_ext.last_plan().kernel.startswith("sm80_decode")
            _assert_causal_entries(out, lse, q, lens, rows,
                                   f"{block_rows} rows per CTA, {heads}/{heads_k} heads, "
                                   f"{seqlen_q} query rows")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_split_heuristic_slots_match_the_reference(head_dim, kernel_opts):
    # The split heuristic aims at two CTAs per SM (one at head dim 256) and trims a grid that
    # ends in a partial wave of the CTAs the GPU holds at once: the kernel's occupancy
    # ("auto") or the option's count per SM.  MQA B = 48 (32-row CTAs at head dims up to 128,
    # 16-row at 256) is where the counts differ on the H100 / H200: 11 splits at 1, 2 and 4
    # per SM at head dim 64, 8 at 3 (docs/perf/decode.md, "The slots"), so the combine's
    # merge and the grid's m-blocks change: each within the error rule of the reference.  MQA
    # B = 8 (16-row CTAs, two m-blocks each) and a paged GQA call beside them, lengths that end
    # mid-tile.
    _skip_unless_decode_route(head_dim)
    gen = torch.Generator().manual_seed(47)
    dtype = torch.float16
    for batch, heads_k, layout, cache_len in ((8, 1, "plain", 8192), (48, 1, "plain", 8192),
                                              (6, 8, "paged16", 1504)):
        k_cache, v_cache, kw, rows = _cache(batch, cache_len, heads_k, head_dim, dtype, layout,
                                            gen)
        q = torch.randn(batch, 1, 32, head_dim, generator=gen).to("cuda", dtype)
        lens = torch.randint(1, cache_len + 1, (batch,), generator=gen)
        lens[0] = cache_len - 5  # (mid-tile)
        outs = {}
        for per_sm in ("auto", 1, 2, 3, 4):
            kernel_opts(decode_ctas_per_sm=per_sm)
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache,
                                               cache_seqlens=lens.to(torch.int32).cuda(),
                                               causal=True, return_softmax_lse=True, **kw)
            assert flash_attn_ext.last_plan().kernel.startswith("sm80_decode")
            _assert_causal_entries(out, lse, q, lens, rows,
                                   f"decode_ctas_per_sm={per_sm}, batch {batch}, "
                                   f"32/{heads_k} heads, {layout}")
            outs[per_sm] = out
        # Where the counts are known (sm_90 code on a 132-SM H100 / H200): the 32-row kernel
        # at head dim 64 holds 3 CTAs per SM, 2 at 128, and the 16-row one 1 at 256; at B = 48
        # the known count gives other splits than the next count (64: 3 gives 8 splits, 2
        # gives 11; 128: 2 gives 11, 3 gives 8; 256: 1 gives 4, 2 gives 2).  At 64 this also
        # catches a failed occupancy query, which trims nothing (the bits of 1, 2 and 4); at
        # 128 and 256 the known count trims nothing itself, so there it holds the rule only.
        props = torch.cuda.get_device_properties(0)
        sm90_code = "9.0" in flash_attn_ext.ops.build_info()["cuda_archs"]
        if (batch, layout) == (48, "plain") and sm90_code and \
                (props.major, props.minor, props.multi_processor_count) == (9, 0, 132):
            same = {n for n in (1, 2, 3, 4) if torch.equal(outs["auto"], outs[n])}
            known, other = {64: (3, 2), 128: (2, 3), 256: (1, 2)}[head_dim]
            assert known in same and other not in same, (head_dim, same)


@pytest.mark.parametrize("keys", ["random", "one_key"])
@pytest.mark.parametrize("layout", ["plain", "paged16", "leftpad"])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("softmax_scale", [1.0, 100.0])
def test_huge_scores_are_exact_on_the_decode_kernels(keys, layout, num_splits, softmax_scale,
                                                     kernel_opts):
    # issue 29 on the decode route: fp16 q and keys of magnitude up to 900 (M ~ 2^24 at scale
    # 1, 2^31 at 100), where an exponent x c - m c with m c rounded to float32 skews P or
    # overflows it, and splits merged from their float32 LSEs are weighted wrongly.  The decode
    # kernels form (x - m) c, merge splits from (m, l) and round the LSE once from float64
    # (flash_decode_kernel.cuh), so no exact pass runs after them (cuda/exact_rows.h) and the
    # option exact_rows_always changes nothing there.  Out against a float64 reference within
    # fp16's rounding, the LSE to fp32's.  "one_key": every cache row holds the same key and v
    # rises with the row, so that every split has the same maximum and its weight in the
    # combine rests on its sum alone: splits merged from float32 LSEs (ulp ~1 at these
    # magnitudes) miss the bound there (by 4e-3 at scale 1, 7e-2 at 100 in a CPU emulation),
    # where with random keys one split carries all the weight.
    dtype = torch.float16
    gen = torch.Generator().manual_seed(29)
    batch, heads, heads_k, d, cache_len = 2, 8, 2, 64, 336
    k_cache, v_cache, kw, rows = _cache(batch, cache_len, heads_k, d, dtype, layout, gen)
    k_cache.copy_(k_cache.float().abs().mul(-300).clamp(min=-900).to(dtype))
    v_cache.copy_(v_cache.float().abs().clamp(max=1).to(dtype))
    if keys == "one_key":
        k_cache.copy_(k_cache[:1, :1].expand_as(k_cache))
        ramp = torch.linspace(0, 1, v_cache.shape[0] * v_cache.shape[1], device="cuda")
        v_cache.copy_(ramp.view(*v_cache.shape[:2], 1, 1).expand_as(v_cache).to(dtype))
    q = (torch.rand(batch, 1, heads, d, generator=gen) * -900).to("cuda", dtype)
    lens = torch.tensor([cache_len, 200])
    leftpad = None
    if layout == "leftpad":
        leftpad = torch.tensor([0, 37])
        kw["cache_leftpad"] = leftpad.to(torch.int32).cuda()

    def call():
        out, lse = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens.to(torch.int32).cuda(),
            softmax_scale=softmax_scale, num_splits=num_splits, return_softmax_lse=True, **kw)
        assert flash_attn_ext.last_plan().kernel.startswith("sm80_decode")
        return out, lse

    def errors(out, lse):
        worst = (0.0, 0.0)
        for b in range(batch):
            lo = 0 if leftpad is None else int(leftpad[b])
            kc, vc = rows(b)
            true, true_lse = attention_ref(q[b:b + 1].double(), kc[None, lo:int(lens[b])].double(),
                                           vc[None, lo:int(lens[b])].double(),
                                           softmax_scale=softmax_scale)
            bound = 2 * torch.finfo(dtype).eps + slack(true, dtype)
            rel = ((lse[b:b + 1].double() - true_lse).abs().max().item()
                   / true_lse.abs().max().item())
            worst = max(worst[0], max_err(out[b:b + 1], true) - bound), max(worst[1], rel - 1e-6)
            # (the regime the exact pass takes elsewhere: |lse log2 e| >= 2^13 on every row)
            assert (true_lse.abs() * math.log2(math.e) >= 2 ** 13).all()
        return worst

    out, lse = call()
    assert max(errors(out, lse)) <= 0
    kernel_opts(exact_rows_always=False)
    out_off, lse_off = call()
    assert torch.equal(out_off, out) and torch.equal(lse_off, lse)


def test_the_plan_names_the_route():
    # last_plan() after a KV-cache call: the decode kernel's instantiation, or the packed-
    # sequence kernels with the reason the decode kernels did not take the call (it named an
    # earlier call's kernels before).
    _skip_unless_decode_route(72)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 1, 8, 72, generator=gen).to("cuda", torch.float16)
    cache = torch.randn(2, 64, 2, 72, generator=gen).to("cuda", torch.float16)
    lens = torch.tensor([10, 64], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens)
    p = flash_attn_ext.last_plan()
    assert (p.kernel, p.fused) == ("sm80_decode_hdim128_fp16", True), p
    flash_attn_with_kvcache(q.requires_grad_(), cache, cache, cache_seqlens=lens)
    p = flash_attn_ext.last_plan()
    assert p.fused and (p.kernel.endswith("_varlen") or p.kernel.startswith("sm80_fwd")), p
    assert "not on the decode kernels: a gradient is wanted" in str(p), p


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_append_and_rotary_equal_the_portable_route(paged, rotary):
    # The same call on the decode route (no grad) and on the packed-sequence route (q requires
    # grad, which only that route serves): the same caches after the append, outputs within the
    # error rule of each other's reference.
    torch.manual_seed(3)
    batch, seqlen_q, new, heads, heads_k, d, page = 3, 2, 2, 8, 2, 64, 16
    shape = (4 * batch, page, heads_k, d) if paged else (batch, 64, heads_k, d)
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, new, heads_k, d, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    kw = dict(cache_seqlens=torch.tensor([5, 0, 60], dtype=torch.int32, device="cuda"),
              causal=True, return_softmax_lse=True)
    if paged:
        kw["block_table"] = torch.randperm(4 * batch, device="cuda").view(batch, 4).int()
    if rotary:
        angles = torch.rand(70, 16, device="cuda") * 6
        kw.update(rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                  rotary_interleaved=rotary == "interleaved")
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    out, lse = flash_attn_with_kvcache(q, *caches[0], k, v, **kw)
    out2, lse2 = flash_attn_with_kvcache(q.clone().requires_grad_(), *caches[1], k, v, **kw)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert (out.float() - out2.float()).abs().max().item() < 2e-2
    assert (lse - lse2.detach()).abs().max().item() < 1e-3


def test_values_that_break_a_rule_give_nan_rows_only():
    # Read on the device, never on the host: a bad length, left pad, entry or page index makes
    # that batch row NaN (no memory error, no effect on the other rows, no append to it).
    torch.manual_seed(4)
    batch, heads, heads_k, d = 4, 8, 2, 128
    k_cache, v_cache = (torch.randn(batch, 64, heads_k, d, device="cuda", dtype=torch.float16)
                        for _ in "kv")
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.float16)
    good = torch.tensor([10, 20, 30, 40], dtype=torch.int32, device="cuda")
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=good)
    # The combine kernel's NaN path, a row's splits on one warp (3) and spread over 4 and 8
    # warps (33, 128; most of them empty: at most 40 keys, 3 blocks of 16).
    wants = {s: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=good, num_splits=s)
             for s in (3, 33, 128)}

    def check(bad_rows, **kw):
        for splits, expected in ((0, want), *wants.items()):
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=splits,
                                               return_softmax_lse=True, **kw)
            torch.cuda.synchronize()
            for b in range(batch):
                if b in bad_rows:
                    assert torch.isnan(out[b]).all() and torch.isnan(lse[b]).all(), (kw, b)
                else:
                    assert torch.equal(out[b], expected[b]), (kw, b)

    check({1}, cache_seqlens=torch.tensor([10, -3, 30, 40], dtype=torch.int32, device="cuda"))
    check({2}, cache_seqlens=torch.tensor([10, 20, 65, 40], dtype=torch.int32, device="cuda"))
    check({3}, cache_seqlens=torch.tensor([10, 20, 30, 2**40], device="cuda"))  # int64
    check({0}, cache_seqlens=good,
          cache_leftpad=torch.tensor([11, 0, 0, 0], dtype=torch.int32, device="cuda"))
    check({0, 2}, cache_seqlens=good,
          cache_batch_idx=torch.tensor([-1, 1, 4, 3], dtype=torch.int32, device="cuda"))
    pages = k_cache.view(batch * 4, 16, heads_k, d), v_cache.view(batch * 4, 16, heads_k, d)
    table = torch.arange(batch * 4, dtype=torch.int32, device="cuda").view(batch, 4)
    table[1, 0] = 99
    table[3, 3] = 99  # past row 40: never read, so row 3 stays good
    out = flash_attn_with_kvcache(q, *pages, cache_seqlens=good, block_table=table)
    assert torch.isnan(out[1]).all() and torch.equal(out[3], want[3])
    # Two rows appending into one entry: both refused, and neither writes it.
    new = torch.randn(batch, 1, heads_k, d, device="cuda", dtype=torch.float16)
    k_dup, v_dup = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(
        q, k_dup, v_dup, new, new, cache_seqlens=good,
        cache_batch_idx=torch.tensor([0, 1, 1, 3], dtype=torch.int32, device="cuda"))
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[3]).all()
    assert torch.equal(k_dup[1], k_cache[1]) and torch.equal(v_dup[1], v_cache[1])
    assert not torch.equal(k_dup[0], k_cache[0])  # (row 0 appended)
    # A left pad past cache_seqlens, within the appended rows (FlashAttention-2's rule is
    # cache_leftpad <= cache_seqlens: the pad hid appended keys).  The append kernel takes no
    # pad, so the row's keys are appended at its cache_seqlens as the call asks; its
    # attention row is refused.
    new2 = torch.randn(batch, 2, heads_k, d, device="cuda", dtype=torch.float16)
    out = flash_attn_with_kvcache(
        q, k_cache.clone(), v_cache.clone(), new2, new2, cache_seqlens=good,
        cache_leftpad=torch.tensor([0, 21, 0, 30], dtype=torch.int32, device="cuda"))
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3]]).all()
    # Host-side values are still checked on the host.
    with pytest.raises(ValueError, match="cache_seqlens \\+ seqlen_new must be in"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=64)


def test_a_call_never_synchronises_and_replays_in_a_cuda_graph():
    torch.manual_seed(5)
    batch, heads, heads_k, d, page = 2, 16, 4, 128, 64
    k_pages, v_pages = (torch.randn(8, page, heads_k, d, device="cuda", dtype=torch.bfloat16)
                        for _ in "kv")
    table = torch.randperm(8, device="cuda").view(batch, 4).int()
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
    new = torch.randn(batch, 1, heads_k, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([3, 100], dtype=torch.int32, device="cuda")
    angles = torch.rand(256, 32, device="cuda")
    kw = dict(cache_seqlens=lens, block_table=table, rotary_cos=angles.cos(),
              rotary_sin=angles.sin(), causal=True)
    flash_attn_with_kvcache(q, k_pages, v_pages, new, new, **kw)  # warm-up (kernel attributes)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash_attn_with_kvcache(q, k_pages, v_pages, new, new, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Captured once, replayed for successive lengths: each replay equals an eager call.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        flash_attn_with_kvcache(q, k_pages, v_pages, new, new, **kw)
        with torch.cuda.graph(graph, stream=stream):
            out = flash_attn_with_kvcache(q, k_pages, v_pages, new, new, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(3):
        lens.copy_(torch.tensor([10 + step, 150 + step], dtype=torch.int32))
        k_eager, v_eager = k_pages.clone(), v_pages.clone()
        want = flash_attn_with_kvcache(q, k_eager, v_eager, new, new, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(k_pages, k_eager)


FIRST_CAPTURE = """
import torch, flash_attn_ext
from flash_attn_ext import flash_attn_with_kvcache
torch.manual_seed(3)
large_smem = torch.cuda.get_device_capability() in flash_attn_ext.kvcache._LARGE_SMEM_CAPABILITIES
for d, heads_k, opts in ((64, 1, {}), (64, 1, {"decode_row_lanes": 2}), (128, 8, {})):
    if d > 64 and not large_smem:
        continue  # (such GPUs send head dims above 64 to the packed-sequence kernels)
    q = torch.randn(2, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4096, heads_k, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lens = torch.tensor([4000, 37], dtype=torch.int32, device="cuda")
    with flash_attn_ext.kernel_options(**opts):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        want = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
        torch.cuda.synchronize()
        assert flash_attn_ext.last_plan().kernel.startswith("sm80_decode"), d
        assert torch.equal(out, want), (d, opts)
print("ok")
"""


def test_the_first_call_of_a_process_is_captured_in_a_cuda_graph():
    # A process's first decode call makes the per-device queries (the opt-in to large shared
    # memory, the SM count, the kernel's occupancy for the split heuristic's slots): captured
    # with no warm-up call, in a fresh process where nothing is cached yet, the replay equals
    # an eager call (the other graph tests warm up first).
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_ext.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", FIRST_CAPTURE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("batch,heads_k,seqlen,splits",
                         [(1, 8, 8192, 0), (1, 1, 32768, 0), (2, 1, 4096, 256), (3, 2, 1000, 7)])
def test_the_combine_as_a_dependent_launch_gives_the_same_bits(batch, heads_k, seqlen, splits,
                                                               head_dim, kernel_opts):
    # The option decode_pdl launches the combine as a programmatic dependent of the attention
    # kernel (sm_90): its CTAs start before the attention kernel ends and wait for its partial
    # outputs.  Without that wait it would read out_accum before (or while) it is written.
    # Eager and replayed from a CUDA graph, GQA and MQA, many splits (num_splits up to 256):
    # the same bits as the ordinary launch.
    torch.manual_seed(9)
    q = torch.randn(batch, 1, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_k, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")

    def call():
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits,
                                       return_softmax_lse=True)
    kernel_opts(decode_pdl=False)
    want_out, want_lse = call()
    kernel_opts(decode_pdl=True)
    for _ in range(3):
        out, lse = call()
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph, stream=stream):
            out, lse = call()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.isfinite(want_out).all()


def test_long_caches_split_over_the_sms():
    # B = 1 and 64k keys: the heuristic splits the keys (many CTAs), the combine merges them;
    # num_splits = 1 (one CTA per head) gives the same answer up to rounding.
    torch.manual_seed(6)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 65536, 8, 128, device="cuda", dtype=torch.bfloat16)
                        for _ in "kv")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    one, lse1 = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1,
                                        return_softmax_lse=True)
    true, true_lse = attention_ref(q, k_cache, v_cache, compute_dtype=torch.float32)
    assert (lse1 - true_lse).abs().max().item() < 1e-3
    low, _ = attention_ref(q, k_cache, v_cache, compute_dtype=torch.bfloat16)
    assert_error_rule(out, low.to(torch.bfloat16), true, 2.0, "split")
    assert_error_rule(one, low.to(torch.bfloat16), true, 2.0, "one split")
    assert (lse - true_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize("num_splits", [17, 33, 65, 128, 256])
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (256, torch.float16),
                                     (200, torch.bfloat16)])
def test_many_splits_merge_as_one(num_splits, d, dtype):
    # Few rows and many splits: the combine spreads each row's splits over 2, 4, 8, 8 and 8
    # warps of a CTA (combine_row_warps: more than 16, 32, 64 splits; 256, the most it takes)
    # and adds their parts through shared memory.  135 rows (odd: the last CTA has rows past
    # the end), head dim 200 (a partial second 128-channel chunk); batch row 0 fills every
    # split (the kernel splits the keys in 16-key blocks: 2048 keys, or 4096 at 256 splits,
    # give every split at least one), row 1 is empty (zeros, LSE -inf), row 2 leaves the last
    # splits empty.
    gen = torch.Generator().manual_seed(8000 + num_splits + d)
    batch, seqlen_q, heads, heads_k = 3, 3, 15, 1
    cache_len = max(2048, 16 * num_splits)
    q = torch.randn(batch, seqlen_q, heads, d, generator=gen).to("cuda", dtype)
    k_cache, v_cache = (torch.randn(batch, cache_len, heads_k, d, generator=gen).to("cuda", dtype)
                        for _ in "kv")
    lens = torch.tensor([cache_len, 0, 1337], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                       num_splits=num_splits, return_softmax_lse=True)
    one, lse1 = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=1,
                                        return_softmax_lse=True)
    assert not out[1].any() and torch.isneginf(lse[1]).all(), "an empty row: zeros, lse -inf"
    for b in (0, 2):
        keys, values = k_cache[b:b + 1, :int(lens[b])], v_cache[b:b + 1, :int(lens[b])]
        true, true_lse = attention_ref(q[b:b + 1], keys, values, compute_dtype=torch.float32)
        low, _ = attention_ref(q[b:b + 1], keys, values, compute_dtype=dtype)
        assert_error_rule(out[b:b + 1], low.to(dtype), true, 2.0, f"{num_splits} splits, [{b}]")
        assert_error_rule(one[b:b + 1], low.to(dtype), true, 2.0, f"one split, [{b}]")
        assert (lse[b] - true_lse[0]).abs().max().item() < 1e-3
        assert (lse[b] - lse1[b]).abs().max().item() < 1e-3
        # (fp32 sums in another order, then one rounding: at most an ulp apart)
        ulp = torch.finfo(dtype).eps * one[b].float().abs().max().item()
        assert (out[b].float() - one[b].float()).abs().max().item() <= 2 * ulp


def test_inputs_the_kernels_must_not_mishandle():
    # A misaligned q view (copied, not read with 16-byte copies), a softmax_scale <= 0 (not
    # the decode kernels': their running maximum assumes a positive scale; the CUDA kernels
    # refuse it by name), NaN in q (NaN out and NaN softmax_lse, also through the split merge).
    torch.manual_seed(7)
    k_cache, v_cache = (torch.randn(2, 200, 2, 128, device="cuda", dtype=torch.float16)
                        for _ in "kv")
    buf = torch.randn(2 * 8 * 128 + 4, device="cuda", dtype=torch.float16)
    q = buf[4:].view(2, 1, 8, 128)
    lens = torch.tensor([100, 37], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    want = flash_attn_with_kvcache(q.clone(), k_cache, v_cache, cache_seqlens=lens)
    assert torch.equal(out, want)
    for scale in (-0.1, 0.0):
        with pytest.raises(NotImplementedError, match="positive scale"):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                    softmax_scale=scale)
    q_nan = q.clone()
    q_nan[1, 0, 3, 5] = float("nan")
    for splits in (1, 4):
        out, lse = flash_attn_with_kvcache(q_nan, k_cache, v_cache, cache_seqlens=lens,
                                           num_splits=splits, return_softmax_lse=True)
        assert torch.isnan(out[1, 0, 3]).all() and torch.isnan(lse[1, 3]).all()
        assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()
        assert torch.isfinite(out[1, 0, :3]).all() and torch.isfinite(lse[1, :3]).all()
