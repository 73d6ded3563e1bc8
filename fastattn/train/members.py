"""--members N > 1: an ensemble of N runs differing only in their seed, shared out among
--jobs processes on a CPU, then scored as one ensemble checkpoint."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from fastattn import checkpoint
from fastattn._extras import MissingExtraError
from fastattn.cli import write_line
from fastattn.train import savedir, signals
from fastattn.train.config import TrainConfig
from fastattn.train.final import finish, plot_metrics, score_final
from fastattn.train.precision import pick_precision
from fastattn.train.run import Run
from fastattn.train.savedir import one_line_errors

try:
    from tqdm import tqdm
except ImportError as e:
    raise MissingExtraError(__name__, e) from None


def member_args(args: TrainConfig, k: int) -> TrainConfig:
    """The arguments of ensemble member k (0-based): its own seed, directory and metrics log."""
    save_dir = Path(args.save_dir) / f"member{k + 1}"
    return replace(args, seed=args.seed + k, save_dir=str(save_dir),
                   metrics=str(save_dir / "metrics.jsonl"), plot=None)


def member_jobs(args: TrainConfig) -> int:
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


def share_precision(args: TrainConfig, members: Sequence[TrainConfig]) -> list[TrainConfig]:
    """The members, with --precision auto on a CPU outside torchrun measured once, here, for all
    of them, so that members training side by side cannot pick different precisions (under
    torchrun rank 0 picks for each member)."""
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.precision != "auto" or args.device != "cpu" or torchrun:
        return list(members)
    kept = args.resume and next(filter(None, map(saved_precision, members)), None)
    if kept:  # resumed: the precision the members began in, not measured again
        name, why = kept, "the checkpoints' precision, kept on resume"
    else:
        autocast, _, why = pick_precision("auto", torch.device("cpu"))
        name = "fp32" if autocast is None else "bf16"
    write_line(f"every member trains in {name} ({why})")
    return [replace(member, precision=name, precision_why=why if kept else
                    "measured once for every member") for member in members]


def saved_precision(member: TrainConfig) -> str | None:
    """The precision a member's run trained in, from the checkpoint it would resume from."""
    with contextlib.suppress(checkpoint.CheckpointError):
        _, state = savedir.resume_point(member.save_dir, lambda message: None,
                                        move_corrupt=False)
        if state is not None:
            return state["meta"].get("precision")
    return None


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


def train_stints(members: Sequence[TrainConfig], stints: Sequence[Stint], job: int,
                 jobs: int, shared: Shared | None,
                 others_failed: Callable[[], bool] = lambda: False) -> Run:
    """Trains one job's stints of the ensemble's members in turn; returns the last one's Run."""
    run = None
    for stint in stints:
        k, member = stint.member, members[stint.member]
        if stint.start:  # the member's head stint ran in another job
            shared.wait_for_head(k, others_failed)
            member = replace(member, resume=True)
        if int(os.environ.get("RANK", "0")) == 0:
            carry_on = f", from update {stint.start}" if stint.start else ""
            write_line(f"ensemble member {k + 1} of {len(members)}: seed {member.seed}, "
                       f"{member.save_dir}{carry_on}")
        if run is not None:
            del run
            gc.collect()
        run = Run(member, name=f"member {k + 1}" if jobs > 1 else "", bar_row=job)
        run.train(until=stint.stop)
        if stint.stop is not None:
            run.log(f"paused at update {run.step}: another job trains the rest")
            shared.paused[k].set()
        else:
            finish(run)
            if shared is not None:
                shared.finished[k] = 1
    return run


def _member_job(members: Sequence[TrainConfig], stints: Sequence[Stint], job: int,
                jobs: int, shared: Shared, parent: int, bar_lock) -> None:
    """A child process's stints. It ends when the run's process does, however that ends
    (Linux: SIGTERM on the parent's death, even by SIGKILL); checkpoints are atomic."""
    # Signals come from the parent, which passes its own on: out of the terminal's process
    # group, a Ctrl-C reaches this process once, not twice (a second would stop it at once).
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)
    if bar_lock is not None:
        tqdm.set_lock(bar_lock)
    try:
        with signals.handled(member=True), one_line_errors():
            train_stints(members, stints, job, jobs, shared)
    except Stopped:
        sys.exit(1)
    except signals.Interrupted as e:  # its checkpoint is saved; the parent says how to go on
        shared.failed.set()
        sys.exit(e.code)
    except BaseException:
        shared.failed.set()
        raise


def train_ensemble(args: TrainConfig) -> Run:
    """--members N > 1: N runs shared out among --jobs processes (this one and children) by
    member_stints, then their final models as one ensemble checkpoint, scored like a final
    model."""
    members = [member_args(args, k) for k in range(args.members)]
    jobs = member_jobs(args)
    plan = member_stints(args.members, args.max_updates, jobs, args.save_every or 1)
    threads = torch.get_num_threads()
    members = share_precision(args, members)
    children, shared = [], None
    if jobs > 1:
        members = [replace(m, threads=args.threads or max(1, threads // jobs)) for m in members]
        spawn = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools
        shared = Shared([spawn.Event() for _ in members], spawn.Array("b", len(members)),
                        spawn.Event())
        bar_lock = None
        if not args.no_progress:  # bars of several processes, each on its own row
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

    interrupted = None
    try:
        with signals.forwarding([child.pid for child in children]):
            try:
                run = train_stints(members, plan[0], 0, jobs, shared, child_failed)
            except Stopped:
                run = None
            while any(child.is_alive() for child in children):
                for child in children:
                    child.join(1.0)
                if child_failed():  # a child waiting to carry on a failed one's member stops
                    shared.failed.set()
    except signals.Interrupted as e:  # passed on to the children: they save too
        interrupted = e
    finally:  # this process failed: stop the others (SIGTERM: each saves its checkpoint)
        with signals.forwarding([child.pid for child in children]):
            for child in children:
                if child.is_alive() and interrupted is None:
                    child.terminate()
                child.join()
    if interrupted is not None and children and not interrupted.at_once:
        raise signals.Interrupted(interrupted.signum, done="each member saved a checkpoint "
                                  "(the lines above name them)")
    if interrupted is not None:
        raise interrupted
    failed = [] if shared is None else [k + 1 for k, done in enumerate(shared.finished) if not done]
    if failed:
        raise SystemExit(f"error: ensemble member{'s' * (len(failed) > 1)} "
                         f"{', '.join(map(str, failed))} stopped before finishing (the error is "
                         "above); --resume continues from the last checkpoints")
    if run.main:
        torch.set_num_threads(args.threads or threads)  # the ensemble's search: every thread
        run.name = ""  # the ensemble's lines are the run's own
        finals = [Path(m.save_dir) / "checkpoint_final.pt" for m in members]
        score_final(run, checkpoint.ensemble_checkpoints(finals), Path(args.save_dir),
                    Path(args.metrics), f"an ensemble of the {len(finals)} members' models")
        if args.plot:
            run.guarded(plot_metrics, [m.metrics for m in members], args.plot)
            run.log(f"training curves: {args.plot}")
    return run
