"""The inference wing: everything that decodes a trained fastattn.model.Transformer. The model
never imports it.

  state.py        DecodingState: the encoder memory and self-attention caches between steps
  native.py       the native engine (fastattn._C, CPU): `convert` maps a model's weights by name
                  into a NativeEngine, which owns them packed or quantized (fp32, int8, bf16)
  decoder.py      Decoder(model, precision): start, step, step_fn, beam_search, greedy_search;
                  the native engine where it runs, else the Python layers' steps
  search.py       beam_search and greedy_search over any step_fn; the native search step
  ensemble.py     Ensemble (members, the checkpoint format) and EnsembleDecoder
  translator.py   Translator: raw text in, translations out, batched, on worker threads
  workers.py      Workers: batches decoded at once on threads
  pretrained.py   the shipped models (fastattn/models/); python -m fastattn.inference.pretrained
  translate_command.py, ensemble_command.py   python -m fastattn.translate, fastattn.ensemble

Each name below is imported from its module on first use (PEP 562), as in fastattn/__init__.py.
"""

import importlib
from typing import Any

_MODULES = {
    "fastattn.inference.decoder": ("Decoder",),
    "fastattn.inference.ensemble": ("Ensemble", "EnsembleDecoder", "decoder_of"),
    "fastattn.inference.native": ("PRECISIONS",),
    "fastattn.inference.search": ("Hypothesis", "beam_search", "greedy_search"),
    "fastattn.inference.state": ("DecodingState",),
    "fastattn.inference.translator": ("Translation", "Translator"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_HOME, key=str.lower)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
