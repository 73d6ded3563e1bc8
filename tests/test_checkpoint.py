"""fastattn.checkpoint and python -m fastattn.tools.average: atomic saves, verified loads, keeping
the last K, averaging, and loading a model for translation."""

import os
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch

from fastattn import checkpoint, data
from fastattn.model import PRESETS, Transformer


def state(value: float = 1.0, step: int = 0) -> dict:
    return {
        "model": {"w": torch.full((3, 2), value), "count": torch.tensor([7])},
        "config": {"a": 1},
        "spm": b"\x00proto bytes",
        "meta": {"step": step},
        "train": {"rng": [torch.get_rng_state()], "position": (2, 5)},
    }


def test_round_trip(tmp_path):
    path = tmp_path / "run" / "c.pt"
    checkpoint.save_checkpoint(path, state(2.5, step=9))
    loaded = checkpoint.load_checkpoint(path)
    assert torch.equal(loaded["model"]["w"], torch.full((3, 2), 2.5))
    assert loaded["spm"] == b"\x00proto bytes"
    assert loaded["train"]["position"] == (2, 5)
    assert torch.equal(loaded["train"]["rng"][0], torch.get_rng_state())
    assert os.listdir(path.parent) == ["c.pt"]  # no temporary file left behind


def corrupt(path, how):
    raw = path.read_bytes()
    if how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "flipped":
        middle = len(raw) // 2
        path.write_bytes(raw[:middle] + bytes([raw[middle] ^ 1]) + raw[middle + 1 :])
    elif how == "foreign":
        path.write_bytes(b"PK\x03\x04 something else entirely")
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize(
    ("how", "match"),
    [("truncated", "truncated or corrupt"), ("flipped", "checksum"),
     ("foreign", "not a fastattn checkpoint"), ("empty", "not a fastattn checkpoint")],
)
def test_damaged_checkpoints_are_detected(tmp_path, how, match):
    path = tmp_path / "c.pt"
    checkpoint.save_checkpoint(path, state())
    corrupt(path, how)
    with pytest.raises(checkpoint.CheckpointError, match=match) as error:
        checkpoint.load_checkpoint(path)
    assert str(path) in str(error.value)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no such checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "none.pt")


def test_nan_is_never_saved(tmp_path):
    bad = state()
    bad["model"]["w"][1, 1] = float("nan")
    with pytest.raises(checkpoint.CheckpointError, match="parameter w has NaN"):
        checkpoint.save_checkpoint(tmp_path / "c.pt", bad)
    assert not any(tmp_path.iterdir())


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    checkpoint.save_checkpoint(path, state(1.0))

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(path, state(5.0))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["c.pt"]
    assert torch.equal(checkpoint.load_checkpoint(path)["model"]["w"], torch.ones(3, 2))


def test_save_numbered_keeps_the_last_k(tmp_path):
    for step in (5, 10, 100, 1000):
        checkpoint.save_numbered(tmp_path, state(step=step), step, keep=3)
    kept = checkpoint.list_checkpoints(tmp_path)
    assert [checkpoint.load_checkpoint(p)["meta"]["step"] for p in kept] == [10, 100, 1000]
    # Those numbered past the step being saved are not this run's: they are not deleted, nor do
    # they take the run's places (a fresh run in a used directory deleted its own so).
    checkpoint.save_numbered(tmp_path, state(step=20), 20, keep=2)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [
        10, 20, 100, 1000]
    checkpoint.save_numbered(tmp_path, state(step=30), 30, keep=2)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [
        20, 30, 100, 1000]


def test_an_interrupted_checkpoint_resumes_but_is_not_numbered_and_the_next_one_deletes_it(
        tmp_path):
    for step in (4, 8):
        checkpoint.save_numbered(tmp_path, state(step=step), step, keep=2)
    stopped = checkpoint.save_numbered(tmp_path, state(step=11), 11, keep=2, interrupted=True)
    assert stopped.name == "checkpoint_00000011_interrupted.pt"
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "checkpoint_00000004.pt", "checkpoint_00000008.pt"]  # what the final model averages
    assert checkpoint.list_resumable(tmp_path)[-1] == stopped
    checkpoint.save_numbered(tmp_path, state(step=12), 12, keep=2)
    assert [p.name for p in checkpoint.list_resumable(tmp_path)] == [
        "checkpoint_00000008.pt", "checkpoint_00000012.pt"]


def test_checkpoints_follow_the_umask(tmp_path):
    before = os.umask(0o022)
    try:
        checkpoint.save_checkpoint(tmp_path / "a.pt", state())
        os.umask(0o077)
        checkpoint.save_checkpoint(tmp_path / "b.pt", state())
    finally:
        os.umask(before)
    assert (tmp_path / "a.pt").stat().st_mode & 0o777 == 0o644  # teammates can read it
    assert (tmp_path / "b.pt").stat().st_mode & 0o777 == 0o600


