import pytest
import torch

import flash_attn_ext  # noqa: F401  (loads the ops)
from flash_attn_ext import _C


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every op output starts as NaN, so an element a kernel forgets to write fails the test."""
    _C.set_debug_poison(True)
    yield
    _C.set_debug_poison(False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
