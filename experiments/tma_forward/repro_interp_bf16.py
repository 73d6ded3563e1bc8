"""Minimal repro: under TRITON_INTERPRET=1 (Triton 3.9), does a bf16 tensor-descriptor load
return the right values? Compares desc.load with a plain masked tl.load of the same tile.

    .venv/bin/python experiments/tma_forward/repro_interp_bf16.py   # from the repo root
"""
import os

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


@triton.jit
def copy_desc(desc, out_ptr, BLOCK: tl.constexpr, D: tl.constexpr):
    x = desc.load([0, 0])
    r = tl.arange(0, BLOCK)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + r, x)


@triton.jit
def copy_ptr(in_ptr, out_ptr, BLOCK: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, BLOCK)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + r, tl.load(in_ptr + r))


@triton.jit
def dot_desc(desc, out_ptr, BLOCK: tl.constexpr, D: tl.constexpr):
    x = desc.load([0, 0])
    r = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(out_ptr + r, tl.dot(x, x.T))


for dtype in (torch.float16, torch.bfloat16):
    x = torch.randn(16, 16).to(dtype)
    a, b = torch.empty_like(x), torch.empty_like(x)
    copy_desc[(1,)](TensorDescriptor.from_tensor(x, [16, 16]), a, BLOCK=16, D=16)
    copy_ptr[(1,)](x, b, BLOCK=16, D=16)
    c = torch.empty(16, 16)
    dot_desc[(1,)](TensorDescriptor.from_tensor(x, [16, 16]), c, BLOCK=16, D=16)
    ref = x.float() @ x.float().T
    print(dtype, "desc copy exact:", torch.equal(a, x), "| ptr copy exact:", torch.equal(b, x),
          "| desc dot max err:", (c - ref).abs().max().item())


@triton.jit
def dot_ptr(in_ptr, out_ptr, BLOCK: tl.constexpr, D: tl.constexpr, TRANS: tl.constexpr):
    r = tl.arange(0, BLOCK)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(in_ptr + r)
    o = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if TRANS:
        tl.store(out_ptr + o, tl.dot(x, x.T))
    else:  # the transposed operand loaded through pointers, as the shipped kernel does
        xt = tl.load(in_ptr + tl.arange(0, BLOCK)[None, :] * D + tl.arange(0, D)[:, None])
        tl.store(out_ptr + o, tl.dot(x, xt))


@triton.jit
def dot_desc_reshape(desc, out_ptr, BLOCK: tl.constexpr, D: tl.constexpr):
    x = desc.load([0, 0])
    y = x + 0  # a copy through arithmetic
    r = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(out_ptr + r, tl.dot(y, tl.trans(y)))


x = torch.randn(16, 16).to(torch.bfloat16)
ref = x.float() @ x.float().T
for trans in (True, False):
    c = torch.empty(16, 16)
    dot_ptr[(1,)](x, c, BLOCK=16, D=16, TRANS=trans)
    print("bf16 ptr dot", "x.T" if trans else "loaded^T", "max err:", (c - ref).abs().max().item())
c = torch.empty(16, 16)
dot_desc_reshape[(1,)](TensorDescriptor.from_tensor(x, [16, 16]), c, BLOCK=16, D=16)
print("bf16 desc (x+0) dot max err:", (c - ref).abs().max().item())
