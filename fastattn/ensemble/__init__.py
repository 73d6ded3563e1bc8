"""Ensembles: fastattn.Ensemble, Transformers decoding as one model
(fastattn/ensemble/ensemble.py); `python -m fastattn.ensemble` runs __main__.py, the command line
of fastattn/ensemble_command.py.

Each name is imported from ensemble.py on first use (PEP 562), so that the command checks the
[mt] extra and catches Ctrl-C (fastattn.cli.starting) before torch is imported.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    import fastattn.ensemble.ensemble as ensemble

    try:
        return getattr(ensemble, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    import fastattn.ensemble.ensemble as ensemble

    return sorted([*globals(), *dir(ensemble)])
