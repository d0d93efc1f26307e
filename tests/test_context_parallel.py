"""PyTorch's own context parallelism (torch.distributed.tensor.experimental.context_parallel:
its DTensor dispatch, ring loop, load balancer, (out, lse) merger and ring backward) on our
kernels, over two gloo processes on the CPU.

Each rank registers our kernels for the aten flash ops under the CPU key
(``torch_flash.register_kernels("CPU")``; PyTorch has no CPU kernel for these ops, so nothing
else can serve them) and counts the calls into the registered impls.  The public API shards q,
k, v and dout in place (``context_parallel(mesh, buffers=..., buffer_seq_dims=...,
no_restore_buffers=...)``, head-tail load balancing where the sequence allows), the call goes
through CP's patched ``F.scaled_dot_product_attention``, the ring calls
``aten._scaled_dot_product_flash_attention`` once per ring step on each rank's shard pair, and
autograd reaches ``_scaled_dot_product_flash_attention_backward`` through the same dispatch;
``context_parallel_unshard`` gathers out, dq, dk, dv and undoes the load balancing.  They must
equal one single-process call of our kernels on the whole sequence, and each rank's calls must
be exactly the ring steps PyTorch's algorithm makes (so no step ran elsewhere).

What cannot run on the CPU as on a GPU: ``F.scaled_dot_product_attention`` on CPU tensors
picks ``aten._scaled_dot_product_flash_attention_for_cpu``, for which DTensor has no sharding
strategy and which CP's handler does not take (NotImplementedError: checked below).  On CUDA,
SDPA's FLASH backend calls ``aten._scaled_dot_product_flash_attention`` instead.  So here the
function CP patches is, for the duration of a case, a stand-in that calls that aten op (what
SDPA's FLASH backend does, without the backend choice); everything after it is PyTorch's CP
code unchanged.

Findings fixed here: gloo serves both rotate methods ("allgather": all_gather_single;
"alltoall": permute_tensor, i.e. all_to_all_single; the backward always rotates dk/dv by
all-to-all); the shards must be equal (L a multiple of the world size: the ring exchanges
fixed-size buffers, and an odd L aborts gloo); head-tail load balancing needs L a multiple of
2 * world size (otherwise context_parallel silently turns it off); not-causal attention needs
load balancing off, which only the private ``_cp_options.enable_load_balance`` does; CP merges
and accumulates in float32 by default (``_cp_options.convert_to_f32``), so float64 inputs are
exact to float64 only with that private option off.
"""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 2

# (name, causal, seqlen, rotate method, dtype, convert_to_f32).  44 = 4 * 11: head-tail load
# balancing (chunks of 11); 38 = 2 * 19: equal shards, no load balancing (38 % 4 != 0).
CASES = [
    ("causal_balanced_allgather", True, 44, "allgather", torch.float64, False),
    ("causal_balanced_alltoall", True, 44, "alltoall", torch.float64, False),
    ("causal_unbalanced_alltoall", True, 38, "alltoall", torch.float64, False),
    ("full_allgather", False, 38, "allgather", torch.float64, False),
    ("full_alltoall", False, 38, "alltoall", torch.float64, False),
    ("causal_balanced_fp32_merge", True, 44, "allgather", torch.float64, True),
    ("causal_balanced_float32", True, 44, "alltoall", torch.float32, True),
]

B, H, H_KV, D = 2, 4, 2, 16  # GQA: 2 query heads per key/value head


def cp_private():
    """The private CP options the tests need (torch 2.9+ keeps them in _context_parallel;
    the old module path re-exports them)."""
    from torch.distributed.tensor.experimental import _attention
    return _attention


def make(seqlen, dtype):
    g = torch.Generator().manual_seed(seqlen)
    shapes = [(B, H, seqlen, D), (B, H_KV, seqlen, D), (B, H_KV, seqlen, D), (B, H, seqlen, D)]
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]  # q, k, v, dout


def expected_calls(rank, causal, seqlen):
    """The (kind, L_q, L_k, is_causal) of each call PyTorch's ring makes on ``rank`` of two:
    step 0 the rank's own shards; step 1 the other rank's key/value shard, which with load
    balancing is the first half of it (rank 1) or serves the second half of the queries
    (rank 0), without load balancing is skipped on rank 0 when causal."""
    n = seqlen // WORLD
    balanced = causal and seqlen % (2 * WORLD) == 0
    steps = [(n, n, causal)]
    if balanced:
        steps.append((n // 2, n, False) if rank == 0 else (n, n // 2, False))
    elif not causal or rank == 1:
        steps.append((n, n, False))
    return [("fwd",) + s for s in steps] + [("bwd",) + s for s in steps]


def _counting(torch_flash, calls):
    """Wraps the impls register_kernels registers so that each call is recorded."""
    forward, backward = torch_flash._sdpa_forward, torch_flash._sdpa_backward

    def sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, *args, **kwargs):
        calls.append(("fwd", query.shape[2], key.shape[2], bool(is_causal)))
        return forward(query, key, value, dropout_p, is_causal, *args, **kwargs)

    def sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                      max_k, dropout_p, is_causal, *args, **kwargs):
        calls.append(("bwd", query.shape[2], key.shape[2], bool(is_causal)))
        return backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                        max_q, max_k, dropout_p, is_causal, *args, **kwargs)

    torch_flash._sdpa_forward, torch_flash._sdpa_backward = sdpa_forward, sdpa_backward


def flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """What SDPA's FLASH backend calls on CUDA: aten._scaled_dot_product_flash_attention on
    (B, H, L, D) q and (B, H_kv, S, D) k, v; returns out (B, H, L, D)."""
    if attn_mask is not None:
        raise RuntimeError("the flash op takes no attn_mask")
    return torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, scale=scale)[0]


flash_sdpa.__name__ = "scaled_dot_product_attention"  # (CP patches F by the function's name)


def run_case(mesh, causal, seqlen, rotate, dtype, convert_to_f32):
    """One case on this rank: (out, dq, dk, dv) unsharded, in sequence order."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import (
        context_parallel_unshard,
        set_rotate_method,
    )
    options = cp_private()._cp_options
    saved = (options.enable_load_balance, options.convert_to_f32, options.rotate_method)
    options.enable_load_balance = causal  # (not-causal CP refuses load balancing)
    options.convert_to_f32 = convert_to_f32
    set_rotate_method(rotate)
    real_sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = flash_sdpa
    try:
        q, k, v, dout = make(seqlen, dtype)
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                              no_restore_buffers={q, k, v, dout}):
            assert q.shape[2] == seqlen // WORLD
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            assert type(out) is torch.Tensor  # (CP's output hook returns the local shard)
            out.backward(dout)
            local = [out.detach()] + [t.grad for t in leaves]
        # (unshard undoes the load balancing the context applied: same option state)
        return context_parallel_unshard(mesh, local, [2, 2, 2, 2])
    finally:
        F.scaled_dot_product_attention = real_sdpa
        options.enable_load_balance, options.convert_to_f32, options.rotate_method = saved


def real_sdpa_error(mesh):
    """The error F.scaled_dot_product_attention raises on CPU tensors under context_parallel
    (None if it runs)."""
    from torch.distributed.tensor.experimental import context_parallel
    q = torch.randn(1, 2, 8, 16)
    with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2], no_restore_buffers={q}):
        try:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        except Exception as e:  # (recorded for the test to check)
            return f"{type(e).__name__}: {e}"
    return None


def _worker(rank, port, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    from flash_attn_ext import _C
    from flash_attn_ext.integrations import torch_flash
    _C.set_debug_poison(True)  # (as the suite's conftest: unwritten outputs are NaN)
    calls = []
    _counting(torch_flash, calls)
    lib = torch_flash.register_kernels("CPU")
    saved = False
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        results = {"real_sdpa_error": real_sdpa_error(mesh)}
        for name, *case in CASES:
            del calls[:]
            results[name] = dict(grads=run_case(mesh, *case), calls=list(calls))
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks saved: no collective of either is in flight at teardown
        saved = True
    finally:
        lib._destroy()
        dist.destroy_process_group()
    if saved:
        # Without the interpreter's own teardown: once, on a loaded machine, a rank aborted
        # there ("terminate called without an active exception", from gloo's threads) after
        # both had saved their results, which failed the whole module.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results of every case, from one spawn of two gloo processes."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        options = cp_private()._cp_options
        options.enable_load_balance, options.convert_to_f32  # noqa: B018
    except (ImportError, AttributeError) as e:
        pytest.skip(f"this torch's context parallelism lacks what the test drives: {e}")
    path = tmp_path_factory.mktemp("cp")
    mp.spawn(_worker, args=(_free_port(), str(path)), nprocs=WORLD)
    return [torch.load(path / f"rank{r}.pt") for r in range(WORLD)]


def single_process(causal, seqlen, dtype):
    """(out, dq, dk, dv), (B, H, L, D) layout, of one call of our kernels on the whole
    sequence."""
    from flash_attn_ext import flash_attn_func
    q, k, v, dout = make(seqlen, dtype)
    leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=causal)
    out.backward(dout.transpose(1, 2))
    return [t.transpose(1, 2) for t in [out.detach()] + [t.grad for t in leaves]]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pytorch_context_parallel_on_our_kernels(ranks, case):
    name, causal, seqlen, _, dtype, convert_to_f32 = case
    want = single_process(causal, seqlen, dtype)
    # Exact to the precision of the merge: float64 where CP keeps float64, else CP's float32
    # merge and dk/dv accumulation (a few float32 ulps).
    tol = 1e-12 if dtype == torch.float64 and not convert_to_f32 else 1e-5
    for rank, result in enumerate(ranks):
        got = result[name]["grads"]
        for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert g.shape == w.shape and g.dtype == dtype, (what, g.shape, g.dtype)
            err = (g - w).abs().max().item()
            assert err <= tol * max(1.0, w.abs().max().item()), (rank, what, err)
        # Every ring step, forward and backward, ran through our registered impls.
        assert result[name]["calls"] == expected_calls(rank, causal, seqlen), rank


def test_cpu_sdpa_does_not_reach_the_ring(ranks):
    # Why the cases call the aten flash op through a stand-in: on the CPU, SDPA picks
    # _scaled_dot_product_flash_attention_for_cpu, which DTensor cannot shard (if a torch
    # version changes this, the stand-in may no longer be needed).
    for result in ranks:
        error = result["real_sdpa_error"]
        assert error is not None and "_scaled_dot_product_flash_attention_for_cpu" in error, \
            error
