"""What fastattn's command lines share."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, TextIO


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
    flag (--help does that)."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage()
        if usage.count("\n") > 2:  # the usage of a command with many flags spans a page
            usage = f"usage: {self.prog} [flags]  (--help lists them)\n"
        sys.stderr.write(usage)
        self.exit(2, f"{self.prog}: error: {message}\n")
