"""fastattn.ops.layer_norm_residual against F.layer_norm(residual + F.dropout(x)), forward and
forward+backward, reported as effective bandwidth: the bytes the fused kernel must move, divided
by each implementation's time (so the rates compare like the times do). The unfused chain's bytes
are recorded beside them.

Forward bytes come from fastattn.kernels.layer_norm.forward_bytes (fused 3e per element, unfused
5e, or 7e+1 with dropout's 1-byte mask). Backward bytes per element of size e, added here:
  fused    read dy, x, residual (the kernel recomputes the sum); write d(sum), and dx separately
           when dropout makes it differ                                       4e (5e with dropout)
  unfused  layer_norm backward reads dy and the sum, writes d(sum); dropout backward reads
           d(sum) and the mask, writes dx                                     3e (5e+1 with dropout)
plus the fp32 row statistics read again and dweight, dbias written.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPES, QUICK, measure
from fastattn.kernels.layer_norm import forward_bytes
from fastattn.ops import layer_norm_residual

# (rows, features, dropout): base and big sub-layers at the paper's batch, and a 16k-wide row.
CASES = (
    [(64, 48, 0.0), (33, 1000, 0.1)]
    if QUICK
    else [(8192, 512, 0.0), (8192, 512, 0.1), (8192, 1024, 0.1), (1024, 16384, 0.0)]
)


def bytes_moved(rows: int, features: int, dtype: torch.dtype, dropout: bool, backward: bool):
    """(fused, unfused) bytes of one forward or forward+backward."""
    fused, unfused = forward_bytes((rows, features), dtype, dropout=dropout)
    if backward:
        e, elements = torch.finfo(dtype).bits // 8, rows * features
        params = 2 * features * e + rows * 8  # dweight, dbias written; mean, rstd read
        fused += elements * e * (5 if dropout else 4) + params
        unfused += elements * (5 * e + 1 if dropout else 3 * e) + params
    return fused, unfused


def torch_layer_norm_residual(x, residual, weight, bias, dropout_p):
    return F.layer_norm(residual + F.dropout(x, dropout_p), weight.shape, weight, bias)


IMPLS = {
    "fastattn": lambda x, r, w, b, p: layer_norm_residual(x, r, w, b, dropout_p=p),
    "torch": torch_layer_norm_residual,
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows,features,dropout_p", CASES, ids=str)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_residual(benchmark, impl, rows, features, dropout_p, backward, dtype):
    torch_dtype = getattr(torch, dtype)

    def tensor(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch_dtype, requires_grad=backward)

    x, residual = tensor(rows, features), tensor(rows, features)
    weight, bias = tensor(features), tensor(features)
    fn = IMPLS[impl]
    if backward:
        grad_out = torch.randn_like(x)
        inputs = (x, residual, weight, bias)
        call = lambda: torch.autograd.grad(fn(*inputs, dropout_p), inputs, grad_out)
    else:
        call = lambda: fn(x, residual, weight, bias, dropout_p)
    fused_bytes, unfused_bytes = bytes_moved(rows, features, torch_dtype, dropout_p > 0, backward)
    mode = "fwd+bwd" if backward else "fwd"
    measure(
        benchmark,
        call,
        group=f"layer_norm_residual {mode} {dtype} N={rows} E={features} dropout={dropout_p}",
        bytes_moved=fused_bytes,
        bytes_moved_unfused=unfused_bytes,
        impl=impl,
        baseline="torch",
    )
