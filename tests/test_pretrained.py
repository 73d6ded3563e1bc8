"""fastattn.inference.pretrained: a tiny two-member ensemble, saved as fastattn.train saves its
final model, exported into a temporary models directory, loaded back and checked against its
model.json."""

import glob
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_translate import SENTENCES, make_checkpoint

from fastattn import bleu
from fastattn.checkpoint import (
    CheckpointError,
    ensemble_checkpoints,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from fastattn.data import Truecaser, load_multi30k, multi30k_path, read_lines
from fastattn.inference import pretrained, translate_command
from fastattn.inference.ensemble import Ensemble
from fastattn.inference.translator import Translator
from fastattn.train.config import config_meta
from fastattn.train.flags import parse_args

NAME = "tiny-en-de"
REPOSITORY = Path(__file__).resolve().parent.parent
# What fastattn.train records for the test run (a record of score_final's shape).
TEST_RECORD = {"step": 8000, "test_bleu": 1.25, "test_tok_bleu": 2.5, "alpha": 0.6,
               "test_length_ratio": 0.9, "signature": "nrefs:1|case:mixed", "time": 1.7e9}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A save directory as `python -m fastattn.train --members 2` leaves it: the ensemble of its
    two members in checkpoint_final.pt, and the metrics log with its test record. The members
    decode at most 2 tokens past their source (--max-len-b 2), to keep scoring fast."""
    run = tmp_path_factory.mktemp("run")
    config = config_meta(parse_args(["--members", "2", "--beam", "2", "--max-len-b", "2",
                                     "--save-dir", str(run / "member1")]))
    paths = []
    for k in range(2):
        state = load_checkpoint(make_checkpoint(run / f"m{k}.pt"))
        generator = torch.Generator().manual_seed(k)
        for tensor in state["model"].values():  # the second member: other weights
            tensor.add_(k * 0.1 * torch.randn(tensor.shape, generator=generator))
        state["meta"] = {"step": 8000, "src": "en", "tgt": "de", "data": "multi30k",
                         "config": config, "precision": "fp32", "alpha": 0.6,
                         "truecase": {"a": "a"}}
        state["train"] = {"step": 8000}  # what a resumable checkpoint carries
        paths.append(run / f"member{k + 1}.pt")
        save_checkpoint(paths[-1], state)
    save_checkpoint(run / "checkpoint_final.pt", ensemble_checkpoints(paths))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 100, "loss": 5.0}) + "\n"
                                       + json.dumps(TEST_RECORD) + "\n")
    return run


@pytest.fixture(scope="module")
def models(run_dir, tmp_path_factory):
    """The models directory the export command wrote NAME into."""
    directory = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pretrained, "MODELS", directory)
        pretrained.main(["--checkpoint", str(run_dir / "checkpoint_final.pt"), "--name", NAME])
    return directory


@pytest.fixture
def shipped(models, monkeypatch):
    monkeypatch.setattr(pretrained, "MODELS", models)
    return models / NAME


def info(directory):
    return json.loads((directory / "model.json").read_text())


def test_load_translates_as_the_checkpoint_with_float16_weights(run_dir, shipped):
    model, sp, meta = pretrained.load(NAME)
    assert isinstance(model, Ensemble) and not model.training
    assert meta["alpha"] == 0.6 and meta["pretrained"] == info(shipped)
    reference, _, _ = load_model(run_dir / "checkpoint_final.pt")
    rounded = {name: t.half().float() for name, t in reference.state_dict().items()}
    loaded = model.state_dict()
    assert all(t.dtype == torch.float32 for t in loaded.values())
    assert all(torch.equal(loaded[name], t) for name, t in rounded.items())
    # The rounding is real: float32 weights differ from what ships.
    assert not all(torch.equal(loaded[name], t) for name, t in reference.state_dict().items())
    reference.load_state_dict(rounded)
    options = dict(beam_size=4, max_len_b=4)
    got = Translator(model, sp, **options).stream(SENTENCES)
    expected = Translator(reference, sp, **options).stream(SENTENCES)
    for one, other in zip(got, expected, strict=True):
        assert [t.tokens for t in one] == [t.tokens for t in other]


def test_the_file_is_float16_smaller_and_without_training_state(run_dir, shipped):
    state = load_checkpoint(shipped / "model.pt")
    assert "train" not in state and isinstance(state["config"], list)
    assert {t.dtype for t in state["model"].values()} == {torch.float16}
    parameters = sum(t.numel() for t in state["model"].values())
    fp32 = (run_dir / "checkpoint_final.pt").stat().st_size
    size = (shipped / "model.pt").stat().st_size
    # 2 bytes saved per parameter; the rest (SentencePiece model, config) is as it was.
    assert fp32 - size >= 0.99 * 2 * parameters
    recorded = info(shipped)
    assert recorded["bytes"] == size and recorded["members"] == 2
    assert recorded["parameters"] == parameters
    assert recorded["languages"] == {"source": "en", "target": "de"}


def test_model_json_records_the_provenance(run_dir, shipped):
    recorded = info(shipped)
    provenance = recorded["provenance"]
    # The save directory given was member 1's; the run's is the one above it.
    assert provenance["command"] == ("python -m fastattn.train --beam 2 --max-len-b 2 "
                                     f"--members 2 --save-dir {run_dir}")
    assert provenance["training_config"]["max_len_b"] == 2
    head = subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert provenance["commit"] == head
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith("model name")][0].split(":", 1)[1].strip()
    assert provenance["machine"]["cpu"] == cpu and provenance["machine"]["cores"] >= 1
    assert provenance["training_precision"] == "fp32"
    trainer = recorded["scores"]["trainer"]
    assert trainer["test_tok_bleu"] == 2.5 and trainer["date"] == "2023-11-14T22:13:20+00:00"
    assert trainer["source"] == str(run_dir / "metrics.jsonl")


def test_a_model_trained_at_an_earlier_commit_records_it_and_the_exports(run_dir, tmp_path,
                                                                         monkeypatch):
    def git(*args):
        return subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True,
                              text=True).stdout.strip()

    monkeypatch.setattr(pretrained, "MODELS", tmp_path / "models")
    provenance = pretrained.provenance_commit(git("rev-parse", "--short", "HEAD~1"))
    assert provenance["commit"] == git("rev-parse", "HEAD~1")
    assert provenance["uncommitted_changes"] is None  # nothing recorded it then
    assert provenance["exported_at"]["commit"] == git("rev-parse", "HEAD")
    with pytest.raises(SystemExit) as caught:
        pretrained.main(["--checkpoint", str(run_dir / "checkpoint_final.pt"), "--name", "x",
                         "--trained-at", "no-such-commit"])
    assert caught.value.code == ("error: --trained-at no-such-commit: not a commit of this "
                                 "checkout's history (HEAD or one before it)")
    assert not (tmp_path / "models" / "x").exists()


def test_the_default_runs_command_is_the_trainer_without_flags():
    assert pretrained.training_command(config_meta(parse_args([]))) == "python -m fastattn.train"


def test_the_recorded_test_score_is_the_shipped_models(shipped):
    """Recomputed here as fastattn.train's score_final computes it, in this process."""
    test = info(shipped)["scores"]["test"]
    assert test["split"] == "multi30k test2016"
    model, sp, meta = pretrained.load(NAME)
    translator = Translator(model, sp, beam_size=2, alpha=meta["alpha"], max_len_b=2,
                            batch_tokens=meta["config"]["eval_batch_tokens"],
                            truecaser=Truecaser(meta["truecase"]))
    hyps = translator.translate(load_multi30k("test2016", "en", "de").src)
    refs = read_lines(multi30k_path("test2016", "de", tokenized=True))
    assert test["tokenized_bleu"] == round(bleu.multi30k_bleu(hyps, refs, "de"), 2)
    assert info(shipped)["scores"]["dev"]["split"] == "multi30k val"


def one_line_error(error: Exception, path: Path, why: str) -> None:
    message = str(error)
    assert "\n" not in message
    assert message == (f"{path}: does not match its model.json ({why}): the file was changed "
                       "or truncated")


def test_a_flipped_byte_or_a_truncation_is_caught(shipped, tmp_path, monkeypatch):
    copy = tmp_path / NAME
    shutil.copytree(shipped, copy)
    monkeypatch.setattr(pretrained, "MODELS", tmp_path)
    raw = (copy / "model.pt").read_bytes()
    middle = len(raw) // 2
    (copy / "model.pt").write_bytes(raw[:middle] + bytes([raw[middle] ^ 1]) + raw[middle + 1:])
    with pytest.raises(CheckpointError) as caught:
        pretrained.load(NAME)
    one_line_error(caught.value, copy / "model.pt", "its sha256 differs")
    (copy / "model.pt").write_bytes(raw[:-10])
    with pytest.raises(CheckpointError) as caught:
        pretrained.load(NAME)
    one_line_error(caught.value, copy / "model.pt", f"{len(raw) - 10} bytes instead of {len(raw)}")
    (copy / "model.pt").write_bytes(raw)
    assert isinstance(pretrained.load(NAME)[0], Ensemble)


def test_an_unknown_name_lists_the_shipped_ones(shipped, tmp_path, monkeypatch):
    assert pretrained.names() == [NAME]
    with pytest.raises(ValueError) as caught:
        pretrained.load("tiny-en-fr")
    assert str(caught.value) == (f"no shipped model named 'tiny-en-fr' (did you mean {NAME!r}?); "
                                 f"shipped: {NAME}")
    with pytest.raises(ValueError) as caught:
        pretrained.load("..")  # a directory, but not a model's
    assert str(caught.value) == f"no shipped model named '..'; shipped: {NAME}"
    monkeypatch.setattr(pretrained, "MODELS", tmp_path / "none")
    assert pretrained.names() == []
    with pytest.raises(ValueError, match="named 'tiny-en-de': none ship with this installation"):
        pretrained.load(NAME)


def test_translator_and_translate_take_a_shipped_model(shipped, tmp_path, capsys):
    """Translator.from_pretrained and `translate --model NAME` translate with the shipped model
    (its α and truecaser from its meta) as Translator.from_checkpoint does with its file; a
    typo is one error line naming the shipped models."""
    expected = Translator.from_checkpoint(shipped / "model.pt", max_len_b=4).translate(SENTENCES)
    assert Translator.from_pretrained(NAME, max_len_b=4).translate(SENTENCES) == expected
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{line}\n" for line in SENTENCES))
    translate_command.main(["--model", NAME, "--max-len-b", "4", "--input", str(source)])
    assert capsys.readouterr().out.splitlines() == expected
    with pytest.raises(SystemExit) as caught:
        translate_command.main(["--model", "tiny-en-fr", "--input", str(source)])
    assert str(caught.value) == (f"error: no shipped model named 'tiny-en-fr' (did you mean "
                                 f"{NAME!r}?); shipped: {NAME}")


@pytest.mark.parametrize("args, error", [
    (["--checkpoint", "c.pt", "--name", "x", "--no-such-flag"],
     "unrecognized arguments: --no-such-flag"),
    (["--checkpoint", "c.pt"], "the following arguments are required: --name"),
    (["--checkpoint", "c.pt", "--name", "../up"], "--name '../up': use lowercase letters"),
])
def test_bad_flags_are_a_short_usage_and_one_error_line(args, error, capsys):
    with pytest.raises(SystemExit) as caught:
        pretrained.main(args)
    assert caught.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3 and lines[0].startswith("usage: python -m fastattn.inference.pretrained")
    assert lines[-1].startswith(f"python -m fastattn.inference.pretrained: error: {error}")


def test_a_checkpoint_that_cannot_ship_is_one_error_line(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(pretrained, "MODELS", tmp_path / "models")
    with pytest.raises(SystemExit) as caught:
        pretrained.main(["--checkpoint", str(tmp_path / "none.pt"), "--name", "x"])
    assert caught.value.code == f"error: {tmp_path / 'none.pt'}: no such checkpoint"
    state = load_checkpoint(run_dir / "m0.pt")  # a checkpoint of no training run
    save_checkpoint(tmp_path / "plain.pt", state)
    with pytest.raises(SystemExit) as caught:
        pretrained.main(["--checkpoint", str(tmp_path / "plain.pt"), "--name", "x"])
    assert caught.value.code == (f"error: {tmp_path / 'plain.pt'}: has no training configuration "
                                 "(meta['config']); export takes a final checkpoint of "
                                 "fastattn.train")
    state["model"]["embedding.weight"][0, 0] = 1e5
    with pytest.raises(CheckpointError, match="embedding.weight has values beyond float16's"):
        pretrained.compact(state)
    assert not (tmp_path / "models").exists()


def test_the_package_carries_the_models_and_git_keeps_them(shipped, tmp_path):
    tomllib = pytest.importorskip("tomllib")
    patterns = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["fastattn"]
    package = tmp_path / "fastattn"  # the package as setuptools globs it, holding the model
    shutil.copytree(shipped, package / "models" / NAME)
    shutil.copy(REPOSITORY / "fastattn" / "models" / "README.md", package / "models")
    included = {Path(p).relative_to(package).as_posix()
                for pattern in patterns for p in glob.glob(str(package / pattern))}
    assert {f"models/{NAME}/model.pt", f"models/{NAME}/model.json",
            "models/README.md"} <= included
    # The repository ignores *.pt; fastattn/models/.gitignore lets the shipped weights in.
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "-C", str(REPOSITORY), "check-ignore", "-q", path]
                              ).returncode == 0

    assert ignored("fastattn/x/model.pt") and not ignored(f"fastattn/models/{NAME}/model.pt")


