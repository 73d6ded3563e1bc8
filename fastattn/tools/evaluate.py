"""python -m fastattn.tools.evaluate: the BLEU of a translation file (e.g. from python -m
fastattn.translate) as fastattn.bleu scores it: detokenized sacreBLEU with its signature, tokenized
BLEU (Multi30k's tok/ references, or the paper's WMT en-de convention with compound splitting),
and the length ratio behind BLEU's brevity penalty.

    python -m fastattn.tools.evaluate --hyp test.hyp.de --multi30k test2016 --lang de
    python -m fastattn.tools.evaluate --hyp out.de --ref ref.de --tokenized-ref ref.tok.de --lang de
    python -m fastattn.tools.evaluate --hyp out.de --ref newstest2014.de --lang de  # WMT: compounds
"""

from __future__ import annotations

import contextlib
import sys

from fastattn.cli import ArgumentParser, HelpFormatter, starting

# As `python -m fastattn.tools.evaluate`: the [mt] extra checked and Ctrl-C caught before torch.
with starting("tools.evaluate") if __name__ == "__main__" else contextlib.nullcontext():
    from fastattn import data
    from fastattn.bleu import length_ratio, multi30k_bleu, sacre_bleu, wmt_bleu


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m fastattn.tools.evaluate",
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
