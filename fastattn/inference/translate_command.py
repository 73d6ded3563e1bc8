"""python -m fastattn.translate, the command line (fastattn/inference/translator.py describes it):
its flags, input and output files, errors as one `error:` line, and the progress bar; the
translating is fastattn.Translator's."""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import stat
import sys
from collections.abc import Iterable, Iterator

import torch

from fastattn._extras import MissingExtraError
from fastattn.checkpoint import CheckpointError
from fastattn.cli import ArgumentParser, HelpFormatter
from fastattn.inference.native import PRECISIONS
from fastattn.inference.translator import MAX_SOURCE_LEN, InputError, Translation, Translator

try:
    from tqdm import tqdm
except ImportError as e:
    raise MissingExtraError(__name__, e) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="python -m fastattn.translate",
        description="Translate raw sentences, one per line, from stdin (or --input) to stdout "
        "(or --output) with a fastattn checkpoint.",
        formatter_class=HelpFormatter,
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", help="a checkpoint of fastattn.train or fastattn.ensemble")
    model.add_argument("--model", metavar="NAME",
                       help="a model that ships with fastattn (docs/pretrained.md), e.g. "
                       "multi30k-en-de")
    parser.add_argument("--beam", type=int, default=4, help="beam size (1: greedy search)")
    parser.add_argument("--alpha", type=float,
                        help="length penalty exponent α (default: the one fastattn.train chose "
                        "on dev, stored in the checkpoint; else 0.6)")
    parser.add_argument("--length-penalty", choices=["gnmt", "pow"], default="gnmt",
                        help="gnmt: ((5 + |Y|) / 6)^α as in the paper; pow: |Y|^α")
    parser.add_argument("--max-len-a", type=float, default=1.0,
                        help="at most max_len_a · source length + max_len_b target tokens")
    parser.add_argument("--max-len-b", type=int, default=50,
                        help="the constant term of that limit (the paper: input length + 50); "
                        "the source length counts its EOS, the limit the translation's")
    parser.add_argument("--max-source-len", type=int, default=MAX_SOURCE_LEN,
                        help="a longer source (in pieces, its EOS included) is truncated to its "
                        "first pieces, with a warning naming the line")
    parser.add_argument("--nbest", type=int, default=1, help="hypotheses written per sentence")
    parser.add_argument("--scores", action="store_true", help="write scores with translations")
    parser.add_argument("--batch-tokens", type=int, default=4096,
                        help="source tokens per batch, padding included")
    parser.add_argument("--window", type=int, default=1000,
                        help="lines read ahead and sorted by length into batches")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="the decoder's arithmetic (the native CPU decoder's): int8 "
                        "quantizes the weights once per output feature and the activations "
                        "per row; bf16 rounds both to bfloat16; both sum in 32 bits")
    parser.add_argument("--workers", type=int,
                        help="batches decoded at once, each on its own thread (default on CPU: "
                        "one per core, but no more than a window has batches; docs/api.md, "
                        "\"Workers and threads\")")
    parser.add_argument("--threads", type=int,
                        help="intra-op threads per worker (default: the cores over --workers)")
    parser.add_argument("--device", default="cpu",
                        help="where the model decodes: cpu, cuda or cuda:N (--precision int8 "
                        "and bf16 decode on cpu only)")
    parser.add_argument("--input", default="-", help="input file (- for stdin)")
    parser.add_argument("--output", default="-", help="output file (- for stdout)")
    parser.add_argument("--plot-attention", metavar="PNG",
                        help="instead of translating, plot attention for the first input line")
    parser.add_argument("--attention", choices=["encoder", "cross"], default="encoder",
                        help="encoder self-attention (the paper's Figures 3-5) or cross-attention")
    parser.add_argument("--attention-layer", type=int,
                        help="layer to plot, 1-based (default: the second to last)")
    parser.add_argument("--attention-heads",
                        help="comma-separated heads to plot, 1-based (default: all)")
    args = parser.parse_args(argv)
    if args.beam < 1 or not 1 <= args.nbest <= args.beam:
        parser.error(f"need --beam >= 1 and 1 <= --nbest <= --beam, got {args.beam}, {args.nbest}")
    if args.batch_tokens < 1 or args.window < 1 or args.max_len_b < 0 or args.max_len_a < 0:
        parser.error("--batch-tokens and --window must be positive, --max-len-a/b not negative")
    for flag, count in (("--workers", args.workers), ("--threads", args.threads)):
        if count is not None and count < 1:
            parser.error(f"{flag} must be >= 1, got {count}")
    if args.max_source_len < 2:
        parser.error(f"--max-source-len must be >= 2 (a piece and the EOS), got "
                     f"{args.max_source_len}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device (cpu, cuda, cuda:1, ...)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no GPU")
    if args.alpha is not None and not args.alpha >= 0:
        parser.error(f"--alpha must not be negative, got {args.alpha}")
    heads = args.attention_heads
    if heads is not None and not all(h.strip().isdigit() and int(h) >= 1 for h in heads.split(",")):
        parser.error(f"--attention-heads takes 1-based head numbers like 1,3, got {heads!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        _main(args)
    except KeyboardInterrupt:  # Ctrl-C: what was translated is written, no traceback
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None


def _main(args: argparse.Namespace) -> None:
    name = "stdin" if args.input == "-" else args.input
    # Before the checkpoint loads: a path that cannot work is named at once.
    for flag, path in (("--input", args.input), ("--output", args.output)):
        if path != "-" and os.path.isdir(path):
            raise SystemExit(f"error: {flag} {path}: {os.strerror(errno.EISDIR)}")
    if args.input != "-" and not os.path.exists(args.input):
        raise SystemExit(f"error: --input {args.input}: {os.strerror(errno.ENOENT)}")
    if "-" not in (args.input, args.output) and os.path.exists(args.output) \
            and os.path.samefile(args.input, args.output):  # opening it for writing empties it
        raise SystemExit(f"error: --output {args.output} is the --input file")
    try:
        load = (Translator.from_pretrained if args.checkpoint is None
                else Translator.from_checkpoint)
        translator = load(
            args.checkpoint or args.model, args.device, beam_size=args.beam, alpha=args.alpha,
            length_penalty=args.length_penalty, max_len_a=args.max_len_a,
            max_len_b=args.max_len_b, nbest=args.nbest, batch_tokens=args.batch_tokens,
            window=args.window, max_source_len=args.max_source_len, precision=args.precision,
            workers=args.workers, threads=args.threads,
        )  # fmt: skip
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    try:
        source = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")
    except OSError as e:
        raise SystemExit(f"error: --input {args.input}: {_reason(e)}") from None
    with source:
        if args.plot_attention:
            _plot_attention(translator, _utf8_lines(source, name), args)
            return
        output = Output(args.output)
        with output:
            _translate(translator, _utf8_lines(source, name), args, output,
                       total=_line_count(source), name=name)


def _reason(e: OSError) -> str:
    """An OSError's cause in words: "Is a directory", "No space left on device", ..."""
    return e.strerror or str(e)


class Output:
    """Translations to a file or stdout, flushed line by line; any OSError is one `error:` line
    naming the path and its cause (what was written before stays)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = "stdout" if path == "-" else f"--output {path}"
        self.file = None

    def __enter__(self) -> Output:
        try:
            self.file = (sys.stdout if self.path == "-"
                         else open(self.path, "w", encoding="utf-8", newline="\n"))
        except OSError as e:
            raise SystemExit(f"error: {self.name}: {_reason(e)}") from None
        return self

    def write(self, text: str) -> None:
        try:
            self.file.write(text)
            self.file.flush()
        except BrokenPipeError:  # the reader is gone (| head): stop quietly, as cat does
            _silence_stdout()
            raise SystemExit(0) from None
        except OSError as e:
            raise SystemExit(f"error: {self.name}: {_reason(e)}") from None

    def __exit__(self, *exc) -> None:
        if self.file is None or self.file is sys.stdout:
            return
        try:
            self.file.close()
        except OSError as e:
            if exc[0] is None:
                raise SystemExit(f"error: {self.name}: {_reason(e)}") from None


def _silence_stdout() -> None:
    """After a broken pipe: Python's flush of stdout at exit would fail again."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _line_count(source) -> int | None:
    """The number of lines of a regular input file from where it is read (for the progress
    bar's total), else None. Read with pread: the position of `source` does not move."""
    try:
        fd = source.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        at, count, last = os.lseek(fd, 0, os.SEEK_CUR), 0, b"\n"
        while chunk := os.pread(fd, 1 << 20, at):
            count, at, last = count + chunk.count(b"\n"), at + len(chunk), chunk[-1:]
        return count + (last != b"\n")
    except (OSError, ValueError, AttributeError):
        return None


def _utf8_lines(binary: Iterable[bytes], name: str) -> Iterator[str]:
    """Lines without their line break; invalid UTF-8 raises InputError naming the line (the
    lines before it are translated first: Translator.stream)."""
    for number, raw in enumerate(binary, 1):
        try:
            yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise InputError(f"{name}:{number}: invalid UTF-8 at byte {e.start} of the line "
                             f"({e.reason})") from None


def _plot_attention(translator: Translator, lines: Iterator[str],
                    args: argparse.Namespace) -> None:
    try:
        sentence = next(lines, None)
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
    if sentence is None:
        raise SystemExit("error: --plot-attention needs one input line")
    heads = args.attention_heads
    heads = None if heads is None else [int(h) - 1 for h in heads.split(",")]
    layer = None if args.attention_layer is None else args.attention_layer - 1
    model = translator.shown_model
    stack = model.encoder.layers if args.attention == "encoder" else model.decoder.layers
    if layer is not None and not 0 <= layer < len(stack):
        raise SystemExit(f"error: --attention-layer {args.attention_layer}: the model has "
                         f"layers 1 to {len(stack)}")
    count = stack[0].self_attention.heads
    if heads is not None and max(heads) >= count:
        raise SystemExit(f"error: --attention-heads {args.attention_heads}: the model has "
                         f"heads 1 to {count}")
    try:
        translator.plot_attention(sentence, args.plot_attention, layer, heads, args.attention)
    except OSError as e:
        raise SystemExit(f"error: --plot-attention {args.plot_attention}: {_reason(e)}") from None


def _translate(translator: Translator, lines: Iterator[str], args: argparse.Namespace,
               output: Output, total: int | None = None, name: str = "stdin") -> None:
    """Writes the translations of lines to output, each line flushed as soon as it is done, with
    a progress bar when stderr is a terminal."""
    bar = tqdm(total=total, unit="line", file=sys.stderr, leave=False, dynamic_ncols=True,
               disable=not _is_terminal(sys.stderr))
    # Output lines on the bar's terminal are written with the bar cleared, then it is redrawn.
    shared = not bar.disable and output.file is sys.stdout and _is_terminal(sys.stdout)

    def truncated(line: int, pieces: int) -> None:
        tqdm.write(f"warning: {name}:{line}: the source has {pieces} pieces; translating its "
                   f"first {translator.max_source_len} (--max-source-len)", file=sys.stderr)

    def unreadable(line: int) -> None:
        tqdm.write(f"warning: {name}:{line}: nothing in the line is in the model's vocabulary "
                   "(emoji, control characters?); its translation is an empty line",
                   file=sys.stderr)

    translator.on_truncated, translator.on_unreadable = truncated, unreadable
    with bar:
        try:
            for line, hypotheses in enumerate(translator.stream(lines)):
                if args.nbest > 1:
                    text = "".join(f"{line}\t{h.score:.4f}\t{h.text}\n" for h in hypotheses)
                else:
                    best = hypotheses[0] if hypotheses else Translation("", -math.inf, [])
                    text = f"{best.score:.4f}\t{best.text}\n" if args.scores else f"{best.text}\n"
                clearing = tqdm.external_write_mode(file=sys.stdout) if shared else None
                with clearing or contextlib.nullcontext():
                    output.write(text)
                bar.update()
        except InputError as e:
            bar.close()
            raise SystemExit(f"error: {e}") from None


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
