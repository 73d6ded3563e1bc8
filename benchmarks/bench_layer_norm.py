"""fastattn.ops.layer_norm_residual against F.layer_norm(residual + F.dropout(x)), forward and
forward+backward, reported as effective bandwidth: the bytes the fused kernel must move, divided
by each implementation's time (so the rates compare like the times do). The unfused chain's bytes
are recorded beside them.

Bytes per element of size s, for rows of E features (per-row mean/rstd and the (E,) parameters
are included; dropout masks are 1 byte per element in PyTorch, regenerated from a seed in the
fused kernel):
  forward    fused: read x, residual; write y                        3s
             unfused: dropout read x, write h and mask; add read h, residual, write sum;
                      layer_norm read sum, write y                     7s + 1 (5s without dropout)
  backward   fused: read dy, the saved sum; write d(sum) (and dx through the dropout mask)
                                                                       3s (4s with dropout)
             unfused: layer_norm backward read dy, sum, write d(sum); dropout backward read
                      d(sum) and the mask, write dx                   5s + 1 (3s without dropout)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPES, QUICK, measure
from fastattn.ops import layer_norm_residual

# (rows, features, dropout): base and big sub-layers at the paper's batch, and a 16k-wide row.
CASES = (
    [(64, 48, 0.0), (33, 1000, 0.1)]
    if QUICK
    else [(8192, 512, 0.0), (8192, 512, 0.1), (8192, 1024, 0.1), (1024, 16384, 0.0)]
)


def bytes_moved(rows: int, features: int, size: int, dropout: bool, backward: bool, fused: bool):
    elements = rows * features
    if fused:
        per_element = 3 * size + (3 * size + (size if dropout else 0) if backward else 0)
    else:
        forward = 7 * size + 1 if dropout else 5 * size
        per_element = forward + ((5 * size + 1 if dropout else 3 * size) if backward else 0)
    row_stats = rows * 2 * 4 * (2 if backward else 1)
    parameters = features * size * (2 + (2 if backward else 0))
    return elements * per_element + row_stats + parameters


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

    x, residual, weight, bias = (
        tensor(rows, features),
        tensor(rows, features),
        tensor(features),
        tensor(features),
    )
    fn = IMPLS[impl]
    if backward:
        grad_out = torch.randn_like(x)
        inputs = (x, residual, weight, bias)
        call = lambda: torch.autograd.grad(fn(*inputs, dropout_p), inputs, grad_out)
    else:
        call = lambda: fn(x, residual, weight, bias, dropout_p)
    size = x.element_size()
    mode = "fwd+bwd" if backward else "fwd"
    measure(
        benchmark,
        call,
        group=f"layer_norm_residual {mode} {dtype} N={rows} E={features} dropout={dropout_p}",
        bytes_moved=bytes_moved(rows, features, size, dropout_p > 0, backward, fused=True),
        bytes_moved_unfused=bytes_moved(rows, features, size, dropout_p > 0, backward, fused=False),
        impl=impl,
        baseline="torch",
    )
