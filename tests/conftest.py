import pytest
import torch

import flash_attn_ext
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


@pytest.fixture
def kernel_opts():
    """flash_attn_ext.set_kernel_options for one test: the options it sets are restored after."""
    before = _C.kernel_options()
    yield flash_attn_ext.set_kernel_options
    flash_attn_ext.set_kernel_options(**before)


@pytest.fixture
def clean_policy():
    """No fallback counted and strict mode unset, before and after the test (modules whose
    tests read fallback_counts() or set strict mode take it for every test: pytestmark)."""
    flash_attn_ext.policy.reset_fallback_counts()
    flash_attn_ext.policy.set_strict(None)
    yield
    flash_attn_ext.policy.reset_fallback_counts()
    flash_attn_ext.policy.set_strict(None)
