"""python -m fastattn.tools.average: average the parameters of the last k checkpoints of a run (the
paper averages the last 5 for base models and the last 20 for big ones), or of given files."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from fastattn.cli import ArgumentParser, HelpFormatter, starting

# As `python -m fastattn.tools.average`: the [mt] extra checked and Ctrl-C caught before torch.
with starting("tools.average") if __name__ == "__main__" else contextlib.nullcontext():
    from fastattn.checkpoint import (
        CheckpointError,
        average_checkpoints,
        describe,
        list_checkpoints,
        save_checkpoint,
    )


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m fastattn.tools.average", description=__doc__,
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
    problem = None
    if Path(args.output).is_dir():  # found before the checkpoints are read, not after
        problem = (f"--output {args.output} is a directory; give the averaged checkpoint a file "
                   f"name (e.g. {Path(args.output) / 'checkpoint_averaged.pt'})")
    elif args.dir and not Path(args.dir).is_dir():
        problem = f"--dir {args.dir}: " + ("is a file, not a directory"
                                           if Path(args.dir).exists() else "no such directory")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        paths = args.inputs or list_checkpoints(args.dir)[-args.last:]
        if args.dir and len(paths) < args.last:
            print(f"note: only {len(paths)} checkpoints in {args.dir}", file=sys.stderr)
        save_checkpoint(args.output, average_checkpoints(paths))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full disk, a read-only file system: the file there is as it was
        print(f"error: cannot write {e.filename or args.output}: {describe(e)}", file=sys.stderr)
        sys.exit(1)
    print(f"averaged {len(paths)} checkpoints into {args.output}")


if __name__ == "__main__":
    main()
