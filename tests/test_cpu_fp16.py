"""The CPU kernels' fp16 -> fp32 conversion of tiles (csrc/cpu/fp16_convert.h): F16C where
the CPU has it, else c10::Half's own conversion, both exact for every fp16 value.  The latter
is reached with FLASH_ATTN_EXT_CPU_F16C=0 in a subprocess (the switch is read once per
process)."""

import os
import subprocess
import sys

import pytest

# One key: softmax is exactly 1, so out is v converted to fp32 and back, which is the identity
# for every finite fp16 value (subnormals included) where the conversion is exact; inf and NaN
# are left out.
SCRIPT = r"""
import torch, flash_attn_ext
bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
v = bits.view(torch.float16)
v = v[torch.isfinite(v)]
n = v.numel() // 64 * 64
v = v[:n].reshape(n // 64, 1, 1, 64).contiguous()  # a batch row per 64 values
q = torch.zeros_like(v)
out = flash_attn_ext.flash_attn_func(q, torch.zeros_like(v), v)
assert torch.equal(out, v), "conversion not exact"  # (-0 comes out +0: O starts at 0)
print("ok")
"""


@pytest.mark.parametrize("switch", ["default", "0"])
def test_fp16_tiles_convert_exactly(switch):
    env = dict(os.environ)
    env.pop("FLASH_ATTN_EXT_CPU_F16C", None)
    if switch != "default":
        env["FLASH_ATTN_EXT_CPU_F16C"] = switch
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_f16c_switch_refuses_values_it_does_not_take():
    # FLASH_ATTN_EXT_CPU_F16C takes FLASH_ATTN_EXT_STRICT's values (csrc/cpu/env_switch.h); a
    # typo is refused by name at the first fp16 call rather than leaving the switch on.
    env = dict(os.environ, FLASH_ATTN_EXT_CPU_F16C="bogus")
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "FLASH_ATTN_EXT_CPU_F16C must be" in run.stderr, \
        run.stderr[-2000:]
    assert "got 'bogus'" in run.stderr
