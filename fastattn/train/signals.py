"""SIGINT (Ctrl-C) and SIGTERM (what schedulers and `docker stop` send): a run stops cleanly.

While updates run (`deferred()`), the first signal only asks the run to stop: it finishes the
update in flight, saves a checkpoint and raises Interrupted, which the command turns into one
line saying how to continue (rerun with --resume) and exit status 128 + the signal (130 for
SIGINT, 143 for SIGTERM), without a traceback. A second signal, or one outside the updates
(reading the text, the final decoding, waiting for another job), raises Interrupted at once:
what is saved is saved atomically, so stopping anywhere loses at most the updates since the
last checkpoint. Signals are passed on to the processes of `forwarding()` (ensemble members
training side by side), each of which saves its own checkpoint; a second one kills them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal; `saved` is the checkpoint it saved on the way out, if any."""

    def __init__(self, signum: int, saved: Path | None = None, step: int | None = None,
                 done: str | None = None, at_once: bool = False) -> None:
        super().__init__(signum)
        self.signum, self.saved, self.step, self.done = signum, saved, step, done
        self.at_once = at_once  # a second signal: nothing saved on the way out

    @property
    def code(self) -> int:
        return 128 + self.signum

    def message(self) -> str:
        """The one line the command prints."""
        name = signal.Signals(self.signum).name
        again = "rerun the same command with --resume to continue"
        if self.done:
            return f"stopped by {name}: {self.done}; {again}"
        if self.saved is not None:
            return f"stopped by {name} after update {self.step}: saved {self.saved}; {again}"
        if _state.checkpoint is not None:
            return f"stopped by {name}: the last checkpoint is {_state.checkpoint}; {again}"
        return f"stopped by {name} before the first checkpoint: nothing to resume from"


class _State:
    def __init__(self) -> None:
        self.signals = 0  # how many this process got
        self.requested: int | None = None  # the signal a deferred() region was sent
        self.deferring = 0
        self.children: list[int] = []
        self.member = False
        self.checkpoint: Path | None = None  # the newest this process saved or resumed from


_state = _State()


def _handle(signum: int, frame) -> None:
    _state.signals += 1
    first = _state.signals == 1
    for pid in _state.children:  # a second signal stops them at once: their saves are atomic
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum if first else signal.SIGKILL)
    if not first and _state.member:
        return  # the same signal again (a process group's and the parent's): the parent decides
    if _state.deferring and first:
        _state.requested = signum
        if not _state.member:  # os.write: print() is not safe inside a signal handler
            os.write(2, f"{signal.Signals(signum).name}: saving a checkpoint after the update "
                        "in flight (send it again to stop at once)\n".encode())
        return
    raise Interrupted(signum, at_once=not first)


@contextlib.contextmanager
def handled(member: bool = False) -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted (or, in deferred(), ask the run to stop) while the
    context lasts; the handlers before it come back after.

    member: a process training ensemble members for its parent, which passes its signals on;
    one signal stops it (the same signal may come twice, from the parent and to a whole process
    group), no notice on stderr (the parent gives it), and only the parent stops it at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set in the main thread
        return
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    _state.__init__()
    _state.member = member
    for signum in SIGNALS:
        signal.signal(signum, _handle)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        _state.__init__()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """The training updates: a first signal only sets requested()."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1


def requested() -> int | None:
    """The signal that asked the run to stop, if one did."""
    return _state.requested


@contextlib.contextmanager
def forwarding(pids: Sequence[int]) -> Iterator[None]:
    """Signals this process gets go to these processes too."""
    _state.children = list(pids)
    try:
        yield
    finally:
        _state.children = []


def note_checkpoint(path: Path) -> None:
    """The run saved (or resumed from) this checkpoint: an interruption names it."""
    _state.checkpoint = path
