"""SIGINT (Ctrl-C) and SIGTERM (what schedulers and `docker stop` send): a run stops cleanly.

While updates run (`deferred()`), the first signal only asks the run to stop: it finishes the
update in flight, saves a checkpoint and raises Interrupted, which the command turns into one
line saying how to continue (rerun with --resume) and exit status 128 + the signal (130 for
SIGINT, 143 for SIGTERM), without a traceback. A second signal, or one outside the updates
(reading the text, the final decoding, waiting for another job), raises Interrupted at once:
what is saved is saved atomically, so stopping anywhere loses at most the updates since the
last checkpoint. Signals are passed on to the processes of `forwarding()` (ensemble members
training side by side), each of which saves its own checkpoint.
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
                 done: str | None = None) -> None:
        super().__init__(signum)
        self.signum, self.saved, self.step, self.done = signum, saved, step, done

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
        self.requested: int | None = None  # the signal a deferred() region was sent
        self.deferring = 0
        self.children: list[int] = []
        self.quiet = False
        self.checkpoint: Path | None = None  # the newest this process saved or resumed from


_state = _State()


def _handle(signum: int, frame) -> None:
    for pid in _state.children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    name = signal.Signals(signum).name
    if _state.deferring and _state.requested is None:
        _state.requested = signum
        if not _state.quiet:  # os.write: print() is not safe inside a signal handler
            os.write(2, f"{name}: saving a checkpoint after the update in flight (send it "
                        "again to stop at once)\n".encode())
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def handled(quiet: bool = False) -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted (or, in deferred(), ask the run to stop) while the
    context lasts; the handlers before it come back after. quiet: no notice on stderr when a
    signal arrives (ensemble members: their parent says it)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set in the main thread
        return
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    _state.__init__()
    _state.quiet = quiet
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
