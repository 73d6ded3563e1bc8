"""One optimisation update: the learning-rate schedule, the loss as a module DDP can wrap,
and launch_step / train_step (accumulation over micro-batches and ranks, the NaN/inf guard,
clipping)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastattn.model import Transformer
from fastattn.rdrop import rdrop_loss


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


@dataclass
class PendingStep:
    """An update launched and not yet read. Its figures travel to the host behind the update's
    own kernels, so result() waits for this update only, not for work launched after it: a
    trainer that launches the next update before reading this one keeps a GPU busy."""

    values: torch.Tensor
    """Loss sum, NLL sum and gradient norm (float64, on the host once `copied` is reached)."""
    tokens: int
    copied: torch.Event | None
    """Recorded after the copy to the host; None when the values were computed there."""

    def result(self) -> StepResult:
        if self.copied is not None:
            self.copied.synchronize()
        loss_sum, nll_sum, grad_norm = self.values.tolist()
        ok = all(map(math.isfinite, (loss_sum, nll_sum, grad_norm)))
        per_token = max(self.tokens, 1)
        return StepResult(loss_sum / per_token, nll_sum / per_token, self.tokens, grad_norm, ok)


def launch_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    autocast_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    clip_norm: float = 0.0,
) -> PendingStep:
    """One update from this rank's micro-batches, launched without the host waiting for the
    device (outside DDP, with a fused optimiser such as Adam(fused=True)); read it with
    .result(). `model` maps a batch (source, decoder input, decoder target) to its summed
    label-smoothed loss and NLL (LossModule, maybe in DDP). Under DDP the gradients are averaged
    over ranks; the loss is scaled so that the result is the gradient of the loss summed over
    every rank's batches divided by their total target tokens. An update whose loss or gradients
    are NaN/inf is skipped: on the device by a fused optimiser (its found_inf, as under
    GradScaler), after a host read by any other."""
    if not batches:
        raise ValueError("train_step: no micro-batches to train on")
    device = next(model.parameters()).device
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    pad_id = getattr(model, "module", model).pad_id  # DDP holds the LossModule as .module
    # Counted on the host batches, before their copy: no device sync.
    batch_tokens = [int((b[2] != pad_id).sum()) for b in batches]
    total_tokens = sum(batch_tokens)
    if distributed:  # the loss scale needs every rank's count: one sync per update under DDP
        counts = torch.tensor([float(total_tokens)], dtype=torch.float64, device=device)
        dist.all_reduce(counts)
        total_tokens = int(counts.item())
    normaliser = total_tokens / world  # DDP averages over ranks: undo that with the world size

    losses, nlls = [], []  # per micro-batch, summed in float64 below
    for i, (batch, tokens) in enumerate(zip(batches, batch_tokens, strict=True)):
        if device.type == "cuda":  # from pageable memory the copy may wait for the stream
            batch = tuple(t.pin_memory() for t in batch)
        batch = tuple(t.to(device, non_blocking=True) for t in batch)
        last = i == len(batches) - 1
        sync = model.no_sync() if distributed and not last else contextlib.nullcontext()
        with sync:
            with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
                loss, nll = model(*batch, tokens=tokens)
            scaled = loss / normaliser
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        losses.append(loss.detach())
        nlls.append(nll.detach())

    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if clip_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
    else:  # the norm alone (clip_grad_norm_ would still scale every gradient by 1)
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    # Loss sum, NLL sum, gradient norm: two launches for one micro-batch.
    values = torch.stack([*losses, *nlls, grad_norm]).double()
    if len(batches) > 1:
        values = torch.stack([values[:len(losses)].sum(), values[len(losses):-1].sum(),
                              values[-1]])
    if distributed:  # the sums over ranks (the gradient norm is the same on every rank)
        dist.all_reduce(values[:2])
    if scaler is not None:
        scaler.step(optimizer)  # skips the update itself when it found inf/NaN gradients
        scaler.update()  # and lowers the loss scale
    elif getattr(optimizer, "_step_supports_amp_scaling", False):
        # A fused optimiser reads found_inf on the device and skips the update (its step
        # counts too) when it is 1: GradScaler's protocol, with no host read. x - x is 0 for
        # finite x, NaN for NaN and inf: three launches where isfinite().all() takes seven.
        optimizer.found_inf = (values - values).sum(dtype=torch.float32).ne_(0)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    else:  # any other optimiser: the host decides, after reading the figures
        values = values.cpu()
        if torch.isfinite(values).all():
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    copied = None
    if values.device.type != "cpu":
        values = values.to("cpu", non_blocking=True)  # into pinned memory, queued on the stream
        copied = torch.Event(device.type)
        copied.record()
    return PendingStep(values, total_tokens, copied)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    autocast_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    clip_norm: float = 0.0,
) -> StepResult:
    """launch_step, then its result: one update, read at once."""
    return launch_step(model, optimizer, batches, autocast_dtype=autocast_dtype, scaler=scaler,
                       clip_norm=clip_norm).result()


class LossModule(torch.nn.Module):
    """model.loss (or fastattn.rdrop.rdrop_loss with weight rdrop > 0) as a forward(), so that
    DistributedDataParallel can wrap it: the summed training loss and the summed NLL of a
    batch."""

    def __init__(self, model: Transformer, rdrop: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.rdrop = rdrop
        self.pad_id = model.cfg.pad_id

    def forward(self, source: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor,
                tokens: int | None = None, every_position: bool = False):
        """`tokens`: the batch's non-padding targets, if known; every_position: as in
        Transformer.loss (not with R-Drop)."""
        if self.rdrop:
            if every_position:
                raise ValueError("R-Drop's loss projects the non-padding positions only")
            return rdrop_loss(self.model, source, inputs, targets, self.rdrop, reduction="sum",
                              return_nll=True, tokens=tokens)
        return self.model.loss(source, inputs, targets, reduction="sum", return_nll=True,
                               tokens=tokens, every_position=every_position)
