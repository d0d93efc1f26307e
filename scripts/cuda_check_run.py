#!/usr/bin/env python3
"""Runs the CUDA compile check's nvcc commands (scripts/check_cuda_compile.sh writes them to
stdin, one per line) in parallel, skipping those that already passed with the same inputs.

A command's key hashes what decides its outcome: the command itself (a temporary directory
named by --stub written as a constant), nvcc's version, the torch version, the contents of its
source file and of every header it reaches through ``#include "..."`` inside csrc/, and the
CUTLASS and curand headers' version files where the command uses them. A command that passes
leaves an empty file named by its key in --cache; the next run skips it. Prints one line per
finished command, and every error and spill warning; exits 1 if any command failed.

    python3 scripts/cuda_check_run.py --cache .cuda-check-cache --jobs 2 --stub /tmp/x < cmds
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import hashlib
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


@functools.cache  # (the sm80 sources are compiled for two archs; headers are shared by all)
def csrc_closure(path: str) -> tuple[str, ...]:
    """The file and every csrc/ header it reaches through #include "...", sorted."""
    seen, todo = set(), [os.path.abspath(path)]
    while todo:
        f = todo.pop()
        if f in seen or not os.path.isfile(f):
            continue
        seen.add(f)
        with open(f, encoding="utf-8", errors="replace") as fh:
            for name in INCLUDE.findall(fh.read()):
                for base in (os.path.dirname(f), CSRC):
                    cand = os.path.normpath(os.path.join(base, name))
                    if os.path.isfile(cand) and cand.startswith(CSRC + os.sep):
                        todo.append(cand)
                        break
    return tuple(sorted(seen))


@functools.cache
def file_digest(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def external_versions(args: list[str]) -> list[str]:
    """Version files of the external header trees a command includes (-I dirs)."""
    out = []
    for i, a in enumerate(args[:-1]):
        if a != "-I":
            continue
        for rel in ("cutlass/version.h", "curand_philox4x32_x.h"):
            f = os.path.join(args[i + 1], rel)
            if os.path.isfile(f):
                out.append(f"{rel}:{file_digest(f)}")
    return out


def command_key(cmd: str, stub: str, context: str) -> tuple[str, str]:
    """(key, source file) of one command."""
    args = shlex.split(cmd)
    source = args[args.index("-c") + 1]
    h = hashlib.sha256()
    h.update(context.encode())
    h.update(cmd.replace(stub, "<stub>").encode())
    for f in csrc_closure(os.path.join(ROOT, source)):
        h.update(f"{os.path.relpath(f, ROOT)}:{file_digest(f)}".encode())
    for v in external_versions(args):
        h.update(v.encode())
    return h.hexdigest()[:32], source


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", required=True)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--stub", default="\0")
    opts = parser.parse_args()
    cmds = [line.strip() for line in sys.stdin if line.strip()]
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    torch_version = subprocess.run(
        [os.environ.get("PY", sys.executable), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True).stdout
    context = nvcc + torch_version
    os.makedirs(opts.cache, exist_ok=True)
    keyed = [(cmd, *command_key(cmd, opts.stub, context)) for cmd in cmds]
    todo = [k for k in keyed if not os.path.exists(os.path.join(opts.cache, k[1]))]
    print(f"check_cuda_compile: {len(todo)} of {len(cmds)} compilations to run "
          f"({len(cmds) - len(todo)} unchanged since they passed; {opts.jobs} at a time)",
          flush=True)

    def run(item):
        cmd, key, source = item
        start = time.time()
        proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT)
        return item, proc, time.time() - start

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(opts.jobs, 1)) as pool:
        for n, fut in enumerate(concurrent.futures.as_completed(
                [pool.submit(run, item) for item in todo]), 1):
            (cmd, key, source), proc, seconds = fut.result()
            arch = re.search(r"code=(sm_\w+)", cmd)
            ok = proc.returncode == 0
            print(f"  [{n}/{len(todo)}] {source} {arch.group(1) if arch else ''}: "
                  f"{'ok' if ok else 'FAILED'} ({seconds:.0f} s)", flush=True)
            notes = [line for line in (proc.stdout + proc.stderr).splitlines()
                     if "error" in line or re.search(r"warning: .*(spill|stack)", line)]
            for line in notes[:40]:
                print("    " + line)
            if ok:
                open(os.path.join(opts.cache, key), "w").close()
            else:
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
