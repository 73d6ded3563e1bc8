"""A run's save directory: one trainer at a time, never two runs mixed, nothing lost.

- claimed(): an advisory lock (fcntl.flock on SAVE_DIR/train.lock, which holds the pid) refuses
  a second trainer in the directory; the kernel releases it when the process ends, however it
  ends, so a killed run's lock file blocks nothing. A fresh run refuses a directory that holds
  another run's checkpoints or metrics (continue it with --resume, or give another --save-dir,
  or --overwrite to delete them first); temporary files an interrupted save left are removed.
- resume_point(): the newest checkpoint that verifies and has training state; those it skips
  are named and moved aside (<name>.corrupt, <name>.no-training-state). A --resume that would
  start afresh over another run's checkpoints (other --members) is refused.
- trim_metrics(): the metrics log as a resumed run continues it: unreadable lines (a kill
  mid-line) and the records after the checkpoint or of the final model are dropped.
- append_line(): a metrics record appended whole or not at all.
- one_line_errors(): what stops a run early, as one `error:` line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastattn import checkpoint, data
from fastattn.cli import write_line
from fastattn.train.config import TrainConfig

LOCK_NAME = "train.lock"
MEMBER_DIR = re.compile(r"member\d+")
# write_atomically's temporary files of a run's own files: .<name>.<8 random characters>.tmp
STALE_TMP = re.compile(r"\.(checkpoint_\w+\.pt|[\w.-]+\.jsonl|(test|valid)\.hyp\.\w+)"
                       r"\.\w{8}" + re.escape(checkpoint.TMP_SUFFIX))
FINAL = "checkpoint_final.pt"


class SaveDirError(RuntimeError):
    """A save directory this run may not use; the message says why and what to do."""


@contextlib.contextmanager
def claimed(args: TrainConfig, log: Callable[[str], None]) -> Iterator[None]:
    """The save directory, locked for this run while the context lasts, checked and cleaned.
    Under torchrun rank 0 claims it for every rank."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    directory = Path(args.save_dir)
    directory.mkdir(parents=True, exist_ok=True)
    fd = _lock(directory)
    try:
        earlier = earlier_run(args)
        if earlier and args.overwrite:
            for path in earlier:
                path.unlink(missing_ok=True)
            for member in _member_dirs(directory):
                with contextlib.suppress(OSError):
                    member.rmdir()  # only if emptied
            log(f"--overwrite: deleted the {len(earlier)} files of the earlier run in "
                f"{directory}")
        elif earlier and not args.resume:
            raise SaveDirError(
                f"{directory} holds another run's {_listed(earlier, directory)}; continue that "
                "run with --resume, or start this one in another --save-dir, or give "
                "--overwrite to delete them first")
        elif args.resume and not _resumable(args) and any(".pt" in p.name for p in earlier):
            # e.g. a single run's --resume in an ensemble's directory: starting afresh there
            # would replace its final model
            shape = f"an ensemble of {args.members}" if args.members > 1 else "a single model"
            raise SaveDirError(
                f"{directory} holds another run's {_listed(earlier, directory)} but no "
                f"checkpoint that {shape} can resume from (other --members?); give that run's "
                "flags, or start this one in another --save-dir, or give --overwrite to delete "
                "them first")
        for stale in _stale_tmp(directory):
            stale.unlink(missing_ok=True)
            log(f"removed {stale}, left by an interrupted save")
        yield
    finally:
        os.close(fd)  # releases the lock


def _listed(files: list[Path], directory: Path) -> str:
    names = [os.path.relpath(p, directory) for p in files]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{'checkpoints' if any('.pt' in n for n in names) else 'metrics log'} ({shown})"


def _resumable(args: TrainConfig) -> bool:
    """Whether the run has a checkpoint to resume from (ensemble members: any of theirs)."""
    directory = Path(args.save_dir)
    dirs = [directory / f"member{k + 1}" for k in range(args.members)] if args.members > 1 \
        else [directory]
    return any(checkpoint.list_resumable(d) for d in dirs)


def _lock(directory: Path) -> int:
    path = directory / LOCK_NAME
    # Read-only: a file open for writing would keep the file system from being remounted
    # read-only, and flock needs no write access.
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        pid = f"pid {holder}" if holder.isdigit() else "pid unknown"
        raise SaveDirError(f"{directory} is in use by another trainer ({pid}, holding "
                           f"{path}); wait for it to end or stop it, or give this run another "
                           "--save-dir") from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):  # the pid only informs (a read-only directory resumes)
        path.write_text(f"{os.getpid()}\n")
    return fd


def _member_dirs(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if MEMBER_DIR.fullmatch(p.name) and p.is_dir())


