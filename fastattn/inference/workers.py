"""Decoding several batches at once: `workers` Python threads, each with its own intra-op threads.

    with Workers(2, 1) as pool:
        for result in pool.map(decode, batches):  # in input order
            ...

Why threads work here, as measured (torch 2.13, OpenMP backend, libgomp; tests/test_workers.py
checks both):

- Native decoding releases the GIL: a call through torch.ops drops it for the call's length
  (torch's invokeOperatorFromPython), as torch's own ops do. While one thread ran a 124 ms
  Transformer.beam_search (one fastattn::transformer_beam_search call), another Python thread
  woke 108 times from 1 ms sleeps.
- torch.set_num_threads is per thread (omp_set_num_threads sets the calling thread's count;
  MKL's is thread-local), but it also stores a process-wide count, and a thread's first
  parallel op (or torch.get_num_threads) replaces the thread's own count with that one
  (at::lazy_init_num_threads, once per thread). So a worker makes that first call before it
  sets its count: without it, a worker that set 1 read 2 after another worker set 2. The
  caller makes it too, before the workers start, and then sets its own count again once they
  have set theirs, so that its count and the one threads started later begin with stay as
  they were.
- A set by another thread still slows a worker down although its own count reads the same (a
  one-thread worker ran about three times slower after the caller set its count again; another
  thread was busy for it). So each worker sets its count again before every call, and map sets
  the caller's back when it ends. In `python -m benchmarks.report` on a 2-core Xeon, two
  one-thread workers then decoded 96.7 multi30k sentences/s at batch 1 where they had decoded 76
  (BENCHMARKS.md at commits fb8cc38 and 1fae290).
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, wait
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def choose(batch_size: int, cores: int) -> tuple[int, int]:
    """(workers, threads per worker) for batches of `batch_size` sentences on `cores` cores: the
    default rule, one-thread workers, one per core. Measured (scripts/measure_workers.py; the
    numbers in docs/api.md, "Workers and threads") on 2 cores at batch 64, 16 and 1, fp32 and
    int8: one-thread workers decoded at least as many sentences per second as one worker with
    both cores at every batch size, up to twice as many at batch 1 (a lone sentence's steps
    are too small to split) and in int8. So batch_size changes nothing on the CPU measured;
    more cores were not measured. A caller with fewer batches than cores gives each worker
    more threads (Translator does)."""
    if batch_size < 1 or cores < 1:
        raise ValueError(f"batch_size and cores must be >= 1, got {batch_size}, {cores}")
    return cores, 1


class Workers:
    """`workers` threads, each decoding with `threads` intra-op threads."""

    def __init__(self, workers: int, threads: int) -> None:
        if workers < 1 or threads < 1:
            raise ValueError(f"workers and threads must be >= 1, got {workers}, {threads}")
        self.workers, self.threads = workers, threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        caller = torch.get_num_threads()  # the caller's first call, before any worker sets one
        ready = threading.Barrier(workers + 1)
        # Daemon threads: a worker waiting for jobs never keeps the process alive.
        self._threads = [
            threading.Thread(target=_work, args=(self._jobs, threads, ready), daemon=True,
                             name=f"fastattn-worker-{i}")
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()
        ready.wait()
        torch.set_num_threads(caller)  # the process-wide count, which the workers' sets changed
        # The threads hold the queue, not this object: a pool nobody holds stops its threads.
        self._stop = weakref.finalize(self, _stop, self._jobs, workers)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """fn(item) for each item, computed on the workers, given in the order of items. Lazy:
        items are read as results are taken, at most 2 · workers in flight (each worker has one
        waiting when it finishes one). An exception raised by fn, or by reading items, is raised
        where its result would have come, after the results before it. When the iterator is
        closed or raises, the calls not started are dropped and the running ones finished first
        (no decoding outlives it)."""
        if not self._stop.alive:
            raise RuntimeError("Workers.map after close()")
        return self._map(fn, iter(items))

    def _map(self, fn: Callable[[T], R], items: Iterator[T]) -> Iterator[R]:
        pending: collections.deque[Future] = collections.deque()
        error: Exception | None = None
        caller = torch.get_num_threads()
        try:
            while True:
                while error is None and len(pending) < 2 * self.workers:
                    try:
                        item = next(items)
                    except StopIteration:
                        break
                    except Exception as e:  # noqa: BLE001 - raised after the results before it
                        error = e
                        break
                    future: Future = Future()
                    self._jobs.put((future, fn, item))
                    pending.append(future)
                if not pending:
                    break
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
            wait(pending)
            torch.set_num_threads(caller)  # the process-wide count, which the workers' sets changed
        if error is not None:
            raise error

    def close(self) -> None:
        """Stops the threads once the calls already given to them are done; map raises after
        it."""
        self._stop()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _work(jobs: queue.SimpleQueue, threads: int, ready: threading.Barrier) -> None:
    torch.get_num_threads()  # this thread's first call, so that the count set next stays
    torch.set_num_threads(threads)
    ready.wait()
    while (job := jobs.get()) is not None:
        future, fn, item = job
        del job  # hold no reference to a finished item while waiting for the next
        torch.set_num_threads(threads)  # again: another thread's set since changed its speed
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(item))
            except BaseException as e:  # noqa: BLE001 - the caller raises it, at its position
                future.set_exception(e)
        del future, fn, item


def _stop(jobs: queue.SimpleQueue, workers: int) -> None:
    for _ in range(workers):
        jobs.put(None)
