"""python -m fastattn.train under faults, each driven for real at tiny sizes (issue 50): a second
trainer in the save directory, a reused directory, a stale lock, signals (tests/test_train.py
sends SIGINT and SIGTERM at random updates and checks the resume bit for bit), a full disk, a
read-only file system, torn metrics lines, corrupt and foreign checkpoints, stale temporary
files, a finished run resumed, the precision and new training text on resume, and file modes.

A full disk and a read-only file system are real where this machine lets the tests mount a
small tmpfs (root with CAP_SYS_ADMIN); everywhere the same faults are also injected, as the
OSError the write gets, into a trainer running in this process (main()).
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from test_train import TORCH_OPS, corpus, losses, train_command

from fastattn import checkpoint, data
from fastattn import train as train_module
from fastattn.train import savedir, signals


def run(command, **kwargs):
    return subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          timeout=600, env=TORCH_OPS, **kwargs)


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-update run (checkpoints at updates 2 and 4, under umask 022), for tests to
    copy: (corpus paths, its save directory)."""
    root = tmp_path_factory.mktemp("finished")
    paths = corpus(root, lines=40)
    result = run(train_command(paths, root / "run", "--max-updates", 4, "--save-every", 2),
                 umask=0o022)
    assert result.returncode == 0, result.stderr
    return paths, root / "run"


def copy_of(finished, tmp_path) -> Path:
    save_dir = tmp_path / "run"
    shutil.copytree(finished[1], save_dir)
    return save_dir


def in_process(argv, monkeypatch, capsys):
    """main(argv) in this process: (exit status, stdout, stderr). The trainer's thread count is
    put back afterwards."""
    threads = torch.get_num_threads()
    try:
        train_module.main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- the save directory --------------------------------------------------------------------