def test_a_directory_where_a_checkpoint_belongs_is_named_as_such(tmp_path):
    (tmp_path / "c.pt").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="c.pt: is a directory, not a "
                       "checkpoint file"):
        checkpoint.load_checkpoint(tmp_path / "c.pt")
    with pytest.raises(IsADirectoryError) as error:
        checkpoint.save_checkpoint(tmp_path / "c.pt", state())
    assert error.value.filename == str(tmp_path / "c.pt")
    assert checkpoint.describe(error.value) == "is a directory"
    assert os.listdir(tmp_path) == ["c.pt"]


def test_a_failed_write_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "c.pt"
    checkpoint.save_checkpoint(path, state(1.0))

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as error:
        checkpoint.save_checkpoint(path, state(5.0))
    monkeypatch.undo()
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(path)
    assert checkpoint.describe(error.value) == "no space left on device"
    assert os.listdir(tmp_path) == ["c.pt"]
    assert torch.equal(checkpoint.load_checkpoint(path)["model"]["w"], torch.ones(3, 2))


def test_average(tmp_path):
    paths = []
    for i, value in enumerate([1.0, 2.0, 6.0]):
        paths.append(tmp_path / f"checkpoint_{i}.pt")
        checkpoint.save_checkpoint(paths[-1], state(value, step=i))
    averaged = checkpoint.average_checkpoints(paths)
    assert torch.equal(averaged["model"]["w"], torch.full((3, 2), 3.0))
    assert averaged["model"]["w"].dtype == torch.float32
    assert torch.equal(averaged["model"]["count"], torch.tensor([7]))
    assert averaged["meta"]["step"] == 2 and "train" not in averaged


@pytest.mark.parametrize(("change", "message"), [
    (lambda b: b["model"].update(extra=torch.zeros(1)), "parameters differ"),
    (lambda b: b["config"].update(a=2), "model configuration differs"),  # e.g. another width
    (lambda b: b.update(spm=b"\x00other proto"), "SentencePiece model differs"),
])
def test_average_rejects_different_models(tmp_path, change, message):
    a, b = state(), state()
    change(b)
    checkpoint.save_checkpoint(tmp_path / "a.pt", a)
    checkpoint.save_checkpoint(tmp_path / "b.pt", b)
    with pytest.raises(checkpoint.CheckpointError, match=f"b.pt: its {message}"):
        checkpoint.average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])


def run_average(*args):
    return subprocess.run([sys.executable, "-m", "fastattn.tools.average", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_average_command(tmp_path):
    for step, value in [(1, 0.0), (2, 3.0), (3, 5.0)]:
        checkpoint.save_numbered(tmp_path, state(value, step=step), step, keep=5)
    out = tmp_path / "avg.pt"
    result = run_average("--dir", tmp_path, "--last", 2, "--output", out)
    assert result.returncode == 0, result.stderr
    assert torch.equal(checkpoint.load_checkpoint(out)["model"]["w"], torch.full((3, 2), 4.0))


def test_average_command_refuses_a_directory_as_output_in_one_line(tmp_path):
    checkpoint.save_numbered(tmp_path, state(step=1), 1, keep=5)
    (tmp_path / "out").mkdir()
    result = run_average("--dir", tmp_path, "--output", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr == (f"error: --output {tmp_path / 'out'} is a directory; give the "
                             "averaged checkpoint a file name (e.g. "
                             f"{tmp_path / 'out' / 'checkpoint_averaged.pt'})\n")
    result = run_average("--dir", tmp_path / "none", "--output", tmp_path / "avg.pt")
    assert result.returncode == 2
    assert result.stderr == f"error: --dir {tmp_path / 'none'}: no such directory\n"


def test_average_command_reports_a_damaged_file(tmp_path):
    path = tmp_path / "checkpoint_1.pt"
    checkpoint.save_checkpoint(path, state())
    corrupt(path, "truncated")
    result = run_average("--inputs", path, "--output", tmp_path / "avg.pt")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert str(path) in result.stderr


def test_load_model(tmp_path):
    sp_proto = data.train_sentencepiece(["a small test sentence", "another one here"] * 20, 30)
    config = replace(PRESETS["tiny"], vocab_size=30)
    torch.manual_seed(0)
    model = Transformer(config)
    path = tmp_path / "m.pt"
    checkpoint.save_checkpoint(path, {"model": model.state_dict(), "config": asdict(config),
                                      "spm": sp_proto, "meta": {"src": "en", "tgt": "de"}})
    loaded, sp, meta = checkpoint.load_model(path)
    assert not loaded.training and meta == {"src": "en", "tgt": "de"}
    assert sp.get_piece_size() == 30
    src = torch.tensor([[5, 6, 7, data.EOS_ID]])
    tgt = torch.tensor([[data.BOS_ID, 8, 9]])
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # Same weights, but not bitwise the same outputs: BLAS and fused attention kernels may pick
    # another code path for differently aligned buffers.
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt), model(src, tgt))
