"""NaN in the inputs comes out as NaN (never as an empty row), on every kernel."""
import pytest
import torch

from flash_attn_ext import flash_attn_func

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["auto", "sm80"])
def test_nan_query_row_gives_nan_out_and_lse(device, kernel, kernel_opts):
    if device == "cpu" and kernel == "sm80":
        pytest.skip("the kernel choice is a CUDA one")
    kernel_opts(force_portable=kernel == "sm80")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(2, 70, 3, 64, device=device, dtype=dtype)
    k, v = (torch.randn(2, 90, 3, 64, device=device, dtype=dtype) for _ in "kv")
    q[1, 5, 2] = float("nan")  # one query row of one head
    k[0, 7, 1, 3] = float("nan")  # one key: every row of (batch 0, head 1) that sees it
    out, lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)[:2]
    nan_rows = torch.zeros(2, 3, 70, dtype=torch.bool, device=device)
    nan_rows[1, 2, 5] = True
    nan_rows[0, 1, :] = True  # bottom-right causal, S > L: every row sees key 7
    assert torch.equal(torch.isnan(lse), nan_rows)
    assert torch.equal(torch.isnan(out).any(-1), nan_rows.transpose(1, 2))
    assert not torch.isnan(out[~nan_rows.transpose(1, 2)]).any()