def test_a_single_model_of_files_exports_and_export_refuses_to_overwrite(run_dir, tmp_path,
                                                                          monkeypatch, capsys):
    """A run on --data files is scored on its --valid and --test text; an existing model is
    replaced only with --force."""
    monkeypatch.setattr(pretrained, "MODELS", tmp_path / "models")
    text = load_multi30k("val", "en", "de")
    files = {}
    for split, lines in (("valid", slice(0, 5)), ("test", slice(5, 8))):
        files[split] = [str(tmp_path / f"{split}.en"), str(tmp_path / f"{split}.de")]
        Path(files[split][0]).write_text("\n".join(text.src[lines]) + "\n")
        Path(files[split][1]).write_text("\n".join(text.tgt[lines]) + "\n")
    state = load_checkpoint(run_dir / "member1.pt")
    state["meta"]["config"] = config_meta(parse_args([
        "--data", "files", "--train", *files["valid"], "--valid", *files["valid"],
        "--test", *files["test"], "--members", "1", "--max-len-b", "2",
        "--save-dir", str(tmp_path / "run")]))
    save_checkpoint(tmp_path / "single.pt", state)
    argv = ["--checkpoint", str(tmp_path / "single.pt"), "--name", "single"]
    pretrained.main(argv)
    directory = tmp_path / "models" / "single"
    assert capsys.readouterr().out.startswith(f"{directory}: ")
    model, _, meta = pretrained.load("single")
    assert not isinstance(model, Ensemble) and meta["pretrained"]["members"] == 1
    scores = meta["pretrained"]["scores"]
    assert scores["dev"]["split"] == f"{files['valid'][0]} -> {files['valid'][1]}"
    assert scores["test"]["split"] == f"{files['test'][0]} -> {files['test'][1]}"
    assert scores["trainer"] is None  # no metrics log beside the checkpoint
    assert meta["pretrained"]["provenance"]["command"].startswith(
        f"python -m fastattn.train --data files --max-len-b 2 --members 1 --save-dir {tmp_path}")

    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(SystemExit) as caught:
        pretrained.main(argv)
    assert caught.value.code == (f"error: {directory} exists: give --force to replace the "
                                 "model in it")
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    pretrained.main([*argv, "--force", "--description", "A tiny test model."])
    assert info(directory)["description"] == "A tiny test model."
    pretrained.load("single")  # model.json describes the model.pt written with it
