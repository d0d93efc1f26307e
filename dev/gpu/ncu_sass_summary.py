"""Summarize ncu's per-SASS-instruction counts of one kernel, or compare two kernels.

Where a variant's extra time goes (its extra instructions, per loop iteration, and its stalls)
is what this answers; ncu's details page gives totals only.  Capture on the device (one launch
each; `dev/gpu/ncu_fwd_variants.py` lists its launches):

    ncu --profile-from-start off -k regex:flash_fwd_sm90 --launch-skip 1 --launch-count 1 \\
        --set full -o /tmp/causal python3 dev/gpu/ncu_fwd_variants.py --dim 64
    ncu -i /tmp/causal.ncu-rep --page source --print-source sass --csv | gzip > causal.csv.gz

then here, without a GPU:

    python dev/gpu/ncu_sass_summary.py causal.csv.gz [mask.csv.gz] [--loop 524288] [--top 12]

Prints per kernel: executed warp instructions and stall samples, the stall reasons, both by
opcode; the static instructions grouped by how often they ran (`--loop N`: the instructions
run about N times, a main loop's body once per iteration and warp); local-memory (spill)
instructions that ran; the top stalled instructions.  With two files, the opcodes of the
loop bodies side by side (second minus first).  Reads the CSV as ncu 2025.x writes it (the
"Address", "Source", "Instructions Executed" and "Warp Stall Sampling (All Samples)" columns
and one "stall_*" column per reason).
"""

import argparse
import csv
import gzip
import io
from collections import Counter


def load(path):
    """The rows of the source page as dicts (the header row is the one naming "Address")."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(source):
    words = source.split()
    if not words:
        return ""
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def loop_body(rows, count):
    """The instructions run within 10% of `count` times (a loop's body, once per iteration)."""
    return [r for r in rows if abs(number(r["Instructions Executed"]) - count) <= 0.1 * count]


def summarize(path, rows, count, top):
    executed = [number(r["Instructions Executed"]) for r in rows]
    stalls = [number(r["Warp Stall Sampling (All Samples)"]) for r in rows]
    total, samples = sum(executed), sum(stalls) or 1.0
    print(f"== {path}: {len(rows)} static instructions, {total / 1e6:.1f} M executed, "
          f"{samples:.0f} stall samples")
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by_reason = {k: sum(number(r[k]) for r in rows) for k in reasons}
    print("  stall reasons: " + ", ".join(
        f"{k[6:]} {v / samples:.1%}" for k, v in Counter(by_reason).most_common(9)))
    ran, stalled = Counter(), Counter()
    for r, e, s in zip(rows, executed, stalls):
        ran[opcode(r["Source"])] += e
        stalled[opcode(r["Source"])] += s
    print("  executed by opcode: " + ", ".join(
        f"{k} {v / 1e6:.1f}M" for k, v in ran.most_common(20)))
    print("  stalls by opcode: " + ", ".join(
        f"{k} {v / samples:.1%}" for k, v in stalled.most_common(12)))
    if count:
        body = loop_body(rows, count)
        print(f"  loop body (run ~{count} times): {len(body)} instructions, "
              f"{sum(number(r['Instructions Executed']) for r in body) / 1e6:.1f} M executed")
    local = [(r, e, s) for r, e, s in zip(rows, executed, stalls)
             if opcode(r["Source"]) in ("LDL", "STL") and e > 0]
    print(f"  local memory: {len(local)} instructions ran, "
          f"{sum(e for _, e, _ in local) / 1e6:.2f} M executed, "
          f"{sum(s for _, _, s in local) / samples:.1%} of the stalls")
    for r, e, s in sorted(local, key=lambda x: -x[1])[:8]:
        print(f"    {e:>10.0f}x  {s / samples:5.1%}  {r['Source'].strip()}")
    print("  top stalls:")
    order = sorted(range(len(rows)), key=lambda i: -stalls[i])[:top]
    for i in order:
        best = max(reasons, key=lambda k: number(rows[i][k]))
        print(f"    #{i:5d} {executed[i]:>10.0f}x  {stalls[i] / samples:5.1%} ({best[6:]})  "
              f"{rows[i]['Source'].strip()[:80]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="one or two gzipped or plain CSV exports")
    parser.add_argument("--loop", type=float, default=0,
                        help="executions per instruction of the loop body to count (0: none)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    tables = [load(f) for f in args.files[:2]]
    for path, rows in zip(args.files, tables):
        summarize(path, rows, args.loop, args.top)
    if len(tables) == 2 and args.loop:
        first, second = (Counter(opcode(r["Source"]) for r in loop_body(t, args.loop))
                         for t in tables)
        print("== loop bodies' opcodes, second minus first:")
        for k in sorted(set(first) | set(second), key=lambda k: first[k] - second[k]):
            if first[k] != second[k]:
                print(f"  {k:10s} {first[k]:4d} {second[k]:4d}  {second[k] - first[k]:+d}")


if __name__ == "__main__":
    main()
