"""Hostile input and I/O faults in translation (issue 50), driven for real at tiny sizes: a
10,000-word line among short ones, empty lines, invalid UTF-8, a directory or a full disk where a
file is expected, and the progress bar on a terminal but not in a pipe."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from test_translate import SHORT, make_checkpoint

from fastattn import data
from fastattn.checkpoint import load_model
from fastattn.inference.translate_command import main
from fastattn.inference.translator import (
    MAX_SOURCE_LEN,
    SourceTruncatedWarning,
    Translation,
    Translator,
    UnreadableSourceWarning,
)
from fastattn.tools import evaluate
from fastattn.train import evaluation

ENV = {**os.environ, "FASTATTN_BACKEND": "torch", "OMP_NUM_THREADS": "2"}
SHORT_LINES = ["A dog runs on the beach.", "Two men are playing football.", "A woman."]
WORDS = "a dog runs on the beach while two men play football in a park".split()
HUGE = " ".join(WORDS[i % len(WORDS)] for i in range(10_000))  # ~19,000 pieces
TIMEOUT = 300  # generous: a stall (the old behaviour) runs for hours, a fix in seconds


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("faults") / "checkpoint.pt")


def translate_command(checkpoint: Path, *flags: str, stdin: bytes = b"", **popen):
    """python -m fastattn.translate in a child process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "fastattn.translate", "--checkpoint", str(checkpoint), *flags],
        input=stdin, capture_output=True, env=ENV, timeout=TIMEOUT, **popen)


# -- a huge line ---------------------------------------------------------------------------------


def test_a_10000_word_line_is_truncated_with_a_warning_and_the_short_lines_come_out(
        checkpoint, tmp_path):
    lines = [SHORT_LINES[0], SHORT_LINES[1], HUGE, SHORT_LINES[2], SHORT_LINES[0]]
    source = tmp_path / "in.en"
    source.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    done = translate_command(checkpoint, "--input", str(source), "--max-len-b", "4")
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    out = done.stdout.decode().split("\n")
    assert out[-1] == "" and len(out) == len(lines) + 1
    expected = Translator.from_checkpoint(checkpoint, **SHORT).translate(SHORT_LINES)
    assert [out[0], out[1], out[3], out[4]] == [expected[0], expected[1], expected[2], expected[0]]
    assert out[2]  # the huge line's translation, of its first pieces
    [warning] = stderr.splitlines()  # one line, no traceback, no progress bar in a pipe
    pieces = len(Translator.from_checkpoint(checkpoint).sp.encode(HUGE)) + 1
    assert warning == (f"warning: {source}:3: the source has {pieces} pieces; translating its "
                       f"first {MAX_SOURCE_LEN} (--max-source-len)")


