"""Small CUDA calls covering every kernel path, for compute-sanitizer (memcheck, racecheck,
synccheck): forward + backward for padded head dims 64/128/256, odd sizes, causal both
alignments, a window, GQA, a mask with a gradient, softcap and dropout; the plain cases again with
the Hopper backward at every head dim it has; softcap, a bias and ALiBi on the Hopper kernels'
general variant, boolean masks on their mask variant, rows a float bias of -1e9 hides (the
backward's exact pass), the Hopper backward's deterministic dQ order; then
flash_attn_with_kvcache on the decode kernels (contiguous, paged with odd page sizes, left
padding, batch indices, appends with rotary, split-KV up to 256 splits, rows whose values break
a rule), and flash_attn_varlen_func on packed sequences (the Hopper forward's and
backward's varlen instantiation: odd and empty sequences, causal, a window, GQA, seqused_k).
`--decode`: only the decode calls; `--ordered`: only the deterministic Hopper backward's
calls; `--hidden`: only the exact pass's; `--hdim256`: only the Hopper backward's head dim 256
calls; `--varlen`: only the packed sequences.

    compute-sanitizer --tool memcheck python dev/gpu/sanitize_cases.py [--decode | --ordered |
        --hdim256 | --varlen | --hidden]
"""

import sys

import torch

import flash_attn_ext
from flash_attn_ext import ops


def decode_cases() -> int:
    """flash_attn_with_kvcache calls on the decode kernels; returns how many ran."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    calls = 0
    for batch, seqlen_q, heads, heads_k, d, page in [(3, 1, 8, 2, 128, 16), (2, 3, 32, 1, 64, 48),
                                                     (2, 2, 6, 3, 256, 0), (3, 1, 4, 4, 40, 0)]:
        cache_len = 96
        entries = batch * cache_len // page if page else batch + 1
        shape = (entries, page or cache_len, heads_k, d)
        k_cache, v_cache = (torch.randn(shape, device=dev, dtype=dt) for _ in "kv")
        q = torch.randn(batch, seqlen_q, heads, d, device=dev, dtype=dt)
        new = torch.randn(batch, 2, heads_k, d, device=dev, dtype=dt)
        lens = torch.randint(0, cache_len - 2, (batch,), device=dev, dtype=torch.int32)
        angles = torch.rand(cache_len, 8, device=dev)
        kw = dict(cache_seqlens=lens, rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                  causal=True)
        if page:
            kw["block_table"] = torch.randperm(entries, device=dev).view(batch, -1).int()
        else:
            kw["cache_batch_idx"] = torch.randperm(batch + 1, device=dev)[:batch].int()
            kw["cache_leftpad"] = (lens // 3).int()
        for splits in (1, 3, 0):
            flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, new, new,
                                                   num_splits=splits, **kw)
            calls += 1
        bad = dict(kw, cache_seqlens=lens + 1000)  # NaN rows, nothing read or written
        if page:
            bad["block_table"] = kw["block_table"] + 10**6
        flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, **bad)
        calls += 1
    # Many splits over few rows: the combine spreads each row's splits over 8 warps (256 and
    # 128 splits, MQA at B = 1; 4090 keys give every one of 256 splits a 16-key block, the
    # last one partial) and over 4 (33 splits, head dim 256, 15 rows: a CTA with a row past
    # the end, a batch row with no key, one whose last splits are empty).
    for batch, heads, d, splits in [(1, 32, 128, 256), (1, 32, 128, 128), (3, 5, 256, 33)]:
        k_cache, v_cache = (torch.randn(batch, 4090, 1, d, device=dev, dtype=dt) for _ in "kv")
        q = torch.randn(batch, 1, heads, d, device=dev, dtype=dt)
        lens = torch.tensor([4090, 0, 1000][:batch], device=dev, dtype=torch.int32)
        flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                               num_splits=splits)
        calls += 1
    torch.cuda.synchronize()
    return calls


def varlen_cases() -> int:
    """flash_attn_varlen_func calls, forward and backward; returns how many ran."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    calls = 0
    for lens_q, lens_k, heads, heads_k, d, kw in [
            ([1, 17, 0, 113, 300], [1, 40, 5, 113, 129], 4, 2, 40, dict(causal=True)),
            ([130, 7, 260], [200, 7, 100], 2, 2, 128, dict(window_size=(50, 7))),
            ([70, 0, 129], [129, 3, 65], 2, 1, 256, dict()),
            ([70, 0, 129], [129, 3, 65], 2, 1, 256, dict(causal=True, deterministic=True)),
            ([300, 5], [300, 64], 2, 2, 64, dict(causal=True, used=[250, 64])),
            # dQ in a fixed order (the writer warp, a counter per padded query block)
            ([1, 17, 0, 300], [1, 40, 5, 290], 4, 2, 128, dict(causal=True, deterministic=True)),
            ([200, 129], [70, 300], 2, 1, 64, dict(deterministic=True))]:
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], device=dev,
                                   dtype=torch.int32) for n in (lens_q, lens_k))
        q = torch.randn(sum(lens_q) + 3, heads, d, device=dev, dtype=dt, requires_grad=True)
        k, v = (torch.randn(sum(lens_k) + 2, heads_k, d, device=dev, dtype=dt,
                            requires_grad=True) for _ in "kv")
        kw = dict(kw)
        used = kw.pop("used", None)
        if used is not None:
            kw["seqused_k"] = torch.tensor(used, device=dev, dtype=torch.int32)
        out = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q),
                                                    max(lens_k), **kw)
        out.backward(torch.randn_like(out))
        calls += 1
    torch.cuda.synchronize()
    return calls


