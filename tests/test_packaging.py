"""The build script's and the CUDA compile check's behaviour that a new user meets."""

import importlib.util
import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_build_without_torch_says_what_to_do(monkeypatch):
    # setup.py's first step: without an importable torch, one line naming the fix, no traceback.
    setup = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="setup_under_test")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        setup["require_torch"]()
    assert "install torch first" in str(e.value) and "--no-build-isolation" in str(e.value)


def test_cuda_check_can_be_skipped():
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "check_cuda_compile.sh")],
                         env={**os.environ, "CUDA_CHECK": "0"}, capture_output=True, text=True)
    assert run.returncode == 0 and "skipped (CUDA_CHECK=0)" in run.stdout


def test_cuda_check_keys_follow_the_included_headers(tmp_path):
    # A compilation's key covers its source and every csrc/ header it reaches: a change to a
    # header it includes changes the key (it is compiled again); the key is stable otherwise.
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import cuda_check_run as ccr
    finally:
        sys.path.pop(0)
    src = "csrc/kernels/sm90/flash_bwd_sm90_hdim64_bf16.cu"
    closure = [os.path.relpath(f, ROOT) for f in ccr.csrc_closure(os.path.join(ROOT, src))]
    assert src in closure and "csrc/kernels/sm90/bwd_mainloop.h" in closure
    assert "csrc/mask.h" in closure and "csrc/kernels/sm90/fwd_kernel.h" not in closure
    cmd = f"nvcc -O2 -I {tmp_path} -c {src} -o /dev/null"
    key, source = ccr.command_key(cmd, str(tmp_path), "ctx")
    assert source == src and ccr.command_key(cmd, str(tmp_path), "ctx")[0] == key
    # (the temporary stub directory's name is not part of the key)
    other = tmp_path / "other"
    assert ccr.command_key(cmd.replace(str(tmp_path), str(other)), str(other), "ctx")[0] == key
    assert ccr.command_key(cmd, str(tmp_path), "another nvcc")[0] != key
