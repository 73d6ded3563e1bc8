"""BLEU as it is reported: detokenized sacreBLEU with its signature, and the tokenized BLEU that
published figures use, and the length ratio behind BLEU's brevity penalty.

Tokenized BLEU prepares hypotheses the way the references were prepared and scores the tokens as
they are (sacreBLEU with tokenize="none"):
- Multi30k (`multi30k_tokenize`): lowercase, Moses punctuation normalisation, Moses tokenisation
  with escaping; this reproduces the official `tok/*.lc.norm.tok.*` references exactly for en and
  de (999/1000 lines for fr).
- WMT en-de as in the paper (`wmt_tokenize`): Moses tokenisation of hypotheses and references,
  then compound splitting, "a-b" -> "a ##AT##-##AT## b" (tensor2tensor's get_ende_bleu.sh), cased.

From the command line, scoring a translation file (e.g. from python -m fastattn.translate):

    python -m fastattn.evaluate --hyp test.hyp.de --multi30k test2016 --lang de
    python -m fastattn.evaluate --hyp out.de --ref ref.de --tokenized-ref ref.tok.de --lang de
    python -m fastattn.evaluate --hyp out.de --ref newstest2014.de --lang de   # WMT: compound split
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Sequence
from functools import cache

from fastattn._extras import MissingExtraError
from fastattn.cli import ArgumentParser, HelpFormatter, starting

# As `python -m fastattn.evaluate`: the [mt] extra checked and Ctrl-C caught before torch.
with starting("evaluate") if __name__ == "__main__" else contextlib.nullcontext():
    from fastattn import data

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


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m fastattn.evaluate",
        description="Detokenized sacreBLEU and tokenized BLEU of a translation file.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--hyp", required=True, help="detokenized translations, one per line")
    refs = parser.add_mutually_exclusive_group(required=True)
    refs.add_argument("--ref", help="detokenized references, one per line (plain or .gz)")
    refs.add_argument("--multi30k", metavar="SPLIT", choices=sorted(data.MULTI30K_SPLITS),
                      help="the embedded Multi30k references of a split (val, test2016)")
    parser.add_argument("--tokenized-ref", help="with --ref: references prepared like "
                        "Multi30k's tok/ files (lowercased, Moses-tokenized); without it "
                        "tokenized BLEU is the paper's WMT en-de convention (compound splitting)")
    parser.add_argument("--lang", required=True, help="target language (Moses tokenizer rules)")
    args = parser.parse_args(argv)
    if args.tokenized_ref and args.multi30k:
        parser.error("--tokenized-ref goes with --ref; --multi30k brings its own")
    try:
        hypotheses = data.read_lines(args.hyp, allow_empty=True)
        if args.multi30k:
            references = data.read_lines(data.multi30k_path(args.multi30k, args.lang))
            tokenized_refs = data.read_lines(
                data.multi30k_path(args.multi30k, args.lang, tokenized=True))
        else:
            references = data.read_lines(args.ref)
            tokenized_refs = args.tokenized_ref and data.read_lines(args.tokenized_ref)
        bleu, signature = sacre_bleu(hypotheses, references)
        ratio, brevity_penalty = length_ratio(hypotheses, references)
        if tokenized_refs:
            tokenized = multi30k_bleu(hypotheses, tokenized_refs, args.lang)
            how = "lowercased, against the tokenized references"
        else:
            tokenized = wmt_bleu(hypotheses, references, args.lang)
            how = "cased, Moses tokenization with compound splitting"
    except (data.DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"BLEU {bleu:.2f}  {signature}")
    print(f"tokenized BLEU {tokenized:.2f}  ({how})")
    print(f"length ratio {ratio:.3f}  (translations / references in 13a tokens; BLEU's brevity "
          f"penalty {brevity_penalty:.3f})")


if __name__ == "__main__":
    main()