def test_ctrl_c_after_the_first_line_keeps_it_and_prints_no_traceback(checkpoint, tmp_path):
    source = tmp_path / "in.en"
    source.write_text(f"{SHORT_LINES[0]}\n{HUGE}\n{SHORT_LINES[1]}\n", encoding="utf-8")
    child = subprocess.Popen(
        [sys.executable, "-m", "fastattn.translate", "--checkpoint", str(checkpoint), "--input",
         str(source), "--max-len-b", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
        # A shell's background job ignores SIGINT, and Python keeps an ignored SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        ready, _, _ = select.select([child.stdout], [], [], TIMEOUT)
        assert ready, "the first line did not come out before the huge one was decoded"
        first = child.stdout.readline().decode()  # before the huge line is done
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=TIMEOUT)
    finally:
        child.kill()
    expected = Translator.from_checkpoint(checkpoint, **SHORT).translate(SHORT_LINES[:1])
    assert first == f"{expected[0]}\n"
    assert child.returncode == 130, stderr
    lines = stderr.decode().splitlines()
    assert lines[-1] == "interrupted" and len(lines) == 2 and lines[0].startswith("warning:")


def test_the_cap_is_an_argument_and_truncation_keeps_the_first_pieces(checkpoint):
    told = []
    translator = Translator.from_checkpoint(checkpoint, max_source_len=8, beam_size=2,
                                            on_truncated=lambda *a: told.append(a), **SHORT)
    [found] = translator.stream([HUGE])
    ids = translator.sp.encode(HUGE)
    [expected] = translator._search([ids[:7] + [translator.eos_id]])
    assert [(t.tokens, t.score) for t in found] == [(t.tokens, t.score) for t in expected]
    assert told == [(1, len(ids) + 1)]
    with pytest.raises(ValueError, match="max_source_len must be >= 2"):
        Translator.from_checkpoint(checkpoint, max_source_len=1)
    # The default tells through the warnings module, naming the line.
    default = Translator.from_checkpoint(checkpoint, max_source_len=8, **SHORT)
    with pytest.warns(SourceTruncatedWarning, match="line 2: the source has"):
        default.translate(["A dog.", HUGE])


def test_the_lines_before_a_long_one_are_given_before_it_is_decoded(checkpoint, monkeypatch):
    # 300 tokens and 3 short sources fit the default 4096 batch tokens, but do not share one.
    translator = Translator.from_checkpoint(checkpoint, max_source_len=300,
                                            on_truncated=lambda *a: None, **SHORT)
    searched = []
    search = translator._search
    monkeypatch.setattr(translator, "_search",
                        lambda sources: searched.append(max(map(len, sources))) or search(sources))
    stream = translator.stream([SHORT_LINES[0], HUGE, *SHORT_LINES[1:]])
    first = next(stream)
    assert first and max(searched) < 300  # the long line is not decoded yet
    assert len(list(stream)) == 3 and searched[-1] == 300 and len(searched) == 2


def test_a_model_with_learned_positions_translates_a_long_line_within_its_positions(tmp_path):
    learned = make_checkpoint(tmp_path / "learned.pt", positions="learned", max_len=40)
    translator = Translator.from_checkpoint(learned, on_truncated=lambda *a: None)
    assert translator.max_source_len == 40
    [found] = translator.stream([HUGE])
    assert found and all(len(t.tokens) < 40 for t in found)


# -- empty lines and invalid UTF-8 ---------------------------------------------------------------


def run_main(monkeypatch, capsys, args, stdin: bytes):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    main(args)
    return capsys.readouterr().out.split("\n")


def test_empty_lines_give_empty_lines_in_place(checkpoint, monkeypatch, capsys):
    lines = ["", SHORT_LINES[0], "", "   ", SHORT_LINES[2], ""]
    base = ["--checkpoint", str(checkpoint), "--max-len-b", "4"]
    out = run_main(monkeypatch, capsys, base, "".join(f"{x}\n" for x in lines).encode())
    expected = Translator.from_checkpoint(checkpoint, **SHORT).translate(SHORT_LINES)
    assert out == ["", expected[0], "", "", expected[2], "", ""]
    assert all(out[i] for i in (1, 4))
    scored = run_main(monkeypatch, capsys, [*base, "--scores"], b"\nA dog.\n")
    assert scored[0] == "0.0000\t" and float(scored[1].split("\t")[0]) < 0
    nbest = run_main(monkeypatch, capsys, [*base, "--beam", "3", "--nbest", "2"], b"A dog.\n\n")
    assert [line.split("\t")[0] for line in nbest[:-1]] == ["0", "0", "1"]
    assert nbest[2] == "1\t0.0000\t"
    translator = Translator.from_checkpoint(checkpoint, **SHORT)
    assert translator.translate(["", " "]) == ["", ""]
    assert list(translator.stream([""])) == [[Translation("", 0.0, [])]]


def test_lines_of_only_unknown_characters_give_empty_lines_with_a_warning(
        checkpoint, monkeypatch, capsys):
    """Emoji, a NUL byte, control characters: the model invented German for them ("Hecker binden
    sich."). A line with a known piece among them translates; an empty one warns of nothing."""
    unreadable = ["\U0001F600\U0001F600", "\x00", "\x01\x02\x1b", " \U0001F415 \x00 \u20ac "]
    mixed = "\U0001F600 " + SHORT_LINES[2]
    lines = [SHORT_LINES[0], *unreadable, "", mixed]
    sp = Translator.from_checkpoint(checkpoint).sp
    assert sp.encode(unreadable[0]) and {sp.id_to_piece(i) for i in sp.encode(unreadable[0])} \
        == {"\u2581", "<unk>"}  # the case decoded before
    expected = Translator.from_checkpoint(checkpoint, **SHORT).translate([SHORT_LINES[0], mixed])
    assert all(expected)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(
        "".join(f"{x}\n" for x in lines).encode())))
    main(["--checkpoint", str(checkpoint), "--max-len-b", "4", "--window", "3"])
    out, err = capsys.readouterr()
    assert out.split("\n") == [expected[0], "", "", "", "", "", expected[1], ""]
    assert err.splitlines() == [
        f"warning: stdin:{line}: nothing in the line is in the model's vocabulary (emoji, "
        "control characters?); its translation is an empty line" for line in (2, 3, 4, 5)]
    told = []
    translator = Translator.from_checkpoint(checkpoint, on_unreadable=told.append, **SHORT)
    assert translator.translate(lines) == out.split("\n")[:-1] and told == [2, 3, 4, 5]
    assert list(translator.stream(unreadable[:1])) == [[Translation("", 0.0, [])]]
    with pytest.warns(UnreadableSourceWarning, match="^line 1: nothing in it is in the model's "
                      r"vocabulary \(emoji, control characters\?\); translated as an empty line$"):
        Translator.from_checkpoint(checkpoint, **SHORT).translate(unreadable[1:2])


