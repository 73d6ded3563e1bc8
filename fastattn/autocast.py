"""Autocast's weight casts, batched. Under autocast every linear map casts its float32 weight and
bias to the autocast dtype (one kernel each, per forward) and its backward casts their
gradients back (one more each): on a GPU, half of a base model's ~1,000 launches per training
micro-batch (benchmarks/launches.py). batched_weight_casts makes the same copies with one
multi-tensor copy per group of modules, forward and backward: the whole model on one process,
a layer under DistributedDataParallel, so that each layer's gradients still arrive as soon as
its backward is done (DDP overlaps their all-reduce with the rest;
fastattn.fused_model.weight_cast_groups). The values are autocast's: the same rounding either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

__all__ = ["batched_weight_casts"]


class _CastAll(torch.autograd.Function):
    """tensors -> their copies in `dtype` by one torch._foreach_copy_ (one kernel per 36
    tensors on CUDA, which casts while it copies); the gradients go back the same way."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.dtypes = [t.dtype for t in tensors]
        return tuple(_copies(tensors, [dtype] * len(tensors)))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        present = [i for i, g in enumerate(grads) if g is not None]
        result: list[Tensor | None] = [None] * len(grads)
        copies = _copies([grads[i] for i in present], [ctx.dtypes[i] for i in present])
        for i, copy in zip(present, copies, strict=True):
            result[i] = copy
        return None, *result


def _copies(tensors: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> list[Tensor]:
    out = [torch.empty_like(t, dtype=d) for t, d in zip(tensors, dtypes, strict=True)]
    if out:
        torch._foreach_copy_(out, list(tensors))
    return out


@contextlib.contextmanager
def batched_weight_casts(groups: Sequence[nn.Module | Sequence[nn.Module]], device_type: str
                         ) -> Iterator[None]:
    """Within the block, under autocast on `device_type`, the nn.Linear maps inside each group
    (a module, or a list of modules) read copies of their float32 weights and biases in the
    autocast dtype, made for each group by one _CastAll (autocast then finds them cast
    already); a map an earlier group cast is left to it. Without autocast, or without float32
    weights, nothing changes. The modules' parameters stay what they are (the optimiser,
    state_dict and DDP see them); the copies shadow them as instance attributes until the
    block ends."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    dtype = torch.get_autocast_dtype(device_type)
    shadowed: list[tuple[nn.Module, str]] = []
    try:
        for group in groups:
            modules = group.modules() if isinstance(group, nn.Module) else dict.fromkeys(
                m for module in group for m in module.modules())  # each module once
            slots = [(linear, name) for linear in modules if isinstance(linear, nn.Linear)
                     for name in ("weight", "bias")
                     if getattr(linear, name) is not None and name not in linear.__dict__
                     and getattr(linear, name).dtype == torch.float32]
            if not slots:
                continue
            copies = _CastAll.apply(dtype, *(getattr(m, name) for m, name in slots))
            for (module, name), copy in zip(slots, copies, strict=True):
                module.__dict__[name] = copy  # found before nn.Module's own _parameters lookup
                shadowed.append((module, name))
        yield
    finally:
        for module, name in shadowed:
            module.__dict__.pop(name, None)
