"""Which SDPA backend PyTorch picks on this GPU, and whether our flash implementation serves it.

With activate_flash_attention_impl("flash_attn_ext"), a call that SDPA sends to its FLASH
backend runs on our kernels (flash_attn_ext.last_plan() is set); one it sends to cuDNN or the
memory-efficient kernel does not.  Prints, per case, SDPA's priority order and whether our
kernels ran: by default, with sdpa_kernel([FLASH_ATTENTION]), and with FLASH first by
sdpa_kernel(..., set_priority=True).  Usage: python3 dev/gpu/sdpa_backend_probe.py
"""

import torch
import torch.nn.functional as F
from torch.nn import attention
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext
from flash_attn_ext.integrations import torch_flash


def ours_ran(q, k, v, grad: bool, mode: str) -> bool:
    """One causal SDPA call (mode: "default", "forced": sdpa_kernel([FLASH]), "first": FLASH
    first by set_priority); whether our kernels served it."""
    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    backends = {"default": order, "forced": [SDPBackend.FLASH_ATTENTION], "first": order}[mode]
    flash_attn_ext.policy._last_plan = None
    with torch.set_grad_enabled(grad):
        if mode == "default":
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            with sdpa_kernel(backends, set_priority=mode == "first"):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return flash_attn_ext.last_plan() is not None


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN "
          f"{torch.backends.cudnn.version()}")
    print("SDPA priority order:", [SDPBackend(int(b)).name
                                   for b in torch._C._get_sdp_priority_order()])
    attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        for dtype in (torch.bfloat16, torch.float16):
            for head_dim in (64, 128):
                for grad in (False, True):
                    q, k, v = (torch.randn(2, 16, 1024, head_dim, device="cuda", dtype=dtype,
                                           requires_grad=grad) for _ in "qkv")
                    ran = {m: ours_ran(q, k, v, grad, m) for m in ("default", "forced", "first")}
                    print(f"{str(dtype):15s} d={head_dim:3d} grad={grad!s:5s}  ours by default: "
                          f"{ran['default']!s:5s}  forced FLASH: {ran['forced']!s:5s}  "
                          f"FLASH first by priority: {ran['first']}")
    finally:
        attention.restore_flash_attention_impl()


if __name__ == "__main__":
    main()
