"""BLEU as it is reported: detokenized sacreBLEU with its signature, and the tokenized BLEU that
published figures use, and the length ratio behind BLEU's brevity penalty.

Tokenized BLEU prepares hypotheses the way the references were prepared and scores the tokens as
they are (sacreBLEU with tokenize="none"):
- Multi30k (`multi30k_tokenize`): lowercase, Moses punctuation normalisation, Moses tokenisation
  with escaping; this reproduces the official `tok/*.lc.norm.tok.*` references exactly for en and
  de (999/1000 lines for fr).
- WMT en-de as in the paper (`wmt_tokenize`): Moses tokenisation of hypotheses and references,
  then compound splitting, "a-b" -> "a ##AT##-##AT## b" (tensor2tensor's get_ende_bleu.sh), cased.

The command line that scores a translation file is python -m fastattn.tools.evaluate.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

from fastattn._extras import MissingExtraError

try:
    import sacrebleu
    from sacremoses import MosesPunctNormalizer, MosesTokenizer
except ImportError as e:
    raise MissingExtraError(__name__, e) from None


@cache
def _moses(lang: str) -> tuple[MosesPunctNormalizer, MosesTokenizer]:
    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def multi30k_tokenize(line: str, lang: str) -> str:
    """A detokenized line prepared like the Multi30k tok/ references (lowercased, normalised,
    Moses-tokenized with escaping)."""
    normalizer, tokenizer = _moses(lang)
    return tokenizer.tokenize(normalizer.normalize(line.lower()), escape=True, return_str=True)


_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(line: str) -> str:
    """The paper's compound splitting for en-de: "a-b" becomes "a ##AT##-##AT## b"."""
    # One non-overlapping pass, exactly as the perl s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g does.
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def wmt_tokenize(line: str, lang: str) -> str:
    """A detokenized line prepared for the paper's WMT en-de tokenized BLEU (cased)."""
    _, tokenizer = _moses(lang)
    return split_compounds(tokenizer.tokenize(line, escape=True, return_str=True))


def _check(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: they must align"
        )


def sacre_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, str]:
    """Detokenized sacreBLEU (13a tokenisation, cased) and its signature."""
    _check(hypotheses, references)
    metric = sacrebleu.BLEU()
    score = metric.corpus_score(list(hypotheses), [list(references)])
    return score.score, str(metric.get_signature())


def length_ratio(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, float]:
    """Length of the translations over that of the references (sacreBLEU's 13a tokens, the
    whole corpus) and BLEU's brevity penalty min(1, e^(1 - 1/ratio)): below 1, translations
    are too short and BLEU is scaled down by the penalty, whatever their n-gram precisions."""
    _check(hypotheses, references)
    score = sacrebleu.BLEU().corpus_score(list(hypotheses), [list(references)])
    return score.sys_len / max(score.ref_len, 1), score.bp


def tokenized_bleu(hypotheses: Sequence[str], tokenized_references: Sequence[str]) -> float:
    """BLEU of already tokenized hypotheses against already tokenized references, tokens as
    they are (multi-bleu.perl's convention)."""
    _check(hypotheses, tokenized_references)
    metric = sacrebleu.BLEU(tokenize="none", force=True)
    return metric.corpus_score(list(hypotheses), [list(tokenized_references)]).score


def multi30k_bleu(
    hypotheses: Sequence[str], tokenized_references: Sequence[str], lang: str
) -> float:
    """Tokenized BLEU of detokenized hypotheses against Multi30k's tok/ references."""
    return tokenized_bleu([multi30k_tokenize(h, lang) for h in hypotheses], tokenized_references)


def wmt_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str) -> float:
    """The paper's tokenized BLEU with compound splitting, both sides from detokenized text."""
    return tokenized_bleu(
        [wmt_tokenize(h, lang) for h in hypotheses], [wmt_tokenize(r, lang) for r in references]
    )
