"""Loads the compiled extension fastattn._C, or says once what falls back to Python without it."""

from __future__ import annotations

import warnings
from types import ModuleType


def _load() -> ModuleType | None:
    try:
        from fastattn import _C
    except ImportError as e:
        warnings.warn(
            f"fastattn._C is not built ({e}): beam search bookkeeping runs in Python "
            "(impl='python'); reinstall with `pip install .` and a C++ compiler to build it",
            stacklevel=3,
        )
        return None
    return _C


native: ModuleType | None = _load()
