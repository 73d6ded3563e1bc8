"""Parallel text for training and evaluation: reading and checking, truecasing, a joint
SentencePiece vocabulary and BPE-dropout on it, length filtering and token-bucket batches.

Text is read strictly: every line is stripped and must be non-empty valid UTF-8, and the two sides
must have the same number of lines. Anything else raises DataError with a one-line message that
names the file and the line. Lines are never split on TAB (Multi30k's train.de has one inside a
sentence).
"""

from __future__ import annotations

import gzip
import io
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from fastattn._extras import MissingExtraError

try:
    import sentencepiece as spm
except ImportError as e:
    raise MissingExtraError(__name__, e) from None

CORPORA = Path(__file__).parent / "corpora"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test2016": "test_2016_flickr"}
MULTI30K_LANGS = ("en", "de", "fr")

# SentencePiece ids; the model pads with PAD_ID and starts/ends target sentences with BOS/EOS.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class DataError(ValueError):
    """Bad input data; the message is one line naming the file (and line) and the problem."""


@dataclass
class ParallelText:
    """Aligned source and target sentences, with where they came from (for messages)."""

    src: list[str]
    tgt: list[str]
    src_path: str
    tgt_path: str

    def __len__(self) -> int:
        return len(self.src)


def read_lines(path: str | Path, allow_empty: bool = False) -> list[str]:
    """The stripped lines of a plain or gzip text file; every line must be UTF-8, and non-empty
    unless allow_empty (translations may be empty)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a file")
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():  # a pipe or a device: read twice below (the gzip test, the text)
        raise DataError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            raw = gzip.GzipFile(fileobj=f).read() if gzipped else f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise DataError(f"{path}: cannot read ({reason})") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline ends the last line, it does not start a new one
    text = []
    for number, line in enumerate(lines, 1):
        try:
            decoded = line.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}:{number}: invalid UTF-8 at byte {e.start} of the line"
            ) from None
        if not decoded and not allow_empty:
            raise DataError(f"{path}:{number}: empty line")
        text.append(decoded)
    if not text and not allow_empty:
        raise DataError(f"{path}: empty file")
    return text


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> ParallelText:
    """Reads an aligned pair of text files (plain or .gz) and checks they have as many lines."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        shorter, longer = (src_path, tgt_path) if len(src) < len(tgt) else (tgt_path, src_path)
        raise DataError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: "
            f"{shorter} ends at line {min(len(src), len(tgt))}, {longer} continues"
        )
    return ParallelText(src, tgt, str(src_path), str(tgt_path))


def multi30k_path(split: str, lang: str, tokenized: bool = False) -> Path:
    """The embedded Multi30k file of a split (train, val, test2016) and language (en, de, fr).

    tokenized=True gives the official lowercased, Moses-tokenised reference (val, test2016)."""
    if split not in MULTI30K_SPLITS:
        raise DataError(f"multi30k has splits {sorted(MULTI30K_SPLITS)}, not {split!r}")
    if lang not in MULTI30K_LANGS:
        raise DataError(f"multi30k has languages {list(MULTI30K_LANGS)}, not {lang!r}")
    if tokenized and split == "train":
        raise DataError("multi30k has tokenized references for val and test2016 only")
    name = MULTI30K_SPLITS[split]
    if tokenized:
        return CORPORA / "multi30k" / "tok" / f"{name}.lc.norm.tok.{lang}.gz"
    return CORPORA / "multi30k" / f"{name}.{lang}.gz"


def load_multi30k(split: str, src: str, tgt: str) -> ParallelText:
    """One split of the embedded Multi30k corpus (Elliott et al., 2016; 2017)."""
    if src == tgt:
        raise DataError(f"source and target language are both {src!r}")
    return read_parallel(multi30k_path(split, src), multi30k_path(split, tgt))


# --- truecasing --------------------------------------------------------------------------------


