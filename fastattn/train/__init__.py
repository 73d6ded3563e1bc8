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
- step: the schedule, the loss module and one update (train_step);
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

from fastattn.train.command import main, train_and_score
from fastattn.train.config import CONFIG_VERSION, TrainConfig, model_config, saved_flags
from fastattn.train.corpus import Split, load_text, truecased
from fastattn.train.evaluation import bleu_scores, dev_loss, translate
from fastattn.train.final import choose_alpha, finish, plot_metrics, score_final
from fastattn.train.flags import parse_args
from fastattn.train.members import (
    Stint,
    member_args,
    member_jobs,
    member_stints,
    share_precision,
    train_ensemble,
)
from fastattn.train.precision import BF16_MIN_SPEEDUP, bf16_matmul_speedup, pick_precision
from fastattn.train.run import Run
from fastattn.train.savedir import one_line_errors
from fastattn.train.step import LossModule, StepResult, learning_rate, train_step

__all__ = [
    "BF16_MIN_SPEEDUP", "CONFIG_VERSION", "LossModule", "Run", "Split", "StepResult", "Stint",
    "TrainConfig", "bf16_matmul_speedup", "bleu_scores", "choose_alpha", "dev_loss", "finish",
    "learning_rate", "load_text", "main", "member_args", "member_jobs", "member_stints",
    "model_config", "one_line_errors", "parse_args", "pick_precision", "plot_metrics",
    "saved_flags", "score_final", "share_precision", "train_and_score", "train_ensemble",
    "train_step", "translate", "truecased",
]
