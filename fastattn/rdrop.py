"""R-Drop's loss (Liang et al., 2021) on the tied output projection, computed in chunks of rows
with its gradient formed in the forward pass, as fastattn.ops.linear_cross_entropy does: the two
passes' (tokens × vocabulary) logits never exist whole, and each chunk is read a few times while
it is in cache instead of by a dozen autograd ops over all of it.

For the two dropout passes' hidden states h1, h2 (N, d) of the same tokens, the projection W
(V, d), targets t, smoothing ε and weight α, per token, with z_i = h_i Wᵀ, l_i = log_softmax(z_i),
p_i = exp(l_i) and the smoothed target q = (1 - ε)·onehot(t) + ε/V:

    loss = ½(CE1 + CE2) + c·S,  CE_i = -Σ_v q l_i,
    S = KL(p1‖p2) + KL(p2‖p1) = Σ_v (p1 - p2)(l1 - l2)

with c = α/4: half the paper's CE1 + CE2 + α/2·S, the same update for Adam. With d = l1 - l2,
K12 = Σ_v p1 d and K21 = -Σ_v p2 d:

    ∂loss/∂z1 = ½(p1 - q) + c·(p1 ⊙ (d - K12) + p1 - p2)
    ∂loss/∂z2 = ½(p2 - q) + c·(p2 ⊙ (-d - K21) + p2 - p1)

The softmaxes, the KL term and the gradient of the logits are float32; the projections run in
the autocast dtype where autocast is on (bf16 on CPUs), as in linear_cross_entropy.

rdrop_loss is a fastattn.model.Transformer's loss with R-Drop (not the paper's): the trainer's
--rdrop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fastattn.tokens import check_loss_args, non_padding, rows

if TYPE_CHECKING:
    from fastattn.model import Transformer


def rdrop_loss(model: Transformer, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, alpha: float,
               *, reduction: str = "mean", return_nll: bool = False, tokens: int | None = None
               ) -> Tensor | tuple[Tensor, Tensor]:
    """R-Drop (Liang et al., 2021): the batch passes through the model twice, under different
    dropout masks, and the loss per target token is the mean of the two passes' label-smoothed
    cross-entropies (as in model.loss) plus α/4 · (KL(p1‖p2) + KL(p2‖p1)) of their
    predictions (linear_rdrop_loss). With return_nll, also the two passes' mean NLL; `tokens`
    as in model.loss."""
    cfg = model.cfg
    check_loss_args(tgt_in, tgt_out, reduction, cfg.output_size, cfg.pad_id)
    hidden = model.hidden(torch.cat([src, src]), torch.cat([tgt_in, tgt_in]), copy=False)
    real = non_padding(tgt_out, cfg.pad_id, tokens)
    h1, h2 = (rows(h, real) for h in hidden.chunk(2))
    loss, nll = linear_rdrop_loss(h1, h2, model.output_weight, rows(tgt_out, real),
                                  smoothing=cfg.label_smoothing, alpha=alpha)
    if reduction == "mean":
        count = max(len(real), 1)
        loss, nll = loss / count, nll / count
    return (loss, nll) if return_nll else loss

CHUNK_ELEMENTS = 2**20  # logits per pass per chunk: four float32 buffers of 4 MB each


def _chunks(h1: Tensor, h2: Tensor, weight: Tensor, target: Tensor, smoothing: float,
            alpha: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(summed loss, summed mean NLL of the two passes, dh1, dh2, dweight): the matmuls in the
    dtype of h1, h2 and weight (bf16 under autocast, as linear_cross_entropy's), the rest in
    float32; dweight in float32."""
    (n, _), vocab = h1.shape, weight.shape[0]
    c, eps = alpha / 4, smoothing
    rows = max(1, min(n, CHUNK_ELEMENTS // vocab))
    loss = torch.zeros((), dtype=torch.float64, device=h1.device)
    nll = torch.zeros_like(loss)
    dh1, dh2 = torch.empty_like(h1), torch.empty_like(h2)
    dweight = torch.zeros_like(weight, dtype=torch.float32)
    buffers = [h1.new_empty(rows, vocab, dtype=torch.float32) for _ in range(4)]  # reused
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        a, b, t = h1[part], h2[part], target[part]
        l1, l2, p1, p2 = (buf[: len(t)] for buf in buffers)
        index = torch.arange(len(t), device=t.device), t
        for h, logp, p in ((a, l1, p1), (b, l2, p2)):
            if h.dtype == torch.float32:
                torch.mm(h, weight.T, out=logp)
            else:
                logp.copy_(h @ weight.T)
            torch.log_softmax(logp, -1, out=logp)
            torch.exp(logp, out=p)
        nll_rows = -(l1[index] + l2[index]) / 2
        smooth_rows = -(l1.mean(-1) + l2.mean(-1)) / 2
        d = l1.sub_(l2)
        k12, k21 = torch.linalg.vecdot(p1, d), -torch.linalg.vecdot(p2, d)
        loss += ((1 - eps) * nll_rows + eps * smooth_rows + c * (k12 + k21)).sum(dtype=loss.dtype)
        nll += nll_rows.sum(dtype=nll.dtype)
        g1 = torch.sub(d, k12[:, None], out=l2).mul_(c).add_(0.5 + c).mul_(p1).sub_(p2, alpha=c)
        g2 = d.add_(k21[:, None]).mul_(-c).add_(0.5 + c).mul_(p2).sub_(p1, alpha=c)
        for g, h, dh in ((g1, a, dh1[part]), (g2, b, dh2[part])):
            g.sub_(eps / (2 * vocab))
            g[index] -= (1 - eps) / 2
            if h.dtype == torch.float32:
                torch.mm(g, weight, out=dh)
                dweight.addmm_(g.T, h)
            else:
                g = g.to(h.dtype)
                torch.mm(g, weight, out=dh)
                dweight += g.T @ h
    return loss.float(), nll.float(), dh1, dh2, dweight


class _RDropLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h1: Tensor, h2: Tensor, weight: Tensor, target: Tensor, smoothing: float,
                alpha: float) -> tuple[Tensor, Tensor]:
        dtype = torch.get_autocast_dtype(h1.device.type) if torch.is_autocast_enabled(
            h1.device.type) else torch.promote_types(h1.dtype, weight.dtype)
        with torch.autocast(h1.device.type, enabled=False):
            loss, nll, dh1, dh2, dweight = _chunks(
                h1.to(dtype), h2.to(dtype), weight.to(dtype), target, smoothing, alpha)
        ctx.save_for_backward(dh1.to(h1.dtype), dh2.to(h2.dtype), dweight.to(weight.dtype))
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, dloss: Tensor, _dnll: Tensor):
        dh1, dh2, dweight = ctx.saved_tensors
        return (dh1 * dloss.to(dh1.dtype), dh2 * dloss.to(dh2.dtype),
                dweight * dloss.to(dweight.dtype), None, None, None)


def linear_rdrop_loss(h1: Tensor, h2: Tensor, weight: Tensor, target: Tensor, *,
                      smoothing: float, alpha: float) -> tuple[Tensor, Tensor]:
    """(loss, nll) summed over the N tokens (the module docstring's loss; nll is the two passes'
    mean unsmoothed NLL, without gradient) for hidden states h1, h2 (N, d) of two dropout
    passes, the projection weight (V, d) and targets (N,)."""
    if h1.shape != h2.shape or h1.dim() != 2 or target.shape != h1.shape[:1]:
        raise ValueError(f"h1 {tuple(h1.shape)} and h2 {tuple(h2.shape)} must both be (N, d) "
                         f"with target (N,), got target {tuple(target.shape)}")
    return _RDropLoss.apply(h1, h2, weight, target, smoothing, alpha)
