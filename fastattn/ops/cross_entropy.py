"""fastattn.ops.cross_entropy: label-smoothed cross-entropy, and the output projection fused
with it, around kernels/cross_entropy.py's Triton kernels (whose docstring has the math).

label_smoothed_cross_entropy runs, per fastattn.backend.implementation, the torch.library op
fastattn::cross_entropy_fwd (the Triton kernels: on CUDA, or on CPU tensors under Triton's
interpreter) or PyTorch's native kernels: one F.cross_entropy, or one log_softmax when the nll
is asked for too.

linear_cross_entropy(hidden, weight, target) is cross-entropy of hidden @ weight.T + bias
computed over row chunks of CHUNK_ELEMENTS logits (GPU_CHUNK_ELEMENTS on a GPU), so the (N, V)
logits never exist in full:
each chunk's logits are overwritten with their gradient in one reused buffer (this function's
own) and folded into dhidden, dweight (fp32) and dbias straight away: in the forward when the
loss is reduced to a scalar, so the backward only scales by grad_output, and in a recomputing
backward for reduction="none". Peak extra memory is one chunk plus an fp32 dweight, against the
unfused pair's logits and their gradient in full. On a CPU with fastattn._C built, float32 and
bfloat16 chunks go through its cross_entropy_grad: loss, nll and gradient computed in float32
with each row read twice and written once, where PyTorch's ops pass over the chunk five times.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastattn.backend import check_float, implementation
from fastattn.kernels import cross_entropy as kernels

REDUCTIONS = ("none", "sum", "mean")
TARGET_DTYPES = (torch.int64, torch.int32)  # both work on every path, forward and backward
CHUNK_ELEMENTS = 2**24  # logits per linear_cross_entropy chunk on a CPU: 64 MB in fp32
# On a GPU, 256 MB in bf16: each chunk is five launches (two products, the loss kernels, dW's
# product; and the add of dW's partial after the first), and the paper's 3,125 target tokens per
# GPU at 37,000 pieces fit in one.
GPU_CHUNK_ELEMENTS = 2**27
# Devices whose matrix products take 16-bit inputs to a float32 result (mm's out_dtype): dW
# accumulates in float32 inside the product, not through a rounded 16-bit partial and an add.
# (meta: benchmarks.launches counts the CUDA path on meta tensors.)
FLOAT32_PRODUCT_DEVICES = ("cuda", "meta")


def _interpreted(logits: torch.Tensor) -> torch.Tensor:
    """CPU tensors reach the Triton ops only under Triton's interpreter: the one override."""
    impl = implementation("label_smoothed_cross_entropy", logits.device, logits.dtype)
    if impl != "triton-interpreter":
        raise RuntimeError(f"fastattn::cross_entropy_* run the Triton kernels; on CPU tensors "
                           f"that needs FASTATTN_BACKEND=triton TRITON_INTERPRET=1 ({impl} now)")
    return logits


