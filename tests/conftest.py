"""Shared test helpers. Test files import the helpers with `from conftest import ...`."""

from __future__ import annotations

import pytest
import torch

from fastattn.backend import get_backend

# Kernels run through Triton's CPU interpreter: slow, and without bf16 or fp64.
INTERPRETED = get_backend() == "triton"


@pytest.fixture
def seeded() -> int:
    """Seeds torch's default generators; the test gets the seed."""
    torch.manual_seed(1234)
    return 1234


def assert_graded_close(actual: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor,
                        *, factor: float = 2.0, atol: float = 0.0, name: str = "") -> None:
    """actual's largest error against the (fp64) reference is at most `factor` times PyTorch's
    own error in the same precision (baseline, e.g. the reference run in fp16) plus atol: low
    precision graded as flash-attention's tests grade it. NaN anywhere fails."""
    assert actual.shape == reference.shape, f"{name}: shape {actual.shape} != {reference.shape}"
    error = (actual.double() - reference.double()).abs().max().item()
    torch_error = (baseline.double() - reference.double()).abs().max().item()
    assert error <= factor * torch_error + atol, (
        f"{name}: max error {error:.3g} > {factor} x PyTorch's {torch_error:.3g} + {atol:.3g}")
