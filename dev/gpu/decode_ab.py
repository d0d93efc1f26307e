"""A kernel option of the decode call, A/B in one process: flash_attn_with_kvcache with each
value of one option of flash_attn_ext.kernel_options (decode_ctas_per_sm: the CTAs per SM the
split heuristic takes as resident; decode_row_lanes: lanes per cache row of
the copies at head dim 64; decode_pdl: the combine as a programmatic dependent launch;
decode_contiguous_loads: a contiguous cache's rows by offsets alone or by the paged lookup), one
query token, 32 query heads, bf16, a full contiguous cache; graph-replayed time per call and
K/V TB/s in interleaved rounds (A B C A B C ...), SDPA's FLASH and cuDNN backends on the same
cache, and the device copy rate.  Checks that every value gives the first value's bits, or
says the largest difference where a value changes the split count.

Usage on the GPU machine:
    python3 dev/gpu/decode_ab.py --option decode_row_lanes --values 2 4 8 --dims 64 \
        --fixed decode_ctas_per_sm=4
    python3 dev/gpu/decode_ab.py --option decode_ctas_per_sm --values "'auto'" 2 \
        --points mqa --dims 64 128
    python3 dev/gpu/decode_ab.py --option decode_pdl --values True False --points small
    python3 dev/gpu/decode_ab.py --option decode_contiguous_loads --values True False \
        --points small --l2 cold
    python3 dev/gpu/decode_ab.py --option decode_block_rows --values 16 32 --points mqa \
        --dims 128 64
"""
import argparse
import ast
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from timing import graph_ms

import flash_attn_ext

# (batch, seqlen, heads_kv): GQA 32:8 and MQA (docs/perf/decode.md).
POINTS = {
    "all": [(64, 8192, 8), (8, 131072, 8), (1, 131072, 8), (8, 32768, 8), (1, 8192, 8),
            (64, 32768, 1), (8, 131072, 1), (1, 131072, 1)],
    # the calls that split the keys (a combine kernel) and are short
    "small": [(1, 8192, 8), (1, 32768, 8), (8, 1024, 8), (1, 32768, 1), (8, 32768, 1),
              (1, 131072, 1), (1, 131072, 8), (8, 32768, 8)],
    # MQA across the batch sizes where decode_block_rows' rule turns from 16 rows to 32 (at
    # batch 32: 32 CTAs of 32 rows; measured 16 better at 8, 32 better at 64)
    "mqa": [(8, 32768, 1), (16, 32768, 1), (24, 32768, 1), (32, 32768, 1), (48, 32768, 1),
            (64, 32768, 1), (16, 8192, 1), (32, 8192, 1), (64, 8192, 1)],
    # GQA 32:8 at head dim 64 around the batches where the occupancy would change the split
    # count (docs/perf/decode.md, "The slots"; B = 24: 4 splits trimmed to one resident wave
    # of 2)
    "gqa": [(8, 1024, 8), (16, 1024, 8), (24, 1024, 8), (32, 1024, 8), (48, 1024, 8),
            (8, 8192, 8), (16, 8192, 8), (24, 8192, 8), (32, 8192, 8), (48, 8192, 8),
            (8, 32768, 8)],
}
HEADS = 32


