"""ReLU's backward fused with the bias gradient of the linear map before it, as one Triton kernel
and its launcher (the op is fastattn.ops.relu): g = grad * (h > 0) and db = sum over rows of g.

The feed-forward's first product is relu(x W^T + b) (fastattn.model._LinearReLU); its backward
needs g for two matrix products and db, which PyTorch gives as two launches (threshold_backward,
then sum). Here every element of grad and h is read once, g is written once, and db is summed
from float32 per-program partials by the launch's last program (kernels/reduction.py: one
launch, summed in program order, so db is deterministic).

The grid splits the columns into BLOCK_N-wide blocks and the rows into groups, about one program
per SM in all: splitting the columns too keeps the groups, hence the partial rows the last
program sums alone, few (16 for 2048 columns on 132 SMs), so that sum stays short.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastattn.kernels.reduction import arrival_counter, last_program, sum_partials

# 16 elements per thread (32, on 8 warps, reached ptxas's 128 registers and spilled on sm_90).
BLOCK_M, BLOCK_N, NUM_WARPS = 32, 256, 16
SUM_BLOCK = 2048  # columns of the last program's sum per step: few steps over L2's latency


@triton.jit
def _relu_bwd_bias_kernel(
    GRAD, H, G, PARTIAL, DB, COUNTER, stride_grad, stride_h, stride_g, M, N, rows_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUM_BLOCK: tl.constexpr,
):
    """Program p covers the columns c·BLOCK_N + [0, BLOCK_N) of the rows
    r·rows_per_program + [0, rows_per_program), with c = p mod (column blocks), r = p div them:

    g = 0 where h <= 0, else grad    (threshold_backward(grad, h, 0): a NaN h passes grad on)
    PARTIAL[r, cols] = sum over the program's rows of g (float32)
    db = sum over r = 0, 1, ... (in order) of PARTIAL[r, :], by the launch's last program
    g is stored in G's dtype, db in DB's.
    """
    pid = tl.program_id(0)
    column_blocks = tl.cdiv(N, BLOCK_N)
    group = pid // column_blocks
    cols = (pid % column_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = group.to(tl.int64) * rows_per_program  # int64 rows: row * stride may pass 2**31
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        grad = tl.load(GRAD + rows[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0)
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
        g = tl.where(h <= 0, 0.0, grad.to(tl.float32))
        tl.store(G + rows[:, None] * stride_g + cols[None, :], g.to(G.dtype.element_ty),
                 mask=mask)
        acc += tl.sum(g, axis=0)
    tl.store(PARTIAL + group * N + cols, acc, mask=col_mask)
    if last_program(COUNTER):
        sum_partials(PARTIAL, DB, tl.num_programs(0) // column_blocks, N, SUM_BLOCK)


def _num_programs(x: torch.Tensor) -> int:
    """Programs in all: one per SM on CUDA, a handful in the interpreter (as layer_norm's)."""
    if x.device.type == "cuda":
        return torch.cuda.get_device_properties(x.device).multi_processor_count
    return 4


def relu_backward_bias(grad: torch.Tensor, h: torch.Tensor, bias_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g in grad's dtype, db in bias_dtype) for 2-D grad and h of one shape, with unit column
    stride and at least one row."""
    M, N = grad.shape
    column_blocks = triton.cdiv(N, BLOCK_N)
    groups = min(max(_num_programs(grad) // column_blocks, 1), M)
    # Whole tiles per group (no half-empty last tile), which may leave a group or two fewer.
    rows_per_program = triton.cdiv(triton.cdiv(M, groups), BLOCK_M) * BLOCK_M
    groups = triton.cdiv(M, rows_per_program)
    g = torch.empty((M, N), dtype=grad.dtype, device=grad.device)
    partial = grad.new_empty((groups, N), dtype=torch.float32)
    db = grad.new_empty(N, dtype=bias_dtype)
    _relu_bwd_bias_kernel[(groups * column_blocks,)](
        grad, h, g, partial, db, arrival_counter(grad.device), grad.stride(0), h.stride(0),
        g.stride(0), M, N, rows_per_program,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SUM_BLOCK=SUM_BLOCK, num_warps=NUM_WARPS,
        num_stages=1,
    )
    return g, db


def compile_configs() -> list[dict]:
    """The launcher's one tile, in every dtype the op runs (grad, h, g and db in one dtype)."""
    configs = []
    for dtype in ("fp16", "bf16", "fp32"):
        signature = {
            "GRAD": f"*{dtype}:16", "H": f"*{dtype}:16", "G": f"*{dtype}:16",
            "PARTIAL": "*fp32:16", "DB": f"*{dtype}:16", "COUNTER": "*i32",
            "stride_grad": "i32:16", "stride_h": "i32:16", "stride_g": "i32:16",
            "M": "i32", "N": "i32", "rows_per_program": "i32:16",
        }
        constexprs = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SUM_BLOCK=SUM_BLOCK)
        configs.append(dict(
            name=f"relu_bwd_bias_{BLOCK_M}x{BLOCK_N} {dtype}", fn=_relu_bwd_bias_kernel,
            signature={**signature, **{k: "constexpr" for k in constexprs}},
            constexprs=constexprs, num_warps=NUM_WARPS, num_stages=1,
        ))
    return configs
