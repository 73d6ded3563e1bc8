"""The benchmark suite collects, and the report script turns results into BENCHMARKS.md: ratios,
rates, memory growth, paper targets, the projection and the compile report, on made-up results
(no timing is asserted anywhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_benchmark_suite_collects_every_file():
    out = run(
        "-m",
        "pytest",
        "benchmarks",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        env={"FASTATTN_BENCH_QUICK": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    collected = out.stdout
    for name in (
        "bench_attention.py::test_attention[",
        "bench_attention.py::test_attention_memory[",
        "bench_attention.py::test_cpu_attention_paths[",
        "bench_layer_norm.py::test_layer_norm_residual[",
        "bench_cross_entropy.py::test_label_smoothed_cross_entropy[",
        "bench_cross_entropy.py::test_linear_cross_entropy[",
        "bench_train.py::test_training_step[",
    ):
        assert name in collected, f"{name} not collected:\n{collected}"
    lines = [line for line in collected.splitlines() if "::" in line]
    assert len(lines) == len(set(lines)), "a benchmark was collected twice"


def bench(group, impl, median, iqr=0.0, **extra_info):
    return {
        "group": group,
        "name": f"test[{impl}]",
        "param": impl,
        "extra_info": {"impl": impl, **extra_info},
        "stats": {"median": median, "iqr": iqr, "rounds": 5, "iterations": 2},
    }


def test_report_renders_made_up_results(tmp_path):
    mib = 2**20
    results = {
        "machine_info": {
            "fastattn_environment": {
                "device": "Test CPU (2 cores)",
                "torch_threads": 2,
                "fastattn_backend": "auto",
                "quick_mode": False,
                "torch": "9.9",
                "triton": "9.8",
                "fastattn": "0.1.0",
                "python": "3.11",
                "device_type": "cpu",
                "peak_float32_basis": "made up",
            }
        },
        "commit_info": {"id": "0123456789abcdef", "dirty": False},
        "datetime": "2026-01-02T03:04:05.000000+00:00",
        "suite_seconds": 600.0,
        "benchmarks": [
            bench(
                "attention fwd float32 L=64",
                "fastattn",
                1e-3,
                2e-4,
                baseline="sdpa",
                flop_per_s=2.5e12,
                peak_memory_bytes=3 * mib,
            ),
            bench(
                "attention fwd float32 L=64",
                "sdpa",
                2e-3,
                baseline="sdpa",
                flop_per_s=1.25e12,
                peak_memory_bytes=3 * mib,
            ),
            *[
                bench(
                    f"attention_memory fwd+bwd L={n}",
                    impl,
                    1e-2,
                    baseline="sdpa",
                    length=n,
                    peak_memory_bytes=scale(n),
                )
                for n in (1024, 2048, 4096)
                for impl, scale in (
                    ("fastattn", lambda n: 1000 * n),
                    ("naive", lambda n: 7 * n * n),
                )
            ],
            bench(
                "train_step base fp32 125x(25+25) tokens",
                "fastattn",
                8.0,
                0.4,
                baseline="torch.nn.Transformer",
                preset="base",
                precision="fp32 (float32)",
                tokens=6250,
                tokens_per_s=781.25,
                mfu=0.4,
                gpu_target_s=0.4,
            ),
            bench(
                "train_step base fp32 125x(25+25) tokens",
                "torch.nn.Transformer",
                10.0,
                baseline="torch.nn.Transformer",
                tokens_per_s=625.0,
            ),
            bench("decoding beam4 batch64", "fastattn", 0.5, sentences_per_s=128.0),
        ],
    }
    compile_rows = [
        {
            "module": "fastattn.kernels.attention",
            "name": "fwd d64 fp16",
            "arch": arch,
            "num_warps": 4,
            "num_stages": 2,
            "registers": 128,
            "spill_bytes": 0,
            "shared_bytes": 32768,
            "mma": True,
            "wgmma": arch == 90,
        }
        for arch in (80, 90)
    ]
    (tmp_path / "results.json").write_text(json.dumps(results))
    (tmp_path / "compile.json").write_text(json.dumps(compile_rows))
    out = run(
        "-m",
        "benchmarks.report",
        "--json",
        str(tmp_path / "results.json"),
        "--compile-report",
        str(tmp_path / "compile.json"),
        "--output",
        str(tmp_path / "BENCHMARKS.md"),
    )
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "BENCHMARKS.md").read_text()

    assert "Test CPU (2 cores)" in text and "torch 9.9" in text and "10.0 min" in text
    assert "GPU step times are quoted, not measured" in text
    attention = next(line for line in text.splitlines() if "| fwd float32 L=64 | fastattn" in line)
    assert "| 1 ms |" in attention and "±10.0%" in attention and "2.00×" in attention
    assert "2.5 TFLOP/s" in attention and "3.0 MiB" in attention
    growth = next(line for line in text.splitlines() if line.startswith("| growth"))
    assert growth.split("|")[2:4] == [" 1.00 ", " 2.00 "], growth
    target = next(line for line in text.splitlines() if line.startswith("| base | fp32"))
    assert "8 s" in target and "40.0%" in target and "| 0.4 s |" in target
    big = next(line for line in text.splitlines() if line.startswith("| big |"))
    assert "not run on this device" in big and "| 1.0 s |" in big
    assert "sentences_per_s" in text and "128" in text
    assert "1.25×" in next(line for line in text.splitlines() if "781" in line)

    projected = text.index("## Projected (not measured)")
    assert text.index("## Measured") < projected < text.index("## Static GPU compile report")
    for gpu in ("P100", "V100", "A100", "H100"):
        assert f"| {gpu}" in text[projected:]
    assert "| attention | sm_90 | 1 | 128 | 0 | 32.0 KiB | 1/1 |" in text


def test_peak_memory_is_the_high_water_mark_of_allocations_forward_and_backward():
    code = """
import torch
from benchmarks.common import DEVICE, peak_memory

mib = 2**20
def allocate():
    a = torch.empty(mib, dtype=torch.uint8, device=DEVICE)
    b = torch.empty(3 * mib, dtype=torch.uint8, device=DEVICE)
    del a
    c = torch.empty(mib, dtype=torch.uint8, device=DEVICE)  # reuses a's level: peak stays 4 MiB
    return b, c

x = torch.ones(mib // 4, device=DEVICE, requires_grad=True)  # 1 MiB of fp32, allocated before
print(peak_memory(allocate), peak_memory(lambda: torch.autograd.grad((x * 3).sum(), x)))
"""
    out = run("-c", code)
    assert out.returncode == 0, out.stderr
    allocated, backward = map(int, out.stdout.split()[-2:])
    assert 4 * 2**20 <= allocated <= 4 * 2**20 + 4096
    assert 2**20 <= backward <= 2 * 2**20 + 4096  # x * 3 and the gradient, never x itself