def earlier_run(args: TrainConfig) -> list[Path]:
    """The files of an earlier run in the save directory (its ensemble members' included):
    checkpoints, metrics logs, translations of the final model."""
    directory = Path(args.save_dir)
    found: list[Path] = []
    for d in (directory, *_member_dirs(directory)):
        found += checkpoint.list_resumable(d)
        found += [p for pattern in ("checkpoint_*.pt.corrupt", "checkpoint_*.pt.no-training-state")
                  for p in sorted(d.glob(pattern)) if p.is_file()]
        found += [p for p in (d / FINAL, d / "metrics.jsonl") if p.is_file()]
        found += sorted(p for p in d.glob("*.hyp.*") if p.is_file()
                        and p.name.split(".")[0] in ("test", "valid"))
    metrics = Path(args.metrics)
    if metrics.is_file() and metrics not in found:
        found.append(metrics)
    # an empty metrics log (a run stopped before its first record) holds no run
    return [p for p in found if p.suffix != ".jsonl" or p.stat().st_size]


def _stale_tmp(directory: Path) -> list[Path]:
    return sorted(p for d in (directory, *_member_dirs(directory)) for p in d.iterdir()
                  if STALE_TMP.fullmatch(p.name) and p.is_file())


def resume_point(directory: str | Path, log: Callable[[str], None], move_corrupt: bool = True
                 ) -> tuple[Path | None, dict[str, Any] | None]:
    """(path, state) of the newest checkpoint in `directory` a run can resume from: one that
    verifies and has training state. The newer ones are skipped with a note saying why and
    moved aside (move_corrupt) to <name>.corrupt or <name>.no-training-state: kept, but out of
    the numbered checkpoints the run deletes (--keep) and averages. (None, None) where the
    directory has no checkpoint; a CheckpointError where none of them can resume."""
    skipped = []
    for path in reversed(checkpoint.list_resumable(directory)):
        try:
            state = checkpoint.load_checkpoint(path)
        except checkpoint.CheckpointError as e:
            skipped.append((path, str(e), ".corrupt"))
            continue
        if "train" not in state:
            skipped.append((path, f"{path}: has no training state (an averaged or exported "
                            "model, not a checkpoint of a run)", ".no-training-state"))
            continue
        for bad, why, suffix in skipped:
            moved = ""
            if move_corrupt:  # kept, but out of the numbering the run prunes and averages
                aside = bad.with_name(bad.name + suffix)
                os.replace(bad, aside)
                moved = f"; moved it to {aside.name}"
            log(f"--resume: skipped {why}{moved}")
        return path, state
    if skipped:
        raise checkpoint.CheckpointError(
            f"no checkpoint in {directory} can resume the run: "
            + "; ".join(why for _, why, _ in skipped))
    return None, None


def is_final_record(record: dict[str, Any]) -> bool:
    """A record of the final model's scoring, which a resumed run writes again."""
    return "loss" not in record and "dev_loss" not in record


def trim_metrics(path: str | Path, step: float, log: Callable[[str], None]) -> None:
    """Keeps the metrics log's training and dev records up to `step` (a resumed run writes the
    rest again) and drops its unreadable lines, saying so; rewritten atomically."""
    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_bytes().splitlines()
    kept, bad, dropped = [], [], 0
    for number, line in enumerate(lines, 1):
        try:  # a line a kill cut short is no JSON (its closing brace is missing)
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError
        except ValueError:
            bad.append(number)
            continue
        if record["step"] <= step and not is_final_record(record):
            kept.append(line + b"\n")
        else:
            dropped += 1
    if bad:
        log(f"{path}: dropped {len(bad)} unreadable line{'s' * (len(bad) > 1)} "
            f"({', '.join(map(str, bad))}; cut short by a kill?)")
    if bad or dropped:
        checkpoint.write_atomically(path, kept)


def drop_final_records(path: str | Path, log: Callable[[str], None]) -> None:
    """Drops an earlier scoring of the final model from a metrics log (the run scores it anew)."""
    trim_metrics(path, math.inf, log)


def append_line(path: str | Path, line: str) -> None:
    """Appends a line whole or not at all: a failed write (a full disk) is cut off again."""
    path = Path(path)
    rest = memoryview(line.encode())
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            while rest:
                rest = rest[os.write(fd, rest):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise checkpoint.naming(e, path) from e
    finally:
        os.close(fd)


class WriteError(RuntimeError):
    """A file the run could not write; the message names it, the cause and the last good
    checkpoint."""


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Bad data, bad checkpoints and an unusable save directory end the process with one
    `error: ...` line and status 2; files that cannot be written (WriteError, OSError) with one
    line and status 1."""
    try:
        yield
    except (data.DataError, checkpoint.CheckpointError, SaveDirError) as e:
        write_line(f"error: {e}", sys.stderr)
        sys.exit(2)
    except WriteError as e:
        write_line(f"error: {e}", sys.stderr)
        sys.exit(1)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        write_line(f"error: {where}{checkpoint.describe(e)}", sys.stderr)
        sys.exit(1)