def main() -> None:
    if "--varlen" in sys.argv:
        print(f"sanitize_cases: {varlen_cases()} packed-sequence calls ran")
        return
    if "--decode" in sys.argv:
        print(f"sanitize_cases: {decode_cases()} decode calls ran")
        return
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    cases = [  # (L, S, H, Hkv, D, Dv, causal, window, bottom_right, softcap, bias, dropout)
        (17, 33, 2, 1, 40, 40, True, (-1, -1), True, 0.0, False, 0.0),
        (70, 65, 4, 2, 128, 128, False, (-1, -1), True, 0.0, True, 0.0),
        (33, 70, 2, 2, 256, 200, True, (-1, -1), False, 5.0, False, 0.2),
        (65, 65, 2, 1, 64, 64, False, (8, 3), True, 0.0, False, 0.1),
        (65, 70, 2, 1, 72, 72, True, (-1, -1), True, 0.0, "alibi", 0.1),
        # Plain attention: the Hopper forward on sm_90 (several K/V tiles, partial last ones).
        (130, 300, 2, 1, 128, 128, True, (-1, -1), True, 0.0, False, 0.0),
        (70, 200, 2, 2, 256, 256, False, (-1, -1), True, 0.0, False, 0.0),
        (300, 129, 2, 2, 64, 64, False, (40, 5), False, 0.0, False, 0.0),
        # Causal, one KV head per query head, several query blocks per head: the partial
        # block first (row shift) at head dim 64, the longest-first tile order in sections.
        (1000, 1000, 2, 2, 64, 64, True, (-1, -1), False, 0.0, False, 0.0),
        (300, 300, 2, 2, 256, 256, True, (-1, -1), False, 0.0, False, 0.0),
        # More (query block, head) tiles than SMs.
        (260, 260, 40, 8, 64, 64, True, (-1, -1), True, 0.0, False, 0.0),
        # Five or six tiles per CTA on an H200 (768 tiles, static schedule): head dim 64's two
        # Q buffers each refilled after their release, both phases of their barriers.
        (400, 400, 128, 128, 64, 64, False, (-1, -1), True, 0.0, False, 0.0),
        # GQA packed into shared tiles (seqlen_q * group rows; Q by cp.async, O from registers).
        (5, 300, 16, 2, 128, 128, True, (-1, -1), True, 0.0, False, 0.0),
        (40, 200, 12, 4, 64, 64, False, (20, 0), True, 0.0, False, 0.0),
    ]
    # The backward's deterministic path (the separate dQ kernel) for the last three cases (head
    # dims 64 and 128) and a head dim 256 GQA case (also run with the atomic dQ); the others
    # take the atomic / bulk dQ.
    deterministic = [False] * (len(cases) - 3) + [True] * 3
    cases += [(300, 257, 4, 2, 256, 256, True, (-1, -1), True, 0.0, False, 0.0)] * 2
    deterministic += [False, True]
    # Then the plain, non-deterministic cases again with the Hopper backward wherever it applies
    # (sm_90: every head dim, including 64, where it is not the default).
    plain = [i for i, c in enumerate(cases) if c[9] == 0.0 and not c[10] and c[11] == 0.0
             and not deterministic[i]]
    runs = [(i, {}, True) for i in range(len(cases))] + \
        [(i, {"sm90_bwd": "on"}, True) for i in plain]
    # The Hopper kernels' general variant (softcap, a bias without gradient, ALiBi, dropout),
    # partial tiles, forward at head dims 64, 128, 256 and backward at 64 and 128.
    # "padding": a causal + key-padding mask as 0 / -inf, (2, 1, L, S): blocks the summary
    # skips (bias_blocks.h), blocks read without the bias, mixed ones, one batch entry empty.
    general = [(70, 300, 4, 2, 40, 40, True, (-1, -1), True, 5.0, True, 0.0),
               (300, 129, 2, 1, 128, 128, False, (50, 7), False, 0.0, True, 0.0),
               (130, 70, 2, 2, 256, 256, False, (-1, -1), True, 30.0, True, 0.0),
               (700, 700, 2, 1, 128, 128, False, (-1, -1), True, 0.0, "padding", 0.0),
               (400, 300, 2, 2, 64, 64, False, (-1, -1), True, 0.0, "padding", 0.0),
               # ALiBi ((2, H) slopes), alone with causal and with softcap and a window.
               (300, 129, 2, 1, 128, 128, True, (-1, -1), True, 0.0, "alibi", 0.0),
               (130, 200, 4, 2, 64, 64, False, (30, 4), False, 5.0, "alibi", 0.0),
               # Dropout (dropout.h's cells: lanes swap halves of Philox calls), with a mask.
               (300, 129, 2, 1, 128, 128, True, (-1, -1), True, 0.0, "padding", 0.1),
               (130, 200, 4, 2, 64, 64, False, (-1, -1), True, 0.0, False, 0.3),
               # dropout alone at head dim 256 (the split's keep bits in P^T's sign)
               (130, 200, 2, 1, 256, 256, True, (-1, -1), True, 0.0, False, 0.2),
               # A boolean mask alone: the mask variant (a byte per score in mixed blocks), the
               # padding mask above as booleans, and a dense random one with an odd row stride.
               (700, 700, 2, 1, 128, 128, False, (-1, -1), True, 0.0, "bool_padding", 0.0),
               (400, 300, 2, 2, 64, 64, True, (-1, -1), True, 0.0, "bool_padding", 0.0),
               (130, 201, 2, 2, 256, 256, False, (-1, -1), True, 0.0, "bool_random", 0.0),
               (201, 129, 4, 2, 40, 40, False, (30, 4), True, 0.0, "bool_random", 0.0)]
    cases += general
    deterministic += [False] * len(general)
    runs += [(i, {"sm90_bwd": "on"}, False)
             for i in range(len(cases) - len(general), len(cases))]
    # Rows a float bias of -1e9 hides entirely (the backward's exact pass around the main
    # kernels: flagged rows, their dq rows and their dk / dv added in key tiles), with the
    # bias's gradient (the portable backward) and without (the Hopper general variant), GQA,
    # dropout, softcap, a window; more than one window of rows and of key tiles.
    hidden = [(300, 129, 4, 2, 128, 128, False, (-1, -1), True, 0.0, "hidden", 0.1),
              (70, 300, 2, 1, 64, 40, True, (-1, -1), False, 5.0, "hidden", 0.0),
              (260, 70, 2, 2, 256, 256, False, (30, 4), True, 0.0, "hidden", 0.0)]
    cases += hidden
    deterministic += [False, True, False]
    runs += [(i, opts, grad) for i in range(len(cases) - len(hidden), len(cases))
             for opts, grad in (({}, True), ({"sm90_bwd": "on"}, False))]
    # deterministic=True on the Hopper backward (the dQ writer warp and its barriers): a window
    # (descending order), no mask (rotated), the general and the mask variants; at head dim 256
    # the split's order warp (run_split_dq_order), causal (descending) and rotated, and the
    # mask variant there (steps of wholly masked blocks counted in by the order warp).
    ordered = [(300, 129, 2, 1, 128, 128, False, (50, 7), False, 0.0, False, 0.0),
               (300, 129, 2, 1, 256, 256, True, (-1, -1), True, 0.0, False, 0.0),
               (129, 300, 4, 2, 256, 256, False, (-1, -1), True, 0.0, False, 0.0),
               (400, 330, 2, 1, 256, 256, True, (-1, -1), True, 0.0, "bool_padding", 0.0),
               (129, 300, 4, 2, 64, 64, False, (-1, -1), True, 0.0, False, 0.0),
               (400, 300, 2, 2, 64, 64, False, (-1, -1), True, 0.0, "padding", 0.1),
               (700, 700, 2, 1, 128, 128, True, (-1, -1), True, 0.0, "bool_padding", 0.0)]
    cases += ordered
    deterministic += [True] * len(ordered)
    runs += [(i, {}, False) for i in range(len(cases) - len(ordered), len(cases))]
    if "--hidden" in sys.argv:  # only the exact pass's calls
        runs = [r for r in runs if cases[r[0]][10] == "hidden"]
    if "--ordered" in sys.argv:  # only those (synccheck, racecheck: their barriers)
        runs = runs[-len(ordered):]
    if "--hdim256" in sys.argv:  # only the Hopper backward's head dim 256 (its split by role)
        runs = [r for r in runs if cases[r[0]][4] > 128 and
                (r[1] and cases[r[0]][10] is False or str(cases[r[0]][10]).startswith("bool"))]
    for i, options, bias_grad in runs:
        with flash_attn_ext.kernel_options(**options):
            run_case(cases[i], deterministic[i], dev, dt, bias_grad)
    only = any(a in sys.argv for a in ("--ordered", "--hdim256", "--hidden"))
    decode = decode_cases() if not only else 0
    packed = varlen_cases() if not only else 0
    print(f"sanitize_cases: {len(runs)} cases, {decode} decode and {packed} packed-sequence "
          "calls ran")


