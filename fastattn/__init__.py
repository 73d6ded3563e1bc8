"""fastattn: fused Triton kernels for the Transformer and a faithful model to train and serve it."""

import signal
import sys


def _interrupted_while_importing(signum, frame):
    # Ctrl-C in the seconds `python -m fastattn.COMMAND` spends importing torch: nothing has
    # started, so nothing is lost: one line, not a traceback through torch's import.
    print("interrupted", file=sys.stderr)
    raise SystemExit(128 + signum)


_as_command = bool(sys.argv) and sys.argv[0] == "-m"  # python -m fastattn.X imports us first
if _as_command and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_importing)

from fastattn import _extras, ops  # noqa: E402
from fastattn._native import cpu_isa, native, set_cpu_isa  # noqa: E402
from fastattn.backend import get_backend, set_backend  # noqa: E402
from fastattn.model import PRESETS, Transformer, TransformerConfig  # noqa: E402
from fastattn.modules import (  # noqa: E402
    LabelSmoothedCrossEntropy,
    MultiHeadAttention,
    ResidualLayerNorm,
    replace_multihead_attention,
)
from fastattn.search import Hypothesis, beam_search, greedy_search  # noqa: E402

if _as_command and signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the command's own handling

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
    "cpu_isa",
    "get_backend",
    "greedy_search",
    "native",
    "ops",
    "replace_multihead_attention",
    "set_backend",
    "set_cpu_isa",
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
