"""What every command line shares (fastattn.cli): a flag is never taken from a prefix of it."""

import importlib
from pathlib import Path

import pytest

from fastattn.cli import ArgumentParser

ROOT = Path(__file__).parent.parent

COMMANDS = ["fastattn.train.command", "fastattn.inference.translate_command",
            "fastattn.tools.evaluate", "fastattn.tools.average",
            "fastattn.inference.ensemble_command", "fastattn.tools.ctranslate2_convert",
            "fastattn.tools.gpu_check", "fastattn.tools.info", "fastattn.inference.pretrained"]

# (command module, its main's argv with one abbreviated flag, the abbreviation, what it cuts);
# the other flags each command requires are given whole, so that the abbreviation is the error.
ABBREVIATED = [
    ("fastattn.train.command", ["--lr", "0.0005"], "--lr", "--lr-scale"),
    ("fastattn.train.command", ["--res"], "--res", "--resume"),
    ("fastattn.inference.translate_command", ["--check", "model.pt"], "--check", "--checkpoint"),
    ("fastattn.tools.evaluate", ["--hy", "h", "--ref", "r", "--lang", "de"], "--hy", "--hyp"),
    ("fastattn.tools.average", ["--dir", "d", "--out", "a.pt"], "--out", "--output"),
    ("fastattn.inference.ensemble_command", ["--in", "a.pt", "--output", "e.pt"], "--in",
     "--inputs"),
    ("fastattn.tools.ctranslate2_convert", ["--checkpoint", "c.pt", "--output=dir"], "--output",
     "--output-dir"),
    ("fastattn.tools.gpu_check", ["--dry"], "--dry", "--dry-run"),
    ("fastattn.tools.info", ["--he"], "--he", "--help"),
    ("fastattn.inference.pretrained", ["--checkpoint", "c.pt", "--na", "x"], "--na", "--name"),
]


@pytest.mark.parametrize("module, argv, abbreviation, flag", ABBREVIATED)
def test_an_abbreviated_flag_is_refused_with_one_line_naming_it(capsys, monkeypatch, module,
                                                                  argv, abbreviation, flag):
    """argparse's default takes a flag's unambiguous prefix for it: `train --lr 0.0005` trained
    with --lr-scale 0.0005 without a word."""
    main = importlib.import_module(module).main
    parse_args = ArgumentParser.parse_args

    def parse_only(*args, **kwargs):  # a command line that parses runs nothing here
        parse_args(*args, **kwargs)
        raise AssertionError(f"{argv} parsed")

    monkeypatch.setattr(ArgumentParser, "parse_args", parse_only)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.endswith(f": error: {abbreviation} is not a flag (flags are never "
                          f"abbreviated): did you mean {flag}?"), error


def test_a_prefix_of_several_flags_names_them_all(capsys):
    parser = ArgumentParser(prog="p")
    for flag in ("--max-len", "--max-updates", "--min"):
        parser.add_argument(flag)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max", "3"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "p: error: --max is not a flag (flags are never abbreviated): did you mean --max-len or "
        "--max-updates?")


def test_whole_flags_and_values_after_a_double_dash_parse_as_before():
    parser = ArgumentParser(prog="p")
    parser.add_argument("--output-dir")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--output-dir=d", "--", "--out"])
    assert (args.output_dir, args.rest) == ("d", ["--out"])
    args = parser.parse_args(["--output-dir", "d"])
    assert args.output_dir == "d"


def test_every_command_parses_with_the_shared_parser():
    """A command's plain argparse.ArgumentParser would take prefixes again: in fastattn/ only
    cli.py makes one; benchmarks/ and scripts/ make theirs with allow_abbrev=False."""
    for path in sorted((ROOT / "fastattn").rglob("*.py")):
        if path.name != "cli.py":
            assert "argparse.ArgumentParser(" not in path.read_text(), path
    for folder in ("benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            assert text.count("argparse.ArgumentParser(") == text.count("allow_abbrev=False"), path


@pytest.mark.parametrize("module", COMMANDS)
def test_every_flag_of_every_command_says_what_it_does_in_help(monkeypatch, module):
    """translate --help gave --max-len-b and --device nothing but their defaults."""
    parsers = []

    def capture(self, *args, **kwargs):  # the command's parser, complete when it parses
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(ArgumentParser, "parse_known_args", capture)
    with pytest.raises(SystemExit):
        importlib.import_module(module).main([])
    [parser] = parsers
    silent = [action.option_strings[0] for action in parser._actions if not action.help]
    assert not silent, f"{parser.prog}: no help for {', '.join(silent)}"
