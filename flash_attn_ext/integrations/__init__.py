"""Integrations with other libraries (added by later issues)."""