class Truecaser:
    """Moses-style truecasing (Koehn et al., 2007, train-truecaser.perl): the first word of a
    sentence takes the form the word most often has inside sentences of the training text, so
    "Ein Hund" and "ein Hund" reach the model as one word; words never seen inside a sentence
    stay as they are. `detruecase` capitalises the first letter of a translation again.

    Only the first word changes: inside a sentence case is part of the word (German nouns)."""

    _WORD = re.compile(r"\w+")

    def __init__(self, forms: dict[str, str]) -> None:
        self.forms = forms
        """Lowercased word -> its most frequent form inside sentences (serialisable)."""

    @classmethod
    def train(cls, sentences: Iterable[str]) -> Truecaser:
        counts: dict[str, Counter[str]] = {}
        for sentence in sentences:
            for word in cls._WORD.findall(sentence)[1:]:
                counts.setdefault(word.lower(), Counter())[word] += 1
        # Ties go to the form seen first, so the result depends only on the text.
        return cls({key: forms.most_common(1)[0][0] for key, forms in counts.items()})

    def __call__(self, sentence: str) -> str:
        first = self._WORD.search(sentence)
        if first is None:
            return sentence
        form = self.forms.get(first.group().lower(), first.group())
        return sentence[: first.start()] + form + sentence[first.end():]

    @classmethod
    def detruecase(cls, sentence: str) -> str:
        first = cls._WORD.search(sentence)
        if first is None:
            return sentence
        return sentence[: first.start()] + sentence[first.start()].upper() \
            + sentence[first.start() + 1:]


# --- vocabulary --------------------------------------------------------------------------------


def train_sentencepiece(
    sentences: Sequence[str], vocab_size: int, model_type: str = "bpe", threads: int = 2
) -> bytes:
    """Trains a SentencePiece model on the sentences and returns its serialized proto.

    Train it on both sides of the training text for a joint vocabulary (the paper shares one
    source-target BPE vocabulary). The ids are fixed: pad 0, unk 1, bos 2, eos 3."""
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=buffer,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            num_threads=threads,
            input_sentence_size=0,  # every sentence: no sampling, so training is deterministic
            minloglevel=2,
        )
    except RuntimeError as e:  # e.g. fewer pieces than distinct characters, or more than possible
        reason = (str(e).split("] ", 1)[-1].strip()  # empty when the special pieces do not fit
                  or "too few for the special pieces and the text's characters")
        raise DataError(f"cannot build a {vocab_size}-piece vocabulary from this text "
                        f"(SentencePiece: {reason})") from None
    return buffer.getvalue()


def pieces_first(proto: bytes, first: Iterable[int]) -> tuple[bytes, int]:
    """The SentencePiece model proto with its pieces renumbered: the special ids 0-3 as they
    are, then the pieces `first` (ids of `proto`) in their order of id, then the rest; and the
    number of ids before the rest.

    Text segments into the same pieces, since BPE merges by score, not by id. The trainer puts
    the pieces of the target language first, so the output softmax can range over a prefix of
    the shared embedding (TransformerConfig.output_vocab_size). The proto is edited in its wire
    format (the pieces are ModelProto's repeated field 1), which needs no protobuf package."""
    fields, pieces, at = [], [], 0
    while at < len(proto):
        start = at
        key, at = _varint(proto, at)
        if key & 7 == 2:
            size, at = _varint(proto, at)
            at += size
        elif key & 7 == 0:
            _, at = _varint(proto, at)
        else:  # ModelProto has no fixed-width fields
            raise ValueError(f"unexpected wire type {key & 7} in a SentencePiece model proto")
        (pieces if key >> 3 == 1 else fields).append(proto[start:at])
    specials = range(EOS_ID + 1)
    chosen = sorted(set(first) - set(specials))
    if chosen and not 0 <= chosen[-1] < len(pieces):
        raise ValueError(f"piece id {chosen[-1]} is outside the vocabulary of {len(pieces)}")
    rest = sorted(set(range(len(pieces))) - set(chosen) - set(specials))
    order = (*specials, *chosen, *rest)
    return b"".join([pieces[i] for i in order] + fields), len(specials) + len(chosen)


