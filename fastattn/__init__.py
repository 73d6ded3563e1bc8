"""fastattn: fused Triton kernels for the Transformer and a faithful model to train and serve it.

Each public name is imported from its module on first use (PEP 562): `import fastattn` loads
nothing else, so the Triton kernels (fastattn.kernels.*) import no other fastattn module and a
command's entry checks the [mt] extra and catches Ctrl-C (fastattn.cli.starting) before torch.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_MODULES = {
    "fastattn._native": ("cpu_isa", "native", "set_cpu_isa"),
    "fastattn.backend": ("get_backend", "set_backend"),
    "fastattn.inference.decoder": ("Decoder",),
    "fastattn.inference.ensemble": ("Ensemble", "EnsembleDecoder"),
    "fastattn.inference.search": ("Hypothesis", "beam_search", "greedy_search"),
    "fastattn.inference.translator": ("Translator",),
    "fastattn.model": ("PRESETS", "Transformer", "TransformerConfig"),
    "fastattn.modules": ("LabelSmoothedCrossEntropy", "MultiHeadAttention", "ResidualLayerNorm",
                         "replace_multihead_attention"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted([*_HOME, "ops"], key=str.lower)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    try:  # a submodule (fastattn.ops, fastattn.data, ...)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
