"""Which implementation runs an op: the Triton kernels or PyTorch.

"auto" (the default) runs the Triton kernels on CUDA tensors and PyTorch's native kernels on CPU
tensors; "triton" runs the Triton kernels everywhere, on CPU tensors through Triton's interpreter,
which only works if TRITON_INTERPRET=1 was set before triton was imported; "torch" runs PyTorch
everywhere. The choice is read from FASTATTN_BACKEND at import and changed with set_backend().
This is the only global state in fastattn.
"""

from __future__ import annotations

import os
import warnings

import torch

BACKENDS = ("auto", "triton", "torch")
TRITON_RANGE = ((3, 2), (3, 10))  # supported: >= 3.2, < 3.10


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"fastattn backend must be one of {BACKENDS}, got {name!r}")
    return name


def _check_triton() -> str | None:
    """Returns why Triton cannot be used, or None when it can."""
    try:
        import triton
    except ImportError as e:
        return f"triton is not installed ({e}); install triton>=3.2,<3.10"
    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
    low, high = TRITON_RANGE
    if not low <= version < high:
        return (
            f"triton {triton.__version__} is not supported: fastattn needs triton>="
            f"{low[0]}.{low[1]},<{high[0]}.{high[1]}"
        )
    return None


_backend = _check_backend(os.environ.get("FASTATTN_BACKEND", "auto"))
TRITON_PROBLEM = _check_triton()
if TRITON_PROBLEM is not None:
    warnings.warn(f"{TRITON_PROBLEM}; fastattn runs its ops with PyTorch", stacklevel=2)


def set_backend(name: str) -> None:
    """Selects "auto", "triton" or "torch" for every fastattn op from now on."""
    global _backend
    _backend = _check_backend(name)


def get_backend() -> str:
    return _backend


@torch.compiler.assume_constant_result  # fixed at triton's import, so dynamo may bake it in
def interpreter_active() -> bool:
    """True if Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    if TRITON_PROBLEM is not None:
        return False
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensor x runs its Triton kernel; raises if "triton" cannot be honoured."""
    if _backend == "torch":
        return False
    if _backend == "auto":
        return x.device.type == "cuda" and TRITON_PROBLEM is None
    if TRITON_PROBLEM is not None:
        raise RuntimeError(f"FASTATTN_BACKEND=triton but {TRITON_PROBLEM}")
    if x.device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            "FASTATTN_BACKEND=triton on CPU tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton is imported"
        )
    return True
