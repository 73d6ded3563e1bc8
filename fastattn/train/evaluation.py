"""Decoding and scoring during and after training: translations, BLEU and the dev loss."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Sequence
from typing import Any

import torch

from fastattn import bleu, data
from fastattn._extras import MissingExtraError
from fastattn.inference.ensemble import Ensemble
from fastattn.inference.translator import Translator
from fastattn.model import Transformer
from fastattn.train.corpus import Split

try:
    from tqdm import tqdm
except ImportError as e:
    raise MissingExtraError(__name__, e) from None


def translate(model: Transformer | Ensemble, sp, sentences: Sequence[str], *, beam: int,
              alpha: float, max_len_b: int, batch_tokens: int,
              truecaser: data.Truecaser | None = None,
              progress: bool | None = None) -> list[str]:
    """Detokenized translations (fastattn.Translator; beam 1 is greedy search). progress: a
    progress bar on stderr; None: when stderr is a terminal (none in pipes and logs), no other
    bar of this process is open (the training bar during dev evaluations) and this is not a
    child process (an ensemble member's job, whose row belongs to another's bar)."""
    was_training = model.training
    translator = Translator(model, sp, beam_size=beam, alpha=alpha, max_len_b=max_len_b,
                            batch_tokens=batch_tokens, truecaser=truecaser)
    if progress is None:
        progress = (_is_terminal(sys.stderr) and not len(getattr(tqdm, "_instances", ()))
                    and multiprocessing.parent_process() is None)
    hypotheses = translator.translate(sentences, progress=progress)
    model.train(was_training)
    return hypotheses


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without one, or closed
        return False


def bleu_scores(hypotheses: list[str], split: Split, tgt_lang: str) -> dict[str, Any]:
    """Detokenized sacreBLEU with signature, and tokenized BLEU: against the official tokenized
    references where the corpus has them (Multi30k), else Moses-tokenized references with the
    paper's compound splitting."""
    score, signature = bleu.sacre_bleu(hypotheses, split.text.tgt)
    if split.tokenized_refs is not None:
        tokenized = bleu.multi30k_bleu(hypotheses, split.tokenized_refs, tgt_lang)
    else:
        tokenized = bleu.wmt_bleu(hypotheses, split.text.tgt, tgt_lang)
    return {"bleu": score, "signature": signature, "tok_bleu": tokenized}


@torch.no_grad()
def dev_loss(model: Transformer, split: Split, max_tokens: int,
             autocast_dtype: torch.dtype | None) -> tuple[float, float]:
    """Label-smoothed loss and NLL per target token on a split."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    lengths = [len(s) + 1 for s in split.src_ids], [len(t) + 1 for t in split.tgt_ids]
    total = nll = tokens = 0.0
    for indices in data.TokenBatches(*lengths, max_tokens).epoch(0):
        batch = [t.to(device) for t in data.collate(split.src_ids, split.tgt_ids, indices)]
        # The model can only predict <unk> for a piece outside its output vocabulary.
        batch[2].masked_fill_(batch[2] >= model.cfg.output_size, data.UNK_ID)
        with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
            loss, batch_nll = model.loss(*batch, reduction="sum", return_nll=True)
        total, nll = total + float(loss), nll + float(batch_nll)
        tokens += int((batch[2] != data.PAD_ID).sum())
    model.train(was_training)
    return total / tokens, nll / tokens
