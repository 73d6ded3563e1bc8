"""fastattn.ops.relu.relu_backward_bias against float64 PyTorch, on both backends."""

import pytest
import torch

from fastattn.backend import implementation
from fastattn.ops.relu import relu_backward_bias, relu_backward_bias_reference

# Every test reaches the Triton kernel (or its argument checks) under FASTATTN_BACKEND=triton.
pytestmark = pytest.mark.triton

INTERPRETED = implementation("relu_backward_bias", "cpu", torch.float32) == "triton-interpreter"
# The interpreter has no bf16.
DTYPES = (torch.float32, torch.float16) + (() if INTERPRETED else (torch.bfloat16,))


def _inputs(rows: int, cols: int, dtype: torch.dtype, seed: int = 0):
    """(grad, h) in dtype: grad far from 1, h with negatives and exact zeros (both signs)."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3 + 0.5
    h = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    zeros = torch.rand(rows, cols, generator=g, dtype=torch.float64)
    h[zeros < 0.1] = 0.0
    h[zeros > 0.95] = -0.0
    return grad.to(dtype), h.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 17, 2048, 3000])
@pytest.mark.parametrize("rows", [1, 17, 97, 1023])
def test_matches_float64(rows, cols, dtype):
    grad, h = _inputs(rows, cols, dtype)
    g, db = relu_backward_bias(grad, h, dtype)
    exact_g, exact_db = relu_backward_bias_reference(grad.double(), h.double(), torch.float64)
    assert g.dtype == dtype and g.shape == grad.shape and db.dtype == dtype and db.shape == (cols,)
    torch.testing.assert_close(g, exact_g.to(dtype), rtol=0, atol=0)  # grad or 0: exact
    # Bounds of a float32 sum of `rows` terms in any order, then the rounding to dtype.
    bound = rows * 2**-24 * exact_g.abs().sum(0) + torch.finfo(dtype).eps * exact_db.abs()
    error = (db.double() - exact_db).abs()
    assert (error <= bound + 1e-30).all(), f"max error {error.max():.3g}"


def test_bias_dtype_and_leading_dims():
    """db in the asked dtype, summed over every leading dimension."""
    grad, h = _inputs(6 * 7, 33, torch.float16, seed=1)
    g, db = relu_backward_bias(grad.view(6, 7, 33), h.view(6, 7, 33), torch.float32)
    exact_g, exact_db = relu_backward_bias_reference(grad.double(), h.double(), torch.float64)
    assert g.shape == (6, 7, 33) and db.dtype == torch.float32
    torch.testing.assert_close(g.view(-1, 33), exact_g.half(), rtol=0, atol=0)
    torch.testing.assert_close(db.double(), exact_db, rtol=1e-6, atol=1e-6)


def test_strided_inputs():
    """A row stride wider than the row, and a transposed (column-strided) grad."""
    grad, h = _inputs(40, 300, torch.float32, seed=2)
    wide = torch.zeros(40, 320)
    wide[:, :300] = h
    ours = relu_backward_bias(grad.t().contiguous().t(), wide[:, :300], torch.float32)
    for o, e in zip(ours, relu_backward_bias(grad, h, torch.float32), strict=True):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


def test_bitwise_deterministic():
    grad, h = _inputs(1023, 300, torch.float32, seed=3)  # several row groups, two column blocks
    first, second = (relu_backward_bias(grad, h, torch.float32) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_nan_h_passes_grad_as_threshold_backward():
    h = torch.tensor([[float("nan"), -1.0, 0.0, 2.0]])
    g, db = relu_backward_bias(torch.full((1, 4), 3.0), h, torch.float32)
    assert g.tolist() == [[3.0, 0.0, 0.0, 3.0]] and db.tolist() == [3.0, 0.0, 0.0, 3.0]


def test_empty_rows():
    g, db = relu_backward_bias(torch.empty(0, 5), torch.empty(0, 5), torch.float16)
    assert g.shape == (0, 5) and db.dtype == torch.float16 and db.tolist() == [0.0] * 5


def test_float64_runs_pytorch():
    assert implementation("relu_backward_bias", "cpu", torch.float64) == "torch"
    grad, h = _inputs(5, 7, torch.float64)
    g, db = relu_backward_bias(grad, h, torch.float64)
    torch.testing.assert_close(db, torch.where(h > 0, grad, 0).sum(0), rtol=0, atol=0)


def test_bad_arguments_raise():
    x = torch.ones(2, 3)
    with pytest.raises(TypeError, match="grad has dtype int64"):
        relu_backward_bias(x.long(), x, torch.float32)
    with pytest.raises(TypeError, match="bias_dtype is int32"):
        relu_backward_bias(x, x, torch.int32)
    with pytest.raises(ValueError, match=r"h shape \(3, 2\) != grad shape \(2, 3\)"):
        relu_backward_bias(x, x.t(), torch.float32)
    with pytest.raises(ValueError, match="feature dimension"):
        relu_backward_bias(torch.ones(()), torch.ones(()), torch.float32)
