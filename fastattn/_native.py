"""Loads the compiled extension fastattn._C, or says once what falls back to Python without it;
and the instruction-set level its CPU kernels run at (FASTATTN_CPU_ISA)."""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

# The levels fastattn._C's CPU kernels are compiled for, lowest first: portable C++ for the
# baseline (x86-64: SSE2), x86-64-v3 (AVX2 + FMA), x86-64-v4 (AVX-512; VNNI and BF16 where the
# CPU has them), and x86-64-v4 with AMX's int8 tiles.
CPU_ISA_LEVELS = ("scalar", "avx2", "avx512", "amx")


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
    level = os.environ.get("FASTATTN_CPU_ISA", "")
    if level:  # the extension read it when it loaded; an unknown name is an error here
        set_cpu_isa(level, source="FASTATTN_CPU_ISA")
    return _C


def cpu_isa() -> str:
    """The instruction-set level fastattn._C's CPU kernels run at now ("scalar" without it)."""
    return torch.ops.fastattn.cpu_isa() if native is not None else "scalar"


def supported_cpu_isas() -> tuple[str, ...]:
    """The levels this process may run, lowest first: up to this CPU's best, or up to the level
    FASTATTN_CPU_ISA holds the process to."""
    best = torch.ops.fastattn.cpu_isa_limit() if native is not None else "scalar"
    return CPU_ISA_LEVELS[:CPU_ISA_LEVELS.index(best) + 1]


def set_cpu_isa(level: str, source: str = "set_cpu_isa") -> str:
    """Holds every native CPU kernel to `level` or below, for this process; a level above the
    CPU's best, or above FASTATTN_CPU_ISA's hold, runs at that. Returns the level in use."""
    if level not in CPU_ISA_LEVELS:
        raise ValueError(f"{source}: unknown instruction-set level {level!r}; expected one of "
                         f"{', '.join(reversed(CPU_ISA_LEVELS))}")
    return torch.ops.fastattn.set_cpu_isa(level)


native: ModuleType | None = _load()
