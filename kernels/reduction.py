"""Sums across the programs of one launch, deterministic and without a second launch: every
program stores its float32 partial, then counts itself in on an arrival counter; the program
that arrives last sums every partial in program order (the same order whatever the schedule, so
the same bits every run) and resets the counter for the next launch.

Memory ordering: a barrier makes the program's own stores precede its counter increment, which
is an acquire-release atomic at GPU scope: the last program's increment observes every other
program's release, so their partials are visible to its loads (read through L2, ".cg"). This is
the ordering CUDA's cooperative-groups grid barrier uses (a block barrier, then one thread's
fenced atomic). One counter per device and stream: launches on one stream run one after the
other, so each finds it at zero. A counter is made (zeroed) outside any CUDA graph capture: made
inside one, its zero-fill would be recorded, not run, and another graph captured on that stream
and replayed first would read whatever the pool held. fastattn.train.graphs warms each graph up
on the stream it captures on, so every counter a capture uses exists before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counter(device: torch.device) -> torch.Tensor:
    """The int32 counter last_program() uses on `device` and its current stream; zero between
    launches (created zeroed once, reset by each launch's last program)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fastattn: a reduction's arrival counter would be made while a CUDA graph is "
                "being captured (its zero-fill would not run); run the work once on the capture "
                "stream before capturing it, as fastattn.train.graphs does")
        _counters[key] = torch.zeros((), dtype=torch.int32, device=device)
    return _counters[key]


@triton.jit
def last_program(COUNTER):
    """True in the last program of the launch to get here, which then sees every program's
    stores made before; it resets COUNTER to zero."""
    tl.debug_barrier()  # all of this program's stores before its increment
    arrived = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
    last = arrived == tl.num_programs(0) - 1
    if last:
        tl.store(COUNTER, 0)
    return last


@triton.jit
def sum_partials(PARTIAL, OUT, programs, N, BLOCK_N: tl.constexpr):
    """OUT[:N] = sum over p in 0..programs-1 (in order) of PARTIAL[p, :N] (float32, rows of N),
    stored in OUT's dtype; four partial rows in flight per step."""
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for p in range(0, programs, 4):
            for i in tl.static_range(4):
                row = tl.full((BLOCK_N,), p + i, tl.int32)
                total += tl.load(PARTIAL + row * N + cols, mask=mask & (row < programs),
                                 other=0.0, cache_modifier=".cg")
        tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=mask)
