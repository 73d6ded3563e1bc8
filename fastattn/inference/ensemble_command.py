"""python -m fastattn.ensemble: one checkpoint holding several models, which fastattn.translate
decodes as a fastattn.Ensemble (fastattn/inference/ensemble.py)."""

from __future__ import annotations

import sys

from fastattn.checkpoint import CheckpointError, ensemble_checkpoints, save_checkpoint
from fastattn.cli import ArgumentParser, HelpFormatter


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m fastattn.ensemble", formatter_class=HelpFormatter,
        description="Write one checkpoint holding several models (for example the final models "
        "of runs with different --seed) that python -m fastattn.translate then decodes as an "
        "ensemble: the mean of their next-token distributions. The models must share one "
        "SentencePiece model and truecaser, as runs on the same training text do.",
    )
    parser.add_argument("--inputs", nargs="+", required=True, help="checkpoints of the members")
    parser.add_argument("--output", required=True, help="where to write the ensemble")
    args = parser.parse_args(argv)
    try:
        save_checkpoint(args.output, ensemble_checkpoints(args.inputs))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"an ensemble of {len(args.inputs)} models in {args.output}")
