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


def test_train_gpt_help_shows_each_default_once():
    """--help gave --dtype and --data two defaults ("(default: fp32 on CPU, bf16 on CUDA)
    (default: None)") and options without a help line (--batch-size, --n-layer, --seed, ...)
    none."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--help"],
                       capture_output=True, text=True, env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    text = " ".join(r.stdout.split())  # (argparse wraps lines)
    assert "(default: None)" not in text
    assert "model dtype (default: fp32 on CPU, bf16 on CUDA)" in text
    for option, default in (("--batch-size BATCH_SIZE", 16), ("--n-layer N_LAYER", 4),
                            ("--n-head N_HEAD", 4), ("--d-model D_MODEL", 128),
                            ("--weight-decay WEIGHT_DECAY", 0.1), ("--seed SEED", 0)):
        after = text.split(option, 2)[2]  # (the option's help, after the usage line)
        assert after.split(" --", 1)[0].endswith(f"(default: {default})"), option
