"""fastattn: fused Triton kernels for the Transformer and a faithful model to train and serve it."""

from fastattn import _extras, ops
from fastattn._native import native
from fastattn.backend import get_backend, set_backend
from fastattn.model import PRESETS, Transformer, TransformerConfig
from fastattn.modules import (
    LabelSmoothedCrossEntropy,
    MultiHeadAttention,
    ResidualLayerNorm,
    replace_multihead_attention,
)
from fastattn.search import Hypothesis, beam_search, greedy_search

# `python -m fastattn.translate` (or another command) without the [mt] extra: one line, exit 1.
_extras.exit_if_command_lacks_extra()

__version__ = "0.1.0"
__all__ = [
    "PRESETS",
    "Ensemble",
    "Hypothesis",
    "LabelSmoothedCrossEntropy",
    "MultiHeadAttention",
    "ResidualLayerNorm",
    "Transformer",
    "TransformerConfig",
    "Translator",
    "beam_search",
    "get_backend",
    "greedy_search",
    "native",
    "ops",
    "replace_multihead_attention",
    "set_backend",
]


def __getattr__(name: str):
    # Imported on first use: `python -m fastattn.translate` (and .ensemble) must not find itself
    # already imported.
    if name == "Translator":
        from fastattn.translate import Translator

        return Translator
    if name == "Ensemble":
        from fastattn.ensemble import Ensemble

        return Ensemble
    raise AttributeError(f"module 'fastattn' has no attribute {name!r}")
