"""A training run (Run): its data, model, optimiser, position, logging and checkpoints."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastattn import checkpoint
from fastattn._extras import MissingExtraError
from fastattn.cli import write_line
from fastattn.model import Transformer, TransformerConfig
from fastattn.train import savedir, signals
from fastattn.train.config import (
    TrainConfig,
    config_meta,
    model_config,
    resume_notes,
    saved_flags,
)
from fastattn.train.corpus import prepare_corpus
from fastattn.train.evaluation import bleu_scores, dev_loss, translate
from fastattn.train.graphs import GraphedUpdate
from fastattn.train.pairs import TrainingPairs
from fastattn.train.precision import choose_precision
from fastattn.train.savedir import WriteError
from fastattn.train.step import LossModule, PendingStep, launch_step, learning_rate

try:
    from tqdm import tqdm
except ImportError as e:
    raise MissingExtraError(__name__, e) from None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class InFlight(NamedTuple):
    """An update launched and not yet read."""

    pending: PendingStep
    batches: list[tuple[torch.Tensor, ...]]
    lr: float
    epoch: int
    """The data position's epoch once its batches were drawn."""


def new_window(carried: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sums over the updates since the last metrics record: none, or those a checkpoint carried
    (Run.state: "seconds", the time they took, sets the clock back). "partial": a checkpoint
    that did not keep them preceded these updates."""
    window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "batch_tokens": 0, "updates": 0,
              "seconds": 0.0, **(carried or {})}
    window["time"] = time.time() - window.pop("seconds")
    return window


class Run:
    """A training run: its data, model, optimiser, position, logging and checkpoints. `name`
    prefixes its log lines and `bar_row` places its progress bar, for runs side by side."""

    def __init__(self, args: TrainConfig, name: str = "", bar_row: int = 0) -> None:
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
        resume, state = None, None
        if args.resume:
            resume, state = savedir.resume_point(args.save_dir, self.log, move_corrupt=self.main)
            if resume is None:
                self.log(f"--resume: no checkpoint in {args.save_dir} yet, starting afresh")
        self.autocast, self.scaler, self.precision = choose_precision(
            args, state, resume, self.device, self.distributed, self.log)

        if state is not None:
            for note in resume_notes(args, state, resume):
                self.log(note)
            # A resumed run keeps the text processing its vocabulary was built for.
            truecase = saved_flags(state["meta"]).get("truecase", False)
            args = self.args = replace(args, truecase=truecase)
        corpus = prepare_corpus(args, state["spm"] if state is not None else None, self.log)
        self.spm_proto, self.sp, self.splits = corpus.spm_proto, corpus.sp, corpus.splits
        self.source_truecaser = corpus.source_truecaser  # for translating
        self.training_pairs = TrainingPairs(args, self.splits["train"], self.sp, self.rank,
                                            self.world, self.log)

        torch.manual_seed(args.seed)
        if state is not None:  # a resumed run keeps its model, whatever the flags say now
            config = TransformerConfig(**state["config"])
        else:
            config = model_config(args, self.sp.get_piece_size(), corpus.output_vocab_size)
        self.config = config
        self.model = Transformer(config).to(self.device)
        self.log(f"model: {self.model.num_parameters():,} parameters, {config}")
        if config.output_size < config.vocab_size:
            dev = self.splits["valid"].tgt_ids
            outside = sum(i >= config.output_size for ids in dev for i in ids)
            self.log(f"dev: {outside} of {sum(map(len, dev))} target pieces are outside the "
                     "output vocabulary (the dev loss counts them as <unk>)")
            if state is not None:  # the text may be new: other pieces than the vocabulary's
                self.map_outside_targets(config.output_size)
        # fused: one kernel over all parameters, not a loop of small ops per tensor
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0,
                                          betas=args.adam_betas, eps=args.adam_eps,
                                          fused=True)
        self.step, self.epoch, self.epoch_step, self.bad_steps = 0, 0, 0, 0
        self.saved_step, self.last_checkpoint = 0, None
        self.window = new_window()
        if state is not None:
            self.restore(state)
            # An interrupted checkpoint is not among those the final model averages: if the
            # run ends here, the end is saved as a numbered checkpoint too.
            self.saved_step = self.step if checkpoint.NAME.fullmatch(resume.name) else -1
            self.last_checkpoint = resume
            signals.note_checkpoint(resume)
            self.log(f"resumed from {resume} at update {self.step} "
                     f"(epoch {self.epoch}, batch {self.epoch_step})")
        else:
            torch.manual_seed(args.seed + self.rank)  # dropout differs between ranks
        if args.resume and self.main:  # what a killed run logged after its checkpoint goes
            self.guarded(savedir.trim_metrics, args.metrics, self.step, self.log)
        loss_module = LossModule(self.model, args.rdrop)
        if self.distributed:
            devices = [self.device.index] if self.device.type == "cuda" else None
            self.trainer = DistributedDataParallel(loss_module, device_ids=devices)
        else:
            self.trainer = loss_module
        self.graphed = None
        if args.cuda_graphs:
            if self.scaler is not None:
                raise SystemExit("error: --cuda-graphs: fp16's loss scaling is not graphed; use "
                                 "--precision bf16 or fp32")
            self.graphed = GraphedUpdate(loss_module, self.optimizer,
                                         autocast_dtype=self.autocast, clip_norm=args.clip_norm)
        self.last_save = time.time()

    def map_outside_targets(self, output_size: int) -> None:
        """Resumed on other training text: its target pieces outside the output vocabulary
        (the target side of the text the run began with) become <unk>, as in the dev loss."""
        train = self.splits["train"]
        targets = train.tgt_ids + train.src_ids * bool(self.args.bidirectional)
        outside = sum(i >= output_size for ids in targets for i in ids)
        if outside:
            self.training_pairs.output_size = output_size
            self.log(f"training: {outside} of {sum(map(len, targets))} target pieces are "
                     "outside the output vocabulary (new training text?): they train as <unk>")

    def log(self, message: str) -> None:
        if self.name:
            message = f"{self.name}: {message}"
        if self.main:
            if self.bar is not None:
                self.bar.write(message)  # above the progress bar, not through it
            else:
                write_line(message)

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
                     "data": self.args.data, "config": config_meta(self.args),
                     "precision": self.precision,
                     "truecase": self.source_truecaser and self.source_truecaser.forms},
            "train": {
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "step": self.step, "epoch": self.epoch, "epoch_step": self.epoch_step,
                "bad_steps": self.bad_steps, "world_size": self.world, "rng": rngs,
                # the sums since the last metrics record: a resumed run's next one covers all
                "window": {**{k: v for k, v in self.window.items() if k != "time"},
                           "seconds": time.time() - self.window["time"]},
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
        window = train.get("window")
        every = saved_flags(state["meta"]).get("log_every", self.args.log_every)
        if window is None and self.step % every:  # written before checkpoints kept the window
            window = {"partial": True}
        self.window = new_window(window)

    def save(self, interrupted: bool = False) -> Path | None:
        """A numbered checkpoint of this moment (rank 0 writes it; a collective under DDP), or
        an interrupted one (checkpoint.save_numbered)."""
        state = self.state()
        path = None
        if self.main:
            path = self.guarded(checkpoint.save_numbered, self.args.save_dir, state, self.step,
                                self.args.keep, interrupted)
            self.log(f"saved {path}")
            self.last_checkpoint = path
            signals.note_checkpoint(path)
        self.saved_step = self.step
        self.last_save = time.time()
        return path

    def guarded(self, write: Callable[..., Any], *args: Any) -> Any:
        """write(*args), an OSError of which (a full disk, a read-only file system, a directory
        where a file belongs) ends the run with one line naming the file, the cause and the
        run's last good checkpoint (WriteError)."""
        try:
            return write(*args)
        except OSError as e:
            if self.last_checkpoint is not None:
                kept = (f"its last good checkpoint is {self.last_checkpoint} (--resume "
                        "continues from it)")
            else:
                kept = "no checkpoint was saved yet"
            raise WriteError(f"cannot write {e.filename or 'a file'}: {checkpoint.describe(e)};"
                             f" the run stopped at update {self.step}, {kept}") from None

    def save_due(self, step: int | None = None) -> bool:
        """Whether a checkpoint is due after update `step` (the last one read by default)."""
        args = self.args
        step = self.step if step is None else step
        due = args.save_every > 0 and step % args.save_every == 0
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
        pairs = self.training_pairs
        batches = pairs.forward_batches if self.step >= args.bidirectional else pairs.both_batches
        epoch_batches = len(batches)
        stream = batches.iterate(self.epoch, self.epoch_step)
        while True:
            group = [next(stream) for _ in range(args.update_freq)]
            self.epoch, self.epoch_step = group[-1][0], group[-1][1] + 1
            if self.epoch_step == epoch_batches:  # the update ended an epoch
                self.epoch, self.epoch_step = self.epoch + 1, 0
            yield [pairs.collate(epoch, i, b) for epoch, i, b in group]

    def finished(self, until: int | None = None, *, step: int | None = None,
                 epoch: int | None = None) -> bool:
        """Whether the run is over (or pauses at update `until`) after update `step`, at the
        data position `epoch` (the last batches'); by default after the last update read."""
        args = self.args
        step = self.step if step is None else step
        epoch = self.epoch if epoch is None else epoch
        return (step >= args.max_updates or (args.max_epochs > 0 and epoch >= args.max_epochs)
                or (until is not None and step >= until))

    def stop_requested(self) -> int | None:
        """The signal that asked the run to stop (signals.deferred), if any; under DDP any
        rank's, so that every rank stops after the same update (a collective)."""
        signum = signals.requested()
        if self.distributed:
            flag = torch.tensor([signum or 0], device=self.device)
            dist.all_reduce(flag, dist.ReduceOp.MAX)
            signum = int(flag.item()) or None
        return signum

    @property
    def progress(self) -> bool | None:
        """The progress-bar setting for this run's decodes: none with --no-progress, else
        evaluation.translate's own rule (a terminal, no other bar open)."""
        return False if self.args.no_progress else None

    def train(self, until: int | None = None) -> None:
        """Trains to the end, or pauses after update `until` with a checkpoint there (an ensemble
        member whose updates two jobs share). SIGINT or SIGTERM: saves after the update in
        flight and raises signals.Interrupted.

        On one device the next update is launched before the last one is read (launch_step),
        so a GPU never idles while the host reads: unless that update may end the run, switch
        phase, evaluate or save, whose work needs it settled first. The learning rate of an
        update launched ahead assumes the one before it was applied: after a skipped update
        (NaN/inf) the next runs at the schedule's rate one step later."""
        args = self.args
        if self.main and not args.no_progress:
            self.bar = tqdm(total=args.max_updates, initial=self.step, unit="upd",
                            dynamic_ncols=True, desc=self.name or None, position=self.bar_row)
        self.model.train()
        self.batches = self.updates()
        in_flight = None  # the update launched last, not yet read
        with signals.deferred():
            while True:
                if in_flight is not None and self.may_run_ahead(until):
                    following = self.launch(ahead=1)
                    self.record(in_flight)
                    in_flight = following
                    continue
                if in_flight is not None:
                    applied = self.record(in_flight)
                    in_flight = None
                    if applied and args.eval_every and self.step % args.eval_every == 0:
                        self.validate()
                    if applied and self.save_due():
                        self.save()
                if self.finished(until) or self.stop_requested():
                    break
                in_flight = self.launch(ahead=0)
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            stopped = self.stop_requested()
            at_end = self.finished(until)
            saved = None
            if self.step != self.saved_step:  # the last update did not just save
                saved = self.save(interrupted=bool(stopped) and not at_end)
        if stopped:
            raise signals.Interrupted(stopped, saved or self.last_checkpoint, self.step)

    def launch(self, ahead: int) -> InFlight:
        """Launches the next update, `ahead` updates past the last one read."""
        batches = next(self.batches)
        lr = learning_rate(self.step + 1 + ahead, self.config.d_model, self.args.warmup,
                           self.args.lr_scale)
        if self.graphed is not None:
            return InFlight(self.graphed.launch(batches, lr), batches, lr, self.epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        pending = launch_step(self.trainer, self.optimizer, batches, autocast_dtype=self.autocast,
                              scaler=self.scaler, clip_norm=self.args.clip_norm)
        return InFlight(pending, batches, lr, self.epoch)

    def may_run_ahead(self, until: int | None) -> bool:
        """Whether the next update may be launched before the one in flight is read: on one
        device, with no stop asked for, and if that update, once applied, neither ends the run
        nor switches phase, evaluates or saves (each needs the model as that update left it)."""
        args, step = self.args, self.step + 1
        if self.distributed or signals.requested():
            return False
        return not (self.finished(until, step=step) or step == args.bidirectional
                    or (args.eval_every and step % args.eval_every == 0)
                    or self.save_due(step))

    def record(self, update: InFlight) -> bool:
        """Reads an update: counts it, logs it and ends the run after too many NaN/inf updates
        in a row. Returns whether it was applied."""
        args = self.args
        result = update.pending.result()
        if not result.ok:
            self.bad_steps += 1
            self.log(f"update {self.step + 1}: NaN/inf gradients, update skipped "
                     f"({self.bad_steps} in a row)")
            if self.bad_steps >= args.max_bad_steps:
                raise SystemExit(f"error: {self.bad_steps} updates in a row had NaN/inf "
                                 "gradients; stopping (lower --lr-scale, enable "
                                 "--clip-norm or use --precision fp32)")
            return False
        self.bad_steps = 0
        self.step += 1
        if self.step == args.bidirectional:  # BiT's tuning phase: source->target only
            self.epoch, self.epoch_step = self.epoch + (self.epoch_step > 0), 0
            self.batches = self.updates()
            self.log(f"update {self.step}: bidirectional phase over, source->target "
                     f"from here (epoch {self.epoch})")
        window = self.window
        window["loss"] += result.loss * result.tokens
        window["nll"] += result.nll * result.tokens
        window["tokens"] += result.tokens
        window["batch_tokens"] += sum(int(b[0].numel() + b[1].numel()) for b in update.batches)
        window["updates"] += 1
        if self.step % args.log_every == 0 or self.finished(epoch=update.epoch):
            elapsed = time.time() - window["time"]
            loss, nll = window["loss"] / window["tokens"], window["nll"] / window["tokens"]
            record = {"step": self.step, "epoch": update.epoch, "loss": loss, "nll": nll,
                      "ppl": math.exp(min(nll, 50)), "lr": update.lr,
                      "tok_per_s": window["batch_tokens"] * self.world / elapsed,
                      "grad_norm": result.grad_norm, "time": time.time()}
            if window.get("partial"):  # the averages of its last updates only
                record["partial_updates"] = window["updates"]
            self.write_metrics(record)
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{loss:.3f}", ppl=f"{record['ppl']:.1f}",
                                     lr=f"{update.lr:.2e}", tok_s=f"{record['tok_per_s']:.0f}",
                                     epoch=update.epoch)
            self.window = new_window()
        if self.bar is not None:
            self.bar.update(1)
        return True

    def write_metrics(self, record: dict[str, Any], path: Path | None = None) -> None:
        """Appends a record to the metrics log (rank 0), or to `path`."""
        if not self.main:
            return
        self.guarded(savedir.append_line, path or Path(self.args.metrics),
                     json.dumps(record) + "\n")

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
                             truecaser=self.source_truecaser, progress=self.progress)
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
