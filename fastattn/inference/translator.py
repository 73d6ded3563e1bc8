"""Translation with a trained checkpoint or a shipped model: fastattn.Translator, the library that
`python -m fastattn.translate` serves. The command line described below lives in
fastattn/inference/translate_command.py, which fastattn/translate/__main__.py runs.

    python -m fastattn.translate (--checkpoint CKPT | --model NAME) [--beam 4] [--alpha A]
        [--max-len-a 1] [--max-len-b 50] [--max-source-len 1024] [--nbest N] [--batch-tokens N]
        [--precision fp32|int8|bf16] [--workers N] [--threads N] [--input FILE] [--output FILE]
        < input > output

Reads raw sentences, one per line, encodes them with the checkpoint's SentencePiece model, sorts
a bounded window of them by length into batches of about --batch-tokens source tokens, decodes
each batch with the cached decoder and beam search (fastattn.Decoder.beam_search: one native
call per batch on CPU), and writes the detokenized translations in input order as soon as they
and every line before them are done: memory does not grow with the input. On CPU, --workers
batches decode at once, each on its own thread with --threads intra-op threads (default:
fastattn.inference.workers.choose for the window's batch size and the cores); --precision int8
or bf16 decodes with int8 or bfloat16 weights and activations (the native CPU decoder).
Defaults are the paper's: beam 4, the GNMT length penalty with the α that fastattn.train chose
on dev (stored in the checkpoint; else the paper's 0.6), at most source length + 50 tokens (the
source length counts the EOS that ends it).
Hostile input: a source longer than --max-source-len pieces (default 1,024, its EOS included;
no more than a model with learned positions has) keeps its first pieces, with a warning on
stderr naming the line, so that one huge line costs seconds, not hours (decoding is quadratic in
the source length), and the lines before it are not held back. An empty line (or one of only
white space) gives an empty line; so does a line with nothing the vocabulary knows (only
emoji, a NUL byte, control characters, ...: no piece but <unk> and word boundaries), with a
warning on stderr naming the line. Invalid UTF-8 stops with one `error:` line naming the line,
after the translations of every line before it are written.
On a terminal, stderr shows a progress bar (lines translated); pipes and logs get none.
Output: one translation per line; with --scores "score<TAB>translation"; with --nbest N > 1,
N lines "line number<TAB>score<TAB>translation" per input line (numbered from 0), best first;
an empty line has one hypothesis, the empty translation, scored 0.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fastattn import backend
from fastattn._extras import MissingExtraError
from fastattn.checkpoint import load_model
from fastattn.data import Truecaser
from fastattn.inference import pretrained
from fastattn.inference.ensemble import Ensemble, decoder_of
from fastattn.inference.native import check_precision
from fastattn.inference.search import LengthPenalty
from fastattn.inference.workers import Workers, choose
from fastattn.model import Transformer

try:
    from tqdm import tqdm
except ImportError as e:
    raise MissingExtraError(__name__, e) from None

MAX_SOURCE_LEN = 1024
"""The most source pieces translated of a line, its EOS included (Translator.max_source_len,
--max-source-len): decoding costs grow with the square of the source length."""


LONG_SOURCE = 256
"""Sources up to this many tokens are batched by --batch-tokens alone; a longer one is not
batched with sources less than half as long (Translator._batches)."""


class SourceTruncatedWarning(UserWarning):
    """A source longer than Translator.max_source_len was cut to its first pieces."""


class UnreadableSourceWarning(UserWarning):
    """A source line with nothing the vocabulary knows was translated to the empty line."""


class InputError(ValueError):
    """Input that cannot be translated (invalid UTF-8); the message names the file and line."""


@dataclass
class Translation:
    text: str
    """Detokenized."""
    score: float
    """Summed log-probability of the tokens and EOS, divided by the length penalty."""
    tokens: list[int]
    """Target ids, EOS excluded."""


class Translator:
    """Translates raw sentences with a Transformer and its SentencePiece model.

    >>> translator = Translator.from_checkpoint("checkpoint_final.pt")
    >>> translator.translate(["A dog runs on the beach."])
    ['Ein Hund rennt am Strand.']

    `stream(lines)` translates an iterable lazily, `plot_attention` draws attention weights.
    Search options as in fastattn.beam_search; beam_size 1 is greedy search. max_len of a
    sentence is max_len_a · source length + max_len_b. A model trained on truecased text
    (fastattn.train --truecase) comes with the source truecaser; its translations are
    detruecased.

    A source of more than max_source_len pieces (its EOS included; at most the positions of a
    model with learned positions) keeps its first max_source_len - 1 pieces and its EOS, and
    `on_truncated(line, pieces)` is called with its line number (from 1) and its length (default:
    a SourceTruncatedWarning). A line that encodes to no pieces (empty, or only white space)
    translates to the empty translation, scored 0, without decoding. So does an unreadable line,
    one with characters besides white space but no piece besides <unk> and the bare word
    boundary "▁" (only emoji, a NUL byte, control characters, which the normalisation may drop,
    ...), from whose unknown tokens the model would invent a sentence; `on_unreadable(line)` is
    called with its line number (default: an UnreadableSourceWarning).

    precision: the decoder's, one of fastattn.inference.native.PRECISIONS (fastattn.Decoder;
    "int8" quantizes the weights once per translator and needs the native CPU decoder). On CPU,
    `workers` batches decode at once, each on its own thread with `threads` intra-op threads
    (fastattn.inference.workers.Workers); translations keep their order. None: given one, the
    other is the cores (torch.get_num_threads() when the translator is made) over it; given
    neither, each window's batches get fastattn.inference.workers.choose(b, cores) for b the
    number of sentences its batches hold on average, with no more workers than batches (the
    cores go to the workers there are). Batches of sources longer than LONG_SOURCE tokens, a
    window's last, decode after its others, with a choice of their own: they never take a
    worker from the lines before them. One worker with the caller's thread count decodes in
    the caller's thread; on a GPU that is the default.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sp,
        *,
        beam_size: int = 4,
        alpha: float = 0.6,
        length_penalty: LengthPenalty = "gnmt",
        max_len_a: float = 1.0,
        max_len_b: int = 50,
        nbest: int = 1,
        batch_tokens: int = 4096,
        window: int = 1000,
        truecaser: Truecaser | None = None,
        max_source_len: int = MAX_SOURCE_LEN,
        on_truncated: Callable[[int, int], None] | None = None,
        on_unreadable: Callable[[int], None] | None = None,
        precision: str = "fp32",
        workers: int | None = None,
        threads: int | None = None,
    ) -> None:
        if not 1 <= nbest <= beam_size:
            raise ValueError(f"nbest must be between 1 and the beam size {beam_size}, got {nbest}")
        if batch_tokens < 1 or window < 1:
            raise ValueError(f"batch_tokens and window must be >= 1, got {batch_tokens}, {window}")
        if max_source_len < 2:
            raise ValueError(f"max_source_len must be >= 2 (a piece and the EOS), got "
                             f"{max_source_len}")
        check_precision(precision)
        for name, count in (("workers", workers), ("threads", threads)):
            if count is not None and not (isinstance(count, int) and count >= 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {count!r}")
        self.model, self.sp = model.eval(), sp
        self.beam_size, self.alpha, self.length_penalty = beam_size, alpha, length_penalty
        self.max_len_a, self.max_len_b, self.nbest = max_len_a, max_len_b, nbest
        self.batch_tokens, self.window, self.truecaser = batch_tokens, window, truecaser
        self.device = next(model.parameters()).device
        self.pad_id, self.bos_id, self.eos_id = sp.pad_id(), sp.bos_id(), sp.eos_id()
        # A model with learned positions has none beyond cfg.max_len: sources and outputs stop
        # there (sinusoids extend to any length).
        members = model.members if isinstance(model, Ensemble) else [model]
        learned = [m.cfg.max_len for m in members
                   if getattr(getattr(m, "cfg", None), "positions", None) == "learned"]
        self.position_limit = min(learned) if learned else None
        self.max_source_len = min(max_source_len, self.position_limit or max_source_len)
        self.on_truncated = on_truncated or self._warn_truncated
        self.on_unreadable = on_unreadable or self._warn_unreadable
        # Pieces that carry no text of the line: <unk>, and the word boundary SentencePiece puts
        # before a word (piece_to_id gives unk_id for a piece the vocabulary lacks).
        self._textless = {sp.unk_id(), sp.piece_to_id("\u2581")}
        self.precision, self.workers, self.threads = precision, workers, threads
        # Decodes every batch, on any worker: the native engine's packed weights are built once.
        self.decoder = decoder_of(self.model, precision)
        self.cores = torch.get_num_threads()
        self._pools: dict[tuple[int, int], Workers] = {}

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, device: str | torch.device = "cpu", **options
    ) -> Translator:
        return cls._from_loaded(*load_model(path, device), **options)

    @classmethod
    def from_pretrained(
        cls, name: str, device: str | torch.device = "cpu", **options
    ) -> Translator:
        """The translator of a model that ships with fastattn
        (fastattn.inference.pretrained.names()), its file checked against its model.json first;
        an unknown name is a ValueError that lists the shipped ones."""
        return cls._from_loaded(*pretrained.load(name, device), **options)

    @classmethod
    def _from_loaded(cls, model: torch.nn.Module, sp, meta: dict, **options) -> Translator:
        if options.get("alpha") is None:  # the length penalty training chose on dev, if any
            options["alpha"] = meta.get("alpha", 0.6)
        if meta.get("truecase") is not None:  # even empty: translations are detruecased
            options["truecaser"] = Truecaser(meta["truecase"])
        return cls(model, sp, **options)

    def translate(self, sentences: Sequence[str], progress: bool = False) -> list[str]:
        """The best translation of each sentence; progress: a progress bar on stderr."""
        bar = tqdm(total=len(sentences), unit="sentence", file=sys.stderr, leave=False,
                   dynamic_ncols=True, disable=not progress)
        translations = []
        with bar:
            for hypotheses in self.stream(sentences):
                translations.append(hypotheses[0].text if hypotheses else "")
                bar.update()
        return translations

    def stream(self, lines: Iterable[str]) -> Iterator[list[Translation]]:
        """The nbest translations of each line, best first, in input order, reading `window`
        lines at a time and giving each translation as soon as it and those of the lines before
        it are done. If reading `lines` raises, the lines read before are translated and given
        first, then the exception is raised."""
        lines = iter(lines)
        first = 1  # the line number of the window's first line
        while True:
            window: list[str] = []
            error: Exception | None = None
            try:
                for line in itertools.islice(lines, self.window):
                    window.append(line.rstrip("\n"))
            except Exception as e:  # noqa: BLE001 - raised again below, after the lines before
                error = e
            yield from self._translate_window(window, first)
            first += len(window)
            if error is not None:
                raise error
            if len(window) < self.window:
                return

    def _encode(self, sentences: list[str], first: int | None = None) -> list[list[int]]:
        """Source ids of raw sentences, EOS included, at most max_source_len of them (a longer
        source keeps its first pieces; on_truncated is told its line, numbered from `first`)."""
        if self.truecaser is not None:
            sentences = [self.truecaser(s) for s in sentences]
        sources = []
        for i, ids in enumerate(self.sp.encode(sentences, out_type=int)):
            if len(ids) + 1 > self.max_source_len:
                self.on_truncated(i + (first or 1), len(ids) + 1)
                ids = ids[: self.max_source_len - 1]
            sources.append(ids + [self.eos_id])
        return sources

    def _warn_truncated(self, line: int, pieces: int) -> None:
        _warn(SourceTruncatedWarning(f"line {line}: the source has {pieces} pieces; translating "
                                     f"its first {self.max_source_len} (max_source_len)"))

    def _warn_unreadable(self, line: int) -> None:
        _warn(UnreadableSourceWarning(f"line {line}: nothing in it is in the model's vocabulary "
                                      "(emoji, control characters?); translated as an empty "
                                      "line"))

    def _translate_window(self, sentences: list[str],
                          first: int = 1) -> Iterator[list[Translation]]:
        """The translations of a window of lines, in order, each as soon as it and the ones
        before it are done (batches go shortest first: a long line holds back only the lines
        after it)."""
        sources = self._encode(sentences, first)
        results: list[list[Translation] | None] = [None] * len(sources)
        decode = []
        for i, ids in enumerate(sources):
            if not self._textless.issuperset(ids[:-1]):
                decode.append(i)
                continue
            if sentences[i].strip():  # not an empty line: characters the vocabulary lacks
                self.on_unreadable(first + i)
            results[i] = [Translation("", 0.0, [])]  # nothing to translate
        batches = list(self._batches(decode, sources))
        # Shortest first: the batches of long sources are the last. They decode after the
        # others (so that they take no worker from them) and get workers of their own choosing.
        long = next((k for k, batch in enumerate(batches)
                     if len(sources[batch[-1]]) > LONG_SOURCE), len(batches))
        done = 0
        for group in (batches[:long], batches[long:]):
            for batch, found in zip(group, self._decode(group, sources), strict=True):
                for i, hypotheses in zip(batch, found, strict=True):
                    results[i] = hypotheses
                while done < len(results) and results[done] is not None:
                    yield results[done]
                    results[done], done = None, done + 1
        while done < len(results):
            yield results[done]
            results[done], done = None, done + 1

    def _batches(self, indices: list[int], sources: list[list[int]]) -> Iterator[list[int]]:
        """The indices of sources in batches of similar length, at most batch_tokens tokens with
        padding (a longer sentence goes alone). A source of more than LONG_SOURCE tokens joins
        no batch of sources less than half as long: it decodes for long, and the translations
        of a batch come out together."""
        batch: list[int] = []
        for i in sorted(indices, key=lambda i: len(sources[i])):
            length = len(sources[i])
            if batch and ((len(batch) + 1) * length > self.batch_tokens
                          or length > max(LONG_SOURCE, 2 * len(sources[batch[0]]))):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _configuration(self, batches: list[list[int]]) -> tuple[int, int]:
        """(workers, threads per worker) for decoding these batches (the class docstring)."""
        if self.workers is not None or self.threads is not None:
            workers = self.workers or max(1, self.cores // self.threads)
            return workers, self.threads or max(1, self.cores // workers)
        # One worker on a GPU, and under Triton's interpreter, which is not thread-safe.
        if self.device.type != "cpu" or backend.interpreter_active():
            return 1, self.cores
        average = sum(map(len, batches)) / len(batches)
        workers, _ = choose(max(1, round(average)), self.cores)
        workers = min(workers, len(batches))
        return workers, max(1, self.cores // workers)

    def _decode(self, batches: list[list[int]],
                sources: list[list[int]]) -> Iterator[list[list[Translation]]]:
        """The translations of each batch of sources, in order, each as soon as it is done."""
        if not batches:
            return iter(())
        searches = ([sources[i] for i in batch] for batch in batches)
        workers, threads = self._configuration(batches)
        if workers == 1 and threads == torch.get_num_threads():  # nothing to change: no thread
            return map(self._search, searches)
        if (workers, threads) not in self._pools:
            self._pools[workers, threads] = Workers(workers, threads)
        return self._pools[workers, threads].map(self._search, searches)

    @torch.inference_mode()  # on the worker's thread too: inference mode is per thread
    def _search(self, sources: list[list[int]]) -> list[list[Translation]]:
        source = torch.full((len(sources), max(map(len, sources))), self.pad_id, dtype=torch.long)
        for row, ids in enumerate(sources):
            source[row, : len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(ids) for ids in sources])
        max_len = (self.max_len_a * lengths + self.max_len_b).floor().long().clamp(min=1)
        if self.position_limit is not None:
            max_len = max_len.clamp(max=self.position_limit)
        source, max_len = source.to(self.device), max_len.to(self.device)
        options = dict(
            bos_id=self.bos_id, eos_id=self.eos_id, max_len=max_len, alpha=self.alpha,
            length_penalty=self.length_penalty,
        )  # fmt: skip
        if self.beam_size > 1:
            found = self.decoder.beam_search(source, beam_size=self.beam_size, nbest=self.nbest,
                                             **options)
        else:
            found = [[h] if h else [] for h in self.decoder.greedy_search(source, **options)]
        return [[self._translation(h.tokens, h.score) for h in hypotheses] for hypotheses in found]

    def _translation(self, tokens: list[int], score: float) -> Translation:
        tokens = tokens[:-1] if tokens and tokens[-1] == self.eos_id else tokens
        text = self.sp.decode(tokens)
        return Translation(text if self.truecaser is None else Truecaser.detruecase(text),
                           score, tokens)

    # -- attention, as in the paper's Figures 3-5 ----------------------------------------------

    @property
    def shown_model(self) -> Transformer:
        """The model whose attention `attention` shows: an ensemble's first member."""
        return self.model.members[0] if isinstance(self.model, Ensemble) else self.model

    @torch.inference_mode()
    def attention(
        self, sentence: str, layer: int, kind: str = "encoder"
    ) -> tuple[list[str], list[str], torch.Tensor]:
        """The attention weights (heads, queries, keys) of one layer (0-based) for a sentence:
        "encoder" self-attention over the source pieces (the paper's Figures 3-5) or "cross"
        attention of the target pieces of the best translation over the source pieces.
        Returns (query pieces, key pieces, weights). An ensemble shows its first member's."""
        if kind not in ("encoder", "cross"):
            raise ValueError(f"kind must be 'encoder' or 'cross', got {kind!r}")
        model = self.shown_model
        stack = model.encoder.layers if kind == "encoder" else model.decoder.layers
        if not 0 <= layer < len(stack):
            raise ValueError(f"layer must be in [0, {len(stack)}), got {layer}")
        source_ids = self._encode([sentence])[0]
        source = torch.tensor([source_ids], device=self.device)
        if kind == "encoder":  # a decoder input is needed, unused: BOS
            target_ids, target = source_ids, torch.tensor([[self.bos_id]], device=self.device)
        else:
            best = self._search([source_ids])[0]
            target_ids = (best[0].tokens if best else []) + [self.eos_id]
            target = torch.tensor([[self.bos_id, *target_ids[:-1]]], device=self.device)
        # The fused attention op returns no weights: the model recomputes them.
        weights = model.attention_weights(source, target)[kind][layer][0].float()
        pieces = self.sp.id_to_piece
        return pieces(target_ids), pieces(source_ids), weights.cpu()

    def plot_attention(
        self,
        sentence: str,
        path: str | Path,
        layer: int | None = None,
        heads: Sequence[int] | None = None,
        kind: str = "encoder",
    ) -> None:
        """Heatmaps of `heads` (0-based, default all) of `layer` (default the second to last, the
        paper's layer 5 of 6) for one sentence, one panel per head, saved to path (PNG)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        model = self.shown_model
        depth = len(model.encoder.layers if kind == "encoder" else model.decoder.layers)
        layer = max(depth - 2, 0) if layer is None else layer
        queries, keys, weights = self.attention(sentence, layer, kind)
        heads = list(range(weights.shape[0])) if heads is None else list(heads)
        if not heads or not all(0 <= h < weights.shape[0] for h in heads):
            raise ValueError(f"heads must be in [0, {weights.shape[0]}), got {heads}")
        columns = min(len(heads), 4)
        rows = math.ceil(len(heads) / columns)
        width, height = 0.3 * len(keys) + 1.5, 0.3 * len(queries) + 1.5
        figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows),
                                    squeeze=False)
        for ax in axes.flat[len(heads):]:
            ax.axis("off")
        darkest = float(weights[heads].max())  # one colour scale for all panels
        for ax, head in zip(axes.flat, heads, strict=False):
            ax.imshow(weights[head].numpy(), cmap="viridis", vmin=0.0, vmax=darkest)
            ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=8)
            ax.set_yticks(range(len(queries)), queries, fontsize=8)
            ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=9)
        what = "encoder self-attention" if kind == "encoder" else "decoder-encoder attention"
        figure.suptitle(f"{what}: rows attend to columns")
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)


def _warn(warning: Warning) -> None:
    """warnings.warn, pointed at the line that called into this module."""
    level, frame = 1, sys._getframe()
    while frame is not None and frame.f_code.co_filename == __file__:
        level, frame = level + 1, frame.f_back
    warnings.warn(warning, stacklevel=level)
