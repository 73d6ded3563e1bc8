"""fastattn.kernels.reduction's arrival counters: made once per device and stream, never while a
CUDA graph is being captured (the zero-fill would be recorded, not run). The capture is faked on
the CPU: torch's current stream and capturing check are replaced."""

import types

import pytest
import torch

from fastattn.kernels import reduction

CUDA = torch.device("cuda")


@pytest.fixture
def fake_stream(monkeypatch):
    """A CUDA current stream (id 7) without a GPU, not capturing unless a test says so; the
    counters start empty and are restored afterwards."""
    monkeypatch.setattr(reduction, "_counters", {})
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return monkeypatch


def test_a_counter_made_while_capturing_is_an_error(fake_stream):
    fake_stream.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"):
        reduction.arrival_counter(CUDA)
    assert reduction._counters == {}


def test_a_counter_made_before_the_capture_is_the_one_it_uses(fake_stream):
    made = torch.zeros((), dtype=torch.int32)  # stands for the one a warm-up made on the stream
    reduction._counters[(CUDA, 7)] = made
    fake_stream.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert reduction.arrival_counter(CUDA) is made


def test_one_counter_per_device_and_stream_made_zero():
    cpu = torch.device("cpu")
    counter = reduction.arrival_counter(cpu)
    assert counter.dtype == torch.int32 and counter.item() == 0
    assert reduction.arrival_counter(cpu) is counter
