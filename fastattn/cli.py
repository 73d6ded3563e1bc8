"""What fastattn's command lines share. Imports nothing beyond the standard library and
fastattn._extras: each command's entry (its __main__.py or `python -m` module, and its script in
pyproject.toml's [project.scripts]) calls starting() before it imports torch."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import NoReturn, TextIO

from fastattn._extras import MT_COMMANDS, missing_message, missing_packages


def _interrupted_while_importing(signum: int, frame: object) -> NoReturn:
    # Ctrl-C in the seconds a command spends importing torch: nothing has started, so nothing is
    # lost: one line, not a traceback through torch's import.
    print("interrupted", file=sys.stderr)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def starting(command: str) -> Iterator[None]:
    """Around the imports of command line `python -m fastattn.<command>` before it starts: a
    command of _extras.MT_COMMANDS without every package of the [mt] extra prints one line
    naming what to install and exits with status 1; Ctrl-C prints one line and exits with status
    130. After the block Ctrl-C is the command's own (Python's KeyboardInterrupt, or a handler the
    command installs); a handler installed before (by an embedding program) is left alone."""
    missing = missing_packages() if command in MT_COMMANDS else []
    if missing:
        print(f"error: {missing_message(f'fastattn.{command}', missing)}", file=sys.stderr)
        raise SystemExit(1)
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, _interrupted_while_importing)
    try:
        yield
    finally:
        if ours and signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def write_line(text: str, file: TextIO | None = None) -> None:
    """text and its newline in one write, flushed: the lines of processes sharing a pipe (an
    ensemble's members) never interleave, where print() makes two writes once stdout is
    unbuffered (PYTHONUNBUFFERED, common in containers and CI)."""
    file = sys.stdout if file is None else file
    file.write(f"{text}\n")
    file.flush()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default, except None ("not set": the help says what applies)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """A bad flag value prints one short usage line and the error, not a usage that lists every
    flag (--help does that). Flags are never abbreviated: argparse's default took `--lr 0.0005`
    for `--lr-scale 0.0005`, its only flag starting so, and trained with it without a word; a
    prefix of a flag is an error that names the flags it begins."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        args = sys.argv[1:] if args is None else list(args)
        # Before parsing, so that an abbreviated required flag (--check for --checkpoint) is named
        # and not reported missing. Arguments after "--" are never flags.
        for arg in itertools.takewhile(lambda a: a != "--", args):
            name = arg.split("=", 1)[0]
            if len(name) > 2 and name.startswith("--") and name not in self._option_string_actions:
                meant = [flag for flag in self._option_string_actions if flag.startswith(name)]
                if meant:
                    flags = meant[0] if len(meant) == 1 else \
                        f"{', '.join(meant[:-1])} or {meant[-1]}"
                    self.error(f"{name} is not a flag (flags are never abbreviated): did you "
                               f"mean {flags}?")
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage()
        if usage.count("\n") > 2:  # the usage of a command with many flags spans a page
            usage = f"usage: {self.prog} [flags]  (--help lists them)\n"
        sys.stderr.write(usage)
        self.exit(2, f"{self.prog}: error: {message}\n")
