"""The optional CUDA extension ``fastcredit._C``: load it if it was built, else say why not.

Callers check :func:`cuda_ext` and fall back to the torch implementation of the same op.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Optional[object], str]:
    try:
        return importlib.import_module("fastcredit._C"), "loaded"
    except ImportError as exc:
        return None, f"fastcredit._C is not available ({exc}); using the torch fallbacks"


def cuda_ext():
    """The extension module, or None when it was not built or cannot load."""
    return _load()[0]


def cuda_ext_status() -> str:
    """A one-line reason, for logs and error messages."""
    return _load()[1]
