"""Checkpoints: atomic saves, verified loads, the last K kept, and averaging (Vaswani et al., 2017,
section 6.1: the base model averages the last 5 checkpoints, the big model the last 20).

A checkpoint file is a header line `fastattn-checkpoint <sha256 of the payload> <payload bytes>`
followed by the payload, a torch.save of a dict of plain types and tensors:
  model    the model's state_dict          config   the TransformerConfig as a dict (an
                                                    ensemble's: a list, one per member)
  spm      the SentencePiece model proto   meta     step, languages, scores, training arguments
  train    what an exact resume needs (optimiser, loss scaler, data position, RNG states);
           averaged checkpoints have none.
Loading checks the header, the length and the checksum before unpickling anything (and unpickles
with weights_only=True), so a corrupt or truncated file is reported, never loaded silently.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from fastattn.data import load_sentencepiece
from fastattn.inference.ensemble import Ensemble
from fastattn.model import Transformer, TransformerConfig

MAGIC = b"fastattn-checkpoint"
NAME = re.compile(r"checkpoint_(\d+)\.pt")
INTERRUPTED = re.compile(r"checkpoint_(\d+)_interrupted\.pt")
TMP_SUFFIX = ".tmp"  # write_atomically's temporary files: .<name>.<random>.tmp


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Writes state to path atomically (write_atomically).

    Refuses a model with NaN or inf parameters, so no checkpoint ever holds one."""
    path = Path(path)
    for name, tensor in state["model"].items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path}: not saved, parameter {name} has NaN or inf values")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = b"%s %s %d\n" % (MAGIC, hashlib.sha256(payload).hexdigest().encode(), len(payload))
    write_atomically(path, [header, payload])