@torch.library.custom_op("fastattn::cross_entropy_fwd", mutates_args=(), device_types="cuda")
def _cross_entropy_fwd(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (loss, nll, lse), all fp32, for logits (N, V) with unit column stride."""
    return kernels.cross_entropy_forward(logits, target, smoothing, ignore_index)


@_cross_entropy_fwd.register_kernel("cpu")
def _(logits, target, smoothing, ignore_index):
    return kernels.cross_entropy_forward(_interpreted(logits), target, smoothing, ignore_index)


@_cross_entropy_fwd.register_fake
def _(logits, target, smoothing, ignore_index):
    rows = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(rows)


@torch.library.custom_op("fastattn::cross_entropy_bwd", mutates_args=(), device_types="cuda")
def _cross_entropy_bwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    smoothing: float,
    ignore_index: int,
) -> torch.Tensor:
    """d(sum_r grad_rows_r loss_r) / dlogits in a new tensor of the logits' dtype."""
    return _cross_entropy_bwd_out(logits, target, lse, grad_rows, smoothing, ignore_index)


@_cross_entropy_bwd.register_kernel("cpu")
def _(logits, target, lse, grad_rows, smoothing, ignore_index):
    return _cross_entropy_bwd_out(_interpreted(logits), target, lse, grad_rows, smoothing,
                                  ignore_index)


def _cross_entropy_bwd_out(logits, target, lse, grad_rows, smoothing, ignore_index):
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return kernels.cross_entropy_backward(logits, target, lse, grad_rows, smoothing,
                                          ignore_index, out)


@_cross_entropy_bwd.register_fake
def _(logits, target, lse, grad_rows, smoothing, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _cross_entropy_setup_context(ctx, inputs, output):
    logits, target, smoothing, ignore_index = inputs
    ctx.save_for_backward(logits, target, output[2])
    ctx.smoothing, ctx.ignore_index = smoothing, ignore_index
    ctx.set_materialize_grads(False)


def _cross_entropy_backward(ctx, dloss, _dnll, _dlse):
    if dloss is None:
        return None, None, None, None
    logits, target, lse = ctx.saved_tensors
    dlogits = _cross_entropy_bwd(logits, target, lse, dloss, ctx.smoothing, ctx.ignore_index)
    return dlogits, None, None, None


torch.library.register_autograd(
    "fastattn::cross_entropy_fwd", _cross_entropy_backward,
    setup_context=_cross_entropy_setup_context,
)


def _cross_entropy_rows_torch(logits, target, smoothing, ignore_index, need_nll=True):
    """Per-row (loss, nll or None) in fp32 (fp64 for fp64) with PyTorch's native kernels and
    autograd: one F.cross_entropy when it suffices, else one log_softmax for both terms."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    half = logits.dtype == torch.float16  # summing V log-probabilities overflows fp16
    if smoothing == 0 or not (need_nll or half):
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none",
                               label_smoothing=smoothing).to(acc)
        return loss, loss if smoothing == 0 else None
    valid = target != ignore_index
    logp = logits.log_softmax(-1)
    nll = -logp.gather(1, target.masked_fill(~valid, 0)[:, None])[:, 0].to(acc)
    total = logp.sum(-1, dtype=acc) if half else logp.sum(-1).to(acc)
    loss = (1 - smoothing) * nll - smoothing * total / logits.shape[1]
    return loss.masked_fill(~valid, 0), nll.masked_fill(~valid, 0)


def _reduce(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str):
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().clamp(min=1)  # a device-side count


def _check(kind, logits, target, smoothing, reduction, op="label_smoothed_cross_entropy"):
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{kind} needs (N, {'H' if kind == 'hidden' else 'V'}) {kind} and (N,) target "
            f"(flatten leading dims), got {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    check_float(op, **{kind: logits})
    if target.dtype not in TARGET_DTYPES:
        raise ValueError(f"target must hold class indices (int64 or int32), got {target.dtype}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"smoothing must be in [0, 1], got {smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check_targets(target, vocab, ignore_index):
    """On CPU, where it costs no device sync, reject targets outside [0, V); on GPUs (and inside
    torch.compile) such rows get a NaN loss from the kernels, an index error from PyTorch.
    Returns the targets as int64, the one index dtype every path reads (int32 is copied)."""
    if target.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"target {target[row].item()} is out of range for {vocab} classes "
                f"(ignore_index={ignore_index}), first at row {row}"
            )
    return target.long()


def cross_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, nll) by F.cross_entropy in the logits' dtype (float64 for ground truth); "mean"
    over zero rows is 0."""
    count = (target != ignore_index).sum().clamp(min=1)
    out = []
    for eps in (smoothing, 0.0):
        rows = F.cross_entropy(
            logits, target, ignore_index=ignore_index, reduction="none", label_smoothing=eps
        )
        divisor = count if reduction == "mean" else 1
        out.append(rows if reduction == "none" else rows.sum() / divisor)
    return out[0], out[1]


def label_smoothed_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    return_nll: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
    label_smoothing=smoothing) for logits (N, V) of any float dtype (float16, bfloat16,
    float32, float64) and target (N,) class indices, int64 or int32 (forward and backward on
    every path, where F.cross_entropy takes int64 only).

    The loss has the logits' dtype, as F.cross_entropy's; "mean" over only ignored targets is 0,
    not NaN. With return_nll=True returns (loss, nll): nll is the unsmoothed negative
    log-likelihood reduced the same way (exp of its mean is the perplexity), in fp32 (fp64 for
    fp64 logits), without gradient, from the same pass over the logits. float64 always runs on
    PyTorch, at float64 precision. What runs is
    fastattn.backend.implementation("label_smoothed_cross_entropy", ...).
    """
    _check("logits", logits, target, smoothing, reduction)
    target = _check_targets(target, logits.shape[1], ignore_index)
    impl = implementation("label_smoothed_cross_entropy", logits.device, logits.dtype)
    if logits.numel() and impl.startswith("triton"):
        loss, nll, _ = _cross_entropy_fwd(
            logits.contiguous(), target.contiguous(), float(smoothing), ignore_index
        )
    else:
        loss, nll = _cross_entropy_rows_torch(logits, target, smoothing, ignore_index, return_nll)
    loss = _reduce(loss, target, ignore_index, reduction).to(logits.dtype)
    if not return_nll:
        return loss
    return loss, _reduce(nll.detach(), target, ignore_index, reduction)



def _cross_entropy_grad_torch(logits, target, row_weight, smoothing, ignore_index):
    """Per-row fp32 (loss, nll) of a logits chunk, which is overwritten with
    d(sum_r row_weight_r loss_r) / dlogits.

    The softmax runs in the chunk's dtype, as F.cross_entropy's does (fp32 accumulation inside);
    the true-class entry, where p_t - 1 cancels, is formed in fp32 as expm1(log p_t)."""
    vocab, dtype = logits.shape[1], logits.dtype
    logp = torch.log_softmax(logits, -1, out=logits)  # in place: the rows reduce before writing
    valid = target != ignore_index
    safe_target = target.masked_fill(~valid, 0)[:, None]
    logp_t = logp.gather(1, safe_target)[:, 0].float()
    nll = (-logp_t).masked_fill(~valid, 0)
    loss = nll
    if smoothing:
        half = dtype == torch.float16  # summing V log-probabilities overflows fp16
        total = logp.sum(-1, dtype=torch.float32) if half else logp.sum(-1).float()
        loss = (1 - smoothing) * nll - smoothing * (total / vocab).masked_fill(~valid, 0)
    w = row_weight.float().masked_fill(~valid, 0)
    grad = logp.exp_().mul_(w[:, None].to(dtype))
    if smoothing:
        grad.sub_((w * (smoothing / vocab))[:, None].to(dtype))
    true_class = w * (torch.expm1(logp_t) + smoothing * (1 - 1 / vocab))
    rows = torch.arange(len(target), device=target.device)
    grad[rows, safe_target[:, 0]] = true_class.to(dtype)  # index_put_: scatter_ is slow on CPU
    return loss, nll




def _cross_entropy_grad(logits, target, row_weight, smoothing, ignore_index, impl, out=None):
    """(loss, nll) of a logits chunk, linear_cross_entropy's own buffer, which is overwritten
    with the gradient by `impl`; written into `out` (two (N,) fp32 tensors) if given, where the
    Triton kernel writes them directly (a GPU launches no copy)."""
    if impl.startswith("triton"):
        loss, nll, lse = kernels.cross_entropy_forward(logits, target, smoothing, ignore_index,
                                                       *(out or ()))
        kernels.cross_entropy_backward(logits, target, lse, row_weight, smoothing, ignore_index,
                                       logits)
        return loss, nll
    if impl == "fastattn._C":
        rows = torch.ops.fastattn.cpu_cross_entropy_grad(
            logits, target, row_weight.float(), smoothing, ignore_index
        )
    else:
        rows = _cross_entropy_grad_torch(logits, target, row_weight, smoothing, ignore_index)
    return _into(rows, out)


def _cross_entropy_loss(logits, target, smoothing, ignore_index, impl, out=None):
    """(loss, nll) of a logits chunk, into `out` if given, as _cross_entropy_grad."""
    if impl.startswith("triton"):
        return kernels.cross_entropy_forward(logits, target, smoothing, ignore_index,
                                             *(out or ()))[:2]
    return _into(_cross_entropy_rows_torch(logits, target, smoothing, ignore_index), out)


def _into(rows, out):
    if out is None:
        return rows
    for destination, values in zip(out, rows, strict=True):
        destination.copy_(values)
    return out


def _logits_buffer(hidden: torch.Tensor, rows: int, V: int) -> torch.Tensor:
    """A (rows, V) view, reused for every chunk (fresh large allocations page-fault), whose rows
    start 64-byte aligned: on a Zen 4 CPU, float32 GEMMs on unaligned 5,455-wide rows made the
    step slower than at 8,000. The padding is zeroed: oneDNN's AMX bf16 GEMM reads it (times
    zero), so a NaN left there by an earlier tensor made the gradient NaN."""
    padded = hidden.new_empty((rows, -(-V // 16) * 16))
    padded[:, V:].zero_()
    return padded[:, :V]


def _linear_cross_entropy_chunks(hidden, weight, bias, target, smoothing, ignore_index, row_weight,
                                 impl):
    """Per-row fp32 (loss, nll) of hidden @ weight.T + bias, a chunk of logits at a time, each
    chunk's loss by `impl`; with row_weight (N,), also the gradients of sum_r row_weight_r loss_r
    for hidden, weight and bias (fp32 for weight and bias), else empty tensors."""
    N, V = hidden.shape[0], weight.shape[0]
    chunk = CHUNK_ELEMENTS if hidden.device.type == "cpu" else GPU_CHUNK_ELEMENTS
    rows = max(1, min(N, chunk // V))
    loss = hidden.new_empty(N, dtype=torch.float32)
    nll = torch.empty_like(loss)
    grads = row_weight is not None
    dhidden = torch.empty_like(hidden) if grads else hidden.new_empty(0)
    float32_product = (hidden.device.type in FLOAT32_PRODUCT_DEVICES
                       and hidden.dtype in (torch.float16, torch.bfloat16))
    if not grads:
        dweight = hidden.new_empty(0)
    elif float32_product:
        dweight = None  # the first chunk's product allocates it: no zeros
    else:
        dweight = torch.zeros_like(weight, dtype=torch.float32)
    dbias = torch.zeros(V, dtype=torch.float32, device=hidden.device)
    if not (grads and bias is not None):
        dbias = hidden.new_empty(0)
    buffer = _logits_buffer(hidden, rows, V)
    for start in range(0, N, rows):
        part = slice(start, start + rows)
        h, t = hidden[part], target[part]
        logits = buffer[: len(h)]
        if bias is None:
            torch.mm(h, weight.T, out=logits)
        else:
            torch.addmm(bias, h, weight.T, out=logits)
        if not grads:
            _cross_entropy_loss(logits, t, smoothing, ignore_index, impl, (loss[part], nll[part]))
            continue
        _cross_entropy_grad(logits, t, row_weight[part], smoothing, ignore_index, impl,
                            (loss[part], nll[part]))
        grad = logits
        torch.mm(grad, weight, out=dhidden[part])
        if dweight is None:
            dweight = torch.mm(grad.T, h, out_dtype=torch.float32)
        elif float32_product:
            dweight += torch.mm(grad.T, h, out_dtype=torch.float32)
        elif dweight.dtype == grad.dtype:
            dweight.addmm_(grad.T, h)
        else:
            dweight += grad.T @ h
        if bias is not None:
            dbias += grad.sum(0, dtype=torch.float32)
    if dweight is None:  # no rows
        dweight = torch.zeros_like(weight, dtype=torch.float32)
    return loss, nll, dhidden, dweight, dbias


def _row_weights(target, ignore_index, reduction):
    """d(reduced loss) / d(loss_r): 1 for "sum", 1 / count for "mean" (device-side count)."""
    ones = torch.ones(target.shape, dtype=torch.float32, device=target.device)
    return ones if reduction == "sum" else ones / (target != ignore_index).sum().clamp(min=1)


def _chunk_implementation(hidden: torch.Tensor, grads: bool) -> str:
    return implementation("linear_cross_entropy", hidden.device, hidden.dtype,
                          requires_grad=grads)


# Matrix products around a per-chunk loss kernel: on each device, the chunk kernel is
# fastattn.backend.implementation's answer (Triton on CUDA, fastattn._C or PyTorch on CPU, the
# Triton interpreter under FASTATTN_BACKEND=triton).
@torch.library.custom_op("fastattn::linear_cross_entropy_fwd", mutates_args=(),
                         device_types=("cuda", "cpu"))
def _linear_cross_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    smoothing: float,
    ignore_index: int,
    reduction: str,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, nll) in fp32 reduced as `reduction`; if compute_grad and the loss is a scalar, also
    its gradients for hidden, weight, bias (fp32 for weight and bias), else empty tensors."""
    row_weight = None
    if compute_grad and reduction != "none":
        row_weight = _row_weights(target, ignore_index, reduction)
    with torch.autocast(hidden.device.type, enabled=False):  # the caller cast the inputs
        loss, nll, dh, dw, db = _linear_cross_entropy_chunks(
            hidden, weight, bias, target, smoothing, ignore_index, row_weight,
            _chunk_implementation(hidden, compute_grad),
        )
    reduce = lambda rows: _reduce(rows, target, ignore_index, reduction)
    return reduce(loss), reduce(nll), dh, dw, db


