"""One optimisation update: the learning-rate schedule, the loss as a module DDP can wrap,
and train_step (accumulation over micro-batches and ranks, the NaN/inf guard, clipping)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastattn import data
from fastattn.model import Transformer


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule (eq. 3): linear warmup, then decay with the inverse square root."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


@dataclass
class StepResult:
    loss: float
    """Label-smoothed loss per target token of the whole update (all ranks)."""
    nll: float
    """Negative log-likelihood per target token (exp of it is the perplexity)."""
    tokens: int
    """Target tokens in the update (all ranks)."""
    grad_norm: float
    ok: bool
    """False if the gradients had NaN/inf and the update was skipped."""


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    autocast_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    clip_norm: float = 0.0,
) -> StepResult:
    """One update from this rank's micro-batches; `model` maps a batch (source, decoder input,
    decoder target) to its summed label-smoothed loss and NLL (LossModule, maybe in DDP). Under DDP
    the gradients are averaged over ranks; the loss is scaled so that the result is the gradient
    of the loss summed over every rank's batches divided by their total target tokens."""
    if not batches:
        raise ValueError("train_step: no micro-batches to train on")
    device = next(model.parameters()).device
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    # Counted on the host batches, before their copy: no device sync.
    batch_tokens = [int((b[2] != data.PAD_ID).sum()) for b in batches]
    total_tokens = sum(batch_tokens)
    if distributed:  # the loss scale needs every rank's count: one sync per update under DDP
        counts = torch.tensor([float(total_tokens)], dtype=torch.float64, device=device)
        dist.all_reduce(counts)
        total_tokens = int(counts.item())
    normaliser = total_tokens / world  # DDP averages over ranks: undo that with the world size

    sums = None  # loss, nll (float64)
    for i, (batch, tokens) in enumerate(zip(batches, batch_tokens, strict=True)):
        batch = tuple(t.to(device, non_blocking=True) for t in batch)
        last = i == len(batches) - 1
        sync = model.no_sync() if distributed and not last else contextlib.nullcontext()
        with sync:
            with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
                loss, nll = model(*batch, tokens=tokens)
            scaled = loss / normaliser
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        part = torch.stack([loss.detach(), nll.detach()]).double()
        sums = part if sums is None else sums + part  # no zeros launched for the first

    if distributed:
        dist.all_reduce(sums)
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if clip_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
    else:  # the norm alone (clip_grad_norm_ would still scale every gradient by 1)
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    # The update's one host read (a GPU's only sync outside DDP), before the optimiser's step.
    loss_sum, nll_sum, grad_norm = torch.cat([sums, grad_norm.double().reshape(1)]).tolist()
    ok = math.isfinite(grad_norm) and math.isfinite(loss_sum)
    if scaler is not None:
        scaler.step(optimizer)  # skips the update itself when it found inf/NaN gradients
        scaler.update()  # and lowers the loss scale
    elif ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(total_tokens, 1)
    return StepResult(loss_sum / tokens, nll_sum / tokens, total_tokens, grad_norm, ok)


class LossModule(torch.nn.Module):
    """model.loss (or model.rdrop_loss with weight rdrop > 0) as a forward(), so that
    DistributedDataParallel can wrap it: the summed training loss and the summed NLL of a
    batch."""

    def __init__(self, model: Transformer, rdrop: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.rdrop = rdrop

    def forward(self, source: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor,
                tokens: int | None = None):
        """`tokens`: the batch's non-padding targets, if known (Transformer.loss)."""
        if self.rdrop:
            return self.model.rdrop_loss(source, inputs, targets, self.rdrop, reduction="sum",
                                         return_nll=True, tokens=tokens)
        return self.model.loss(source, inputs, targets, reduction="sum", return_nll=True,
                               tokens=tokens)