def write_atomically(path: str | Path, chunks: Iterable[bytes]) -> None:
    """Writes a file whole or not at all: a temporary file in the same directory (removed if
    anything fails), fsync, rename over `path`, fsync of the directory. The file gets the mode
    the umask gives new files (0644 under the usual 022), not mkstemp's 0600.

    An OSError names `path` (e.g. IsADirectoryError where `path` is a directory, ENOSPC, EROFS);
    the file that was at `path` is then as it was."""
    path = Path(path)
    tmp = None
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        directory = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as e:
        if e.filename is None or e.filename == tmp:  # name the file meant, not the tmp
            raise naming(e, path) from e
        raise
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask sets it: set it straight back
    os.umask(mask)
    return mask


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Reads a checkpoint written by save_checkpoint, after verifying it is whole."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({describe(e)})") from None
    header, _, payload = raw.partition(b"\n")
    fields = header.split(b" ")
    if len(fields) != 3 or fields[0] != MAGIC or not fields[2].isdigit():
        raise CheckpointError(f"{path}: not a fastattn checkpoint (bad header)")
    digest, size = fields[1].decode(errors="replace"), int(fields[2])
    if len(payload) != size:
        raise CheckpointError(
            f"{path}: truncated or corrupt, {len(payload)} payload bytes instead of {size}"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: corrupt, the checksum does not match its contents")
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The numbered checkpoints (checkpoint_<step>.pt) in a directory, oldest step first."""
    return [p for _, p in _numbered(directory, NAME)]


def list_resumable(directory: str | Path) -> list[Path]:
    """The checkpoints a run can resume from, oldest step first: the numbered ones and those
    saved when a signal stopped the run (checkpoint_<step>_interrupted.pt, after a numbered one
    of the same step)."""
    found = [(step, 0, p) for step, p in _numbered(directory, NAME)]
    found += [(step, 1, p) for step, p in _numbered(directory, INTERRUPTED)]
    return [p for *_, p in sorted(found)]


def step_of(path: str | Path) -> int | None:
    """The step in a numbered or interrupted checkpoint's name."""
    name = Path(path).name
    m = NAME.fullmatch(name) or INTERRUPTED.fullmatch(name)
    return int(m.group(1)) if m else None


def _numbered(directory: str | Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in Path(directory).glob("checkpoint_*.pt")
                  if (m := pattern.fullmatch(p.name)) and p.is_file())


def save_numbered(directory: str | Path, state: dict[str, Any], step: int, keep: int,
                  interrupted: bool = False) -> Path:
    """Saves checkpoint_<step>.pt and deletes all but the newest `keep` numbered checkpoints up
    to `step` (one numbered past it is not this run's to delete), and the interrupted ones
    before it (this checkpoint supersedes them).

    interrupted: saves checkpoint_<step>_interrupted.pt instead, deleting nothing, for a run a
    signal stopped between its regular checkpoints: --resume continues from it, but it takes no
    place among the numbered checkpoints the final model averages (so that model is the one an
    uninterrupted run makes)."""
    directory = Path(directory)
    if interrupted:
        path = directory / f"checkpoint_{step:08d}_interrupted.pt"
        save_checkpoint(path, state)
        return path
    path = directory / f"checkpoint_{step:08d}.pt"
    save_checkpoint(path, state)
    mine = [p for s, p in _numbered(directory, NAME) if s <= step]
    old = mine[:-keep] if keep > 0 else []
    old += [p for s, p in _numbered(directory, INTERRUPTED) if s <= step]
    for p in old:
        try:
            p.unlink(missing_ok=True)
        except OSError as e:
            raise naming(e, p) from e
    return path


def naming(error: OSError, path: str | Path) -> OSError:
    """The OSError again, of the same kind, naming `path`."""
    return type(error)(error.errno, error.strerror or str(error), str(path))


def describe(error: OSError) -> str:
    """An OSError's cause as words: 'no space left on device', 'read-only file system', ..."""
    cause = error.strerror or str(error)
    return cause[:1].lower() + cause[1:]


def average_checkpoints(paths: Sequence[str | Path]) -> dict[str, Any]:
    """The element-wise mean of the models' parameters (accumulated in fp64), with config, spm
    and meta of the last checkpoint and no training state."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    first: dict[str, Any] = {}
    for path in paths:
        last = load_checkpoint(path)
        first = first or last
        # Only the same model, numbering its pieces the same way, averages meaningfully.
        if last["config"] != first["config"]:
            raise CheckpointError(f"{path}: its model configuration differs from {paths[0]}'s")
        if last["spm"] != first["spm"]:
            raise CheckpointError(f"{path}: its SentencePiece model differs from {paths[0]}'s")
        if last["model"].keys() != first["model"].keys():
            raise CheckpointError(f"{path}: its parameters differ from {paths[0]}'s")
        for name, tensor in last["model"].items():
            if tensor.is_floating_point():
                total[name] = total.get(name, 0) + tensor.double()
            else:
                total[name] = tensor  # integer buffers are not averaged
    model = {
        name: (total[name] / len(paths)).to(t.dtype) if t.is_floating_point() else t
        for name, t in last["model"].items()
    }
    meta = {**last["meta"], "averaged": [str(p) for p in paths]}
    return {"model": model, "config": last["config"], "spm": last["spm"], "meta": meta}


def ensemble_checkpoints(paths: Sequence[str | Path]) -> dict[str, Any]:
    """One checkpoint holding the models of several (fastattn.Ensemble's state_dict, a list of
    configs), with spm and meta of the first. They must share the SentencePiece model and the
    truecaser: the ensemble averages distributions over one vocabulary of one text."""
    if not paths:
        raise CheckpointError("no checkpoints to ensemble")
    model: dict[str, torch.Tensor] = {}
    configs: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    for k, path in enumerate(paths):
        state = load_checkpoint(path)
        if isinstance(state["config"], list):
            raise CheckpointError(f"{path}: is an ensemble itself; give its members instead")
        first = first or state
        if state["spm"] != first["spm"]:
            raise CheckpointError(f"{path}: its SentencePiece model differs from {paths[0]}'s")
        if state["meta"].get("truecase") != first["meta"].get("truecase"):
            raise CheckpointError(f"{path}: its truecaser differs from {paths[0]}'s")
        model.update({f"members.{k}.{name}": t for name, t in state["model"].items()})
        configs.append(state["config"])
    meta = {**first["meta"], "members": [str(p) for p in paths]}
    return {"model": model, "config": configs, "spm": first["spm"], "meta": meta}


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode, SentencePiece processor, meta) from a checkpoint: a Transformer, or
    for an ensemble checkpoint a fastattn.Ensemble."""
    state = load_checkpoint(path)
    config = state["config"]
    if isinstance(config, list):
        model = Ensemble([Transformer(TransformerConfig(**c)) for c in config])
    else:
        model = Transformer(TransformerConfig(**config))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), load_sentencepiece(state["spm"]), state["meta"]
