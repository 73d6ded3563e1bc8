"""pytest setup of the benchmark suite: collects bench_*.py, pins torch's threads to the cores this
process may use, and records the device, versions and backend with every result."""

from __future__ import annotations

import fnmatch
import os
import platform

import pytest
import torch

import fastattn
from benchmarks.common import (
    CORES,
    DEVICE,
    HELD_ISA,
    QUICK,
    device_name,
    device_peak_flop_per_s,
    dtype_name,
    low_precision,
    low_precision_has_hardware,
)

torch.set_num_threads(CORES)


def pytest_collect_file(file_path, parent):
    """Benchmarks live in bench_*.py (not test_*.py, so the unit-test run never picks them up).
    Files named on the command line or matching python_files pytest collects by itself."""
    patterns = parent.config.getini("python_files")
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)
        and not any(fnmatch.fnmatch(file_path.name, p) for p in patterns)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(autouse=True)
def seeded():
    """Every benchmark draws the same inputs on every run."""
    torch.manual_seed(0)


def environment() -> dict[str, object]:
    import triton

    info: dict[str, object] = {
        "device": device_name(),
        "device_type": DEVICE.type,
        "torch_threads": torch.get_num_threads(),
        "fastattn_backend": fastattn.get_backend(),
        "quick_mode": QUICK,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fastattn": fastattn.__version__,
        "python": platform.python_version(),
        "low_precision_measured": low_precision_has_hardware(),
        "cpu_isa": fastattn.cpu_isa(),  # fastattn._C's level; the variables holding the rest:
        "held": {k: os.environ[k] for k in sorted({k for v in HELD_ISA.values() for k in v})
                 if k in os.environ},
    }
    if DEVICE.type == "cuda":
        info["cuda"] = torch.version.cuda
    for dtype in (torch.float32,) + ((low_precision(),) if low_precision_has_hardware() else ()):
        peak = device_peak_flop_per_s(dtype)
        if peak is not None:
            name = dtype_name(dtype)
            info[f"peak_flop_per_s_{name}"], info[f"peak_{name}_basis"] = peak
    return info


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["fastattn_environment"] = environment()


def pytest_report_header(config):
    env = environment()
    return [
        f"fastattn benchmarks on {env['device']}: {env['torch_threads']} torch threads, "
        f"backend {env['fastattn_backend']}" + (", QUICK MODE (smoke run)" if QUICK else "")
    ]
