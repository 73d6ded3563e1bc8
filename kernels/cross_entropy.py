"""Label-smoothed cross-entropy as Triton kernels and their launchers (the ops, including the
output projection fused with the loss, are fastattn.ops.cross_entropy).

For logits x (N, V), target t (N,) and smoothing eps, as F.cross_entropy(label_smoothing=eps):

    lse_r  = log sum_j exp(x_rj)
    nll_r  = lse_r - x_rt                                 (the unsmoothed loss, for perplexity)
    loss_r = (1 - eps) nll_r + eps (lse_r - sum_j x_rj / V)
    dloss_r / dx_rj = softmax(x_r)_j - eps / V - (1 - eps) [j == t_r]

Rows whose target is ignore_index contribute 0 and have zero gradient; "mean" divides the sum by
the number of the other rows, counted on the device (no host sync), and is 0 when every row is
ignored (F.cross_entropy gives NaN there).

The forward kernel streams each row once in BLOCK_V chunks with an online logsumexp, so no fp32
copy of the softmax exists; it saves only lse (fp32, one per row). The backward kernel rereads
the logits and writes the gradient into a new buffer of the logits' dtype (the caller's logits
are never overwritten); the true-class term is formed in fp32 before that single rounding.
Traffic: read N*V forward, read + write N*V backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_V = 4096  # vocabulary chunk one program holds in registers


@triton.jit
def _cross_entropy_fwd_kernel(
    Logits, Target, Loss, Nll, Lse,
    stride, V, smoothing, ignore_index,
    BLOCK_V: tl.constexpr,
):
    """One row per program; online logsumexp over vocabulary chunks.

    m_k = max(m_{k-1}, max(chunk_k)),  d_k = d_{k-1} exp(m_{k-1} - m_k) + sum exp(chunk_k - m_k)
    lse = m + log d,  nll = lse - x_t,  loss = (1 - eps) nll + eps (lse - sum(x) / V)
    Ignored rows store 0; a target outside [0, V) stores NaN.
    """
    row = tl.program_id(0).to(tl.int64)
    base = Logits + row * stride
    target = tl.load(Target + row)
    m = -float("inf")
    d = 0.0
    total = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        total += tl.where(cols < V, x, 0.0)
    lse = m + tl.log(d)
    in_range = (target >= 0) & (target < V)
    x_t = tl.load(base + target, mask=in_range, other=0.0).to(tl.float32)
    nll = lse - x_t
    loss = (1.0 - smoothing) * nll + smoothing * (lse - tl.sum(total, axis=0) / V)
    ignored = target == ignore_index
    tl.store(Loss + row, tl.where(ignored, 0.0, tl.where(in_range, loss, float("nan"))))
    tl.store(Nll + row, tl.where(ignored, 0.0, tl.where(in_range, nll, float("nan"))))
    tl.store(Lse + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(
    Logits, Target, Lse, GradRows, DLogits,
    stride, stride_d, stride_g, V, smoothing, ignore_index,
    BLOCK_V: tl.constexpr,
):
    """One row per program: dx_j = g * (exp(x_j - lse) - eps / V - (1 - eps) [j == t]), in fp32,
    g = 0 on ignored rows. DLogits may be Logits itself: each element is read before written."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(Target + row)
    lse = tl.load(Lse + row)
    g = tl.load(GradRows + row * stride_g).to(tl.float32)
    g = tl.where(target == ignore_index, 0.0, g)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(Logits + row * stride + cols, mask=cols < V, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - smoothing / V - tl.where(cols == target, 1.0 - smoothing, 0.0)
        tl.store(DLogits + row * stride_d + cols, (g * grad).to(DLogits.dtype.element_ty),
                 mask=cols < V)


def _launch_config(vocab: int) -> dict:
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    return dict(BLOCK_V=block_v, num_warps=min(max(block_v // 512, 1), 8))


def cross_entropy_forward(logits: torch.Tensor, target: torch.Tensor, smoothing: float,
                          ignore_index: int, loss: torch.Tensor | None = None,
                          nll: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (loss, nll, lse), all fp32, for logits (N, V) with unit column stride; loss and
    nll are written into the given contiguous (N,) fp32 tensors (e.g. a chunk's rows of the
    whole batch's), if any."""
    N, V = logits.shape
    loss, nll = (torch.empty(N, dtype=torch.float32, device=logits.device) if t is None else t
                 for t in (loss, nll))
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    _cross_entropy_fwd_kernel[(N,)](
        logits, target, loss, nll, lse, logits.stride(0), V, smoothing, ignore_index,
        **_launch_config(V),
    )
    return loss, nll, lse


def cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                           grad_rows: torch.Tensor, smoothing: float, ignore_index: int,
                           out: torch.Tensor) -> torch.Tensor:
    """out = d(sum_r grad_rows_r loss_r) / dlogits (out may be logits itself)."""
    N, V = logits.shape
    _cross_entropy_bwd_kernel[(N,)](
        logits, target, lse, grad_rows, out,
        logits.stride(0), out.stride(0), grad_rows.stride(0), V, smoothing, ignore_index,
        **_launch_config(V),
    )
    return out


def compile_configs() -> list[dict]:
    """Every (kernel, BLOCK_V, warps) the launchers pick, for fp16 logits."""
    fwd_signature = {
        "Logits": "*fp16:16", "Target": "*i64:16", "Loss": "*fp32:16", "Nll": "*fp32:16", "Lse": "*fp32:16",
        "stride": "i32:16", "V": "i32", "smoothing": "fp32", "ignore_index": "i32",
    }
    bwd_signature = {
        "Logits": "*fp16:16", "Target": "*i64:16", "Lse": "*fp32:16", "GradRows": "*fp32:16",
        "DLogits": "*fp16:16", "stride": "i32:16", "stride_d": "i32:16", "stride_g": "i32:16", "V": "i32",
        "smoothing": "fp32", "ignore_index": "i32",
    }
    configs = []
    for log2 in range(MAX_BLOCK_V.bit_length()):
        launch = _launch_config(2**log2)
        for name, fn, signature in (
            ("cross_entropy_fwd", _cross_entropy_fwd_kernel, fwd_signature),
            ("cross_entropy_bwd", _cross_entropy_bwd_kernel, bwd_signature),
        ):
            configs.append(dict(
                name=f"{name}_V{launch['BLOCK_V']}", fn=fn,
                signature={**signature, "BLOCK_V": "constexpr"},
                constexprs={"BLOCK_V": launch["BLOCK_V"]}, num_warps=launch["num_warps"],
                num_stages=1,
            ))
    return configs
