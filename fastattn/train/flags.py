"""The command line of python -m fastattn.train: its flags with their help, their checks, and
the TrainConfig they make."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch

from fastattn import data
from fastattn.cli import ArgumentParser, HelpFormatter
from fastattn.model import PRESETS
from fastattn.train.config import DROPOUT_FLAGS, SIZE_FLAGS, TrainConfig
from fastattn.train.precision import BF16_MIN_SPEEDUP

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



def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = ArgumentParser(
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
    add(g, "--cuda-graphs", action="store_true",
        help="replay each update from CUDA graphs, one per batch shape (token buckets repeat "
        "theirs every epoch): a few launches per micro-batch instead of about 400, for a GPU "
        "that outruns the host; one process on a GPU, bf16 or fp32, no --rdrop or --bpe-dropout")

    g = parser.add_argument_group("checkpoints")
    add(g, "--save-dir", default="checkpoints/{data}-{src}-{tgt}",
        help="checkpoint directory ({data}, {src}, {tgt} are filled in)")
    add(g, "--save-every", type=int, default=200, help="save every N updates (0: off)")
    add(g, "--save-every-minutes", type=float, default=0.0, help="also save every M minutes")
    add(g, "--keep", type=int, default=20, help="numbered checkpoints to keep")
    add(g, "--resume", action="store_true", help="continue from the newest checkpoint in "
        "--save-dir that verifies exactly where it stopped (after Ctrl-C, SIGTERM or a kill), "
        "with its model, vocabulary, task and precision (flags given for these must match it); "
        "other flags given with new values apply, with a note. Without --resume a --save-dir "
        "holding another run's checkpoints is refused")
    add(g, "--overwrite", action="store_true", help="start afresh in a --save-dir that holds "
        "another run: first delete that run's checkpoints, metrics log and translations")
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
    given = tuple(sorted(name for name, value in vars(again).items() if value is not unset))
    save_dir = args.save_dir.format(data=args.data, src=args.src, tgt=args.tgt)
    existing = next(p for p in (Path(save_dir), *Path(save_dir).parents) if p.exists())
    if not existing.is_dir():
        parser.error(f"--save-dir {save_dir}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        parser.error(f"--save-dir {save_dir}: {existing} is not a writable directory")
    for flag, path in (("--metrics", args.metrics), ("--plot", args.plot)):
        if path and Path(path).is_dir():
            parser.error(f"{flag} {path} is a directory; give a file name")
    return TrainConfig(**{
        **vars(args),
        "train": args.train and tuple(args.train), "valid": args.valid and tuple(args.valid),
        "test": args.test and tuple(args.test),
        "adam_betas": tuple(args.adam_betas), "alpha": tuple(args.alpha),
        # the pieces of --bpe-dropout vary, so by default the softmax covers them all
        "output_vocab": args.output_vocab or ("all" if args.bpe_dropout else "target"),
        "device": ("cuda" if torch.cuda.is_available() else "cpu")
        if args.device == "auto" else args.device,
        "save_dir": save_dir,
        "metrics": args.metrics or str(Path(save_dir) / "metrics.jsonl"),
        "given": given,
    })


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
    """Refuses bad flag values with an `error:` line and status 2, before anything runs."""
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
    if args.output_vocab == "target" and args.bpe_dropout:
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
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --save-dir, --overwrite deletes it: give "
                     "one of them")
    if args.cuda_graphs:
        if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
            parser.error("--cuda-graphs needs a GPU (--device cuda)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            parser.error("--cuda-graphs trains in one process: DDP's updates under torchrun "
                         "are not graphed")
        if args.precision == "fp16":
            parser.error("--cuda-graphs: fp16's loss scaling is not graphed; use --precision "
                         "bf16 or fp32")
        if args.rdrop:
            parser.error("--cuda-graphs: R-Drop's loss is not graphed; drop one of the two")
        if args.bpe_dropout:
            parser.error("--cuda-graphs: --bpe-dropout gives batches new shapes every epoch, "
                         "and each shape its own graph; drop one of the two")
    if args.keep < args.average_last:
        parser.error(f"--keep {args.keep} must be at least --average-last {args.average_last}")


