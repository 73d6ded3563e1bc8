"""fastattn.ops.attention against F.scaled_dot_product_attention and a naive materialised
attention: forward and forward+backward, causal and not, several lengths and head dims; and the
peak memory of forward+backward as the sequence grows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPES, QUICK, attention_flop, measure
from fastattn._native import native
from fastattn.ops import attention
from fastattn.ops.attention import attention_reference

TOKENS, HEADS = (64, 2) if QUICK else (4096, 8)  # batch = TOKENS // length
SHAPES = [(32, 16), (64, 32)] if QUICK else [(32, 64), (128, 64), (512, 64), (2048, 64), (512, 128)]
MEMORY_LENGTHS = [64, 128, 256] if QUICK else [1024, 2048, 4096, 8192]
NAIVE_MAX_LENGTH = 128 if QUICK else 4096  # beyond it the naive (L, L) scores take gigabytes


def naive_attention(q, k, v, causal):
    """softmax(q k^T / sqrt(d)) v with the full (B, H, L, L) score matrix in memory."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        lq, lk = scores.shape[-2:]
        future = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


IMPLS = {
    "fastattn": lambda q, k, v, causal: attention(q, k, v, causal=causal),
    "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "naive": naive_attention,
}


def attention_call(impl, batch, heads, length, head_dim, dtype, causal, backward):
    """A closure running one forward (and backward with a random grad_output) on fresh inputs."""
    q, k, v = (
        torch.randn(
            batch, heads, length, head_dim, device=DEVICE, dtype=dtype, requires_grad=backward
        )
        for _ in range(3)
    )
    fn = IMPLS[impl]
    if not backward:
        return lambda: fn(q, k, v, causal)
    grad_out = torch.randn_like(q)
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), grad_out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("length,head_dim", SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention(benchmark, impl, length, head_dim, causal, backward, dtype):
    batch = TOKENS // length
    mode = "fwd+bwd" if backward else "fwd"
    measure(
        benchmark,
        attention_call(
            impl, batch, HEADS, length, head_dim, getattr(torch, dtype), causal, backward
        ),
        group=(
            f"attention {mode} {dtype} B={batch} H={HEADS} L={length} D={head_dim}"
            f" {'causal' if causal else 'full'}"
        ),
        flop=attention_flop(
            batch, HEADS, length, length, head_dim, causal=causal, backward=backward
        ),
        impl=impl,
        baseline="sdpa",
    )


@pytest.mark.parametrize(
    "impl,length",
    [
        (impl, length)
        for length in MEMORY_LENGTHS
        for impl in IMPLS
        if impl != "naive" or length <= NAIVE_MAX_LENGTH
    ],
)
def test_attention_memory(benchmark, impl, length):
    """Forward+backward of one sequence (B=1, H=8, D=64, fp32) at growing length: the fused
    kernel's extra memory grows like L, the materialised one like L^2 (so the naive one stops at
    NAIVE_MAX_LENGTH, where each of its (L, L) buffers already takes 512 MiB)."""
    heads, head_dim = 8, 64
    measure(
        benchmark,
        attention_call(impl, 1, heads, length, head_dim, torch.float32, False, True),
        group=f"attention_memory fwd+bwd float32 B=1 H={heads} L={length} D={head_dim}",
        flop=attention_flop(1, heads, length, length, head_dim, causal=False, backward=True),
        min_rounds=3,
        impl=impl,
        baseline="sdpa",
        length=length,
    )


# The CPU paths fastattn/ops/attention.py chooses among for a call that needs a gradient, forced:
# fastattn._C's kernel, the explicit (materialised) product, and PyTorch's fused kernel. Its
# dispatch follows these numbers.
CPU_LENGTHS = [16, 32] if QUICK else [16, 32, 64, 128, 256, 512]
CPU_MASKS = ["none", "causal", "key_padding"]


def cpu_attention_call(impl, length, mask, dtype):
    """A forward+backward closure of one CPU path at batch 4096 // length, 8 heads of 64."""
    batch, heads, head_dim = max(1, TOKENS // length), HEADS, 64 if not QUICK else 16
    q, k, v = (torch.randn(batch, heads, length, head_dim, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn_like(q)
    causal = mask == "causal"
    keep = None
    if mask == "key_padding":  # each sequence keeps a random prefix of at least half its keys
        lengths = torch.randint(length // 2 + 1, length + 1, (batch, 1, 1, 1))
        keep = torch.arange(length) < lengths
    if impl == "native":
        bias = None if keep is None else (
            torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
            .expand(batch, heads, length, length))
        args = (bias, causal, 0, head_dim ** -0.5, 0.0, 0)

        def run():
            out, lse = torch.ops.fastattn.cpu_attention_fwd(q, k, v, *args)
            return torch.ops.fastattn.cpu_attention_bwd(grad_out, q, k, v, out, lse, *args)
        return run
    if impl == "explicit":
        fn = lambda: attention_reference(q, k, v, causal=causal, attn_mask=keep)
    else:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, attn_mask=keep)
    return lambda: torch.autograd.grad(fn(), (q, k, v), grad_out)


@pytest.mark.skipif(DEVICE.type != "cpu" or native is None,
                    reason="compares the CPU paths; needs a CPU run with fastattn._C built")
@pytest.mark.parametrize("impl", ["native", "explicit", "sdpa"])
@pytest.mark.parametrize("length", CPU_LENGTHS, ids=lambda n: f"L{n}")
@pytest.mark.parametrize("mask", CPU_MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_attention_paths(benchmark, impl, length, mask, dtype):
    fn = cpu_attention_call(impl, length, mask, getattr(torch, dtype))
    batch = max(1, TOKENS // length)
    measure(
        benchmark,
        fn,
        group=f"cpu_attention_paths fwd+bwd {dtype} B={batch} H={HEADS} L={length} {mask}",
        flop=attention_flop(batch, HEADS, length, length, 64 if not QUICK else 16,
                            causal=mask == "causal", backward=True),
        impl=impl,
        baseline="explicit",
    )