@_linear_cross_entropy_fwd.register_fake
def _(hidden, weight, bias, target, smoothing, ignore_index, reduction, compute_grad):
    shape = target.shape if reduction == "none" else ()
    loss = hidden.new_empty(shape, dtype=torch.float32)
    grads = compute_grad and reduction != "none"
    dh = torch.empty_like(hidden) if grads else hidden.new_empty(0)
    dw = torch.empty_like(weight, dtype=torch.float32) if grads else hidden.new_empty(0)
    has_db = grads and bias is not None
    db = hidden.new_empty(weight.shape[0] if has_db else 0, dtype=torch.float32)
    return loss, torch.empty_like(loss), dh, dw, db


@torch.library.custom_op("fastattn::linear_cross_entropy_bwd", mutates_args=(),
                         device_types=("cuda", "cpu"))
def _linear_cross_entropy_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    grad_rows: torch.Tensor,
    smoothing: float,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of sum_r grad_rows_r loss_r for hidden, weight, bias (fp32 for the last two;
    empty without bias): the backward of reduction="none", recomputing the logits chunk-wise."""
    with torch.autocast(hidden.device.type, enabled=False):
        _, _, dh, dw, db = _linear_cross_entropy_chunks(
            hidden, weight, bias, target, smoothing, ignore_index,
            grad_rows.float().contiguous(),  # sum()'s backward gives a stride-0 grad_rows
            _chunk_implementation(hidden, True),
        )
    return dh, dw, db


@_linear_cross_entropy_bwd.register_fake
def _(hidden, weight, bias, target, grad_rows, smoothing, ignore_index):
    db = hidden.new_empty(0 if bias is None else weight.shape[0], dtype=torch.float32)
    return torch.empty_like(hidden), torch.empty_like(weight, dtype=torch.float32), db


def _linear_cross_entropy_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, smoothing, ignore_index, reduction, compute_grad = inputs
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, target)
    else:
        ctx.save_for_backward(*output[2:])
    ctx.reduction, ctx.smoothing, ctx.ignore_index = reduction, smoothing, ignore_index
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
    ctx.set_materialize_grads(False)


def _linear_cross_entropy_backward(ctx, dloss, _dnll, *_dgrads):
    if dloss is None:
        return (None,) * 8
    if ctx.reduction == "none":
        dh, dw, db = _linear_cross_entropy_bwd(
            *ctx.saved_tensors, dloss, ctx.smoothing, ctx.ignore_index
        )
    else:  # gradients of the scalar loss were formed in the forward: scale by grad_output
        dh, dw, db = ctx.saved_tensors
        dh, dw, db = dh * dloss.to(dh.dtype), dw * dloss, db * dloss
    weight_dtype, bias_dtype = ctx.dtypes
    return (
        dh, dw.to(weight_dtype), None if bias_dtype is None else db.to(bias_dtype),
        None, None, None, None, None,
    )


torch.library.register_autograd(
    "fastattn::linear_cross_entropy_fwd", _linear_cross_entropy_backward,
    setup_context=_linear_cross_entropy_setup_context,
)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    return_nll: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """label_smoothed_cross_entropy(hidden @ weight.T + bias, target, ...) without the (N, V)
    logits ever existing in full: hidden (N, H), weight (V, H) (the tied embedding), bias (V,),
    target (N,) int64 or int32. Runs in chunks of CHUNK_ELEMENTS logits (GPU_CHUNK_ELEMENTS on a
    GPU), each with the Triton loss kernels or PyTorch (per the backend) and matmuls in the
    autocast dtype when autocast is on. Loss dtype and return_nll as
    label_smoothed_cross_entropy's, with hidden's dtype (after autocast).
    """
    _check("hidden", hidden, target, smoothing, reduction, "linear_cross_entropy")
    check_float("linear_cross_entropy", weight=weight, bias=bias)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be (V, {hidden.shape[1]}) for hidden {tuple(hidden.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    target = _check_targets(target, weight.shape[0], ignore_index)
    if torch.is_autocast_enabled(hidden.device.type):  # cast once, not once per chunk
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if hidden.dtype == torch.float64:  # the reference precision: plain PyTorch, logits in full
        return label_smoothed_cross_entropy(
            F.linear(hidden, weight, bias), target, smoothing, ignore_index, reduction, return_nll
        )
    params = (hidden, weight) if bias is None else (hidden, weight, bias)
    compute_grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    loss, nll, *_ = _linear_cross_entropy_fwd(
        hidden.contiguous(), weight.contiguous(), bias, target.contiguous(), float(smoothing),
        ignore_index, reduction, compute_grad,
    )
    loss = loss.to(hidden.dtype)
    return (loss, nll.detach()) if return_nll else loss

