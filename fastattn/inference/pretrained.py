"""Models that ship inside the package, ready to translate without training.

Each lives in fastattn/models/<name>/ (package data, so `pip install .` carries it):
  model.pt    a fastattn checkpoint (fastattn.checkpoint's format) of a trained model or
              ensemble, its weights stored in float16 and no training state
  model.json  name, description, languages, model.pt's sha256 and size, and provenance: the
              training command and configuration, the commit, the machine, the date, and its dev
              and test scores measured on the float16 weights it ships with

`load(name)` verifies model.pt against model.json before loading it (float32 in memory).

    python -m fastattn.inference.pretrained \\
        --checkpoint checkpoints/multi30k-en-de/checkpoint_final.pt --name multi30k-en-de

writes fastattn/models/multi30k-en-de/ from a trained checkpoint (docs/pretrained.md).
"""

from __future__ import annotations

import datetime
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from fastattn import data
from fastattn.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model,
    save_checkpoint,
    write_atomically,
)
from fastattn.cli import ArgumentParser, HelpFormatter

MODELS = Path(__file__).resolve().parent.parent / "models"
REPOSITORY = Path(__file__).resolve().parent.parent  # where `git rev-parse HEAD` is asked
NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")  # a directory name that reads the same everywhere
FLOAT16_MAX = torch.finfo(torch.float16).max


def names() -> list[str]:
    """The names of the shipped models, sorted (those whose directory holds a model.json)."""
    if not MODELS.is_dir():
        return []
    return sorted(p.parent.name for p in MODELS.glob("*/model.json"))


def load(name: str, device: str | torch.device = "cpu") -> tuple[Any, Any, dict[str, Any]]:
    """(model in eval mode, SentencePiece processor, meta) of a shipped model, as
    fastattn.checkpoint.load_model gives them for a checkpoint (a Transformer, or a
    fastattn.Ensemble), with float32 weights; meta["pretrained"] is its model.json.

    ValueError for a name that does not ship (the message lists those that do);
    CheckpointError for a model.pt whose size or sha256 differs from its model.json's."""
    directory = MODELS / name
    if name not in names():
        raise ValueError(_unknown(name))
    info = read_info(directory / "model.json")
    path = directory / "model.pt"
    verify(path, info)
    model, sp, meta = load_model(path, device)
    return model, sp, {**meta, "pretrained": info}


