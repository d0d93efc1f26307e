"""The contract that context parallelism (ring attention: PyTorch's context_parallel, or any
sequence-sharded training) relies on, on the CPU: attention over key/value shards, one call of
our op per (query shard, key/value shard) pair returning (out, softmax_lse), merged in fp32 as
    lse = logsumexp_j lse_j,   out = sum_j exp(lse_j - lse) out_j,
equals attention over the whole sequence, forward and backward (the gradient reaches q, k and v
through out and through softmax_lse).  Causal attention with the sequence split in chunks:
a query chunk sees earlier key chunks whole, its own chunk under the causal mask, later chunks
not at all; or, in one call, the prefix of keys up to its chunk with bottom-right alignment
(L != S).  Head-tail load balancing (rank r holds chunks r and 2R-1-r) only reassigns chunks.
Across processes: two gloo ranks, each holding one shard of q, k and v."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_attn_ext import flash_attn_func


def partial_attention(q, k, v, causal):
    """(out, softmax_lse (B, H, L)) of one shard pair in softmax_lse's dtype (float32; float64
    for float64 inputs); causal bottom-right."""
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    return out.to(lse.dtype), lse


def merge(parts):
    """Merges [(out_j (B, L, H, D), lse_j (B, H, L))] over key/value shards, in their (fp32 or
    fp64) dtype."""
    lses = torch.stack([lse for _, lse in parts])  # (J, B, H, L)
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse).transpose(-1, -2).unsqueeze(-1)  # (J, B, L, H, 1)
    out = sum(w * o for w, (o, _) in zip(weights, parts))
    return out, lse


def chunked_attention(q, k, v, chunks, causal, prefix=False):
    """Attention of q over k, v with the sequence split into `chunks` equal chunks: per query
    chunk, one call per key chunk it sees (merged), or with prefix=True one call over the key
    prefix up to and including its chunk (causal bottom-right, L != S).  Returns out and the
    merged softmax_lse (B, H, L)."""
    qs, ks, vs = (t.chunk(chunks, dim=1) for t in (q, k, v))
    outs, lses = [], []
    for i, qi in enumerate(qs):
        if prefix and causal:
            kp, vp = torch.cat(ks[: i + 1], 1), torch.cat(vs[: i + 1], 1)
            out, lse = partial_attention(qi, kp, vp, True)
        else:
            out, lse = merge([partial_attention(qi, ks[j], vs[j], causal and j == i)
                              for j in range(chunks) if not (causal and j > i)])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 2)


def make(seqlen=96, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(2, seqlen, 4, 16, dtype=dtype)
    k = torch.randn(2, seqlen, 2, 16, dtype=dtype)
    v = torch.randn(2, seqlen, 2, 24, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("causal,prefix", [(False, False), (True, False), (True, True)],
                         ids=["full", "causal_chunks", "causal_prefix"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sharded_attention_merges_to_the_whole(causal, prefix, dtype):
    q, k, v = make(dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = chunked_attention(*leaves, chunks=4, causal=causal, prefix=prefix)
    ref, ref_lse = flash_attn_func(*ref_leaves, causal=causal, return_softmax_lse=True)
    dout = torch.randn_like(ref)
    (out * dout).sum().backward()
    (ref * dout).sum().backward()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), atol=tol, rtol=tol)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=10 * tol, rtol=10 * tol)


def test_head_tail_load_balancing_reassigns_chunks_only():
    # Rank r of R holds query chunks r and 2R-1-r (equal causal work per rank); its results,
    # put back in sequence order, are the whole causal attention.
    q, k, v = make(seqlen=128)
    ranks, chunks = 2, 4
    qs, ks, vs = (t.chunk(chunks, dim=1) for t in (q, k, v))
    by_chunk = {}
    for r in range(ranks):
        for c in (r, 2 * ranks - 1 - r):
            parts = [partial_attention(qs[c], ks[j], vs[j], j == c) for j in range(c + 1)]
            by_chunk[c] = merge(parts)[0]
    out = torch.cat([by_chunk[c] for c in range(chunks)], 1)
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ring_worker(rank, world, port, causal, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        q, k, v = make(seqlen=64)
        dout = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=torch.float64,
                           generator=torch.Generator().manual_seed(1))
        mine = [t.chunk(world, dim=1)[rank].contiguous() for t in (q, k, v, dout)]
        q_shard, k_shard, v_shard, dout_shard = mine
        # Every rank's key/value shard (as a ring delivers them, one per step), as leaves whose
        # gradients go back to their owners.
        kv = []
        for t in (k_shard, v_shard):
            shards = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(shards, t)
            kv.append([s.requires_grad_() for s in shards])
        q_leaf = q_shard.clone().requires_grad_()
        parts = [partial_attention(q_leaf, kv[0][j], kv[1][j], causal and j == rank)
                 for j in range(world) if not (causal and j > rank)]
        out, _ = merge(parts)
        (out * dout_shard).sum().backward()
        grads = [q_leaf.grad]
        for shards in kv:  # dK, dV of each shard summed on its owner
            mine_grad = None
            for j, s in enumerate(shards):
                g = s.grad if s.grad is not None else torch.zeros_like(s)
                dist.reduce(g, dst=j)
                if j == rank:
                    mine_grad = g
            grads.append(mine_grad)
        torch.save(dict(out=out.detach(), grads=grads),
                   os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal", [False, True])
def test_ring_over_two_gloo_processes(tmp_path, causal):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    world = 2
    mp.spawn(_ring_worker, args=(world, _free_port(), causal, str(tmp_path)), nprocs=world)
    q, k, v = make(seqlen=64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attn_func(*leaves, causal=causal)
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (ref * dout).sum().backward()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    out = torch.cat([r["out"] for r in results], 1)
    torch.testing.assert_close(out, ref.detach())
    for i, leaf in enumerate(leaves):
        got = torch.cat([r["grads"][i] for r in results], 1)
        torch.testing.assert_close(got, leaf.grad, atol=1e-10, rtol=1e-10)
