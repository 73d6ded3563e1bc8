"""python -m fastattn.tools.info: its dispatch table is what fastattn.backend.implementation
answers."""

import os
import subprocess
import sys

import torch

from fastattn.backend import OPS, TRITON_MAX_HEAD_DIM, implementation
from fastattn.inference import native
from fastattn.kernels.attention import MAX_HEAD_DIM
from fastattn.tools.info import DTYPES, GRAD_MODES, VARIANTS

# Every answer fastattn.backend.implementation gives (its module docstring names them).
IMPLEMENTATIONS = ("triton", "triton-interpreter", "fastattn._C", "torch")


def test_info_prints_the_dispatch_table_implementation_returns():
    out = subprocess.run([sys.executable, "-m", "fastattn.tools.info", "--all"],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    head, table = out.stdout.split("dispatch:")
    for field in ("python", "torch", "triton", "fastattn._C", "backend", "cpu features", "gpu",
                  "cpu decoding"):
        assert field in head, field
    if native.NATIVE_INT8:  # the kernels this machine runs, as the extension reports them
        assert f"int8 kernel {torch.ops.fastattn.int8_kernel()}, bf16 kernel " \
               f"{torch.ops.fastattn.bf16_kernel()}" in head
    rows = {tuple(line.split()[:4]): line.split(None, 4)[4] for line in table.splitlines()[1:]}
    assert len(rows) == (len(OPS) + len(VARIANTS)) * 2 * len(DTYPES) * len(GRAD_MODES)
    for (label, device, dtype, mode), impl in rows.items():
        if impl.startswith("error"):
            continue  # the override cannot be honoured here; the ops raise too
        op, kwargs = VARIANTS.get(label, (label, {}))
        expected = implementation(op, torch.device(device), DTYPES[dtype], GRAD_MODES[mode],
                                  **kwargs)
        assert impl == expected and impl in IMPLEMENTATIONS, (label, device, dtype, mode)
        if label != op:  # heads wider than the Triton kernels' never run them
            assert not impl.startswith("triton"), (label, device, dtype, mode)


def test_the_head_dim_limit_is_the_kernels():
    assert TRITON_MAX_HEAD_DIM == MAX_HEAD_DIM


def test_without_a_gpu_info_shows_the_cpu_rows_and_counts_the_rest():
    out = subprocess.run([sys.executable, "-m", "fastattn.tools.info"], capture_output=True,
                         text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("dispatch:")[1].splitlines()[1:]
    cuda_rows = (len(OPS) + len(VARIANTS)) * len(DTYPES) * len(GRAD_MODES)
    devices = {line.split()[1] for line in table if not line.strip().startswith("(")}
    if torch.cuda.is_available():
        assert devices == {"cpu", "cuda"}
    else:
        assert devices == {"cpu"}
        assert table[-1] == f"  (and {cuda_rows} cuda rows: no GPU here; --all prints them)"
