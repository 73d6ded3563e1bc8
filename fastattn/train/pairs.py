"""The training pairs of a run, filtered by length, and their batches: planned once, each sampled
afresh (BPE-dropout, word dropout) at its data position."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastattn import data
from fastattn.train.config import TrainConfig
from fastattn.train.corpus import Split


class TrainingPairs:
    """Training pair j is (sentences[j], sentences[partner(j)]): j < n the pairs as given,
    n <= j < 2n the same pairs reversed (used by --bidirectional)."""

    def __init__(self, args: TrainConfig, train: Split, sp: Any, rank: int, world: int,
                 log: Callable[[str], None]) -> None:
        self.args, self.rank = args, rank
        self.output_size: int | None = None
        """Set where targets may lie outside the output vocabulary: those become <unk>."""
        keep, counts = data.filter_by_length(train.src_ids, train.tgt_ids, args.max_len,
                                             args.max_len_ratio)
        log(f"training pairs: {counts['kept']} kept, {counts['too_long']} dropped as "
            f"longer than {args.max_len} tokens, {counts['bad_ratio']} dropped for a length "
            f"ratio over {args.max_len_ratio}")
        if not keep:
            raise data.DataError(f"no training pair is left after length filtering; raise "
                                 f"--max-len ({args.max_len}) or --max-len-ratio "
                                 f"({args.max_len_ratio})")
        self.pairs = n = len(keep)
        self.sentences = [train.src_ids[i] for i in keep] + [train.tgt_ids[i] for i in keep]
        lengths = [len(s) for s in self.sentences]
        self.bpe_dropout = None
        if args.bpe_dropout > 0:
            started = time.time()
            self.bpe_dropout = data.BPEDropout(sp, self.sentences, args.bpe_dropout,
                                               seed=args.seed)
            # Batches are planned on the expected sampled lengths, so they hold about
            # --max-tokens tokens whatever segmentation each sentence then gets.
            expected = [math.ceil(m) for m in self.bpe_dropout.expected_lengths]
            growth = sum(expected) / sum(lengths)
            lengths = expected
            log(f"BPE-dropout {args.bpe_dropout}: {self.bpe_dropout.samples} segmentations "
                f"of each of {len(self.bpe_dropout.segmentations)} words drawn in "
                f"{time.time() - started:.1f}s, {growth:.2f}x the tokens on average")

        longest = max(lengths[j] + lengths[self.partner(j)] for j in range(n)) + 2  # with </s>
        if args.max_tokens < longest:
            raise data.DataError(f"--max-tokens {args.max_tokens} is less than the longest "
                                 f"training pair, {longest} tokens (source + target, end marks "
                                 f"included); raise --max-tokens or lower --max-len "
                                 f"({args.max_len})")

        def batches(pairs: int) -> data.TokenBatches:  # of the first `pairs` pairs
            return data.TokenBatches(
                [lengths[j] + 1 for j in range(pairs)],
                [lengths[self.partner(j)] + 1 for j in range(pairs)],
                args.max_tokens, seed=args.seed, rank=rank, world_size=world,
            )

        self.forward_batches = batches(n)
        log(f"{len(self.forward_batches)} batches per epoch per rank, padding "
            f"{100 * self.forward_batches.padding_fraction():.1f}% of the batch tokens")
        self.both_batches = None
        if args.bidirectional:
            self.both_batches = batches(2 * n)
            log(f"bidirectional training (BiT) for the first {args.bidirectional} updates: "
                f"{2 * n} pairs in both directions, {len(self.both_batches)} batches per "
                "epoch per rank")

    def partner(self, j: int) -> int:
        """The sentence that sentence j translates to."""
        return (j + self.pairs) % (2 * self.pairs)

    def collate(self, epoch: int, step: int, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The batch at this data position, freshly sampled with BPE-dropout and word dropout."""
        partners = [self.partner(j) for j in indices]
        # Seeded by the position, so a resumed run samples what the uninterrupted one did.
        rng = np.random.default_rng([self.args.seed, epoch, step, self.rank])
        if self.bpe_dropout is None:
            src = [self.sentences[j] for j in indices]
            tgt = [self.sentences[j] for j in partners]
        else:
            src = self.bpe_dropout.sample(indices, rng)
            tgt = self.bpe_dropout.sample(partners, rng)
        source, inputs, targets = data.collate(src, tgt, range(len(indices)))
        if self.output_size is not None:  # the model can only predict <unk> for these
            targets.masked_fill_(targets >= self.output_size, data.UNK_ID)
        if self.args.word_dropout > 0:  # the targets stay: the model still predicts every word
            source = data.drop_words(source, self.args.word_dropout, rng)
            inputs = data.drop_words(inputs, self.args.word_dropout, rng)
        return source, inputs, targets