def _unknown(name: str) -> str:
    shipped = names()
    if not shipped:
        return (f"no shipped model named {name!r}: none ship with this installation yet "
                f"({MODELS} holds none; docs/pretrained.md says how to export one)")
    close = difflib.get_close_matches(name, shipped, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"no shipped model named {name!r}{hint}; shipped: {', '.join(shipped)}"


def read_info(path: Path) -> dict[str, Any]:
    """A model.json, as a dict."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})") from None


def verify(path: Path, info: dict[str, Any]) -> None:
    """Raises CheckpointError unless the file at path has the size and sha256 info records."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(raw) != info["bytes"]:
        why = f"{len(raw)} bytes instead of {info['bytes']}"
    elif hashlib.sha256(raw).hexdigest() != info["sha256"]:
        why = "its sha256 differs"
    else:
        return
    raise CheckpointError(f"{path}: does not match its model.json ({why}): the file was changed "
                          "or truncated")


# --- export ----------------------------------------------------------------------------------


def compact(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint to ship from a trained one: its floating-point weights in float16, no
    training state ("train"); config, spm and meta as they are."""
    model = {}
    for name, tensor in state["model"].items():
        if tensor.is_floating_point():
            if tensor.abs().max() > FLOAT16_MAX:
                raise CheckpointError(f"parameter {name} has values beyond float16's range "
                                      f"(±{FLOAT16_MAX:.0f}): it cannot ship in float16")
            tensor = tensor.half()
        model[name] = tensor
    return {"model": model, "config": state["config"], "spm": state["spm"],
            "meta": state["meta"]}


def export(checkpoint: str | Path, name: str, description: str | None = None,
           force: bool = False, trained_at: str | None = None) -> Path:
    """Writes MODELS/name/{model.pt,model.json} from a trained checkpoint (a model or an
    ensemble of fastattn.train: its meta["config"] says how to score it) and returns the
    directory. model.json's scores are the shipped float16 weights' on the run's dev and test
    text (`score`), beside the ones the run's metrics log next to the checkpoint recorded for
    its float32 weights. Refuses an existing directory unless force. trained_at: the commit
    the run trained at, when the export runs at a later one (a checkpoint does not record it;
    provenance)."""
    if not NAME.fullmatch(name):
        raise ValueError(f"model name {name!r}: use lowercase letters, digits, '.', '_', '-'")
    directory = MODELS / name
    if directory.exists() and not force:
        raise FileExistsError(f"{directory} exists: give --force to replace the model in it")
    checkpoint = Path(checkpoint)
    source = provenance_commit(trained_at)
    state = load_checkpoint(checkpoint)
    config = state["meta"].get("config")
    if config is None:
        raise CheckpointError(f"{checkpoint}: has no training configuration (meta['config']); "
                              "export takes a final checkpoint of fastattn.train")
    shipped = compact(state)
    with tempfile.TemporaryDirectory() as scratch:
        # Scored from a file, as a user loads it; the same bytes become model.pt afterwards, so
        # a model whose scoring fails ships nothing.
        candidate = Path(scratch) / "model.pt"
        save_checkpoint(candidate, shipped)
        scores = score(candidate, config, Path(scratch))
        raw = candidate.read_bytes()
    write_atomically(directory / "model.pt", [raw])
    members = len(state["config"]) if isinstance(state["config"], list) else 1
    parameters = sum(t.numel() for t in shipped["model"].values() if t.is_floating_point())
    info = {
        "name": name,
        "description": description or _description(config, members, parameters),
        "languages": {"source": config["src"], "target": config["tgt"]},
        "file": "model.pt",
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "weights": "float16, loaded as float32",
        "members": members,
        "parameters": parameters,
        "scores": {**scores, "trainer": trainer_scores(checkpoint.parent / "metrics.jsonl")},
        "provenance": {**provenance(checkpoint, config, state["meta"]), **source},
    }
    write_atomically(directory / "model.json",
                     [(json.dumps(info, indent=2, ensure_ascii=False) + "\n").encode()])
    return directory


def _description(config: dict[str, Any], members: int, parameters: int) -> str:
    what = f"an ensemble of {members} Transformers" if members > 1 else "a Transformer"
    corpus = "the embedded Multi30k" if config["data"] == "multi30k" else "its own text"
    return (f"{config['src']}->{config['tgt']} translation: {what} ({parameters:,} parameters "
            f"in all, preset {config['preset']}) trained on {corpus} by fastattn.train")


def score(model_pt: Path, config: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Dev and test BLEU of a checkpoint file, computed as fastattn.train scores its final model
    (its beam, max_len_b, batch tokens and, stored in the checkpoint, its length penalty and
    truecaser) by the commands a user runs: python -m fastattn.translate on the source text,
    python -m fastattn.tools.evaluate on the translations. Multi30k: val and test2016 against their
    embedded references; tokenized BLEU lowercased against the official tokenized ones."""
    src, tgt = config["src"], config["tgt"]
    if config["data"] == "multi30k":
        splits = {"dev": ("multi30k val", data.multi30k_path("val", src),
                          ["--multi30k", "val"]),
                  "test": ("multi30k test2016", data.multi30k_path("test2016", src),
                           ["--multi30k", "test2016"])}
    else:  # --data files: the run's --valid and --test pairs, where this machine has them
        pairs = {"dev": config["valid"], "test": config["test"]}
        splits = {key: (f"{pair[0]} -> {pair[1]}", Path(pair[0]), ["--ref", pair[1]])
                  for key, pair in pairs.items() if pair}
    flags = ["--beam", str(config["beam"]), "--max-len-b", str(config["max_len_b"]),
             "--batch-tokens", str(config["eval_batch_tokens"])]
    # One translate process for all splits (each line's translation is the same in any batch):
    # it loads the model once.
    sources = {key: data.read_lines(source) for key, (_, source, _) in splits.items()}
    plain, translations = scratch / f"sources.{src}", scratch / f"translations.{tgt}"
    plain.write_text("".join(line + "\n" for lines in sources.values() for line in lines),
                     encoding="utf-8")
    _command("fastattn.translate", "--checkpoint", str(model_pt), *flags, "--input", str(plain),
             "--output", str(translations))
    # split, not splitlines: U+2028 and the like are text inside a translation
    hyps = translations.read_text(encoding="utf-8").split("\n")[:-1]
    found: dict[str, Any] = {
        "how": "the shipped float16 weights, translated and scored as fastattn.train scores its "
               "final model: python -m fastattn.translate --checkpoint model.pt "
               f"{' '.join(flags)} on the dev and test sources (one --input file), then "
               f"python -m fastattn.tools.evaluate --hyp HYP --lang {tgt} with --multi30k SPLIT "
               "(or --ref REFERENCE) on each split's translations; tokenized BLEU as the trainer "
               "reports it (Multi30k: lowercased, against the official tokenized references)",
    }
    for key, (split, _, references) in splits.items():
        hyp = scratch / f"{key}.hyp.{tgt}"
        mine, hyps = hyps[:len(sources[key])], hyps[len(sources[key]):]
        hyp.write_text("".join(line + "\n" for line in mine), encoding="utf-8")
        report = _command("fastattn.tools.evaluate", "--hyp", str(hyp), "--lang", tgt, *references)
        found[key] = {"split": split, **_bleu(report)}
    return found


def _command(module: str, *args: str) -> str:
    """The stdout of python -m module args; a failure is a RuntimeError with its last line."""
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                            text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"python -m {module} failed while scoring the model: {last}")
    return result.stdout


def _bleu(report: str) -> dict[str, Any]:
    """The figures of python -m fastattn.tools.evaluate's report."""
    bleu = re.search(r"^BLEU (\S+)  (.*)$", report, re.M)
    tokenized = re.search(r"^tokenized BLEU (\S+)", report, re.M)
    ratio = re.search(r"^length ratio (\S+)", report, re.M)
    return {"tokenized_bleu": float(tokenized.group(1)), "bleu": float(bleu.group(1)),
            "signature": bleu.group(2), "length_ratio": float(ratio.group(1))}


def trainer_scores(metrics: Path) -> dict[str, Any] | None:
    """The final model's scores as the run reported them (its float32 weights): the last
    test (or, without test text, valid) record of its metrics log, and the dev BLEU of each
    length penalty where it chose among several. None without a log."""
    if not metrics.is_file():
        return None
    records = []
    for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line a kill cut short
            continue
    final = [r for r in records if "test_tok_bleu" in r or "valid_tok_bleu" in r]
    if not final:
        return None
    found = {key: value for key, value in final[-1].items() if key not in ("step", "time")}
    found["date"] = _date(final[-1]["time"])
    chosen = [r for r in records if "alpha_dev_tok_bleu" in r]
    if chosen:
        found["alpha_dev_tok_bleu"] = chosen[-1]["alpha_dev_tok_bleu"]
    return {**found, "source": str(metrics)}


def provenance(checkpoint: Path, config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Where the model comes from: the training command and configuration, the commit, the
    machine this runs on (export where the model was trained), the training precision."""
    return {
        "command": training_command(config),
        "training_config": config,
        "checkpoint": str(checkpoint),
        **provenance_commit(),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count()},
        "training_precision": meta.get("precision"),
        "exported": _date(datetime.datetime.now().timestamp()),
    }


def provenance_commit(trained_at: str | None = None) -> dict[str, Any]:
    """The commit of the code that trained the model and whether tracked files differed from
    it: HEAD and the checkout's state, where the export runs at the commit the run trained at;
    else `trained_at` (whose uncommitted changes nothing recorded: None), which must be HEAD or
    an ancestor of it (ValueError), with HEAD as `exported_at`."""
    head = _git("rev-parse", "HEAD")
    changes = _git("status", "--porcelain", "--untracked-files=no")
    here = {"commit": head or "unknown (not a git checkout)",
            "uncommitted_changes": bool(changes) if head else None}
    if trained_at is None:
        return here
    commit = _git("rev-parse", "--verify", "--quiet", f"{trained_at}^{{commit}}")
    if commit is None or _git("merge-base", "--is-ancestor", commit, "HEAD") is None:
        raise ValueError(f"--trained-at {trained_at}: not a commit of this checkout's history "
                         "(HEAD or one before it)")
    return {"commit": commit, "uncommitted_changes": None,
            "exported_at": {"commit": here["commit"],
                            "uncommitted_changes": here["uncommitted_changes"]}}


def training_command(config: dict[str, Any]) -> str:
    """The fastattn.train command line of a run, rebuilt from the flags its config records as
    given (`./run train` runs python -m fastattn.train with its arguments). An ensemble's
    config is its first member's: its save directory is the run's plus /member1, and its
    --metrics and --plot were replaced, so those two are left out; --resume too, which
    continues a run to the model it would have reached uninterrupted."""
    words = ["python", "-m", "fastattn.train"]
    for name in config.get("given", ()):
        value = config[name]
        if name in ("metrics", "plot", "resume"):
            continue
        if name == "save_dir" and config["members"] > 1:
            value = str(Path(value).parent)
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag[2:]}")
        elif name == "alpha":
            words += [flag, ",".join(map(str, value))]
        elif isinstance(value, (list, tuple)):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return " ".join(words)


def _git(*args: str) -> str | None:
    """git's output in the repository holding this package; None outside a git checkout."""
    try:
        result = subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True,
                                text=True)
    except OSError:  # no git on this machine
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else "unknown"


def _date(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(
        timespec="seconds")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m fastattn.inference.pretrained", formatter_class=HelpFormatter,
        description="Write a trained checkpoint into the package as a shipped model, "
        f"{MODELS}/NAME/{{model.pt,model.json}}: float16 weights, no training state, its "
        "provenance and its dev and test BLEU measured on the weights it ships with "
        "(docs/pretrained.md).",
    )
    parser.add_argument("--checkpoint", required=True, help="a final checkpoint of "
                        "fastattn.train, e.g. checkpoints/multi30k-en-de/checkpoint_final.pt")
    parser.add_argument("--name", required=True, help="the model's name, e.g. multi30k-en-de")
    parser.add_argument("--description", help="one sentence for model.json (default: made "
                        "from the checkpoint's languages, size and data)")
    parser.add_argument("--force", action="store_true", help="replace a model of that name")
    parser.add_argument("--trained-at", metavar="COMMIT", help="the commit the run trained at, "
                        "when this checkout is at a later one (checkpoints do not record it); "
                        "model.json then records HEAD as exported_at (default: HEAD)")
    args = parser.parse_args(argv)
    if not NAME.fullmatch(args.name):
        parser.error(f"--name {args.name!r}: use lowercase letters, digits, '.', '_', '-' "
                     "(it names a directory)")
    try:
        directory = export(args.checkpoint, args.name, args.description, args.force,
                           args.trained_at)
    except (CheckpointError, FileExistsError, RuntimeError, OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    info = read_info(directory / "model.json")
    test = info["scores"].get("test", {}).get("tokenized_bleu")
    print(f"{directory}: {info['bytes']:,} bytes, test tokenized BLEU {test}")


if __name__ == "__main__":
    main()
