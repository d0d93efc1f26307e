"""Integrations with other libraries: Hugging Face transformers (``register_transformers``) and
PyTorch's flash attention registry (``register_flash_impl``: torch_flash)."""

from .torch_flash import register_flash_impl
from .transformers import attention_forward, register_transformers, register_when_imported

__all__ = ["attention_forward", "register_flash_impl", "register_transformers",
           "register_when_imported"]