def test_invalid_utf8_names_the_line_after_the_lines_before_it_are_written(
        checkpoint, tmp_path, monkeypatch, capsys):
    good = [SHORT_LINES[0], "", SHORT_LINES[1], SHORT_LINES[2]]
    raw = "".join(f"{line}\n" for line in good).encode() + b"Un caf\xe9.\n" + b"A dog.\n"
    path = tmp_path / "latin1.en"
    path.write_bytes(raw)
    expected = Translator.from_checkpoint(checkpoint, **SHORT).translate(good)
    done = translate_command(checkpoint, "--input", str(path), "--max-len-b", "4")
    assert done.returncode == 1
    assert done.stdout.decode().split("\n") == [*expected, ""]
    assert done.stderr.decode().splitlines() == [
        f"error: {path}:5: invalid UTF-8 at byte 6 of the line (invalid continuation byte)"]
    # From stdin, and with the bad line in a later window than the first.
    for flags in ([], ["--window", "3"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
        with pytest.raises(SystemExit, match="^error: stdin:5: invalid UTF-8 at byte 6"):
            main(["--checkpoint", str(checkpoint), "--max-len-b", "4", *flags])
        assert capsys.readouterr().out.split("\n") == [*expected, ""]


def test_stream_translates_what_was_read_before_its_input_fails(checkpoint):
    translator = Translator.from_checkpoint(checkpoint, **SHORT)

    def lines():
        yield from SHORT_LINES
        raise OSError(errno.EIO, "Input/output error")

    found = []
    with pytest.raises(OSError, match="Input/output error"):
        for hypotheses in translator.stream(lines()):
            found.append(hypotheses[0].text)
    assert found == translator.translate(SHORT_LINES)


# -- a directory, a full disk, a read-only file system --------------------------------------------


def test_a_directory_where_a_file_is_expected_is_named_as_such(checkpoint, tmp_path, capsys):
    base = ["--checkpoint", str(checkpoint)]
    for flag in ("--input", "--output"):
        with pytest.raises(SystemExit, match=f"^error: {flag} {tmp_path}: Is a directory$"):
            main([*base, flag, str(tmp_path)])
    with pytest.raises(SystemExit, match=f"^error: --output {tmp_path}/none/out: No such file"):
        main([*base, "--input", os.devnull, "--output", str(tmp_path / "none" / "out")])
    (tmp_path / "in.en").write_text("A dog.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="is the --input file"):  # not emptied before it is read
        main([*base, "--input", str(tmp_path / "in.en"), "--output", str(tmp_path / "in.en")])
    assert (tmp_path / "in.en").read_text(encoding="utf-8") == "A dog.\n"
    with pytest.raises(data.DataError, match=f"^{tmp_path}: is a directory, not a file$"):
        data.read_lines(tmp_path)
    with pytest.raises(data.DataError, match="is a directory"):
        data.read_parallel(tmp_path, tmp_path)
    (tmp_path / "hyp").write_text("a\n", encoding="utf-8")
    for argv in (["--hyp", str(tmp_path), "--multi30k", "val"],
                 ["--hyp", str(tmp_path / "hyp"), "--ref", str(tmp_path)]):
        with pytest.raises(SystemExit):
            evaluate.main([*argv, "--lang", "de"])
        assert capsys.readouterr().err == f"error: {tmp_path}: is a directory, not a file\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_one_error_line(checkpoint, tmp_path):
    source = tmp_path / "in.en"
    source.write_text("A dog.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="^error: --output /dev/full: No space left on device$"):
        main(["--checkpoint", str(checkpoint), "--input", str(source), "--max-len-b", "4",
              "--output", "/dev/full"])


def test_a_read_only_file_system_is_one_error_line_and_the_lines_before_stay(
        checkpoint, tmp_path, monkeypatch):
    source, target = tmp_path / "in.en", tmp_path / "out.de"
    source.write_text("".join(f"{line}\n" for line in SHORT_LINES), encoding="utf-8")

    class TurnsReadOnly(io.StringIO):  # the file system turns read-only after the first line
        def write(self, text):
            if self.getvalue():
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return super().write(text)

        def close(self):  # keep what was written readable
            pass

    written = TurnsReadOnly()
    real_open = open
    monkeypatch.setattr("fastattn.inference.translate_command.open",
                        lambda path, *a, **k: written if str(path) == str(target)
                        else real_open(path, *a, **k), raising=False)
    with pytest.raises(SystemExit, match=f"^error: --output {target}: Read-only file system$"):
        main(["--checkpoint", str(checkpoint), "--max-len-b", "4", "--input", str(source),
              "--output", str(target)])
    expected = Translator.from_checkpoint(checkpoint, **SHORT).translate(SHORT_LINES[:1])
    assert written.getvalue() == f"{expected[0]}\n"


# -- the progress bar ----------------------------------------------------------------------------


def under_terminal(command: list[str], tmp_path: Path) -> tuple[int, bytes, str]:
    """Runs command with stderr on a pseudo-terminal (80 columns), stdout to a file: its exit
    status, what it wrote to the terminal, and to stdout."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    out = tmp_path / "stdout"
    with open(out, "wb") as stdout:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout,
                                 stderr=follower, env=ENV)
    os.close(follower)
    terminal = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], TIMEOUT)
            if not ready:
                child.kill()
                pytest.fail(f"no output on the terminal for {TIMEOUT} s")
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            terminal += chunk
    finally:
        os.close(leader)
    return child.wait(timeout=TIMEOUT), terminal, out.read_text(encoding="utf-8")


def test_translate_shows_a_progress_bar_on_a_terminal_only(checkpoint, tmp_path):
    source = tmp_path / "in.en"
    source.write_text("".join(f"{line}\n" for line in SHORT_LINES * 2), encoding="utf-8")
    command = [sys.executable, "-m", "fastattn.translate", "--checkpoint", str(checkpoint),
               "--input", str(source), "--max-len-b", "4", "--window", "2"]
    status, terminal, stdout = under_terminal(command, tmp_path)
    assert status == 0, terminal
    assert b"/6 [" in terminal and b"line" in terminal  # tqdm's "n/6 [elapsed<left, rate]"
    expected = Translator.from_checkpoint(checkpoint, **SHORT).translate(SHORT_LINES * 2)
    assert stdout.splitlines() == expected
    # In a pipe no bar: test_a_10000_word_line_... reads stderr from one.


EVALUATION_SCRIPT = """
import sys
from fastattn.checkpoint import load_model
from fastattn.train.evaluation import translate
model, sp, _ = load_model(sys.argv[1])
hyps = translate(model, sp, ["A dog runs.", "Two men.", "A woman."] * 3, beam=2, alpha=0.6,
                 max_len_b=4, batch_tokens=16)
print(len(hyps))
"""


def test_the_trainers_test_decoding_shows_a_progress_bar_on_a_terminal_only(checkpoint,
                                                                            tmp_path, capfd):
    command = [sys.executable, "-c", EVALUATION_SCRIPT, str(checkpoint)]
    status, terminal, stdout = under_terminal(command, tmp_path)
    assert status == 0, terminal
    assert b"/9 [" in terminal and b"sentence" in terminal and stdout == "9\n"
    # stderr not a terminal (here pytest's capture file): no bar.
    model, sp, _ = load_model(checkpoint)
    hyps = evaluation.translate(model, sp, SHORT_LINES, beam=2, alpha=0.6, max_len_b=4,
                                batch_tokens=16)
    assert hyps == Translator(model, sp, beam_size=2, max_len_b=4).translate(SHORT_LINES)
    assert capfd.readouterr().err == ""
