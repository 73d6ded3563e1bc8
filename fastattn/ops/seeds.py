"""Dropout: the seeds of the fused kernels (attention, residual LayerNorm, embedding), and
dropout(), the op for every dropout no fused kernel draws.

Each call draws fresh int64 seeds from torch's default CPU generator (torch.manual_seed
reproduces them) and the kernels take them by value: a GPU op neither launches a kernel to draw
them nor synchronises to read them. A CUDA graph would freeze such values, replaying one dropout
mask forever; so work captured in a graph draws its seeds from a DeviceSeeds table instead
(`with from_device(table):`), whose slots the kernels read through a pointer, and refills the
table inside the graph: every replay draws new masks, from torch's graph-safe CUDA generator.

On CPU, dropout() and the fastattn._C kernels (attention, residual LayerNorm) draw one
counter-based mask, a function of (seed, position): seeded_dropout, the torch.library op around
fastattn._C's cpu_dropout, takes the seed as a tensor, so torch.compile traces it. The Triton
kernels' side of the seeds is kernels/seeds.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fastattn.backend import check_float, implementation

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


def cpu_seed(seed: torch.Tensor | None) -> int:
    """The seed's value for fastattn._C's CPU kernels (0 without dropout)."""
    return 0 if seed is None else int(seed)


@torch.library.custom_op("fastattn::seeded_dropout", mutates_args=(), device_types="cpu")
def seeded_dropout(x: torch.Tensor, seed: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """x · keep / (1 - p) on CPU float32, keep a function of (seed, position): fastattn._C's
    cpu_dropout, with layer_norm_residual's mask. Its backward is itself applied to the grad."""
    return torch.ops.fastattn.cpu_dropout(x, int(seed), dropout_p)


@seeded_dropout.register_fake
def _(x, seed, dropout_p):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _seeded_dropout_setup_context(ctx, inputs, output):
    ctx.seed, ctx.dropout_p = inputs[1], inputs[2]


torch.library.register_autograd(
    "fastattn::seeded_dropout",
    lambda ctx, grad: (seeded_dropout(grad, ctx.seed, ctx.dropout_p), None, None),
    setup_context=_seeded_dropout_setup_context,
)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training) for p in [0, 1). On CPU PyTorch draws masks from a serial
    generator (dropout was a fifth of a small model's step), so float32, bfloat16 and float16
    take fastattn._C's counter-based mask (layer_norm_residual's), computed in float32, and
    float64 compares torch.rand against p (bernoulli_ is 4x slower than rand there). GPUs run
    F.dropout. What runs is fastattn.backend.implementation("dropout", ...)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x  # as F.dropout: the identity, for any dtype
    check_float("dropout", x=x)
    if x.device.type != "cpu":
        return F.dropout(x, p, training)
    if implementation("dropout", x.device, x.dtype) == "fastattn._C":
        return seeded_dropout(x.float(), draw(1), p).to(x.dtype)
    return x * (torch.rand(x.shape, device=x.device) >= p) * (1.0 / (1.0 - p))
