"""The one error type of the kernels package (kept apart so every module can raise it)."""

from __future__ import annotations


class KernelError(ValueError):
    """A backend or a shape the kernels cannot serve; str(e) is one line for the user."""
