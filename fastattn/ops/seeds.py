"""Dropout seeds of the fused kernels (attention, residual LayerNorm, embedding).

Each call draws fresh int64 seeds from torch's default CPU generator (torch.manual_seed
reproduces them) and the kernels take them by value: a GPU op neither launches a kernel to draw
them nor synchronises to read them. A CUDA graph would freeze such values, replaying one dropout
mask forever; so work captured in a graph draws its seeds from a DeviceSeeds table instead
(`with from_device(table):`), whose slots the kernels read through a pointer, and refills the
table inside the graph: every replay draws new masks, from torch's graph-safe CUDA generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SEED_RANGE = 2**62
_active: DeviceSeeds | None = None


class DeviceSeeds:
    """A table of dropout seeds in `device` memory, handed out slot by slot (take). refill()
    draws new ones in place and starts over: captured in a CUDA graph, it runs on every replay.
    Outside a capture the table grows when a pass takes more than it holds, so one eager pass
    sizes it for the captured ones."""

    def __init__(self, device: torch.device | str) -> None:
        self.table = torch.empty(0, dtype=torch.int64, device=device)
        self.taken = 0

    def refill(self) -> None:
        self.table.random_(0, _SEED_RANGE)
        self.taken = 0

    def take(self, n: int) -> torch.Tensor:
        end = self.taken + n
        if end > len(self.table):
            if self.table.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"DeviceSeeds: a captured pass took more than the "
                                   f"{len(self.table)} seeds its eager pass did")
            fresh = torch.randint(0, _SEED_RANGE, (end - len(self.table),), dtype=torch.int64,
                                  device=self.table.device)
            self.table = torch.cat([self.table, fresh])  # slots handed out keep the old one
        seeds, self.taken = self.table[self.taken:end], end
        return seeds


@contextlib.contextmanager
def from_device(seeds: DeviceSeeds) -> Iterator[DeviceSeeds]:
    """Within the block, the fused kernels' seeds are slots of `seeds`."""
    global _active
    outer, _active = _active, seeds
    try:
        yield seeds
    finally:
        _active = outer


def draw(n: int) -> torch.Tensor:
    """n fresh int64 seeds for one op: on the CPU from torch's generator, or, inside
    from_device, the next n slots of its table."""
    if _active is not None:
        return _active.take(n)
    return torch.randint(0, _SEED_RANGE, (n,), dtype=torch.int64)


def kernel_argument(seed: torch.Tensor | None) -> int | torch.Tensor:
    """What a Triton kernel takes for a one-element seed: its value when it lies on the CPU (no
    sync), else the tensor itself, which the kernel loads (kernels' `scalar`)."""
    if seed is None:
        return 0
    return int(seed) if seed.device.type == "cpu" else seed
