"""The optional [mt] extra: what training and translation need beyond torch, triton and numpy.

`pip install fastattn` gives the ops, the modules and the model; `pip install 'fastattn[mt]'` adds
the packages in MT_PACKAGES. Without them:
- a library import of a module that needs one (fastattn.data, fastattn.bleu, ...) raises
  MissingExtraError, an ImportError whose message is one line naming what to install;
- a command line (`python -m fastattn.translate`, ...) prints that line on stderr and exits with
  status 1, no traceback: its entry checks with fastattn.cli.starting() before it imports the
  command's modules.

A module imports an extra's package as

    try:
        import sentencepiece as spm
    except ImportError as e:
        raise MissingExtraError(__name__, e) from None
"""

from __future__ import annotations

import importlib.util

# Distribution names as pip installs them, with the module each is imported as.
MT_PACKAGES = {"sentencepiece": "sentencepiece", "sacrebleu": "sacrebleu",
               "sacremoses": "sacremoses", "tqdm": "tqdm"}
# The command lines (python -m fastattn.NAME) that need the [mt] extra: every one of them reads
# or writes SentencePiece vocabularies (checkpoints carry one).
MT_COMMANDS = ("train", "translate", "ensemble", "tools.evaluate", "tools.average",
               "tools.ctranslate2_convert")


def missing_message(module: str, missing: list[str] | tuple[str, ...], extra: str = "mt") -> str:
    return (f"{module} needs the [{extra}] extra (missing: {', '.join(missing)}): "
            f"pip install 'fastattn[{extra}]'")


class MissingExtraError(ImportError):
    """An optional package of an extra is not installed; the message is one line saying what to
    install. `module` is the fastattn module that needs it."""

    def __init__(self, module: str, cause: ImportError | str, extra: str = "mt") -> None:
        name = cause if isinstance(cause, str) else (cause.name or str(cause))
        super().__init__(missing_message(module, [name.split(".")[0]], extra),
                         name=name.split(".")[0])
        self.module = module
        self.extra = extra


def missing_packages(packages: dict[str, str] = MT_PACKAGES) -> list[str]:
    """The distributions of `packages` whose module cannot be found (nothing is imported)."""
    missing = []
    for distribution, module in packages.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(distribution)
    return missing