def wait_for(condition, process, what, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"no {what} in {timeout}s"
        time.sleep(0.05)


def test_a_second_trainer_is_refused_naming_the_first_and_a_killed_ones_lock_blocks_nothing(
        tmp_path, monkeypatch, capsys):
    paths = corpus(tmp_path, lines=40)
    save_dir = tmp_path / "run"
    command = train_command(paths, save_dir, "--max-updates", 100000, "--save-every", 2)
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=TORCH_OPS)
    try:
        wait_for(lambda: (save_dir / "checkpoint_00000002.pt").exists(), first, "checkpoint")
        for flags in ([], ["--resume"], ["--overwrite"]):  # refused before anything runs
            code, _, err = in_process([*command[3:], *flags], monkeypatch, capsys)
            assert code == 2
            assert one_error_line(err) == (
                f"error: {save_dir} is in use by another trainer (pid {first.pid}, holding "
                f"{save_dir / 'train.lock'}); wait for it to end or stop it, or give this run "
                "another --save-dir")
        assert checkpoint.list_checkpoints(save_dir)  # the second deleted nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The killed trainer's lock file is still there, with its pid: the kernel released the lock.
    assert (save_dir / "train.lock").read_text().strip() == str(first.pid)
    resumed = run([*command[:-4], "--max-updates", "1", "--save-every", "20", "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout


def test_a_fresh_run_refuses_a_used_directory_and_resume_or_overwrite_go_on(finished, tmp_path,
                                                                          monkeypatch, capsys):
    paths = finished[0]
    save_dir = copy_of(finished, tmp_path)
    def contents():  # the lock file aside: it holds the pid of the trainer that last ran
        return {p.name: p.read_bytes() for p in save_dir.iterdir() if p.name != "train.lock"}

    before = contents()
    command = train_command(paths, save_dir, "--max-updates", 4, "--save-every", 2, "--seed", 7)
    code, _, err = in_process(command[3:], monkeypatch, capsys)  # refused before anything runs
    assert code == 2
    assert one_error_line(err) == (
        f"error: {save_dir} holds another run's checkpoints (checkpoint_00000002.pt, "
        "checkpoint_00000004.pt, checkpoint_final.pt and 2 more); continue that run with "
        "--resume, or start this one in another --save-dir, or give --overwrite to delete them "
        "first")
    assert contents() == before  # nothing touched

    code, _, err = in_process([*command[3:], "--resume", "--overwrite"], monkeypatch, capsys)
    assert code == 2 and "give one of them" in err

    overwritten = run([*command, "--overwrite"])
    assert overwritten.returncode == 0, overwritten.stderr
    assert f"--overwrite: deleted the 5 files of the earlier run in {save_dir}" in \
        overwritten.stdout
    assert sorted(losses(save_dir / "metrics.jsonl")) == [1, 2, 3, 4]  # the new run's alone
    assert checkpoint.load_checkpoint(save_dir / "checkpoint_00000004.pt")["meta"]["config"][
        "seed"] == 7
    assert [r for r in records(save_dir / "metrics.jsonl") if "valid_bleu" in r][0]["step"] == 4

    resumed = run([*command, "--resume", "--max-updates", 6])
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(losses(save_dir / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]


def test_an_ensembles_member_directories_count_as_the_earlier_run(tmp_path, monkeypatch, capsys):
    paths = corpus(tmp_path, lines=20)
    member = tmp_path / "run" / "member2"
    member.mkdir(parents=True)
    (member / "checkpoint_00000200.pt").write_bytes(b"whatever it holds")
    command = train_command(paths, tmp_path / "run")[3:]  # each refused before anything runs
    code, _, err = in_process(command, monkeypatch, capsys)
    assert code == 2
    assert "holds another run's checkpoints (member2/checkpoint_00000200.pt)" in \
        one_error_line(err)
    # --resume with --members 1: no checkpoint of a single model to go on from, and starting
    # afresh would replace the ensemble's final model
    code, _, err = in_process([*command, "--resume"], monkeypatch, capsys)
    assert code == 2
    assert one_error_line(err) == (
        f"error: {tmp_path / 'run'} holds another run's checkpoints (member2/"
        "checkpoint_00000200.pt) but no checkpoint that a single model can resume from (other "
        "--members?); give that run's flags, or start this one in another --save-dir, or give "
        "--overwrite to delete them first")


# --- I/O faults ----------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB tmpfs mounted for the test, or None where this machine does not allow it."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
            capture_output=True).returncode:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def remount(mount: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)


def fill(mount: Path, leave: int) -> Path:
    """Fills a file system but for `leave` bytes."""
    filler = mount / "filler"
    stat = os.statvfs(mount)
    with open(filler, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
    return filler


def fail_writes_to(monkeypatch, name: str, error: int) -> None:
    """Injects `error` into every write of a file named `name` in this process: its fsync (a
    checkpoint: write_atomically) or its opening for appending (the metrics log)."""
    fsync, open_ = os.fsync, os.open

    def failing_fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(f".{name}."):
            raise OSError(error, os.strerror(error))
        return fsync(fd)

    def failing_open(path, flags, *rest, **kwargs):
        if Path(path).name == name and flags & os.O_APPEND:
            raise OSError(error, os.strerror(error), str(path))
        return open_(path, flags, *rest, **kwargs)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    monkeypatch.setattr(os, "open", failing_open)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_a_full_disk_at_a_save_is_one_line_naming_the_last_good_checkpoint(
        finished, tmp_path, small_fs, monkeypatch, capsys, how):
    if how == "tmpfs" and small_fs is None:
        pytest.skip("this machine does not let the test mount a tmpfs (see the injected case)")
    save_dir = copy_of(finished, small_fs if how == "tmpfs" else tmp_path)
    command = train_command(finished[0], save_dir, "--max-updates", 6, "--save-every", 2,
                            "--resume")
    if how == "tmpfs":
        filler = fill(small_fs, leave=256 * 1024)  # room for log lines, not for a checkpoint
        result = run(command)
        code, err = result.returncode, result.stderr
    else:
        fail_writes_to(monkeypatch, "checkpoint_00000006.pt", errno.ENOSPC)
        code, _, err = in_process(command[3:], monkeypatch, capsys)
        monkeypatch.undo()
    assert code == 1
    assert one_error_line(err) == (
        f"error: cannot write {save_dir / 'checkpoint_00000006.pt'}: no space left on device; "
        f"the run stopped at update 6, its last good checkpoint is "
        f"{save_dir / 'checkpoint_00000004.pt'} (--resume continues from it)")
    assert not [p for p in save_dir.iterdir() if p.name.endswith(".tmp")]
    for path in checkpoint.list_checkpoints(save_dir):  # nothing saved before is damaged
        checkpoint.load_checkpoint(path)
    if how == "tmpfs":
        filler.unlink()
    resumed = run(command)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(losses(save_dir / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
@pytest.mark.parametrize("how", ["tmpfs", "chmod", "injected"])
def test_a_file_system_turning_read_only_is_one_line_and_resume_goes_on(
        finished, tmp_path, small_fs, monkeypatch, capsys, how):
    """tmpfs: remounted read-only under a running trainer, whose next write is a metrics line;
    chmod: its directory made mode 0555, whose next write is a checkpoint (root writes there
    all the same); injected: EROFS at the metrics log's fifth line."""
    if how == "tmpfs" and small_fs is None:
        pytest.skip("this machine does not let the test mount a tmpfs (see the injected case)")
    if how == "chmod" and os.geteuid() == 0:
        pytest.skip("root writes to a mode 0555 directory all the same (the tmpfs and the "
                    "injected cases make the file system read-only instead)")
    paths = finished[0]
    if how == "injected":
        save_dir = copy_of(finished, tmp_path)
        metrics = save_dir / "metrics.jsonl"
        # As if the run had stopped at update 4 before scoring its final model: resuming
        # writes nothing before its first log record.
        metrics.write_text("".join(json.dumps(r) + "\n" for r in records(metrics)
                                   if "loss" in r))
        command = train_command(paths, save_dir, "--max-updates", 6, "--save-every", 2,
                                "--resume")
        fail_writes_to(monkeypatch, "metrics.jsonl", errno.EROFS)
        code, _, err = in_process(command[3:], monkeypatch, capsys)
        monkeypatch.undo()
        failed, stopped, last, end = metrics, 5, 4, 6
    else:
        save_dir = (small_fs or tmp_path) / "run"
        metrics = save_dir / "metrics.jsonl"
        command = train_command(paths, save_dir, "--max-updates", 100000, "--save-every", 20)
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, env=TORCH_OPS)
        try:
            wait_for(lambda: (save_dir / "checkpoint_00000020.pt").exists(), process,
                     "checkpoint")
            if how == "tmpfs":
                for _ in range(100):  # busy while a file is open for writing: retry
                    if not subprocess.run(["mount", "-o", "remount,ro", str(small_fs)],
                                          capture_output=True).returncode:
                        break
                    time.sleep(0.01)
                else:
                    pytest.fail("the tmpfs could not be remounted read-only")
            else:
                save_dir.chmod(0o555)
            _, err = process.communicate(timeout=300)
            code = process.returncode
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            if how == "tmpfs":
                remount(small_fs, "rw")
            else:
                save_dir.chmod(0o755)
        line = one_error_line(err)
        stopped = int(re.search(r"the run stopped at update (\d+)", line).group(1))
        last = checkpoint.step_of(checkpoint.list_checkpoints(save_dir)[-1])
        failed = metrics if how == "tmpfs" else save_dir / f"checkpoint_{stopped:08d}.pt"
        end = stopped + 2
        command = [*command[:-4], "--max-updates", end, "--save-every", 20, "--resume"]
    cause = "permission denied" if how == "chmod" else "read-only file system"
    assert code == 1, err
    assert one_error_line(err) == (
        f"error: cannot write {failed}: {cause}; the run stopped at update {stopped}, its last "
        f"good checkpoint is {save_dir / f'checkpoint_{last:08d}.pt'} (--resume continues "
        "from it)")
    for path in checkpoint.list_checkpoints(save_dir):  # nothing saved before is damaged
        checkpoint.load_checkpoint(path)
    resumed = run(command)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(losses(metrics)) == list(range(1, end + 1))


def test_a_read_only_save_dir_is_refused_before_anything_runs(tmp_path, small_fs, capsys):
    directory = small_fs if small_fs is not None and os.geteuid() == 0 else tmp_path / "ro"
    if directory == small_fs:
        remount(small_fs, "ro")
    else:
        directory.mkdir()
        directory.chmod(0o555)
        if os.access(directory, os.W_OK):
            pytest.skip("root writes to a mode 0555 directory and no tmpfs can be mounted")
    try:
        with pytest.raises(SystemExit):
            train_module.parse_args(["--save-dir", str(directory / "run")])
    finally:
        remount(small_fs, "rw") if directory == small_fs else directory.chmod(0o755)
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"--save-dir {directory / 'run'}: {directory} is not a writable directory")


def test_a_metrics_line_written_on_a_full_disk_is_cut_off_again(tmp_path, monkeypatch):
    log = tmp_path / "metrics.jsonl"
    savedir.append_line(log, '{"step": 1}\n')
    write = os.write

    def half_then_full(fd, data):
        if len(data) > 4:
            return write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as error:
        savedir.append_line(log, '{"step": 2, "loss": 3.25}\n')
    monkeypatch.undo()
    assert error.value.filename == str(log) and error.value.errno == errno.ENOSPC
    assert log.read_text() == '{"step": 1}\n'  # no torn line left
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(IsADirectoryError, match="dir.jsonl"):
        savedir.append_line(tmp_path / "dir.jsonl", "{}\n")


def test_a_directory_given_for_a_file_is_named_as_such(tmp_path, capsys):
    (tmp_path / "metrics").mkdir()
    with pytest.raises(SystemExit):
        train_module.parse_args(["--metrics", str(tmp_path / "metrics")])
    assert f"--metrics {tmp_path / 'metrics'} is a directory; give a file name" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_module.parse_args(["--save-dir", str(tmp_path / "metrics" / "x"), "--plot",
                                 str(tmp_path)])
    assert f"--plot {tmp_path} is a directory" in capsys.readouterr().err


def test_checkpoints_and_outputs_follow_the_umask(finished):
    save_dir = finished[1]
    for name in ("checkpoint_00000004.pt", "checkpoint_final.pt", "metrics.jsonl",
                 "valid.hyp.de"):
        assert (save_dir / name).stat().st_mode & 0o777 == 0o644, name


# --- resuming ------------------------------------------------------------------------------


def test_resume_drops_torn_and_bad_metrics_lines_and_removes_its_stale_temporary_files(
        finished, tmp_path):
    save_dir = copy_of(finished, tmp_path)
    metrics = save_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:2]) + "not json\n" + "".join(lines[2:]) + '{"step": 5, "lo')
    stale = [save_dir / ".checkpoint_00000006.pt.x1y2z3w4.tmp",
             save_dir / ".metrics.jsonl.abcdefgh.tmp"]
    for path in stale:
        path.write_bytes(b"half a checkpoint")
    (save_dir / "notes.tmp").write_text("the user's own")
    resumed = run(train_command(finished[0], save_dir, "--max-updates", 6, "--save-every", 2,
                                "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"{metrics}: dropped 2 unreadable lines (3, {len(lines) + 2}; cut short by a kill?)" \
        in resumed.stdout
    for path in stale:
        assert f"removed {path}, left by an interrupted save" in resumed.stdout
        assert not path.exists()
    assert (save_dir / "notes.tmp").exists()
    assert sorted(losses(metrics)) == [1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def reference_to_6(finished, tmp_path_factory) -> Path:
    """The save directory of `finished`'s run trained uninterrupted to update 6."""
    save_dir = tmp_path_factory.mktemp("reference") / "ref"
    reference = run(train_command(finished[0], save_dir, "--max-updates", 6, "--save-every", 2))
    assert reference.returncode == 0, reference.stderr
    return save_dir


@pytest.mark.parametrize("damage", ["corrupt", "averaged"])
def test_resume_takes_the_newest_checkpoint_that_verifies_and_has_training_state(
        finished, reference_to_6, tmp_path, damage):
    paths = finished[0]
    save_dir = copy_of(finished, tmp_path)
    newest = save_dir / "checkpoint_00000004.pt"
    if damage == "corrupt":  # a flipped bit: resume goes back to update 2
        raw = bytearray(newest.read_bytes())
        raw[len(raw) // 2] ^= 1
        newest.write_bytes(bytes(raw))
        foreign, start = newest, 2
    else:  # an averaged model under a numbered name: resume ignores it
        foreign, start = save_dir / "checkpoint_00000005.pt", 4
        averaged = run([sys.executable, "-m", "fastattn.tools.average", "--dir", save_dir,
                        "--last", 2, "--output", foreign])
        assert averaged.returncode == 0
    resumed = run(train_command(paths, save_dir, "--max-updates", 6, "--save-every", 2,
                                "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    skipped = [line for line in resumed.stdout.splitlines() if line.startswith("--resume: skipped")]
    if damage == "corrupt":
        assert skipped == [f"--resume: skipped {newest}: corrupt, the checksum does not match "
                           "its contents; moved it to checkpoint_00000004.pt.corrupt"]
    else:
        assert skipped == [f"--resume: skipped {foreign}: has no training state (an averaged or "
                           "exported model, not a checkpoint of a run); moved it to "
                           "checkpoint_00000005.pt.no-training-state"]
        # kept, out of the numbered checkpoints the run deletes and averages
        assert (save_dir / "checkpoint_00000005.pt.no-training-state").exists()
    assert f"resumed from {save_dir / f'checkpoint_{start:08d}.pt'} at update {start}" in \
        resumed.stdout
    expected = losses(reference_to_6 / "metrics.jsonl")
    assert losses(save_dir / "metrics.jsonl") == expected  # as if nothing had happened
    for name in ("checkpoint_00000006.pt", "checkpoint_final.pt"):
        ref = checkpoint.load_checkpoint(reference_to_6 / name)["model"]
        got = checkpoint.load_checkpoint(save_dir / name)["model"]
        assert all(torch.equal(t, got[k]) for k, t in ref.items()), name


def test_resume_refuses_when_no_checkpoint_can_resume_and_says_why(finished, tmp_path,
                                                                   monkeypatch, capsys):
    save_dir = copy_of(finished, tmp_path)
    for path in checkpoint.list_checkpoints(save_dir):
        path.write_bytes(path.read_bytes()[:1000])
    code, _, err = in_process(train_command(finished[0], save_dir, "--resume")[3:], monkeypatch,
                              capsys)
    assert code == 2
    line = one_error_line(err)
    assert line.startswith(f"error: no checkpoint in {save_dir} can resume the run: ")
    assert line.count("truncated or corrupt") == 2


def test_a_finished_run_resumed_scores_again_without_a_second_record(finished, tmp_path):
    save_dir = copy_of(finished, tmp_path)
    before = records(save_dir / "metrics.jsonl")
    resumed = run(train_command(finished[0], save_dir, "--max-updates", 4, "--save-every", 2,
                                "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    after = records(save_dir / "metrics.jsonl")
    assert [sorted(r) for r in after] == [sorted(r) for r in before]  # the same records, once
    assert [r for r in after if "valid_bleu" in r] == [
        {**r, "time": after[-1]["time"]} for r in before if "valid_bleu" in r]


def test_resume_keeps_the_checkpoints_precision_without_measuring_again(tmp_path, monkeypatch,
                                                                        capsys):
    paths = corpus(tmp_path, lines=20)
    calls = []

    def pick(name, device, answer):
        calls.append(name)
        if name == "auto":
            name = answer
        return {"fp32": None, "bf16": torch.bfloat16}[name], False, f"picked {name}"

    command = [*train_command(paths, tmp_path / "run", "--max-updates", 2, "--save-every", 2,
                              "--precision", "auto")[3:]]
    monkeypatch.setattr(train_module.precision, "pick_precision",
                        lambda name, device: pick(name, device, "fp32"))
    code, out, err = in_process(command, monkeypatch, capsys)
    assert code == 0, err
    assert calls == ["auto"] and "fp32 (picked fp32)" in out
    saved = checkpoint.load_checkpoint(tmp_path / "run" / "checkpoint_00000002.pt")
    assert saved["meta"]["precision"] == "fp32"
    # On a busier machine the measurement would now pick bf16: resuming does not measure.
    calls.clear()
    monkeypatch.setattr(train_module.precision, "pick_precision",
                        lambda name, device: pick(name, device, "bf16"))
    code, out, err = in_process([*command, "--max-updates", 3, "--resume"], monkeypatch, capsys)
    assert code == 0, err
    assert calls == ["fp32"] and "fp32 (kept from checkpoint_00000002.pt)" in out
    # Members resumed keep it too (members.share_precision).
    args = train_module.parse_args([*command, "--resume", "--members", "2", "--device", "cpu",
                                    "--save-dir", str(tmp_path / "ensemble")])
    members = [train_module.member_args(args, k) for k in range(2)]
    for member in members:
        shutil.copytree(tmp_path / "run", member.save_dir)
    monkeypatch.setattr(train_module.members, "pick_precision", lambda *_: calls.append("auto"))
    shared = train_module.share_precision(args, members)
    assert [m.precision for m in shared] == ["fp32", "fp32"] and "auto" not in calls


def test_resume_on_new_training_text_trains_its_unknown_target_pieces_as_unk(tmp_path):
    paths = corpus(tmp_path, lines=20)
    first = run(train_command(paths, tmp_path / "run", "--max-updates", 2, "--save-every", 2))
    assert first.returncode == 0, first.stderr
    other = data.load_multi30k("train", "en", "de")
    for side, text in [("en", other.src[500:700]), ("de", other.tgt[500:700])]:
        (tmp_path / f"other.{side}").write_text("\n".join(text) + "\n", encoding="utf-8")
    command = train_command(paths, tmp_path / "run", "--max-updates", 4, "--save-every", 2,
                            "--resume", "--max-tokens", 600)
    command[command.index("--train") + 1:command.index("--train") + 3] = [
        str(tmp_path / "other.en"), str(tmp_path / "other.de")]
    resumed = run(command)
    assert resumed.returncode == 0, resumed.stderr
    assert "--resume: --train" in resumed.stdout
    [note] = [line for line in resumed.stdout.splitlines() if line.startswith("training: ")]
    assert "target pieces are outside the output vocabulary" in note and "as <unk>" in note
    assert sorted(losses(tmp_path / "run" / "metrics.jsonl")) == [1, 2, 3, 4]


# --- signals -------------------------------------------------------------------------------


def test_a_first_signal_asks_the_updates_to_stop_and_a_second_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    with signals.handled():
        with pytest.raises(signals.Interrupted) as outside:  # outside the updates: at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert outside.value.code == 143
    with signals.handled():
        with signals.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs
            assert signals.requested() == signal.SIGINT
            with pytest.raises(signals.Interrupted) as again:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
        assert again.value.code == 130 and again.value.at_once
        assert again.value.message() == ("stopped by SIGINT before the first checkpoint: "
                                         "nothing to resume from")
    assert signal.getsignal(signal.SIGINT) is before  # put back
    # An ensemble member's process: the parent passes its signals on and may get them from its
    # process group too; one stops the member after the update in flight, repeats change nothing.
    with signals.handled(member=True):
        with signals.deferred():
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
            assert signals.requested() == signal.SIGTERM


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG, spawn")
def test_a_log_line_is_one_write_so_members_sharing_stdout_never_split_each_others_lines(
        monkeypatch):
    # Under PYTHONUNBUFFERED print() writes the text and its newline apart: two members saving
    # at a SIGTERM once printed "member 1: saved A.ptmember 2: saved B.pt\n\n".
    writes = []

    class Pipe(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", Pipe())
    member = types.SimpleNamespace(name="member 2", main=True, bar=None)
    train_module.run.Run.log(member, "saved checkpoint_00000006_interrupted.pt")
    assert writes == ["member 2: saved checkpoint_00000006_interrupted.pt\n"]


def test_sigterm_to_an_ensemble_trained_side_by_side_saves_every_member_and_resumes_exactly(
        tmp_path):
    paths = corpus(tmp_path, lines=40)
    run_dir = tmp_path / "run"
    flags = ["--members", 2, "--jobs", 2, "--save-every", 50]
    command = train_command(paths, run_dir, *flags, "--max-updates", 100000)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**TORCH_OPS, "PYTHONUNBUFFERED": "1"})
    logs = [run_dir / f"member{k}" / "metrics.jsonl" for k in (1, 2)]
    wait_for(lambda: all(log.exists() and len(log.read_text().splitlines()) >= 5 for log in logs),
             process, "updates of both members")
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "stopped by SIGTERM: each member saved a checkpoint (the lines above name them); rerun "
        "the same command with --resume to continue")
    stops = []
    for k in (1, 2):
        saved = [line for line in out.splitlines() if line.startswith(f"member {k}: saved ")]
        stops.append(checkpoint.step_of(saved[-1].rsplit(" ", 1)[1]))
        assert sorted(losses(logs[k - 1])) == list(range(1, stops[-1] + 1))
    updates = max(stops) + 3
    resumed = run(train_command(paths, run_dir, *flags, "--max-updates", updates, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    reference = run(train_command(paths, tmp_path / "ref", *flags, "--max-updates", updates))
    assert reference.returncode == 0, reference.stderr
    for k in (1, 2):
        assert losses(logs[k - 1]) == losses(tmp_path / "ref" / f"member{k}" / "metrics.jsonl")
        name = f"member{k}/checkpoint_{updates:08d}.pt"
        ref = checkpoint.load_checkpoint(tmp_path / "ref" / name)["model"]
        got = checkpoint.load_checkpoint(run_dir / name)["model"]
        assert all(torch.equal(t, got[n]) for n, t in ref.items()), name
