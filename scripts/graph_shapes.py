"""How many batch shapes --cuda-graphs captures, and what its padding costs, per rounding grid:
the embedded Multi30k en-de's token-bucket batches (a joint 8,000-piece BPE, as the default
recipe) with each batch's lengths rounded up to multiples of g (1: as they are; the trainer's
choice) and its rows to multiples of --row-grid. Shapes: distinct in the first epoch and in the
first ten (graphs are captured once per shape); padding cost: the rounded batches' positions
(source + target) over the batches' own.

    python -m scripts.graph_shapes [--max-tokens 16000 6250] [--grids 1 2 4 8] [--row-grid 1]
"""

from __future__ import annotations

import argparse

from fastattn import data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[16000, 6250])
    parser.add_argument("--grids", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--row-grid", type=int, default=1)
    args = parser.parse_args()
    train = data.load_multi30k("train", "en", "de")
    sp = data.load_sentencepiece(data.train_sentencepiece(train.src + train.tgt, 8000))
    src = [len(s) + 1 for s in data.encode(sp, train.src)]  # with EOS / BOS
    tgt = [len(t) + 1 for t in data.encode(sp, train.tgt)]
    print("| max tokens | length grid | batches per epoch | shapes, epoch 1 | shapes, epochs "
          "1-10 | padded / unrounded positions |")
    print("|---|---|---|---|---|---|")
    for max_tokens in args.max_tokens:
        batches = data.TokenBatches(src, tgt, max_tokens)
        epochs = [batches.epoch(e) for e in range(10)]
        for g in args.grids:
            shapes, plain, padded = [], 0, 0
            for epoch in epochs:
                shapes.append(set())
                for b in epoch:
                    rows, s, t = len(b), max(src[i] for i in b), max(tgt[i] for i in b)
                    r = args.row_grid
                    shape = (-(-rows // r) * r, -(-s // g) * g, -(-t // g) * g)
                    shapes[-1].add(shape)
                    plain += rows * (s + t)
                    padded += shape[0] * (shape[1] + shape[2])
            print(f"| {max_tokens} | {g} | {len(epochs[0])} | {len(shapes[0])} | "
                  f"{len(set().union(*shapes))} | {padded / plain:.3f} |")


if __name__ == "__main__":
    main()
