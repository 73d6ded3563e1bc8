"""The optional [mt] extra: what training and translation need beyond torch, triton and numpy.

`pip install fastattn` gives the ops, the modules and the model; `pip install 'fastattn[mt]'` adds
the packages in MT_PACKAGES. Without them:
- a library import of a module that needs one (fastattn.data, fastattn.evaluate, ...) raises
  MissingExtraError, an ImportError whose message is one line naming what to install;
- a command line (`python -m fastattn.translate`, ...) prints that line on stderr and exits with
  status 1, no traceback: fastattn/__init__.py calls exit_if_command_lacks_extra(), which runs
  while `python -m` imports the package, before the command's module starts importing.

A module imports an extra's package as

    try:
        import sentencepiece as spm
    except ImportError as e:
        raise MissingExtraError(__name__, e) from None
"""

from __future__ import annotations

import importlib.util
import sys

# Distribution names as pip installs them, with the module each is imported as.
MT_PACKAGES = {"sentencepiece": "sentencepiece", "sacrebleu": "sacrebleu",
               "sacremoses": "sacremoses", "tqdm": "tqdm"}
# The command lines (python -m fastattn.NAME) that need the [mt] extra: every one of them reads
# or writes SentencePiece vocabularies (checkpoints carry one).
MT_COMMANDS = ("train", "translate", "evaluate", "average", "ctranslate2_convert", "ensemble")


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


def _command(argv: list[str]) -> str | None:
    """The module `python [options] -m MODULE ...` runs, from sys.orig_argv, or None."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None)
        if arg.startswith("-m"):
            return arg[2:]
        if arg in ("-X", "-W", "--check-hash-based-pycs"):
            next(args, None)  # the option's value
        elif arg == "-" or arg == "-c" or not arg.startswith("-"):
            return None  # a script, -c code or stdin
    return None


def exit_if_command_lacks_extra() -> None:
    """Under `python -m fastattn.COMMAND` (COMMAND in MT_COMMANDS) without every package of the
    [mt] extra: prints one line on stderr and exits with status 1. Does nothing otherwise, in
    particular on a library import."""
    # While `python -m` imports the package of the module it runs, sys.argv[0] is "-m".
    if not sys.argv or sys.argv[0] != "-m":
        return
    command = _command(getattr(sys, "orig_argv", []))
    if command is None or command.removesuffix(".__main__") not in {
            f"fastattn.{name}" for name in MT_COMMANDS}:
        return
    missing = missing_packages()
    if missing:
        print(f"error: {missing_message(command.removesuffix('.__main__'), missing)}",
              file=sys.stderr)
        raise SystemExit(1)
