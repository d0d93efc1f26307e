"""The main job runs end to end (a short run; `make train` does the full 100 steps)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_gpt(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """examples/train_gpt.py with ``args``, from this checkout, its output captured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), *args],
                          capture_output=True, text=True, env=env, timeout=timeout, check=False)


def test_train_gpt_short_run_agrees_with_reference():
    r = train_gpt("--steps", "6", "--log-every", "2", "--n-layer", "2", "--d-model", "64",
                  "--batch-size", "4", "--seq-len", "64", "--eval-batches", "1", "--device",
                  "cpu", "--sample", "20")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "cpu_flash_fwd_fp32" in r.stdout
    assert "agree" in r.stdout


def test_train_gpt_help_shows_each_default_once():
    """--help gave --dtype and --data two defaults ("(default: fp32 on CPU, bf16 on CUDA)
    (default: None)") and options without a help line (--batch-size, --n-layer, --seed, ...)
    none."""
    r = train_gpt("--help", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    text = " ".join(r.stdout.split())  # (argparse wraps lines)
    assert "(default: None)" not in text
    assert "model dtype (default: fp32 on CPU, bf16 on CUDA)" in text
    for option, default in (("--batch-size BATCH_SIZE", 16), ("--n-layer N_LAYER", 4),
                            ("--n-head N_HEAD", 4), ("--d-model D_MODEL", 128),
                            ("--weight-decay WEIGHT_DECAY", 0.1), ("--seed SEED", 0)):
        after = text.split(option, 2)[2]  # (the option's help, after the usage line)
        assert after.split(" --", 1)[0].endswith(f"(default: {default})"), option


def test_train_gpt_fp16_trains_with_finite_losses():
    """--dtype fp16 trained to NaN from its second step (all-fp16 AdamW: eps 1e-8 is 0 in fp16,
    a vanishing gradient gives 0 / 0) and still exited 0; now mixed precision (fp32 weights,
    fp16 autocast, a GradScaler), and a NaN or infinite loss fails the run."""
    r = train_gpt("--steps", "8", "--log-every", "1", "--n-layer", "1", "--d-model", "32",
                  "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--device",
                  "cpu", "--dtype", "fp16")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "cpu_flash_fwd_fp16" in r.stdout
    steps = [line.split() for line in r.stdout.splitlines()
             if line.split()[:1] and line.split()[0].isdigit()]
    assert len(steps) == 8 and all(float(s[1]) < 10 and float(s[2]) < 10 for s in steps), steps
    assert "nan" not in r.stdout.lower()
