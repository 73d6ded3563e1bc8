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
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastattn import checkpoint, data, evaluate
from fastattn.cli import HelpFormatter
from fastattn.ensemble import Ensemble
from fastattn.model import PRESETS, Transformer, TransformerConfig
from fastattn.translate import Translator

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

# Paper values where the defaults differ, shown by --help.
PAPER = {
    "preset": "base",
    "vocab_size": "37000 (shared BPE, WMT en-de)",
    "max_tokens": "about 25000 source + 25000 target tokens per update",
    "warmup": "4000",
    "lr_scale": "1.0",
    "max_updates": "100000 (base), 300000 (big)",
    "average_last": "5 (base), 20 (big)",
    "precision": "fp32 (P100 GPUs)",
    "members": "1 (single models)",
    "alpha": "0.6",
    "output_vocab": "all (the shared vocabulary)",
}


# --- the optimisation step ---------------------------------------------------------------------


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule (eq. 3): linear warmup, then decay with the inverse square root."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


@dataclass
class StepResult:
    loss: float
    """Label-smoothed loss per target token of the whole update (all ranks)."""
    nll: float
    """Negative log-likelihood per target token (exp of it is the perplexity)."""
    tokens: int
    """Target tokens in the update (all ranks)."""
    grad_norm: float
    ok: bool
    """False if the gradients had NaN/inf and the update was skipped."""


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    autocast_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    clip_norm: float = 0.0,
) -> StepResult:
    """One update from this rank's micro-batches; `model` maps a batch (source, decoder input,
    decoder target) to its summed label-smoothed loss and NLL (LossModule, maybe in DDP). Under DDP
    the gradients are averaged over ranks; the loss is scaled so that the result is the gradient
    of the loss summed over every rank's batches divided by their total target tokens."""
    device = next(model.parameters()).device
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    local_tokens = sum(int((b[2] != data.PAD_ID).sum()) for b in batches)
    counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(counts)
    total_tokens = int(counts.item())
    normaliser = total_tokens / world  # DDP averages over ranks: undo that with the world size

    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, nll
    for i, batch in enumerate(batches):
        batch = tuple(t.to(device, non_blocking=True) for t in batch)
        last = i == len(batches) - 1
        sync = model.no_sync() if distributed and not last else contextlib.nullcontext()
        with sync:
            with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
                loss, nll = model(*batch)
            scaled = loss / normaliser
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        sums += torch.stack([loss.detach(), nll.detach()]).double()

    if distributed:
        dist.all_reduce(sums)
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = float(
        torch.nn.utils.clip_grad_norm_(params, clip_norm if clip_norm > 0 else math.inf)
    )
    loss_sum, nll_sum = sums.tolist()
    ok = math.isfinite(grad_norm) and math.isfinite(loss_sum)
    if scaler is not None:
        scaler.step(optimizer)  # skips the update itself when it found inf/NaN gradients
        scaler.update()  # and lowers the loss scale
    elif ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(total_tokens, 1)
    return StepResult(loss_sum / tokens, nll_sum / tokens, total_tokens, grad_norm, ok)