def layer_count(nbytes: int, l2: str) -> int:
    """Caches the timed graph reads in turn: 1 ("warm": the same cache every call, which stays
    in L2 where it fits: a 32 MB cache of B = 1, S = 8k, H_kv = 8 on a 50 MB L2), or enough
    that the bytes read between two reads of one cache exceed three times the L2 ("cold": a
    decode step over many layers, each layer's cache read once; ncu at 31c850e put our small
    call's attention kernel at 14.7 us warm and 18.8 cold, cuDNN's at 11.7 and 17.3)."""
    if l2 == "warm":
        return 1
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20
    return min(64, max(1, -(-3 * l2_bytes // nbytes)))  # (64: a graph of bounded size)


def point(batch, seqlen, heads_kv, d, option, values, rounds, l2="warm", fixed=None):
    torch.manual_seed(0)  # (drawn on the GPU: a 2 GB cache drawn on the CPU takes seconds)
    q = torch.randn(batch, 1, HEADS, d, device="cuda", dtype=torch.bfloat16)
    shape = (batch, seqlen, heads_kv, d)
    nbytes = 2 * batch * seqlen * heads_kv * d * 2
    layers = [tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv")
              for _ in range(layer_count(nbytes, l2))]
    k, v = layers[0]
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")

    def ours_one():
        return flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)

    def ours():  # every layer once; the time per call is the graph's over len(layers)
        for kl, vl in layers:
            flash_attn_ext.flash_attn_with_kvcache(q, kl, vl, cache_seqlens=lens)
    outs, best = [], [float("inf")] * len(values)
    for value in values:
        with flash_attn_ext.kernel_options(**{**(fixed or {}), option: value}):
            outs.append(ours_one())
    same = all(torch.equal(out, outs[0]) for out in outs)
    # (values that change the split count round differently: the largest difference says
    # whether it is rounding)
    diff = max((out.float() - outs[0].float()).abs().max().item() for out in outs)
    for _ in range(rounds):
        for i, value in enumerate(values):
            with flash_attn_ext.kernel_options(**{**(fixed or {}), option: value}):
                best[i] = min(best[i], graph_ms(ours, reps=10, groups=3) / len(layers))
    row = [f"B={batch:3d} S={seqlen:6d} H_kv={heads_kv} d={d:3d}"]
    if l2 == "cold":
        row[0] += f" layers={len(layers)}"
    row += [f"{value}: {ms * 1e3:6.1f} us {nbytes / ms / 1e9:5.2f} TB/s"
            for value, ms in zip(values, best)]
    qs = q.transpose(1, 2)
    kvs = [(kl.transpose(1, 2), vl.transpose(1, 2)) for kl, vl in layers]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def peer(b=backend):
            with sdpa_kernel(b):
                for ks, vs in kvs:
                    F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        try:
            ms = graph_ms(peer, reps=10, groups=3) / len(layers)
            row.append(f"{name} {ms * 1e3:6.1f} us {nbytes / ms / 1e9:5.2f}")
        except RuntimeError as e:
            row.append(f"{name} refused ({str(e).splitlines()[0][:30]})")
    src = torch.cat([k.flatten(), v.flatten()])
    dst = torch.empty_like(src)
    copy_ms = graph_ms(lambda: dst.copy_(src), reps=10, groups=3)
    row.append(f"copy {2 * nbytes / copy_ms / 1e9:5.2f}")  # (read + write)
    row.append("bits equal" if same else f"bits differ (max {diff:.1e})")
    return "  ".join(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", required=True, help="a kernel option, e.g. decode_pdl")
    parser.add_argument("--values", nargs="+", required=True,
                        help="its values (Python literals: 2, True, 'auto')")
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--points", choices=sorted(POINTS), default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--l2", choices=["warm", "cold"], default="warm",
                        help="cold: each timed call reads another copy of the cache, as a decode "
                             "step over many layers does (layer_count)")
    parser.add_argument("--fixed", nargs="*", default=[], metavar="OPTION=VALUE",
                        help="other kernel options held for every value, e.g. "
                             "decode_ctas_per_sm=4 when A/B-ing the load forms (their "
                             "occupancies differ, so the heuristic's split counts would too)")
    args = parser.parse_args()
    values = [ast.literal_eval(v) for v in args.values]
    fixed = {k: ast.literal_eval(v) for k, v in (f.split("=", 1) for f in args.fixed)}
    print(torch.cuda.get_device_name(), torch.__version__, f"{args.option}: {values}", flush=True)
    for d in args.dims:
        for batch, seqlen, heads_kv in POINTS[args.points]:
            print(point(batch, seqlen, heads_kv, d, args.option, values, args.rounds, args.l2,
                        fixed), flush=True)


if __name__ == "__main__":
    main()
