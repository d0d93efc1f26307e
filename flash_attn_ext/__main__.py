"""``python -m flash_attn_ext info``: the build, the device, and the kernel of common calls."""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch


def info() -> int:
    import flash_attn_ext
    from flash_attn_ext import ops, planning, policy

    b = ops.build_info()
    print(f"flash_attn_ext {flash_attn_ext.__version__}")
    # (which copy is imported: a checkout's own flash_attn_ext/ shadows an installed one)
    print(f"  location        {os.path.dirname(os.path.abspath(flash_attn_ext.__file__))}")
    print(f"  python          {platform.python_version()}")
    print(f"  torch           {torch.__version__} (built against {b.get('torch_version_built')})")
    print(f"  torch CUDA      {torch.version.cuda}")
    print(f"  CUDA kernels    {'yes, archs ' + b['cuda_archs'] if b['cuda'] else 'not built'}")
    if b["cuda"]:
        print("  Hopper kernels  " + ("yes (sm90 forward and backward)" if b.get("sm90") else
                                      "not built (need 9.0a in TORCH_CUDA_ARCH_LIST and the "
                                      "CUTLASS headers; see setup.py)"))
    bf16 = (", bf16 tiles on AMX and AVX512-BF16" if b.get("cpu_bf16_amx") else
            ", bf16 tiles on AVX512-BF16" if b.get("cpu_bf16_dot") else
            ", bf16 as fp32 tiles (no AVX512-BF16, or switched off)")
    print("  CPU kernels     yes" + bf16)
    print(f"  strict mode     {policy.strict_enabled()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            print(f"  GPU {i}           {torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]})")
    else:
        print("  GPU             none visible")
    print("\nkernel per configuration (q/k/v of shape (2, 1024, 8, head_dim)):")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            for head_dim in (64, 128):
                q = torch.empty(2, 1024, 8, head_dim, dtype=dtype, device=device)
                p = planning.plan(q, q, q)
                name = str(dtype).replace("torch.", "")
                print(f"  {device:5s} {name:9s} d={head_dim:<4d} {p}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_attn_ext")
    parser.add_argument("command", choices=["info"], help="info: build, device and kernels")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    return 2


if __name__ == "__main__":
    sys.exit(main())
