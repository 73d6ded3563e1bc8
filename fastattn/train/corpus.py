"""The text a run trains and is scored on: its splits, truecased as the model sees them, and the
vocabulary that encodes them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastattn import data
from fastattn.train.config import TrainConfig


@dataclass
class Split:
    """A split of the corpus as ids, with its text for BLEU."""

    text: data.ParallelText
    src_ids: list[list[int]]
    tgt_ids: list[list[int]]
    tokenized_refs: list[str] | None = None
    """Official tokenized references (Multi30k tok/), when the corpus has them."""


def load_text(args: TrainConfig) -> dict[str, tuple[data.ParallelText, list[str] | None]]:
    """The training, dev and (if any) test text, with tokenized references where they exist."""
    if args.data == "multi30k":
        splits = {"train": "train", "valid": "val", "test": "test2016"}
        return {
            name: (
                data.load_multi30k(split, args.src, args.tgt),
                None if name == "train" else
                data.read_lines(data.multi30k_path(split, args.tgt, tokenized=True)),
            )
            for name, split in splits.items()
        }
    text = {"train": (data.read_parallel(*args.train), None),
            "valid": (data.read_parallel(*args.valid), None)}
    if args.test:
        text["test"] = (data.read_parallel(*args.test), None)
    return text


def truecased(text: data.ParallelText,
              truecasers: tuple[data.Truecaser, data.Truecaser] | None) -> data.ParallelText:
    """The text as the model sees it: truecased by the (source, target) truecasers, if any."""
    if truecasers is None:
        return text
    src, tgt = truecasers
    return replace(text, src=[src(s) for s in text.src], tgt=[tgt(t) for t in text.tgt])



@dataclass
class Corpus:
    """The text of a run encoded with its vocabulary."""

    spm_proto: bytes
    """The SentencePiece model, as checkpoints store it."""
    sp: Any
    """The loaded SentencePiece processor."""
    splits: dict[str, Split]
    source_truecaser: data.Truecaser | None
    """Truecases sources for translating (None: --no-truecase)."""
    output_vocab_size: int | None
    """With --output-vocab target on a fresh run: the pieces the softmax ranges over."""


def prepare_corpus(args: TrainConfig, spm_proto: bytes | None,
                   log: Callable[[str], None]) -> Corpus:
    """Reads the text, truecases it (--truecase) and encodes it with the vocabulary `spm_proto`
    of a resumed run, or with one trained here on the training text."""
    text = load_text(args)
    truecasers = None
    if args.truecase:
        raw = text["train"][0]
        truecasers = data.Truecaser.train(raw.src), data.Truecaser.train(raw.tgt)
    model_text = {name: truecased(t, truecasers) for name, (t, _) in text.items()}
    output_vocab_size = None
    if spm_proto is None:
        started = time.time()
        train = model_text["train"]
        spm_proto = data.train_sentencepiece(train.src + train.tgt, args.vocab_size)
        log(f"SentencePiece BPE, {args.vocab_size} joint pieces, trained on "
            f"{2 * len(train)} {'truecased ' * args.truecase}sentences in "
            f"{time.time() - started:.1f}s")
        if args.output_vocab == "target":
            sp = data.load_sentencepiece(spm_proto)
            targets = train.tgt + train.src * bool(args.bidirectional)
            pieces = {i for ids in data.encode(sp, targets) for i in ids}
            spm_proto, output_vocab_size = data.pieces_first(spm_proto, pieces)
            log(f"output vocabulary: the {output_vocab_size} pieces (special ones "
                f"included) of the training text's {args.tgt} side"
                f"{' and of its source side' * bool(args.bidirectional)}, numbered "
                "first")
    sp = data.load_sentencepiece(spm_proto)
    # Splits keep the raw text (BLEU is against it) beside the ids of the model's text.
    splits = {
        name: Split(t, data.encode(sp, model_text[name].src), data.encode(sp, model_text[name].tgt),
                    refs)
        for name, (t, refs) in text.items()
    }
    return Corpus(spm_proto, sp, splits, truecasers[0] if truecasers else None, output_vocab_size)
