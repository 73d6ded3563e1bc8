"""Translation quality of the CPU decoding precisions against float32: on a Multi30k split, each
precision's tokenized BLEU (as the trainer reports it: lowercased, against the official tokenized
references) and sacreBLEU, and the share of its translations identical to float32's. Issue 51's
criterion for the default model in int8: at most 0.3 tokenized BLEU lost, at least 85% identical.

    .venv/bin/python scripts/precision_quality.py --model multi30k-en-de
    .venv/bin/python scripts/precision_quality.py --checkpoint CKPT [--split test2016]
        [--precisions int8,bf16]

Decoding is fastattn.Translator's with its defaults (those of `python -m fastattn.translate`:
beam 4, --max-len-b 50, 4,096 tokens a batch, the checkpoint's length penalty and truecaser), on
this process's threads; precisions this CPU's fastattn._C lacks are reported as such. Prints a
Markdown table with the machine and the seconds each precision took.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from fastattn import bleu, checkpoint, data
from fastattn.inference import native, pretrained
from fastattn.inference.translator import Translator


def cpu_model() -> str:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model",
                        help="a shipped model's name (fastattn.inference.pretrained.names())")
    source.add_argument("--checkpoint", help="a checkpoint of fastattn.train")
    parser.add_argument("--split", default="test2016", choices=("val", "test2016"))
    parser.add_argument("--precisions", default="int8,bf16",
                        help="compared with fp32, comma-separated")
    args = parser.parse_args()
    precisions = ["fp32", *(p for p in args.precisions.split(",") if p != "fp32")]
    for p in precisions:
        native.check_precision(p)
    if args.model:
        meta = pretrained.load(args.model)[2]

        def translator(precision: str) -> Translator:
            return Translator.from_pretrained(args.model, precision=precision)
    else:
        meta = checkpoint.load_model(args.checkpoint)[2]

        def translator(precision: str) -> Translator:
            return Translator.from_checkpoint(args.checkpoint, precision=precision)
    src, tgt = meta["src"], meta["tgt"]
    sources = data.read_lines(data.multi30k_path(args.split, src))
    references = data.read_lines(data.multi30k_path(args.split, tgt))
    tokenized = data.read_lines(data.multi30k_path(args.split, tgt, tokenized=True))
    print(f"{args.model or args.checkpoint}, Multi30k {args.split} {src}->{tgt}, "
          f"{len(sources)} sentences; {cpu_model()}, {torch.get_num_threads()} threads\n")
    print("| precision | tokenized BLEU | sacreBLEU | vs fp32 | identical to fp32 | seconds |")
    print("|---|---|---|---|---|---|")
    baseline = None
    for precision in precisions:
        try:
            decoder = translator(precision)
            start = time.perf_counter()
            hypotheses = decoder.translate(sources)
        except ValueError as e:  # a precision this CPU or build does not run
            print(f"| {precision} | – | – | – | – | not run: {e} |")
            continue
        seconds = time.perf_counter() - start
        tokenized_bleu = bleu.multi30k_bleu(hypotheses, tokenized, tgt)
        sacre, _ = bleu.sacre_bleu(hypotheses, references)
        if baseline is None:
            baseline = tokenized_bleu, hypotheses
            delta, same = "–", "–"
        else:
            delta = f"{tokenized_bleu - baseline[0]:+.2f}"
            identical = sum(a == b for a, b in zip(hypotheses, baseline[1], strict=True))
            same = f"{identical / len(hypotheses):.1%} ({identical} of {len(hypotheses)})"
        print(f"| {precision} | {tokenized_bleu:.2f} | {sacre:.2f} | {delta} | {same} "
              f"| {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
