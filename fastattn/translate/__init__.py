"""Translation: fastattn.Translator and what goes with it (fastattn/translate/translator.py);
`python -m fastattn.translate` runs __main__.py, the command line of fastattn/translate_command.py.

Each name is imported from translator.py on first use (PEP 562), so that the command checks the
[mt] extra and catches Ctrl-C (fastattn.cli.starting) before torch is imported.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    import fastattn.translate.translator as translator

    try:
        return getattr(translator, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    import fastattn.translate.translator as translator

    return sorted([*globals(), *dir(translator)])