# --- arguments ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fastattn.train",
        description="Train a Transformer (Vaswani et al., 2017). Defaults: the tuned CPU recipe on "
        "the embedded Multi30k en->de; [paper: ...] gives the paper's value where it differs.",
        formatter_class=HelpFormatter,
    )
    add = _adder(parser)
    g = parser.add_argument_group("data")
    add(g, "--data", default="multi30k", help="an embedded corpus by name (multi30k), or 'files' "
        "to use --train/--valid/--test")
    add(g, "--src", default="en", help="source language")
    add(g, "--tgt", default="de", help="target language")
    add(g, "--train", nargs=2, metavar=("SRC", "TGT"), help="training text pair (plain or .gz)")
    add(g, "--valid", nargs=2, metavar=("SRC", "TGT"), help="development text pair")
    add(g, "--test", nargs=2, metavar=("SRC", "TGT"), help="test text pair (optional)")
    add(g, "--vocab-size", type=int, default=8000, help="joint SentencePiece BPE vocabulary")
    add(g, "--output-vocab", choices=("target", "all"),
        help="the pieces the output softmax ranges over (not in the paper): 'target', those the "
        "target side of the training text is made of (both sides with --bidirectional), "
        "numbered first so that the projection is the tied embedding's first rows: a smaller "
        "softmax, the same segmentation; 'all': the whole joint vocabulary (default: target; "
        "all with --bpe-dropout, whose pieces vary)")
    add(g, "--max-len", type=int, default=256, help="drop training pairs with a longer side")
    add(g, "--max-len-ratio", type=float, default=3.0,
        help="drop training pairs whose longer side is this many times the shorter")
    add(g, "--truecase", action=argparse.BooleanOptionalAction, default=True,
        help="Moses-style truecasing (not in the paper): the first word of every sentence takes "
        "the form it mostly has inside sentences of the training text, so sentence-initial "
        "words share the other occurrences' pieces; translations get their capital first letter "
        "back (--no-truecase: train on the text as it is)")
    add(g, "--bpe-dropout", type=float, default=0.0,
        help="BPE-dropout rate: training sentences get a randomly perturbed segmentation "
        "(Provilkov et al., 2020; not in the paper)")
    add(g, "--bidirectional", type=int, default=0, metavar="UPDATES",
        help="bidirectional training, BiT (Ding et al., 2021; not in the paper): the first "
        "UPDATES updates train on every pair in both directions (target->source too, without "
        "tags), the rest on source->target only; BiT spends a third of the updates so (0: off)")
    add(g, "--word-dropout", type=float, default=0.0,
        help="each piece of a training batch's source and decoder input becomes <unk> with this "
        "probability (Sennrich & Zhang, 2019; not in the paper)")
    add(g, "--max-tokens", type=int, default=16000,
        help="source + target tokens (padding included) per micro-batch per rank")
    add(g, "--seed", type=int, default=1,
        help="seeds initialisation, dropout and the batch order")

    g = parser.add_argument_group("model")
    add(g, "--preset", default="multi30k", choices=sorted(PRESETS), help="model preset")
    add(g, "--encoder-layers", type=int, help="N of the encoder (default: the preset's)")
    add(g, "--decoder-layers", type=int, help="N of the decoder (default: the preset's)")
    add(g, "--d-model", type=int, help="model width (default: the preset's)")
    add(g, "--d-ff", type=int, help="feed-forward width (default: the preset's)")
    add(g, "--heads", type=int, help="attention heads (default: the preset's)")
    add(g, "--dropout", type=float,
        help="P_drop on sub-layers and embeddings (default: the preset's; paper: 0.1 base, "
        "0.3 big)")
    add(g, "--attention-dropout", type=float,
        help="dropout on the attention weights (default: the preset's; not in the paper)")
    add(g, "--activation-dropout", type=float,
        help="dropout after the feed-forward ReLU (default: the preset's; not in the paper)")
    add(g, "--members", type=int, default=3, metavar="N",
        help="train N models that differ only in their seed (SEED, SEED+1, ...), each a full "
        "run of its own in SAVE_DIR/member<k>, and translate with their ensemble, the mean of "
        "their next-token distributions (not in the paper), saved as "
        "SAVE_DIR/checkpoint_final.pt")
    add(g, "--jobs", type=int, default=0, metavar="J",
        help="jobs training the ensemble's members at once on a CPU, each a process of its own "
        "with --threads threads (default: the CPU threads shared among them, at least one "
        "each); the members' updates are shared out evenly, so a member may pause in one job "
        "and finish in another; 0: one job per CPU thread, up to one per member; 1: one member "
        "after another (always so on GPUs and under torchrun)")

    g = parser.add_argument_group("optimisation")
    add(g, "--lr-scale", type=float, default=2.5, help="multiplies the paper's schedule")
    add(g, "--warmup", type=int, default=2000, help="warmup updates of the schedule")
    add(g, "--adam-betas", type=float, nargs=2, default=(0.9, 0.98), help="Adam's β1 β2")
    add(g, "--adam-eps", type=float, default=1e-9, help="Adam's ε")
    add(g, "--label-smoothing", type=float,
        help="ε_ls of the loss (default: the preset's; paper: 0.1)")
    add(g, "--rdrop", type=float, default=0.0, metavar="ALPHA",
        help="R-Drop (Liang et al., 2021; not in the paper): each micro-batch runs twice under "
        "different dropout masks and the loss adds ALPHA/4 times the symmetric KL divergence "
        "of the two passes' predictions (0: off); doubles the compute per update")
    add(g, "--update-freq", type=int, default=1,
        help="micro-batches accumulated per update (the paper's ~50k tokens per update on one "
        "GPU: --max-tokens 6250 --update-freq 8)")
    add(g, "--clip-norm", type=float, default=0.0, help="clip the gradient norm (0: off)")
    add(g, "--max-updates", type=int, default=8000,
        help="stop after this many updates (each member, with --members)")
    add(g, "--max-epochs", type=int, default=0, help="stop after this many epochs (0: no limit)")
    add(g, "--max-bad-steps", type=int, default=10,
        help="stop after this many consecutive updates with NaN/inf gradients")
    add(g, "--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
        help="auto: on GPUs bf16 autocast where supported, else fp16 with dynamic loss scaling; "
        "on CPUs bf16 autocast where a quick measurement finds bf16 matmuls at least "
        f"{BF16_MIN_SPEEDUP}x faster than fp32 (AMX), else fp32; measured once for all "
        "--members")
    add(g, "--threads", type=int, default=0,
        help="CPU threads per process (0: torch's choice, shared among the processes of --jobs)")
    add(g, "--device", default="auto", choices=["auto", "cpu", "cuda"],
        help="cuda: the GPU of LOCAL_RANK under torchrun, else the first")

    g = parser.add_argument_group("checkpoints")
    add(g, "--save-dir", default="checkpoints/{data}-{src}-{tgt}",
        help="checkpoint directory ({data}, {src}, {tgt} are filled in)")
    add(g, "--save-every", type=int, default=200, help="save every N updates (0: off)")
    add(g, "--save-every-minutes", type=float, default=0.0, help="also save every M minutes")
    add(g, "--keep", type=int, default=20, help="numbered checkpoints to keep")
    add(g, "--resume", action="store_true", help="continue from the newest checkpoint in "
        "--save-dir exactly where it stopped, with its model, vocabulary and task (flags given "
        "for these must match it); other flags given with new values apply, with a note")
    add(g, "--average-last", type=int, default=20,
        help="average the last k checkpoints for the final model (1: no averaging)")

    g = parser.add_argument_group("evaluation")
    add(g, "--eval-every", type=int, default=1000,
        help="dev loss and greedy dev BLEU every N updates (0: never)")
    add(g, "--beam", type=int, default=4, help="test beam size")
    add(g, "--alpha", type=_alphas, default="1.5", metavar="A[,A...]",
        help="length penalty ((5+|Y|)/6)^alpha (1.5: the CPU recipe's, see the README); "
        "given several (e.g. 0.6,1.0,1.5,2.0), the final model decodes the dev set with each and "
        "keeps the best; stored in the checkpoint for translate")
    add(g, "--max-len-b", type=int, default=50, help="hypotheses get source length + this")
    add(g, "--eval-batch-tokens", type=int, default=4096,
        help="source tokens per decoding batch")

    g = parser.add_argument_group("logging")
    add(g, "--log-every", type=int, default=50, help="metrics log interval in updates")
    add(g, "--metrics", help="JSON-lines metrics file (default: SAVE_DIR/metrics.jsonl); with "
        "--members > 1 it gets the ensemble's scores, each member logs to its own directory")
    add(g, "--plot", metavar="PNG", help="write the training curves here (needs matplotlib)")
    add(g, "--no-progress", action="store_true", help="no progress bar")

    args = parser.parse_args(argv)
    _check_args(parser, args)
    # The flags on the command line, told apart from defaults (--resume compares them): parsed
    # again over placeholders, which defaults do not replace.
    unset = object()
    again = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset)))
    args.given = sorted(name for name, value in vars(again).items() if value is not unset)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.save_dir = args.save_dir.format(data=args.data, src=args.src, tgt=args.tgt)
    save_dir = Path(args.save_dir)
    existing = next(p for p in (save_dir, *save_dir.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        parser.error(f"--save-dir {args.save_dir}: {existing} is not a writable directory")
    args.metrics = args.metrics or str(Path(args.save_dir) / "metrics.jsonl")
    return args


def _adder(parser: argparse.ArgumentParser):
    """add_argument that appends [paper: ...] to the help of options whose default differs."""

    def add(group, flag: str, **kwargs):
        paper = PAPER.get(flag.lstrip("-").replace("-", "_"))
        if paper is not None:
            kwargs["help"] = f"{kwargs.get('help', '')} [paper: {paper}]".strip()
        return group.add_argument(flag, **kwargs)

    return add


def _alphas(text: str) -> list[float]:
    try:
        alphas = [float(a) for a in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}") from None
    if any(not a >= 0 for a in alphas):
        raise argparse.ArgumentTypeError(f"length penalty exponents must be >= 0: {text!r}")
    return alphas


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.data == "files":
        if not args.train or not args.valid:
            parser.error("--data files needs --train SRC TGT and --valid SRC TGT")
    elif args.data != "multi30k":
        parser.error(f"--data must be 'multi30k' or 'files', not {args.data!r}")
    elif args.src not in data.MULTI30K_LANGS or args.tgt not in data.MULTI30K_LANGS:
        parser.error(f"multi30k languages are {', '.join(data.MULTI30K_LANGS)}")
    if args.src == args.tgt:
        parser.error("--src and --tgt must differ")
    positive = ["members", "vocab_size", "max_len", "max_tokens", "warmup", "update_freq",
                "max_updates", "beam", "eval_batch_tokens", "log_every", "average_last",
                "max_bad_steps", "keep"]
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ["save_every", "eval_every", "max_epochs", "threads", "jobs", "clip_norm", "rdrop",
                 "save_every_minutes", "max_len_b", "bidirectional"]:
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    for name in (*DROPOUT_FLAGS, "label_smoothing", "bpe_dropout", "word_dropout"):
        if getattr(args, name) is not None and not 0 <= getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1)")
    for name in SIZE_FLAGS:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.output_vocab is None:
        args.output_vocab = "all" if args.bpe_dropout else "target"
    elif args.output_vocab == "target" and args.bpe_dropout:
        parser.error("--output-vocab target needs the text's own segmentation; --bpe-dropout "
                     "samples other pieces too")
    if args.lr_scale <= 0:
        parser.error("--lr-scale must be positive")
    if not all(0 <= beta < 1 for beta in args.adam_betas):
        parser.error("--adam-betas must be in [0, 1)")
    if not args.adam_eps >= 0:
        parser.error("--adam-eps must not be negative")
    if not args.max_len_ratio >= 1:
        parser.error("--max-len-ratio must be at least 1 (longer side / shorter side)")
    preset = PRESETS[args.preset]
    d_model, heads = args.d_model or preset.d_model, args.heads or preset.heads
    if (preset.d_k is None or preset.d_v is None) and d_model % heads:  # heads are d_model / h
        parser.error(f"--d-model {d_model} must be divisible by --heads {heads}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # not after hours of training
        parser.error("--plot needs matplotlib (pip install matplotlib)")
    if args.keep < args.average_last:
        parser.error(f"--keep {args.keep} must be at least --average-last {args.average_last}")


# --- setup -------------------------------------------------------------------------------------


def _resumed_flags(args: argparse.Namespace, state: dict[str, Any], path: Path) -> list[str]:
    """Notes on the trajectory flags given with other values than the checkpoint's run had;
    a checkpoint flag given so is a CheckpointError."""
    saved = state["meta"]["args"]
    notes = []
    for name in args.given:
        if name not in CHECKPOINT_FLAGS + TRAJECTORY_FLAGS:
            continue
        then = state["config"][name] if name in MODEL_FLAGS else saved.get(name)
        now = getattr(args, name)
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


def model_config(args: argparse.Namespace, vocab_size: int,
                 output_vocab_size: int | None = None) -> TransformerConfig:
    """The preset with the model flags that were given applied to it."""
    overrides = {name: getattr(args, name) for name in MODEL_FLAGS
                 if getattr(args, name) is not None}
    return replace(PRESETS[args.preset], vocab_size=vocab_size,
                   output_vocab_size=output_vocab_size, pad_id=data.PAD_ID, **overrides)


@dataclass
class Split:
    """A split of the corpus as ids, with its text for BLEU."""

    text: data.ParallelText
    src_ids: list[list[int]]
    tgt_ids: list[list[int]]
    tokenized_refs: list[str] | None = None
    """Official tokenized references (Multi30k tok/), when the corpus has them."""


def load_text(args: argparse.Namespace) -> dict[str, tuple[data.ParallelText, list[str] | None]]:
    """The training, dev and (if any) test text, with tokenized references where they exist."""
    if args.data == "multi30k":
        splits = {"train": "train", "valid": "val", "test": "test2016"}
        return {
            name: (
                data.load_multi30k(split, args.src, args.tgt),
                None if name == "train" else
                data.read_lines(data.multi30k_path(split, args.tgt, tokenized=True)),
            )
            for name, split in splits.items()
        }
    text = {"train": (data.read_parallel(*args.train), None),
            "valid": (data.read_parallel(*args.valid), None)}
    if args.test:
        text["test"] = (data.read_parallel(*args.test), None)
    return text


def truecased(text: data.ParallelText,
              truecasers: tuple[data.Truecaser, data.Truecaser] | None) -> data.ParallelText:
    """The text as the model sees it: truecased by the (source, target) truecasers, if any."""
    if truecasers is None:
        return text
    src, tgt = truecasers
    return replace(text, src=[src(s) for s in text.src], tgt=[tgt(t) for t in text.tgt])


BF16_MIN_SPEEDUP = 1.25  # a bf16 step also pays for casts, so its matmuls must win clearly


def bf16_matmul_speedup() -> float:
    """fp32 time / bf16 time of a matmul shaped like a training step's (2048 tokens, 256 to
    1024 features) on this CPU, best of five each: AMX makes bf16 several times faster, AVX-512
    BF16 alone can make it slower (0.5–0.9× on an Intel Xeon without AMX)."""
    a, b = torch.randn(2048, 256), torch.randn(256, 1024)

    def best_time(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)  # the first call picks and prepares the kernel
        times = []
        for _ in range(5):
            started = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - started)
        return min(times)

    return best_time(a, b) / best_time(a.bfloat16(), b.bfloat16())


def pick_precision(name: str, device: torch.device) -> tuple[torch.dtype | None, bool, str]:
    """(autocast dtype or None, whether to scale the loss, what was chosen and why) for
    --precision on a device. `auto` on a CPU measures instead of trusting the instruction set."""
    why = "as asked"
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
            why = "auto on this GPU"
        elif not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            # Without bf16 instructions (AVX-512 BF16, AMX) bf16 matmuls take a slow generic
            # path: measured 30× slower than fp32 on an AVX2-only CPU.
            name, why = "fp32", "auto: this CPU has no bf16 instructions"
        else:
            speedup = bf16_matmul_speedup()
            name = "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"
            why = (f"auto: bf16 matmuls measured {speedup:.2f}× the speed of fp32 here "
                   f"(bf16 from {BF16_MIN_SPEEDUP}×)")
    if name == "fp16" and device.type != "cuda":
        raise SystemExit("error: --precision fp16 needs a GPU; use bf16 or fp32 on CPU")
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    return dtypes[name], name == "fp16", why


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class LossModule(torch.nn.Module):
    """model.loss (or model.rdrop_loss with weight rdrop > 0) as a forward(), so that
    DistributedDataParallel can wrap it: the summed training loss and the summed NLL of a
    batch."""

    def __init__(self, model: Transformer, rdrop: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.rdrop = rdrop

    def forward(self, source: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor):
        if self.rdrop:
            return self.model.rdrop_loss(source, inputs, targets, self.rdrop, reduction="sum",
                                         return_nll=True)
        return self.model.loss(source, inputs, targets, reduction="sum", return_nll=True)


# --- decoding and BLEU -------------------------------------------------------------------------


def translate(model: Transformer | Ensemble, sp, sentences: Sequence[str], *, beam: int,
              alpha: float, max_len_b: int, batch_tokens: int,
              truecaser: data.Truecaser | None = None) -> list[str]:
    """Detokenized translations (fastattn.Translator; beam 1 is greedy search)."""
    was_training = model.training
    translator = Translator(model, sp, beam_size=beam, alpha=alpha, max_len_b=max_len_b,
                            batch_tokens=batch_tokens, truecaser=truecaser)
    hypotheses = translator.translate(sentences)
    model.train(was_training)
    return hypotheses


def bleu_scores(hypotheses: list[str], split: Split, tgt_lang: str) -> dict[str, Any]:
    """Detokenized sacreBLEU with signature, and tokenized BLEU: against the official tokenized
    references where the corpus has them (Multi30k), else Moses-tokenized references with the
    paper's compound splitting."""
    bleu, signature = evaluate.sacre_bleu(hypotheses, split.text.tgt)
    if split.tokenized_refs is not None:
        tokenized = evaluate.multi30k_bleu(hypotheses, split.tokenized_refs, tgt_lang)
    else:
        tokenized = evaluate.wmt_bleu(hypotheses, split.text.tgt, tgt_lang)
    return {"bleu": bleu, "signature": signature, "tok_bleu": tokenized}


@torch.no_grad()
def dev_loss(model: Transformer, split: Split, max_tokens: int,
             autocast_dtype: torch.dtype | None) -> tuple[float, float]:
    """Label-smoothed loss and NLL per target token on a split."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    lengths = [len(s) + 1 for s in split.src_ids], [len(t) + 1 for t in split.tgt_ids]
    total = nll = tokens = 0.0
    for indices in data.TokenBatches(*lengths, max_tokens).epoch(0):
        batch = [t.to(device) for t in data.collate(split.src_ids, split.tgt_ids, indices)]
        # The model can only predict <unk> for a piece outside its output vocabulary.
        batch[2].masked_fill_(batch[2] >= model.cfg.output_size, data.UNK_ID)
        with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
            loss, batch_nll = model.loss(*batch, reduction="sum", return_nll=True)
        total, nll = total + float(loss), nll + float(batch_nll)
        tokens += int((batch[2] != data.PAD_ID).sum())
    model.train(was_training)
    return total / tokens, nll / tokens


# --- the run -----------------------------------------------------------------------------------


def new_window() -> dict[str, float]:
    """Sums over the updates since the last log record."""
    return {"loss": 0.0, "nll": 0.0, "tokens": 0, "batch_tokens": 0, "time": time.time()}


class Run:
    """A training run: its data, model, optimiser, position, logging and checkpoints. `name`
    prefixes its log lines and `bar_row` places its progress bar, for runs side by side."""

    def __init__(self, args: argparse.Namespace, name: str = "", bar_row: int = 0) -> None:
        self.args = args
        self.name, self.bar_row = name, bar_row
        self.bar = None
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but torch sees no GPU")
        if self.distributed and not dist.is_initialized():  # ensemble members share the group
            if args.device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.main = self.rank == 0
        self.device = torch.device(args.device, torch.cuda.current_device()) \
            if args.device == "cuda" else torch.device("cpu")
        if args.threads:
            torch.set_num_threads(args.threads)
        # oneDNN, which runs bf16 matmuls on CPUs, keeps 1,024 compiled kernels by default; token
        # buckets give every batch its own shapes, and Multi30k's 64 batches need more, so steps
        # recompiled kernels all run long (measured: a fifth slower, and a growing heap). Read
        # when oneDNN first runs, below; a user's own setting wins.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")
        self.autocast, use_scaler, why = pick_precision(args.precision, self.device)
        why = getattr(args, "precision_why", why)  # set by share_precision
        if self.distributed and self.device.type == "cpu":  # each rank measured: rank 0 decides
            use_bf16 = torch.tensor([self.autocast is not None])
            dist.broadcast(use_bf16, 0)
            self.autocast = torch.bfloat16 if use_bf16.item() else None
        self.scaler = torch.amp.GradScaler(self.device.type) if use_scaler else None
        precision = {None: "fp32", torch.bfloat16: "bf16 autocast",
                     torch.float16: "fp16 autocast with dynamic loss scaling"}[self.autocast]
        self.log(f"device {self.device}, {torch.get_num_threads()} threads per process, "
                 f"{precision} ({why})")

        resume = checkpoint.list_checkpoints(args.save_dir)[-1:] if args.resume else []
        if args.resume and not resume:
            self.log(f"--resume: no checkpoint in {args.save_dir} yet, starting afresh")
        state = checkpoint.load_checkpoint(resume[0]) if resume else None

        if state is not None:
            for note in _resumed_flags(args, state, resume[0]):
                self.log(note)
        text = load_text(args)
        # A resumed run keeps the text processing its vocabulary was built for.
        if state is not None:
            args.truecase = state["meta"]["args"].get("truecase", False)
        truecasers = None
        if args.truecase:
            raw = text["train"][0]
            truecasers = data.Truecaser.train(raw.src), data.Truecaser.train(raw.tgt)
        self.source_truecaser = truecasers[0] if truecasers else None  # for translating
        model_text = {name: truecased(t, truecasers) for name, (t, _) in text.items()}
        output_vocab_size = None
        if state is not None:
            self.spm_proto = state["spm"]
        else:
            started = time.time()
            train = model_text["train"]
            self.spm_proto = data.train_sentencepiece(train.src + train.tgt, args.vocab_size)
            self.log(f"SentencePiece BPE, {args.vocab_size} joint pieces, trained on "
                     f"{2 * len(train)} {'truecased ' * args.truecase}sentences in "
                     f"{time.time() - started:.1f}s")
            if args.output_vocab == "target":
                sp = data.load_sentencepiece(self.spm_proto)
                targets = train.tgt + train.src * bool(args.bidirectional)
                pieces = {i for ids in data.encode(sp, targets) for i in ids}
                self.spm_proto, output_vocab_size = data.pieces_first(self.spm_proto, pieces)
                self.log(f"output vocabulary: the {output_vocab_size} pieces (special ones "
                         f"included) of the training text's {args.tgt} side"
                         f"{' and of its source side' * bool(args.bidirectional)}, numbered "
                         "first")
        self.sp = data.load_sentencepiece(self.spm_proto)
        # Splits keep the raw text (BLEU is against it) beside the ids of the model's text.
        self.splits = {
            name: Split(t, data.encode(self.sp, model_text[name].src),
                        data.encode(self.sp, model_text[name].tgt), refs)
            for name, (t, refs) in text.items()
        }

        train = self.splits["train"]
        keep, counts = data.filter_by_length(train.src_ids, train.tgt_ids, args.max_len,
                                             args.max_len_ratio)
        self.log(f"training pairs: {counts['kept']} kept, {counts['too_long']} dropped as "
                 f"longer than {args.max_len} tokens, {counts['bad_ratio']} dropped for a length "
                 f"ratio over {args.max_len_ratio}")
        if not keep:
            raise data.DataError(f"no training pair is left after length filtering; raise "
                                 f"--max-len ({args.max_len}) or --max-len-ratio "
                                 f"({args.max_len_ratio})")
        # Training pair j is (sentences[j], sentences[partner(j)]): j < n the pairs as given,
        # n <= j < 2n the same pairs reversed (used by --bidirectional).
        self.pairs = n = len(keep)
        self.sentences = [train.src_ids[i] for i in keep] + [train.tgt_ids[i] for i in keep]
        lengths = [len(s) for s in self.sentences]
        self.bpe_dropout = None
        if args.bpe_dropout > 0:
            started = time.time()
            self.bpe_dropout = data.BPEDropout(self.sp, self.sentences, args.bpe_dropout,
                                               seed=args.seed)
            # Batches are planned on the expected sampled lengths, so they hold about
            # --max-tokens tokens whatever segmentation each sentence then gets.
            expected = [math.ceil(m) for m in self.bpe_dropout.expected_lengths]
            growth = sum(expected) / sum(lengths)
            lengths = expected
            self.log(f"BPE-dropout {args.bpe_dropout}: {self.bpe_dropout.samples} segmentations "
                     f"of each of {len(self.bpe_dropout.segmentations)} words drawn in "
                     f"{time.time() - started:.1f}s, {growth:.2f}x the tokens on average")

        longest = max(lengths[j] + lengths[self.partner(j)] for j in range(n)) + 2  # with </s>
        if args.max_tokens < longest:
            raise data.DataError(f"--max-tokens {args.max_tokens} is less than the longest "
                                 f"training pair, {longest} tokens (source + target, end marks "
                                 f"included); raise --max-tokens or lower --max-len "
                                 f"({args.max_len})")

        def batches(pairs: int) -> data.TokenBatches:  # of the first `pairs` pairs
            return data.TokenBatches(
                [lengths[j] + 1 for j in range(pairs)],
                [lengths[self.partner(j)] + 1 for j in range(pairs)],
                args.max_tokens, seed=args.seed, rank=self.rank, world_size=self.world,
            )

        self.forward_batches = batches(n)
        self.log(f"{len(self.forward_batches)} batches per epoch per rank, padding "
                 f"{100 * self.forward_batches.padding_fraction():.1f}% of the batch tokens")
        self.both_batches = None
        if args.bidirectional:
            self.both_batches = batches(2 * n)
            self.log(f"bidirectional training (BiT) for the first {args.bidirectional} updates: "
                     f"{2 * n} pairs in both directions, {len(self.both_batches)} batches per "
                     "epoch per rank")

        torch.manual_seed(args.seed)
        if state is not None:  # a resumed run keeps its model, whatever the flags say now
            config = TransformerConfig(**state["config"])
        else:
            config = model_config(args, self.sp.get_piece_size(), output_vocab_size)
        self.config = config
        self.model = Transformer(config).to(self.device)
        self.log(f"model: {self.model.num_parameters():,} parameters, {config}")
        if config.output_size < config.vocab_size:
            dev = self.splits["valid"].tgt_ids
            outside = sum(i >= config.output_size for ids in dev for i in ids)
            self.log(f"dev: {outside} of {sum(map(len, dev))} target pieces are outside the "
                     "output vocabulary (the dev loss counts them as <unk>)")
        # fused: one kernel over all parameters, not a loop of small ops per tensor
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0,
                                          betas=tuple(args.adam_betas), eps=args.adam_eps,
                                          fused=True)
        self.step, self.epoch, self.epoch_step, self.bad_steps = 0, 0, 0, 0
        if state is not None:
            self.restore(state)
            self.forget_metrics_after(self.step)
            self.log(f"resumed from {resume[0]} at update {self.step} "
                     f"(epoch {self.epoch}, batch {self.epoch_step})")
        else:
            torch.manual_seed(args.seed + self.rank)  # dropout differs between ranks
        loss_module = LossModule(self.model, args.rdrop)
        if self.distributed:
            devices = [self.device.index] if self.device.type == "cuda" else None
            self.trainer = DistributedDataParallel(loss_module, device_ids=devices)
        else:
            self.trainer = loss_module
        self.last_save = time.time()

    def log(self, message: str) -> None:
        if self.name:
            message = f"{self.name}: {message}"
        if self.main:
            if self.bar is not None:
                self.bar.write(message)  # above the progress bar, not through it
            else:
                print(message, flush=True)

    # -- state ----------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The checkpoint of this moment; a collective under DDP (every rank's RNG state)."""
        rngs = [rng_state()]
        if self.distributed:
            rngs = [None] * self.world
            dist.all_gather_object(rngs, rng_state())
        return {
            "model": self.model.state_dict(),
            "config": asdict(self.config),
            "spm": self.spm_proto,
            "meta": {"step": self.step, "src": self.args.src, "tgt": self.args.tgt,
                     "data": self.args.data, "args": dict(vars(self.args)),
                     "truecase": self.source_truecaser and self.source_truecaser.forms},
            "train": {
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "step": self.step, "epoch": self.epoch, "epoch_step": self.epoch_step,
                "bad_steps": self.bad_steps, "world_size": self.world, "rng": rngs,
            },
        }

    def restore(self, state: dict[str, Any]) -> None:
        train = state["train"]
        if train["world_size"] != self.world:
            raise SystemExit(f"error: the checkpoint was written at world size "
                             f"{train['world_size']}, this run has {self.world}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(train["optimizer"])
        if self.scaler is not None and train["scaler"] is not None:
            self.scaler.load_state_dict(train["scaler"])
        self.step, self.epoch = train["step"], train["epoch"]
        self.epoch_step, self.bad_steps = train["epoch_step"], train["bad_steps"]
        set_rng_state(train["rng"][self.rank])

    def save(self) -> None:
        state = self.state()
        if self.main:
            path = checkpoint.save_numbered(self.args.save_dir, state, self.step, self.args.keep)
            self.log(f"saved {path}")
        self.last_save = time.time()

    def save_due(self) -> bool:
        args = self.args
        due = args.save_every > 0 and self.step % args.save_every == 0
        if args.save_every_minutes > 0:
            due |= time.time() - self.last_save >= 60 * args.save_every_minutes
        if self.distributed:  # rank 0's clock decides for everyone
            flag = torch.tensor([int(due)], device=self.device)
            dist.broadcast(flag, 0)
            due = bool(flag.item())
        return due

    # -- training -------------------------------------------------------------------------------

    def updates(self) -> Iterator[list[tuple[torch.Tensor, ...]]]:
        """The micro-batches of each update from the current data position; advances it.

        Both directions while the run is in --bidirectional's first updates, else source->target.
        """
        args = self.args
        batches = self.forward_batches if self.step >= args.bidirectional else self.both_batches
        epoch_batches = len(batches)
        stream = batches.iterate(self.epoch, self.epoch_step)
        while True:
            group = [next(stream) for _ in range(args.update_freq)]
            self.epoch, self.epoch_step = group[-1][0], group[-1][1] + 1
            if self.epoch_step == epoch_batches:  # the update ended an epoch
                self.epoch, self.epoch_step = self.epoch + 1, 0
            yield [self.collate(epoch, i, b) for epoch, i, b in group]

    def collate(self, epoch: int, step: int, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The batch at this data position, freshly sampled with BPE-dropout and word dropout."""
        partners = [self.partner(j) for j in indices]
        # Seeded by the position, so a resumed run samples what the uninterrupted one did.
        rng = np.random.default_rng([self.args.seed, epoch, step, self.rank])
        if self.bpe_dropout is None:
            src = [self.sentences[j] for j in indices]
            tgt = [self.sentences[j] for j in partners]
        else:
            src = self.bpe_dropout.sample(indices, rng)
            tgt = self.bpe_dropout.sample(partners, rng)
        source, inputs, targets = data.collate(src, tgt, range(len(indices)))
        if self.args.word_dropout > 0:  # the targets stay: the model still predicts every word
            source = data.drop_words(source, self.args.word_dropout, rng)
            inputs = data.drop_words(inputs, self.args.word_dropout, rng)
        return source, inputs, targets

    def partner(self, j: int) -> int:
        """The sentence that sentence j translates to."""
        return (j + self.pairs) % (2 * self.pairs)

    def finished(self) -> bool:
        args = self.args
        return self.step >= args.max_updates or (
            args.max_epochs > 0 and self.epoch >= args.max_epochs
        )

    def train(self, until: int | None = None) -> None:
        """Trains to the end, or pauses after update `until` with a checkpoint there (an ensemble
        member whose updates two jobs share)."""
        args = self.args
        if self.main and not args.no_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=args.max_updates, initial=self.step, unit="upd",
                            dynamic_ncols=True, desc=self.name or None, position=self.bar_row)
        self.model.train()
        window = new_window()
        updates = self.updates()
        while not self.finished() and (until is None or self.step < until):
            batches = next(updates)
            lr = learning_rate(self.step + 1, self.config.d_model, args.warmup, args.lr_scale)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            result = train_step(self.trainer, self.optimizer, batches,
                                autocast_dtype=self.autocast,
                                scaler=self.scaler, clip_norm=args.clip_norm)
            if not result.ok:
                self.bad_steps += 1
                self.log(f"update {self.step + 1}: NaN/inf gradients, update skipped "
                         f"({self.bad_steps} in a row)")
                if self.bad_steps >= args.max_bad_steps:
                    raise SystemExit(f"error: {self.bad_steps} updates in a row had NaN/inf "
                                     "gradients; stopping (lower --lr-scale, enable "
                                     "--clip-norm or use --precision fp32)")
                continue
            self.bad_steps = 0
            self.step += 1
            if self.step == args.bidirectional:  # BiT's tuning phase: source->target only
                self.epoch, self.epoch_step = self.epoch + (self.epoch_step > 0), 0
                updates = self.updates()
                self.log(f"update {self.step}: bidirectional phase over, source->target from "
                         f"here (epoch {self.epoch})")
            window["loss"] += result.loss * result.tokens
            window["nll"] += result.nll * result.tokens
            window["tokens"] += result.tokens
            window["batch_tokens"] += sum(int(b[0].numel() + b[1].numel()) for b in batches)
            if self.step % args.log_every == 0 or self.finished():
                elapsed = time.time() - window["time"]
                loss, nll = window["loss"] / window["tokens"], window["nll"] / window["tokens"]
                record = {"step": self.step, "epoch": self.epoch, "loss": loss, "nll": nll,
                          "ppl": math.exp(min(nll, 50)), "lr": lr,
                          "tok_per_s": window["batch_tokens"] * self.world / elapsed,
                          "grad_norm": result.grad_norm, "time": time.time()}
                self.write_metrics(record)
                if self.bar is not None:
                    self.bar.set_postfix(loss=f"{loss:.3f}", ppl=f"{record['ppl']:.1f}",
                                         lr=f"{lr:.2e}", tok_s=f"{record['tok_per_s']:.0f}",
                                         epoch=self.epoch)
                window = new_window()
            if self.bar is not None:
                self.bar.update(1)
            if args.eval_every and self.step % args.eval_every == 0:
                self.validate()
            if self.save_due():
                self.save()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if args.save_every == 0 or self.step % args.save_every:
            self.save()  # the final state, if the last update did not just save it

    def forget_metrics_after(self, step: int) -> None:
        """Drops the log records a killed run wrote after its last checkpoint: the resumed run
        writes them again."""
        path = Path(self.args.metrics)
        if not self.main or not path.exists():
            return
        lines = path.read_text().splitlines(keepends=True)
        # A kill may have cut the last line short: it has no newline and is dropped too.
        path.write_text("".join(line for line in lines
                                if line.endswith("\n") and json.loads(line)["step"] <= step))

    def write_metrics(self, record: dict[str, Any], path: Path | None = None) -> None:
        """Appends a record to the metrics log (rank 0), or to `path`."""
        if not self.main:
            return
        path = path or Path(self.args.metrics)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def validate(self) -> None:
        """Dev loss and greedy dev BLEU (rank 0; the others wait)."""
        if self.main:
            dev = self.splits["valid"]
            started = time.time()
            loss, nll = dev_loss(self.model, dev, self.args.max_tokens, self.autocast)
            # Greedy search: alpha changes no output.
            hyps = translate(self.model, self.sp, dev.text.src, beam=1, alpha=0.0,
                             max_len_b=self.args.max_len_b,
                             batch_tokens=self.args.eval_batch_tokens,
                             truecaser=self.source_truecaser)
            scores = bleu_scores(hyps, dev, self.args.tgt)
            self.write_metrics({"step": self.step, "epoch": self.epoch, "dev_loss": loss,
                                "dev_ppl": math.exp(min(nll, 50)),
                                "dev_bleu": scores["bleu"], "dev_tok_bleu": scores["tok_bleu"],
                                "time": time.time()})
            self.log(f"update {self.step}: dev loss {loss:.3f}, ppl {math.exp(min(nll, 50)):.2f}, "
                     f"greedy dev BLEU "
                     f"{scores['bleu']:.2f} (tokenized {scores['tok_bleu']:.2f}) "
                     f"[{time.time() - started:.0f}s]")
        if self.distributed:
            dist.barrier()

    def finish(self) -> None:
        """Averages the last checkpoints into the final model and scores it (rank 0)."""
        if not self.main:
            return
        args = self.args
        paths = checkpoint.list_checkpoints(args.save_dir)[-args.average_last:]
        self.score_final(checkpoint.average_checkpoints(paths), Path(args.save_dir),
                         Path(args.metrics), f"averaged the last {len(paths)} checkpoints")
        if args.plot:
            plot_metrics([args.metrics], args.plot)
            self.log(f"training curves: {args.plot}")

    def score_final(self, state: dict[str, Any], save_dir: Path, metrics: Path,
                    made: str) -> None:
        """Saves a final model as save_dir/checkpoint_final.pt, chooses its length penalty on dev
        (stored in the checkpoint for translate) and reports its test BLEU under beam search."""
        args = self.args
        final = save_dir / "checkpoint_final.pt"
        checkpoint.save_checkpoint(final, state)
        self.log(f"{made} into {final}")
        model, sp, _ = checkpoint.load_model(final, self.device)
        alpha = self.choose_alpha(model, sp, metrics)
        state["meta"]["alpha"] = alpha
        checkpoint.save_checkpoint(final, state)
        name = "test" if "test" in self.splits else "valid"
        split = self.splits[name]
        started = time.time()
        hyps = translate(model, sp, split.text.src, beam=args.beam, alpha=alpha,
                         max_len_b=args.max_len_b, batch_tokens=args.eval_batch_tokens,
                         truecaser=self.source_truecaser)
        scores = bleu_scores(hyps, split, args.tgt)
        ratio, _ = evaluate.length_ratio(hyps, split.text.tgt)  # final report only, not dev evals
        output = save_dir / f"{name}.hyp.{args.tgt}"
        output.write_text("\n".join(hyps) + "\n", encoding="utf-8")
        self.write_metrics({"step": self.step, f"{name}_bleu": scores["bleu"],
                            f"{name}_tok_bleu": scores["tok_bleu"], "alpha": alpha,
                            f"{name}_length_ratio": ratio,
                            "signature": scores["signature"], "time": time.time()}, metrics)
        tokenized = "lowercased, official tokenized references" if split.tokenized_refs \
            is not None else "cased, Moses tokenization with compound splitting"
        self.log(f"{name} ({len(hyps)} sentences, beam {args.beam}, alpha {alpha}, "
                 f"{time.time() - started:.0f}s, {ratio:.3f} of the references' "
                 f"length), translations in {output}")
        self.log(f"{name} BLEU {scores['bleu']:.2f}  {scores['signature']}")
        self.log(f"{name} tokenized BLEU {scores['tok_bleu']:.2f}  ({tokenized})")
        self.log(f"checkpoint: {final}")

    def choose_alpha(self, model: Transformer | Ensemble, sp, metrics: Path) -> float:
        """The --alpha with the best tokenized dev BLEU under beam search (the paper chose its
        length penalty on dev): some models write too short translations at the paper's 0.6."""
        alphas = self.args.alpha
        if len(alphas) == 1:
            return alphas[0]
        dev, found = self.splits["valid"], {}
        for alpha in alphas:
            hyps = translate(model, sp, dev.text.src, beam=self.args.beam, alpha=alpha,
                             max_len_b=self.args.max_len_b,
                             batch_tokens=self.args.eval_batch_tokens,
                             truecaser=self.source_truecaser)
            found[alpha] = bleu_scores(hyps, dev, self.args.tgt)["tok_bleu"]
        best = max(alphas, key=found.__getitem__)  # ties: the first given
        self.write_metrics({"step": self.step, "alpha_dev_tok_bleu": found, "alpha": best,
                            "time": time.time()}, metrics)
        self.log("beam dev tokenized BLEU by alpha: "
                 + ", ".join(f"{a} {b:.2f}" for a, b in found.items()) + f"; alpha {best}")
        return best


def plot_metrics(metrics: Sequence[str | Path], png: str | Path) -> None:
    """Training loss, learning rate and dev BLEU against updates, from the metrics logs of a run
    or of the members of an ensemble."""
    import matplotlib  # parse_args made sure it is there

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, log in enumerate(metrics):
        records = [json.loads(line) for line in Path(log).read_text().splitlines()]
        train = [r for r in records if "loss" in r]
        dev = [r for r in records if "dev_bleu" in r]
        who = f"member {k + 1} " if len(metrics) > 1 else ""
        steps = [r["step"] for r in dev]
        axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{who}train")
        axes[0].plot(steps, [r["dev_loss"] for r in dev], "o-", label=f"{who}dev")
        axes[1].plot([r["step"] for r in train], [r["lr"] for r in train])
        axes[2].plot(steps, [r["dev_bleu"] for r in dev], "o-", label=f"{who}sacreBLEU")
        axes[2].plot(steps, [r["dev_tok_bleu"] for r in dev], "o-", label=f"{who}tokenized")
    axes[0].set(xlabel="update", ylabel="label-smoothed loss per token")
    axes[1].set(xlabel="update", ylabel="learning rate")
    axes[2].set(xlabel="update", ylabel="greedy dev BLEU")
    axes[0].legend()
    axes[2].legend()
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def member_args(args: argparse.Namespace, k: int) -> argparse.Namespace:
    """The arguments of ensemble member k (0-based): its own seed, directory and metrics log."""
    member = argparse.Namespace(**vars(args))
    member.seed = args.seed + k
    member.save_dir = str(Path(args.save_dir) / f"member{k + 1}")
    member.metrics = str(Path(member.save_dir) / "metrics.jsonl")
    member.plot = None
    return member


def member_jobs(args: argparse.Namespace) -> int:
    """How many jobs train the ensemble's members, each a process of its own: by default one per
    CPU thread (up to one per member), but only on a CPU outside torchrun. There one-thread
    processes outrun one process with the threads (small ops leave cores idle that another
    process fills), and more processes than threads lose to time-slicing (on 2 cores: three
    processes 0.94x the tokens/s of two); member_stints shares the members out evenly."""
    alone_on_cpu = args.device == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) == 1
    if args.jobs == 0:
        return min(args.members, torch.get_num_threads()) if alone_on_cpu else 1
    if args.jobs > 1 and not alone_on_cpu:
        raise SystemExit("error: --jobs > 1 trains members side by side on a CPU, in one "
                         "process each; not on a GPU or under torchrun")
    return min(args.jobs, args.members)


@dataclass(frozen=True)
class Stint:
    """Ensemble member `member` (0-based) trained by one job from update `start` (its checkpoint
    there, unless 0) to update `stop`, where it pauses, or to its end (None)."""

    member: int
    start: int = 0
    stop: int | None = None


def member_stints(members: int, updates: int, jobs: int, grid: int) -> list[list[Stint]]:
    """Each job's stints, in order, so that the jobs end together and no core idles at the end.

    The members' updates are laid end to end and cut into `jobs` equal shares (McNaughton's
    wrap-around rule), each cut rounded to `grid` updates (the checkpoint interval). A member cut
    in two trains its first updates at the head of the later job's share and the rest, resumed
    from its checkpoint (resuming is exact), at the tail of the earlier job's; a share is at
    least one member long, so the head ends before the tail starts."""
    plan: list[list[Stint]] = [[] for _ in range(jobs)]
    job = 0
    for k in range(members):
        room = Fraction((job + 1) * members * updates, jobs) - k * updates  # left in job's share
        if room >= updates:
            plan[job].append(Stint(k))
            job += room == updates
            continue
        tail = min(updates, round(room / grid) * grid)
        head = updates - tail
        if tail:
            plan[job].append(Stint(k, start=head) if head else Stint(k))
        job += 1
        if head:
            plan[job].append(Stint(k, stop=head) if tail else Stint(k))
    return plan


def share_precision(args: argparse.Namespace, members: Sequence[argparse.Namespace]) -> None:
    """--precision auto on a CPU outside torchrun: measured once, here, for every member, so that
    members training side by side cannot pick different precisions (under torchrun rank 0 picks
    for each member)."""
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.precision != "auto" or args.device != "cpu" or torchrun:
        return
    autocast, _, why = pick_precision("auto", torch.device("cpu"))
    name = "fp32" if autocast is None else "bf16"
    print(f"every member trains in {name} ({why})", flush=True)
    for member in members:
        member.precision, member.precision_why = name, "measured once for every member"


class Stopped(Exception):
    """Another job stopped before the paused member this job was to carry on."""


@dataclass
class Shared:
    """What the jobs of an ensemble share: per member, an event set when its head stint has
    paused and a flag set when it has finished; and an event set when any job fails."""

    paused: list[Any]
    finished: Any
    failed: Any

    def wait_for_head(self, k: int, others_failed: Callable[[], bool]) -> None:
        while not self.paused[k].wait(1.0):
            if self.failed.is_set() or others_failed():
                raise Stopped


def train_stints(members: Sequence[argparse.Namespace], stints: Sequence[Stint], job: int,
                 jobs: int, shared: Shared | None,
                 others_failed: Callable[[], bool] = lambda: False) -> Run:
    """Trains one job's stints of the ensemble's members in turn; returns the last one's Run."""
    run = None
    for stint in stints:
        k, member = stint.member, members[stint.member]
        if stint.start:  # the member's head stint ran in another job
            shared.wait_for_head(k, others_failed)
            member = argparse.Namespace(**{**vars(member), "resume": True})
        if int(os.environ.get("RANK", "0")) == 0:
            carry_on = f", from update {stint.start}" if stint.start else ""
            print(f"ensemble member {k + 1} of {len(members)}: seed {member.seed}, "
                  f"{member.save_dir}{carry_on}", flush=True)
        if run is not None:
            del run
            gc.collect()
        run = Run(member, name=f"member {k + 1}" if jobs > 1 else "", bar_row=job)
        run.train(until=stint.stop)
        if stint.stop is not None:
            run.log(f"paused at update {run.step}: another job trains the rest")
            shared.paused[k].set()
        else:
            run.finish()
            if shared is not None:
                shared.finished[k] = 1
    return run


def _member_job(members: Sequence[argparse.Namespace], stints: Sequence[Stint], job: int,
                jobs: int, shared: Shared, parent: int, bar_lock) -> None:
    """A child process's stints. It ends when the run's process does, however that ends
    (Linux: SIGTERM on the parent's death, even by SIGKILL); checkpoints are atomic."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)
    if bar_lock is not None:
        from tqdm import tqdm

        tqdm.set_lock(bar_lock)
    try:
        with one_line_errors():
            train_stints(members, stints, job, jobs, shared)
    except Stopped:
        sys.exit(1)
    except KeyboardInterrupt:
        shared.failed.set()
        sys.exit(130)
    except BaseException:
        shared.failed.set()
        raise


def train_ensemble(args: argparse.Namespace) -> Run:
    """--members N > 1: N runs shared out among --jobs processes (this one and children) by
    member_stints, then their final models as one ensemble checkpoint, scored like a final
    model."""
    members = [member_args(args, k) for k in range(args.members)]
    jobs = member_jobs(args)
    plan = member_stints(args.members, args.max_updates, jobs, args.save_every or 1)
    threads = torch.get_num_threads()
    share_precision(args, members)
    children, shared = [], None
    if jobs > 1:
        import multiprocessing

        for member in members:
            member.threads = args.threads or max(1, threads // jobs)
        spawn = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools
        shared = Shared([spawn.Event() for _ in members], spawn.Array("b", len(members)),
                        spawn.Event())
        bar_lock = None
        if not args.no_progress:  # bars of several processes, each on its own row
            from tqdm import tqdm

            bar_lock = spawn.RLock()
            tqdm.set_lock(bar_lock)
        children = [spawn.Process(target=_member_job, name=f"fastattn member job {j + 1}",
                                  args=(members, plan[j], j, jobs, shared, os.getpid(),
                                        bar_lock))
                    for j in range(1, jobs)]
        for child in children:
            child.start()

    def child_failed() -> bool:
        return any(child.exitcode not in (None, 0) for child in children)

    try:
        try:
            run = train_stints(members, plan[0], 0, jobs, shared, child_failed)
        except Stopped:
            run = None
        while any(child.is_alive() for child in children):
            for child in children:
                child.join(1.0)
            if child_failed():  # a child waiting to carry on a failed one's member stops too
                shared.failed.set()
    finally:  # this process failed: stop the others (their checkpoints stay)
        for child in children:
            if child.is_alive():
                child.terminate()
                child.join()
    failed = [] if shared is None else [k + 1 for k, done in enumerate(shared.finished) if not done]
    if failed:
        raise SystemExit(f"error: ensemble member{'s' * (len(failed) > 1)} "
                         f"{', '.join(map(str, failed))} stopped before finishing (the error is "
                         "above); --resume continues from the last checkpoints")
    if run.main:
        torch.set_num_threads(args.threads or threads)  # the ensemble's search: every thread
        run.name = ""  # the ensemble's lines are the run's own
        finals = [Path(m.save_dir) / "checkpoint_final.pt" for m in members]
        run.score_final(checkpoint.ensemble_checkpoints(finals), Path(args.save_dir),
                        Path(args.metrics), f"an ensemble of the {len(finals)} members' models")
        if args.plot:
            plot_metrics([m.metrics for m in members], args.plot)
            run.log(f"training curves: {args.plot}")
    return run


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Bad data and bad checkpoints end the process with one `error: ...` line and status 2."""
    try:
        yield
    except (data.DataError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        with one_line_errors():
            train_and_score(args)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def train_and_score(args: argparse.Namespace) -> None:
    if args.members > 1:
        run = train_ensemble(args)
    else:
        run = Run(args)
        run.train()
        run.finish()
    # Free DDP's reducer while the process group is still registered: were it the last owner,
    # its gloo destructor would join worker threads that wait for the GIL it holds.
    del run
    gc.collect()


if __name__ == "__main__":
    main()
