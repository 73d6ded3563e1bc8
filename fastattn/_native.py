"""Loads the compiled extension fastattn._C, or says once what falls back to Python without it."""

from __future__ import annotations

import warnings
from types import ModuleType

import torch

from fastattn.backend import use_triton


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


FLOAT32 = (torch.float32,)


def native_cpu(*tensors: torch.Tensor | None, dtypes: tuple[torch.dtype, ...] = FLOAT32) -> bool:
    """Whether fastattn._C's CPU training kernels take these tensors (None ones ignored): CPU
    tensors of `dtypes` where the Triton kernels do not run (they do under TRITON_INTERPRET=1)."""
    return native is not None and all(
        t is None or (t.device.type == "cpu" and t.dtype in dtypes and not use_triton(t))
        for t in tensors
    )
