"""TrainConfig, the typed and frozen settings of a training run (the parsed flags of
python -m fastattn.train, see flags.py for their help), how a checkpoint stores it, and the rules
for which of them a resumed run may change."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fastattn import checkpoint, data
from fastattn.model import PRESETS, TransformerConfig

SIZE_FLAGS = ("encoder_layers", "decoder_layers", "d_model", "d_ff", "heads")
DROPOUT_FLAGS = ("dropout", "attention_dropout", "activation_dropout")
# the preset gives each of these unless the flag is given (table3-D3/D4 vary label smoothing)
MODEL_FLAGS = SIZE_FLAGS + DROPOUT_FLAGS + ("label_smoothing",)
# A resumed run keeps its checkpoint's model, vocabulary and task: these flags, given anew with
# other values, are an error. The trajectory flags it takes as given, with a note in the log.
CHECKPOINT_FLAGS = ("data", "src", "tgt", "vocab_size", "output_vocab", "truecase", "preset",
                    *MODEL_FLAGS)
TRAJECTORY_FLAGS = ("train", "seed", "max_tokens", "update_freq", "lr_scale", "warmup",
                    "adam_betas", "adam_eps", "rdrop", "clip_norm", "word_dropout", "bpe_dropout",
                    "bidirectional", "max_len", "max_len_ratio")

# Version 1 was the argparse namespace itself, stored as meta["args"] (before issue 48): the
# same names, lists where version 2 has tuples.
CONFIG_VERSION = 2


@dataclass(frozen=True)
class TrainConfig:
    """One field per flag, named as argparse names it, with what parse_args derives filled in
    (device, save_dir, metrics, output_vocab). A value that changes later (a member's seed, a
    resumed run's truecasing) makes a new config with dataclasses.replace."""

    # data
    data: str
    src: str
    tgt: str
    train: tuple[str, str] | None
    valid: tuple[str, str] | None
    test: tuple[str, str] | None
    vocab_size: int
    output_vocab: str
    max_len: int
    max_len_ratio: float
    truecase: bool
    bpe_dropout: float
    bidirectional: int
    word_dropout: float
    max_tokens: int
    seed: int
    # model: None where the preset's value applies
    preset: str
    encoder_layers: int | None
    decoder_layers: int | None
    d_model: int | None
    d_ff: int | None
    heads: int | None
    dropout: float | None
    attention_dropout: float | None
    activation_dropout: float | None
    members: int
    jobs: int
    # optimisation
    lr_scale: float
    warmup: int
    adam_betas: tuple[float, float]
    adam_eps: float
    label_smoothing: float | None
    rdrop: float
    update_freq: int
    clip_norm: float
    max_updates: int
    max_epochs: int
    max_bad_steps: int
    precision: str
    threads: int
    device: str
    # checkpoints
    save_dir: str
    save_every: int
    save_every_minutes: float
    keep: int
    resume: bool
    average_last: int
    # evaluation
    eval_every: int
    beam: int
    alpha: tuple[float, ...]
    max_len_b: int
    eval_batch_tokens: int
    # logging
    log_every: int
    metrics: str
    plot: str | None
    no_progress: bool
    overwrite: bool = False  # flags with defaults: configs saved before them lack them
    cuda_graphs: bool = False
    # not flags
    given: tuple[str, ...] = ()
    """The flags given on the command line, told apart from defaults (--resume compares them)."""
    precision_why: str | None = None
    """Why `precision`, where it was measured once for every member (members.share_precision)."""


def config_meta(config: TrainConfig) -> dict[str, Any]:
    """The config as a checkpoint stores it, in meta["config"]."""
    return {"version": CONFIG_VERSION, **asdict(config)}


def saved_flags(meta: dict[str, Any]) -> dict[str, Any]:
    """The flag values of a checkpoint's run, by name: from its versioned config, or from the
    argparse namespace a checkpoint written before it stored (version 1, meta["args"])."""
    if "config" in meta:
        return {name: value for name, value in meta["config"].items() if name != "version"}
    return meta["args"]


def resume_notes(config: TrainConfig, state: dict[str, Any], path: Path) -> list[str]:
    """Notes on the trajectory flags given with other values than the checkpoint's run had;
    a checkpoint flag given so is a CheckpointError."""
    saved = saved_flags(state["meta"])
    notes = []
    for name in config.given:
        if name not in CHECKPOINT_FLAGS + TRAJECTORY_FLAGS:
            continue
        then = state["config"][name] if name in MODEL_FLAGS else saved.get(name)
        now = getattr(config, name)
        if isinstance(now, (list, tuple)):
            then, now = list(then or ()), list(now)
        if then == now:
            continue
        if name in CHECKPOINT_FLAGS:
            raise checkpoint.CheckpointError(
                f"{path} was trained with {_flag(name, then)}, this command gives "
                f"{_flag(name, now)}: a resumed run keeps its model, vocabulary and task (drop "
                f"{_flag(name, now).split()[0]}, or use another --save-dir)")
        notes.append(f"--resume: {_flag(name, now)} instead of the checkpoint's "
                     f"{_flag(name, then)}; the run goes on with it, so it is no longer the "
                     "uninterrupted run's")
    return notes


def _flag(name: str, value: Any) -> str:
    """The command-line text giving flag `name` this value."""
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def model_config(config: TrainConfig, vocab_size: int,
                 output_vocab_size: int | None = None) -> TransformerConfig:
    """The preset with the model flags that were given applied to it."""
    overrides = {name: getattr(config, name) for name in MODEL_FLAGS
                 if getattr(config, name) is not None}
    return replace(PRESETS[config.preset], vocab_size=vocab_size,
                   output_vocab_size=output_vocab_size, pad_id=data.PAD_ID, **overrides)
