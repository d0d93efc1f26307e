"""Compares the `ptxas -v` lines (registers, spills, stack) of every kernel in two build logs
(built with NVCC_APPEND_FLAGS="-Xptxas -v", as gpu_session.sh builds): a refactoring that
keeps the kernels the same shows no difference.  Usage: ptxas_compare.py BEFORE.log AFTER.log"""
import re
import subprocess
import sys


def table(path: str) -> dict:
    out, cur = {}, None
    for line in open(path, errors="replace"):
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            cur = (m.group(1), m.group(2))
            out[cur] = []
        elif cur and ("registers" in line or "spill" in line or "stack frame" in line):
            out[cur].append(re.sub(r".*ptxas info\s*:\s*", "", line.strip()))
    return {k: " | ".join(v) for k, v in out.items()}


def main() -> int:
    before, after = table(sys.argv[1]), table(sys.argv[2])
    same = sum(1 for k in before if after.get(k) == before[k])
    print(f"ptxas: {len(before)} kernels before, {len(after)} after, {same} identical")
    for k in sorted(set(before) | set(after)):
        if before.get(k) != after.get(k):
            name = subprocess.run(["c++filt"], input=k[0], capture_output=True, text=True)
            print("DIFF", (name.stdout.strip() or k[0])[:160], k[1])
            print("   before:", before.get(k))
            print("   after: ", after.get(k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
