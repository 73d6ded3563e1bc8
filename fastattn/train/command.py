"""main(): python -m fastattn.train from its command line to the scored final model."""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist

from fastattn.cli import write_line
from fastattn.train import savedir, signals
from fastattn.train.config import TrainConfig
from fastattn.train.final import finish
from fastattn.train.flags import parse_args
from fastattn.train.members import train_ensemble
from fastattn.train.run import Run
from fastattn.train.savedir import one_line_errors


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        with signals.handled():
            try:
                with one_line_errors():
                    train_and_score(args)
            except signals.Interrupted as e:  # one line, no traceback
                write_line(e.message(), sys.stderr)
                sys.exit(e.code)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def train_and_score(args: TrainConfig) -> None:
    """The run of `args` in its save directory, claimed for it (savedir.claimed)."""
    with savedir.claimed(args, print):
        if args.members > 1:
            run = train_ensemble(args)
        else:
            run = Run(args)
            run.train()
            finish(run)
    # Free DDP's reducer while the process group is still registered: were it the last owner,
    # its gloo destructor would join worker threads that wait for the GIL it holds.
    del run
    gc.collect()