def run_case(case, deterministic, dev, dt, bias_grad=True):
    """One forward and backward through the ops (the kernels the rule picks for them);
    bias_grad: whether the backward computes the bias's gradient."""
    L, S, H, Hkv, D, Dv, causal, window, br, softcap, has_bias, p = case
    q = torch.randn(2, L, H, D, device=dev, dtype=dt)
    k = torch.randn(2, S, Hkv, D, device=dev, dtype=dt)
    v = torch.randn(2, S, Hkv, Dv, device=dev, dtype=dt)
    bias = torch.randn(2, 1, L, S, device=dev) if has_bias is True else None
    slopes = torch.rand(2, H, device=dev) if has_bias == "alibi" else None
    if has_bias in ("padding", "bool_padding"):
        i, j = torch.arange(L, device=dev)[:, None], torch.arange(S, device=dev)[None, :]
        visible = (j <= i + S - L) & (j < torch.tensor([S * 2 // 3, 0], device=dev)[:, None, None])
        bias = torch.zeros(2, 1, L, S, device=dev).masked_fill(~visible[:, None], float("-inf"))
        if has_bias == "bool_padding":
            bias = visible[:, None]
    if has_bias == "bool_random":
        bias = torch.rand(2, H, L, S, device=dev) < 0.6
    if has_bias == "hidden":  # rows hidden by a huge finite value: the exact pass (exact_rows.h)
        bias = torch.randn(2, H, L, S, device=dev)
        bias[:, :, ::7] = -1e9
    out, lse, rng = ops.fwd(q, k, v, None, causal, window[0], window[1], br, softcap, slopes,
                            bias, p)
    grads = ops.bwd_op(torch.randn_like(out), q, k, v, out, lse, rng, None, causal,
                       window[0], window[1], br, softcap, slopes, bias, p, deterministic,
                       bias is not None and bias.is_floating_point() and bias_grad)
    torch.cuda.synchronize()
    assert all(torch.isfinite(g).all() for g in grads if g.numel())


if __name__ == "__main__":
    main()
