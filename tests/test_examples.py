"""The main job runs end to end (a short run; `make train` does the full 100 steps)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_gpt_short_run_agrees_with_reference():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "6",
         "--log-every", "2", "--n-layer", "2", "--d-model", "64", "--batch-size", "4",
         "--seq-len", "64", "--eval-batches", "1", "--device", "cpu", "--sample", "20"],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "cpu_flash_fwd_fp32" in r.stdout
    assert "agree" in r.stdout
