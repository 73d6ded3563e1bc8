"""python -m fastattn.train: the paper's training recipe (Vaswani et al., 2017, section 5), end to
end, on one CPU or on many GPUs with torchrun.

With no arguments it trains the default CPU preset on the embedded Multi30k en->de three times,
with seeds 1, 2 and 3 (`--members 3`; on a CPU the three train side by side, one process each),
and ends by printing the test BLEU of the three models' ensemble and its checkpoint path. Scale
out with `torchrun --nproc_per_node N -m fastattn.train ...` (DistributedDataParallel: NCCL on
GPUs, gloo on CPUs; each rank reads its own shard of the batches, rank 0 logs and saves).

One update: `--update-freq` micro-batches per rank, each about `--max-tokens` source + target
tokens; the label-smoothed loss is summed over target tokens and divided by the number of target
tokens of the whole update over all ranks, so an update is the same whatever the world size and
accumulation that make it up. Then the NaN/inf guard, optional clipping, Adam, and the schedule
lr = lr_scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5).

The modules, each depending only on those before it:
- config: TrainConfig, the run's typed, frozen settings, as checkpoints store them, and what a
  resumed run may change;
- precision: --precision, measured on a CPU, kept by a resumed run;
- flags: the command line (argparse), its checks, and the TrainConfig it makes;
- step: the schedule, the loss module and one update (launch_step, read later; train_step);
- corpus: the text and its vocabulary; pairs: the training pairs and their batches;
- evaluation: decoding, BLEU and the dev loss;
- signals: SIGINT and SIGTERM stop a run after the update in flight, with a checkpoint;
- savedir: the save directory, locked and never shared by two runs; the checkpoint to resume
  from; the metrics log; one-line errors;
- run: Run, one training run with its checkpoints;
- final: the final model's length penalty, test BLEU and training curves;
- members: --members, an ensemble trained by one or more processes;
- command: main().
"""

import importlib
from typing import Any

# Each name is imported from its module on first use (PEP 562), so that fastattn.train.step, which
# needs only torch, serves fastattn.tools.gpu_check on a machine without the [mt] extra; the others
# need it and raise MissingExtraError when used there.
_MODULES = {
    "command": ("main", "train_and_score"),
    "config": ("CONFIG_VERSION", "TrainConfig", "model_config", "saved_flags"),
    "corpus": ("Split", "load_text", "truecased"),
    "evaluation": ("bleu_scores", "dev_loss", "translate"),
    "final": ("choose_alpha", "finish", "plot_metrics", "score_final"),
    "flags": ("parse_args",),
    "members": ("Stint", "member_args", "member_jobs", "member_stints", "share_precision",
                "train_ensemble"),
    "precision": ("BF16_MIN_SPEEDUP", "bf16_matmul_speedup", "pick_precision"),
    "run": ("Run",),
    "savedir": ("one_line_errors",),
    "step": ("LossModule", "PendingStep", "StepResult", "launch_step", "learning_rate",
             "train_step"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_HOME, key=str.lower)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    try:  # a submodule (fastattn.train.signals, ...)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
