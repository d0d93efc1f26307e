"""Integrations with other libraries: Hugging Face transformers (``register_transformers``)."""

from .transformers import attention_forward, register_transformers, register_when_imported

__all__ = ["attention_forward", "register_transformers", "register_when_imported"]
