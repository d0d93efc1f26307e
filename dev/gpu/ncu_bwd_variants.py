"""One forward + backward per bench_score_mods case inside a profiler range, for ncu of the
Hopper backward's kernels side by side (bf16, B * L = 16k tokens, H * d = 2048, SDPA's
(B, H, L, d) layout, as benchmarks/bench_score_mods.py): what the mask variant's backward costs
against the causal flag's on the same shape.  Launch order (= ncu's report order with the
filter below): the cases in the order given.

    ncu --profile-from-start off -k regex:flash_bwd_sm90_kernel --set full \
        --import-source yes -o /tmp/bwd python dev/gpu/ncu_bwd_variants.py \
        --dim 64 --cases causal causal_padding

then `dev/gpu/ncu_sass_summary.py` on each launch's SASS page (`ncu -i ... --page source
--print-source sass --csv`).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from bench_score_mods import CASES, implementations, make_case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=["causal", "causal_padding"])
    args = parser.parse_args()
    torch.manual_seed(0)
    d, seqlen = args.dim, args.seqlen
    batch, heads = max(1, 16384 // seqlen), 2048 // d
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in "qkv")
    dout = torch.randn_like(q)
    calls = [(case, make_case(case, batch, seqlen, d), implementations(case, False, d)["ours"])
             for case in args.cases]

    def run(spec, ours):
        out = ours(q, k, v, spec)
        torch.autograd.grad(out, (q, k, v), dout)

    for _, spec, ours in calls:  # warm up (and load every kernel) outside the profiled range
        run(spec, ours)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for case, spec, ours in calls:
        run(spec, ours)
        print("launched:", case, flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
