"""python -m fastattn.average: average the parameters of the last k checkpoints of a run (the
paper averages the last 5 for base models and the last 20 for big ones), or of given files."""

from __future__ import annotations

import sys

from fastattn.checkpoint import (
    CheckpointError,
    average_checkpoints,
    list_checkpoints,
    save_checkpoint,
)
from fastattn.cli import ArgumentParser, HelpFormatter


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m fastattn.average", description=__doc__,
        formatter_class=HelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dir", help="a run's checkpoint directory (checkpoint_<step>.pt)")
    source.add_argument("--inputs", nargs="+", help="checkpoint files to average")
    parser.add_argument("--last", type=int, default=5, help="with --dir: how many to average")
    parser.add_argument("--output", required=True, help="where to write the averaged checkpoint")
    args = parser.parse_args(argv)
    if args.last < 1:
        parser.error("--last must be at least 1")
    try:
        paths = args.inputs or list_checkpoints(args.dir)[-args.last:]
        if args.dir and len(paths) < args.last:
            print(f"note: only {len(paths)} checkpoints in {args.dir}", file=sys.stderr)
        save_checkpoint(args.output, average_checkpoints(paths))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"averaged {len(paths)} checkpoints into {args.output}")


if __name__ == "__main__":
    main()
