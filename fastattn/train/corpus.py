"""The text a run trains and is scored on: the splits, truecased as the model sees them."""

from __future__ import annotations

from dataclasses import dataclass, replace

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

