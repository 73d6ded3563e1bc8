"""A tiny two-member training run gives the losses, gradient norms, final weights and test BLEU
recorded in tests/data/recorded_run_*.json, bit for bit: restructuring the trainer, the ops or the
model must not change a number. And a checkpoint written before the redesign of issue 48
(tests/data/checkpoint_pre48_00000010.pt, update 10 of a one-member run, written on Zen 5) still
resumes to the recorded updates 11 to 20.

One thread, MKL's conditional numerical reproducibility pinned to its AVX2 code path (MKL_CBWR),
ATen's and fastattn._C's kernels held to one instruction-set level (ATEN_CPU_CAPABILITY,
FASTATTN_CPU_ISA) and the PyTorch ops (FASTATTN_BACKEND=torch) make a run reproducible on one CPU
vendor at one level, not across them: AVX-512 and AVX2 code contract and vectorise differently
(update 14's gradient norm differs in its last bits), and on Intel a run rounds differently than
on AMD at the same level (update 5's gradient norm differs in the 7th digit: the libraries'
vendor-specific code paths, MKL or oneDNN, not fastattn). So there is a record per vendor and
level, recorded_run_<vendor>_<level>.json, and the run takes the best level this CPU has, or the
one FASTATTN_CPU_ISA holds it to (amx runs as avx512):
- AuthenticAMD avx512: Zen 5 and Zen 4, made by the code before the redesign (commit ee131e1);
- GenuineIntel avx512: a 2-core Xeon (family 6 model 207, AVX-512, no AMX visible), with the Zen 5
  checkpoint above, by ee131e1 too;
- AuthenticAMD avx2: a Zen 4 held to AVX2 (FASTATTN_CPU_ISA=avx2), the level a Zen 3 runs;
- GenuineIntel avx2: a 2-core Xeon with AMX held to AVX2, by 70cc48b (gradient norms differ from
  AMD's at avx2 in the last bits from update 1, as at avx512).

Re-record only when a change is meant to alter the numbers, on each vendor and level, and say why
in its commit (it writes this CPU's record at the level in use; the old checkpoint stays as it is):
    [FASTATTN_CPU_ISA=avx2] python tests/test_recorded_run.py --record
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastattn import checkpoint, cpu_isa, data


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id: AuthenticAMD, GenuineIntel, ..."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return "unknown"


VENDOR = cpu_vendor()
# The best level this CPU runs, or what FASTATTN_CPU_ISA holds it to; amx is avx512 but for the
# decoder's int8 and bf16 products, which this float32 run never reaches.
LEVEL = {"amx": "avx512"}.get(cpu_isa(), cpu_isa())
RECORD = Path(__file__).parent / "data" / f"recorded_run_{VENDOR}_{LEVEL}.json"
OLD_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint_pre48_00000010.pt"
UPDATES = 30
ENV = {**os.environ, "FASTATTN_BACKEND": "torch", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "FASTATTN_CPU_ISA": LEVEL,
       "ATEN_CPU_CAPABILITY": {"scalar": "default"}.get(LEVEL, LEVEL)}


def write_corpus(directory: Path) -> dict[str, Path]:
    """The first Multi30k lines as plain files: 120 training pairs, 8 dev and 8 test pairs."""
    train = data.load_multi30k("train", "en", "de")
    paths = {}
    for name, rows in [("train", slice(0, 120)), ("valid", slice(120, 128)),
                       ("test", slice(128, 136))]:
        for side, text in [("en", train.src[rows]), ("de", train.tgt[rows])]:
            paths[f"{name}.{side}"] = directory / f"{name}.{side}"
            paths[f"{name}.{side}"].write_text("\n".join(text) + "\n", encoding="utf-8")
    return paths


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().contiguous().cpu()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def train(directory: Path, *flags) -> Path:
    """Runs the trainer on write_corpus's text with the flags of every recorded run (dropout,
    R-Drop, word and BPE-dropout on: every random stream is exercised) and `flags`."""
    paths = write_corpus(directory)
    save_dir = directory / "run"
    command = [
        sys.executable, "-m", "fastattn.train", "--data", "files",
        "--train", paths["train.en"], paths["train.de"],
        "--valid", paths["valid.en"], paths["valid.de"],
        "--test", paths["test.en"], paths["test.de"],
        "--preset", "tiny", "--vocab-size", "200", "--max-tokens", "300",
        "--precision", "fp32", "--threads", "1", "--log-every", 1,
        "--average-last", 2, "--keep", 3, "--beam", 2, "--max-len-b", 3,
        "--rdrop", "0.5", "--word-dropout", "0.1", "--bpe-dropout", "0.1",
        "--no-progress", "--save-dir", save_dir, *flags,
    ]
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                            timeout=900, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return save_dir


def updates(metrics: Path) -> dict[str, list[float]]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {str(r["step"]): [r["loss"], r["grad_norm"]] for r in records if "loss" in r}


def resumed(directory: Path, old_checkpoint: Path) -> dict:
    """Resumes a one-member run from old_checkpoint (update 10) to update 20."""
    save_dir = directory / "run"
    save_dir.mkdir(parents=True)
    shutil.copy(old_checkpoint, save_dir / old_checkpoint.name.replace("_pre48", ""))
    train(directory, "--members", 1, "--max-updates", 20, "--save-every", 10, "--eval-every", 0,
          "--resume")
    return {"updates": updates(save_dir / "metrics.jsonl"),
            "final_weights": weights_digest(checkpoint.load_checkpoint(
                save_dir / "checkpoint_00000020.pt")["model"])}


def run(directory: Path) -> dict:
    """Trains two tiny members in turn for UPDATES updates each and returns what the record
    holds."""
    save_dir = train(directory, "--members", 2, "--jobs", 1, "--max-updates", UPDATES,
                     "--save-every", 10, "--eval-every", 15, "--alpha", "0.6,1.0")
    members = {}
    for k in (1, 2):
        records = [json.loads(line) for line in
                   (save_dir / f"member{k}" / "metrics.jsonl").read_text().splitlines()]
        members[f"member{k}"] = {
            "updates": updates(save_dir / f"member{k}" / "metrics.jsonl"),
            "dev": {str(r["step"]): [r["dev_loss"], r["dev_bleu"]] for r in records
                    if "dev_loss" in r},
            "final_weights": weights_digest(checkpoint.load_checkpoint(
                save_dir / f"member{k}" / f"checkpoint_{UPDATES:08d}.pt")["model"]),
        }
    final = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in final if "test_bleu" in r]
    hypotheses = (save_dir / "test.hyp.de").read_text(encoding="utf-8")
    return {"members": members,
            "ensemble": {"test_bleu": scored[-1]["test_bleu"], "alpha": scored[-1]["alpha"],
                         "hypotheses_sha256": hashlib.sha256(hypotheses.encode()).hexdigest()}}


@pytest.mark.slow
def recorded_numbers() -> dict:
    assert RECORD.exists(), (f"no recorded run for this CPU vendor ({VENDOR}) at {LEVEL}: record "
                             "one (see this file's docstring), or hold the run to a recorded "
                             "level with FASTATTN_CPU_ISA")
    return json.loads(RECORD.read_text())


def test_a_recorded_tiny_run_gives_the_same_numbers_bit_for_bit(tmp_path):
    recorded = recorded_numbers()
    measured = run(tmp_path)
    for name, member in recorded["members"].items():
        got = measured["members"][name]
        assert got["updates"].keys() == member["updates"].keys(), name
        for step, values in member["updates"].items():
            assert got["updates"][step] == values, f"{name} update {step}: loss, grad norm"
        assert got["dev"] == member["dev"], f"{name}: dev losses"
        assert got["final_weights"] == member["final_weights"], f"{name}: final weights"
    assert measured["ensemble"] == recorded["ensemble"]


@pytest.mark.slow
def test_a_checkpoint_from_before_the_redesign_resumes_to_the_recorded_updates(tmp_path):
    recorded = recorded_numbers()["resumed"]
    measured = resumed(tmp_path, OLD_CHECKPOINT)
    assert measured == recorded


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_recorded_run.py --record")
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        record = run(Path(directory))
    with tempfile.TemporaryDirectory() as directory:
        record["resumed"] = resumed(Path(directory), OLD_CHECKPOINT)
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"recorded {RECORD}")
