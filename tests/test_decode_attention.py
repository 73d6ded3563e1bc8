"""fastattn._C's decode_attention (the CPU attention of a decoding step) against the float64
explicit product, and the model's step_attention on either path."""

import math

import pytest
import torch

import fastattn  # noqa: F401  (loads fastattn._C, which registers the op)
from fastattn.model import _NATIVE_STEP_ATTENTION, step_attention

pytestmark = pytest.mark.skipif(not _NATIVE_STEP_ATTENTION, reason="fastattn._C is not built")


def reference(q, k, v, bias, scale):
    q, k, v = q.double(), k.double(), v.double()
    scores = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.double()[:, None, None, :]
    empty = (scores == -math.inf).all(-1, keepdim=True)
    p = scores.masked_fill(empty, 0.0).softmax(-1).masked_fill(empty, 0.0)
    return p @ v


def inputs(groups, heads, rows, keys, d_k, d_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(groups, heads, rows, d_k, generator=g, dtype=dtype)
    # Keys and values as slices of a larger cache, like the decoder's preallocated ones.
    k = torch.randn(groups, heads, keys + 5, d_k, generator=g, dtype=dtype)[:, :, :keys]
    v = torch.randn(groups, heads, keys + 5, d_v, generator=g, dtype=dtype)[:, :, :keys]
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "groups,heads,rows,keys,d_k,d_v",
    [(1, 1, 1, 1, 8, 8), (3, 4, 1, 17, 32, 32), (2, 2, 4, 97, 16, 24), (5, 1, 3, 1023, 64, 64)],
)
def test_matches_float64_reference(groups, heads, rows, keys, d_k, d_v, dtype):
    q, k, v = inputs(groups, heads, rows, keys, d_k, d_v, dtype)
    bias = torch.zeros(groups, keys, dtype=dtype)
    bias[0, keys // 2:] = -math.inf  # padding of the first group's source
    for b in (None, bias):
        out = torch.ops.fastattn.decode_attention(q, k, v, b, 0.3)
        assert out.shape == (groups, heads, rows, d_v) and out.dtype == dtype
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.double(), reference(q, k, v, b, 0.3), **tol)


def test_fully_masked_row_reads_zeros():
    q, k, v = inputs(2, 2, 1, 5, 8, 8, torch.float32)
    bias = torch.zeros(2, 5)
    bias[1] = -math.inf
    out = torch.ops.fastattn.decode_attention(q, k, v, bias, 1.0)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


def test_step_attention_native_equals_explicit_product():
    """The model's two paths agree (the bias as the decoder keeps it, (G, 1, 1, L))."""
    q, k, v = inputs(3, 4, 2, 11, 16, 16, torch.float64)
    bias = torch.zeros(3, 1, 1, 11, dtype=torch.float64)
    bias[2, ..., 7:] = -math.inf
    native = step_attention(q, k, v, bias)
    explicit = torch.matmul(
        (torch.matmul(q * 16**-0.5, k.transpose(-2, -1)) + bias).softmax(-1), v)
    torch.testing.assert_close(native, explicit, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, k, v, b: (q[0], k, v, b), "must be 4-D"),
        (lambda q, k, v, b: (q, k[:1], v, b), "must be \\(G, H, R, Dk\\)"),
        (lambda q, k, v, b: (q.half(), k.half(), v.half(), b), "float32 or all float64"),
        (lambda q, k, v, b: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, b),
         "unit stride"),
        (lambda q, k, v, b: (q, k, v, b[:, :3]), "bias must be \\(G, L\\)"),
    ],
)
def test_bad_input_errors(change, message):
    q, k, v = inputs(2, 2, 1, 5, 8, 8, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fastattn.decode_attention(*change(q, k, v, torch.zeros(2, 5)), 1.0)