def _varint(buffer: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at


def load_sentencepiece(proto: bytes) -> spm.SentencePieceProcessor:
    """A SentencePiece processor from a serialized model proto (as stored in checkpoints)."""
    return spm.SentencePieceProcessor(model_proto=proto)


def encode(sp: spm.SentencePieceProcessor, sentences: Sequence[str]) -> list[list[int]]:
    """Token ids of each sentence, without bos/eos."""
    return sp.encode(list(sentences), out_type=int)


class BPEDropout:
    """BPE-dropout (Provilkov et al., 2020): while a word is segmented, each applicable merge is
    skipped with probability p, so a training sentence comes in a different segmentation each
    time it is seen; a regulariser that helps most on small corpora. p = 0 is the ordinary
    SentencePiece BPE segmentation exactly (merge the adjacent pair whose union scores best).

    Sampling every word occurrence anew in Python would cost more than a training step, so each
    word type gets `samples` segmentations drawn once (seeded), and every occurrence picks one of
    them at random. Everything depends only on the seeds: a resumed run samples what the
    uninterrupted run sampled. (SentencePiece's own sampler is not reproducible across
    processes, even with set_random_generator_seed.)
    """

    def __init__(self, sp: spm.SentencePieceProcessor, sentences: Sequence[Sequence[int]],
                 p: float, seed: int = 0, samples: int = 16) -> None:
        if not 0 < p < 1:
            raise ValueError(f"BPE-dropout p must be in (0, 1), not {p}")
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        self._scores = {piece: sp.get_score(i) for i, piece in enumerate(pieces)
                        if len(piece) > 1 and not (sp.is_control(i) or sp.is_unknown(i))}
        types: dict[tuple[int, ...], int] = {}
        self.words = []  # per sentence: the type index of each word
        for ids in sentences:
            word_ids = []
            for word in _words(ids, pieces):
                word_ids.append(types.setdefault(word, len(types)))
            self.words.append(np.asarray(word_ids, dtype=np.int64))
        rng = np.random.default_rng([seed, 0xB1E])
        self.segmentations = [
            [word] * samples if UNK_ID in word else  # unknown text cannot be re-segmented
            [tuple(map(sp.piece_to_id, self._segment("".join(pieces[i] for i in word), p, rng)))
             for _ in range(samples)]
            for word in types
        ]
        self.samples = samples
        mean_length = np.array([np.mean([len(s) for s in segs]) for segs in self.segmentations])
        self.expected_lengths = [float(mean_length[w].sum()) for w in self.words]

    def _segment(self, word: str, p: float, rng: np.random.Generator) -> list[str]:
        symbols = list(word)
        while len(symbols) > 1:
            kept = rng.random(len(symbols) - 1) >= p
            best, at = -math.inf, -1
            for i in range(len(symbols) - 1):
                score = self._scores.get(symbols[i] + symbols[i + 1])
                if score is not None and score > best and kept[i]:
                    best, at = score, i
            if at < 0:  # every applicable merge dropped (or none left): the word is done
                break
            symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
        return symbols

    def sample(self, indices: Sequence[int], rng: np.random.Generator) -> list[list[int]]:
        """A sampled segmentation (token ids) of each of these sentences."""
        out = []
        for i in indices:
            words = self.words[i]
            picks = rng.integers(self.samples, size=len(words))
            out.append([t for w, k in zip(words.tolist(), picks.tolist(), strict=True)
                        for t in self.segmentations[w][k]])
        return out


def _words(ids: Sequence[int], pieces: Sequence[str]) -> Iterator[tuple[int, ...]]:
    """The ids of each word of a segmented sentence (a word starts at a piece with "▁")."""
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or pieces[ids[end]].startswith("▁"):
            yield tuple(ids[start:end])
            start = end


def filter_by_length(
    src: Sequence[Sequence[int]],
    tgt: Sequence[Sequence[int]],
    max_len: int,
    max_ratio: float = math.inf,
) -> tuple[list[int], dict[str, int]]:
    """Indices of the pairs with both sides in [1, max_len] tokens and a length ratio of at most
    max_ratio, and the counts: kept, too_long, bad_ratio (a pair counts under its first reason)."""
    keep = []
    counts = {"kept": 0, "too_long": 0, "bad_ratio": 0}
    for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
        if not 1 <= len(s) <= max_len or not 1 <= len(t) <= max_len:
            counts["too_long"] += 1
        elif max(len(s), len(t)) > max_ratio * min(len(s), len(t)):
            counts["bad_ratio"] += 1
        else:
            keep.append(i)
    counts["kept"] = len(keep)
    return keep, counts


# --- batching ----------------------------------------------------------------------------------


class TokenBatches:
    """Token-bucket batching: batches of about max_tokens source + target tokens (padding
    included), sentences of similar lengths together, batch order shuffled every epoch.

    The batches of an epoch depend only on (seed, epoch), so a run resumed from a position
    (epoch, step within the epoch) sees exactly the batches it would have seen. With world_size
    > 1 each rank iterates over its own shard: batch i of the epoch goes to rank i % world_size,
    and every rank gets the same number of batches.
    """

    def __init__(
        self,
        src_lengths: Sequence[int],
        tgt_lengths: Sequence[int],
        max_tokens: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.src_lengths = np.asarray(src_lengths, dtype=np.int64)
        self.tgt_lengths = np.asarray(tgt_lengths, dtype=np.int64)
        if len(self.src_lengths) != len(self.tgt_lengths) or len(self.src_lengths) == 0:
            raise ValueError("need the same, non-zero number of source and target lengths")
        longest = int((self.src_lengths + self.tgt_lengths).max())
        if max_tokens < longest:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than the longest pair ({longest} tokens)"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.max_tokens, self.seed = max_tokens, seed
        self.rank, self.world_size = rank, world_size

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """The index batches this rank sees in an epoch, in order."""
        rng = np.random.default_rng([self.seed, epoch])
        # Sort by the longer side first: a batch then spans a narrow range of both lengths. Sorted
        # by target length alone, a batch of hundreds of equally long targets pads every source to
        # its longest (on Multi30k, 11.6% padding against 5.8%). Ties (most sentences) are broken
        # at random so that the batches differ per epoch.
        longer = np.maximum(self.src_lengths, self.tgt_lengths)
        order = np.lexsort((rng.random(len(longer)), self.src_lengths, self.tgt_lengths, longer))
        batches, start, widest_src, widest_tgt = [], 0, 0, 0
        for end, i in enumerate(order):
            src_max = max(widest_src, self.src_lengths[i])
            tgt_max = max(widest_tgt, self.tgt_lengths[i])
            if (end + 1 - start) * (src_max + tgt_max) > self.max_tokens:
                batches.append(order[start:end])
                start, src_max, tgt_max = end, self.src_lengths[i], self.tgt_lengths[i]
            widest_src, widest_tgt = src_max, tgt_max
        batches.append(order[start:])
        batches = [batches[i] for i in rng.permutation(len(batches))]
        usable = len(batches) - len(batches) % self.world_size
        return batches[self.rank : usable : self.world_size]

    def __len__(self) -> int:
        return len(self.epoch(0))

    def iterate(self, epoch: int = 0, step: int = 0) -> Iterator[tuple[int, int, np.ndarray]]:
        """Endless (epoch, step within epoch, indices) from a position, epoch after epoch."""
        while True:
            for i, batch in enumerate(self.epoch(epoch)[step:], step):
                yield epoch, i, batch
            epoch, step = epoch + 1, 0

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of padding in the padded source + target tensors of an epoch's batches."""
        real = padded = 0
        for b in self.epoch(epoch):
            s, t = self.src_lengths[b], self.tgt_lengths[b]
            real += int(s.sum() + t.sum())
            padded += len(b) * int(s.max() + t.max())
        return 1 - real / padded


def collate(
    src: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]], indices: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded (source, decoder input, decoder target) id tensors of a batch.

    The source ends with EOS; the decoder input is BOS + target, the decoder target is
    target + EOS. Padding is PAD_ID."""
    src = [src[i] for i in indices]
    tgt = [tgt[i] for i in indices]
    src_len = max(map(len, src)) + 1
    tgt_len = max(map(len, tgt)) + 1
    return (_padded(src, src_len, last=EOS_ID), _padded(tgt, tgt_len, first=BOS_ID),
            _padded(tgt, tgt_len, last=EOS_ID))


def _padded(rows: list[Sequence[int]], length: int, first: int | None = None,
            last: int | None = None) -> torch.Tensor:
    """(len(rows), length) int64: each row as [first,] *row [, last], then PAD_ID. Filled in
    numpy at once, not with a few small tensor ops per sentence (thousands per batch)."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), length), PAD_ID, dtype=np.int64)
    start = 0 if first is None else 1
    if first is not None:
        out[:, 0] = first
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    out[:, start:][np.arange(length - start) < lengths[:, None]] = flat
    if last is not None:
        out[np.arange(len(rows)), lengths] = last
    return torch.from_numpy(out)


def drop_words(ids: torch.Tensor, p: float, rng: np.random.Generator) -> torch.Tensor:
    """ids with each piece (not PAD, UNK, BOS or EOS) replaced by UNK_ID with probability p.

    Word dropout (Sennrich & Zhang, 2019): the model learns not to lean on any one input piece.
    """
    hit = torch.from_numpy(rng.random(tuple(ids.shape)) < p) & (ids > EOS_ID)  # specials: 0-3
    return ids.masked_fill(hit, UNK_ID)
