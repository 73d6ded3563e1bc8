"""The benchmark suite collects, and the report script turns results into BENCHMARKS.md: ratios,
rates, memory growth, paper targets, the projection and the compile report, on made-up results;
the decoding benchmark's cells run in quick mode and render (no timing is asserted anywhere)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import fastattn.fused_model
from benchmarks import launches
from fastattn.inference import native

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # Without the variables of the xdist worker running this test: in them, pytest-benchmark
    # takes the child pytest for a worker too and disables itself.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**inherited, **(env or {})},
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
        "bench_decoding.py::test_decoding_throughput[d512-6+6-int8-batch1-fastattn-2x1]",
        "bench_decoding.py::test_decoding_throughput[multi30k-fp32-batch1-ctranslate2-1x2]",
        "bench_decoding.py::test_ensemble_decoding_throughput[",
        "bench_decoding.py::test_bookkeeping_per_step_batch1[",
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
    assert "sentences/s" in text and "| 128 |" in text
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


def decoding_row(model, precision, batch, system, workers, threads, per_s, **extra_info):
    return bench(
        f"decoding {model} {precision} batch{batch}",
        f"{system} {workers}×{threads}",
        1 / per_s,
        system=system,
        model_name=model,
        precision=precision,
        batch_size=batch,
        workers=workers,
        threads=threads,
        sentences_per_s=per_s,
        output_tokens=40.0,
        **extra_info,
    )


def render_decoding(tmp_path, benchmarks):
    results = {
        "machine_info": {"fastattn_environment": {"device": "Test CPU (2 cores)"}},
        "benchmarks": benchmarks,
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = run(
        "-m",
        "benchmarks.report",
        "--json",
        str(tmp_path / "results.json"),
        "--no-compile-report",
        "--output",
        str(tmp_path / "BENCHMARKS.md"),
    )
    assert out.returncode == 0, out.stderr
    return (tmp_path / "BENCHMARKS.md").read_text()


def test_report_sets_fastattns_best_configuration_against_ctranslate2s_best(tmp_path):
    loads = {"other_cores": 0.02}
    text = render_decoding(tmp_path, [
        decoding_row("d512-6+6", "int8", 16, "fastattn", 1, 2, 8.0, **loads),
        decoding_row("d512-6+6", "int8", 16, "fastattn", 2, 1, 12.0, default=True, **loads),
        decoding_row("d512-6+6", "int8", 16, "ctranslate2", 1, 2, 6.0, **loads),
        decoding_row("d512-6+6", "int8", 16, "ctranslate2", 2, 1, 10.0, same_beam_outputs=0.9,
                     other_cores=0.06),
        decoding_row("multi30k", "fp32", 1, "ctranslate2", 1, 2, 3.0, **loads),
    ])
    header = next(line for line in text.splitlines() if line.startswith("| model | precision"))
    assert "| fastattn 1×2 | fastattn 2×1 | CT2 1×2 | CT2 2×1 |" in header
    cell = next(line for line in text.splitlines() if line.startswith("| d512-6+6 | int8 | 16 |"))
    assert "| 8 | 12 (default) | 6 | 10 | 1.20× | 90% | 40.0, 40.0 |" in cell
    alone = next(line for line in text.splitlines() if line.startswith("| multi30k | fp32 | 1 |"))
    assert "| – | – | 3 | – | – | – | –, 40.0 |" in alone  # no fastattn row: no ratio
    assert "at most 0.06 cores busy during a row" in text and "on average 0.03" in text
    assert "Not a quiet run" not in text


def test_report_says_when_the_decoding_run_was_not_quiet(tmp_path):
    text = render_decoding(tmp_path, [
        decoding_row("multi30k", "fp32", 1, "fastattn", 1, 2, 3.0, other_cores=0.01),
        decoding_row("multi30k", "fp32", 1, "fastattn", 2, 1, 3.0, other_cores=0.8),
    ])
    assert "Not a quiet run" in text and "took up to 0.80 cores" in text


def test_decoding_cells_run_in_quick_mode_and_render(tmp_path):
    """The multi30k cells at batch 1, every precision and configuration, for real (quick mode):
    a system's cells run where it has the precision and the configuration, and skip elsewhere."""
    out = run(
        "-m",
        "pytest",
        "benchmarks/bench_decoding.py",
        "--benchmark-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "test_decoding_throughput and multi30k and batch1",
        f"--benchmark-json={tmp_path / 'results.json'}",
        # The random model whatever ./run train left here: its outputs all run to quick mode's 8
        # tokens. A trained one's are cut there mid-sentence, where fastattn and CTranslate2
        # can keep different hypotheses (at 40 tokens, the full run's, they agree).
        env={"FASTATTN_BENCH_QUICK": "1", "FASTATTN_BENCH_CHECKPOINT": "random"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["benchmarks"]
    ran = {(b["extra_info"]["precision"], b["extra_info"]["impl"]) for b in rows}
    precisions = getattr(native, "PRECISIONS", ("fp32",))
    ctranslate2 = importlib.util.find_spec("ctranslate2") is not None
    for precision in ("fp32", "int8", "bf16"):
        assert ((precision, "fastattn 1×2") in ran) == (precision in precisions)
        assert ((precision, "fastattn 2×1") in ran) == (precision in precisions)
    assert (("fp32", "ctranslate2 2×1") in ran) == ctranslate2
    assert (("int8", "ctranslate2 1×2") in ran) == ctranslate2
    for b in rows:
        info = b["extra_info"]
        if "random" in info["model"]:  # its outputs run to MAX_LEN (quick mode's)
            assert info["output_tokens"] == 8.0, info
        assert info["sentences_per_s"] > 0 and info["cores_busy"] > 0
        assert 0 <= info["other_cores"] < 2  # what other processes took while the row ran
        # The profiler sees only the calling thread's torch allocations: no figure elsewhere.
        assert ("peak_memory_bytes" in info) == (info["impl"] == "fastattn 1×2"), info
        if info["precision"] == "fp32" and info["impl"] != "fastattn 1×2":
            assert info["same_beam_outputs"] == 1.0, info  # the same weights and search

    results = json.loads((tmp_path / "results.json").read_text())
    text = render_decoding(tmp_path, results["benchmarks"])
    fp32 = next(line for line in text.splitlines() if line.startswith("| multi30k | fp32 | 1 |"))
    ratio = fp32.split("|")[-4].strip()  # fastattn best / CT2 best
    assert ratio.endswith("×") if ctranslate2 else ratio == "–", fp32
    assert "Other processes kept at most" in text


def test_launch_counter_counts_the_cuda_path_of_one_update(monkeypatch):
    """benchmarks.launches on the tiny preset: each Triton kernel as often as the model calls
    it, no host sync (the results' read waits on an event), the totals the sums of their rows,
    and the launches the LayerNorm kernels' bf16 copies of their outputs spare."""
    cfg = launches.PRESETS["tiny"]
    r = launches.trace("tiny", sentences=3, length=5, vocab=500)
    by_op = r["launches_by_op"]
    attention_calls = cfg.encoder_layers + 2 * cfg.decoder_layers  # self, causal self, cross
    for kernel in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv"):
        assert by_op[f"triton {kernel}"] == attention_calls
    norms = 2 * cfg.encoder_layers + 3 * cfg.decoder_layers
    assert by_op["triton _layer_norm_fwd_kernel"] == by_op["triton _layer_norm_bwd_kernel"] == norms
    # dW and dB are summed by the backward's last program: no launch of their own
    assert sum("layer_norm" in op for op in by_op) == 2, by_op
    assert by_op["_fused_adam_"] >= 1 and by_op["mm"] > 0
    assert r["launches"] == sum(by_op.values()) == sum(r["launches_by_phase"].values())
    # No host sync: the NaN guard skips the update on the device (fused Adam's found_inf), the
    # results go to the host behind the update (a non-blocking copy) and their read waits on
    # an event recorded after them, not on what the trainer launched since.
    assert r["host_syncs"] == sum(r["syncs_by_reason"].values()) == 0, r["syncs_by_reason"]
    assert r["host_syncs_by_phase"] == {"micro-batch": 0, "update": 0, "read": 0}
    [(wait, count)] = r["event_waits"].items()
    assert count == 1 and wait.startswith("read at fastattn/train/step.py"), wait
    assert by_op["copy to the host (non-blocking)"] == 1
    assert set(r["launches_by_phase"]) == {"micro-batch", "update"}
    assert r["launches_by_phase"]["update"] < r["launches_by_phase"]["micro-batch"]
    # No dropout seed launched (LayerNorm's and attention's come from the CPU generator);
    # attention's results merge heads as views (no clone) and its gradients need no copy.
    assert "randint" not in by_op and "clone" not in by_op, by_op
    # Autocast's weight casts in one group on one process: one copy forward, one backward
    # (fastattn.autocast).
    assert by_op["_foreach_copy_"] == 2
    assert r["bytes_copied_by_op"]["_foreach_copy_"] > 0
    assert r["bytes_copied"] == sum(r["bytes_copied_by_op"].values()) > 0
    assert r["host_to_device_copies"] == 3  # the batch: source, decoder input, target
    # Without the copies each LayerNorm output a linear map reads is cast, its gradient cast
    # back and added to the residual's: 3 launches, but for the encoder's last (the memory,
    # read as float32) and the decoder's last (no residual after it: 2); so is each embedding's
    # output (3); and each feed-forward's ReLU runs apart from its product (a float32 input
    # beside bf16 weights), its backward and bias gradient apart too (2).
    monkeypatch.setattr(fastattn.fused_model, "autocast_copy_dtype", lambda x: None)
    uncopied = launches.trace("tiny", sentences=3, length=5, vocab=500)["launches"]
    feed_forwards = cfg.encoder_layers + cfg.decoder_layers
    assert uncopied - r["launches"] == 3 * (norms - 2) + 2 + 3 * 2 + 2 * feed_forwards


def test_launch_counter_counts_the_graphed_update():
    """benchmarks.launches --cuda-graphs on the tiny preset: nothing a capture refuses inside
    the graphs (no host sync, no copy from the host), five launches around the replays, and
    the gradients handed over by the backward, not added to per parameter."""
    cfg = launches.PRESETS["tiny"]
    r = launches.trace_graphed("tiny", sentences=3, length=5, vocab=500)
    assert r["host_syncs_by_phase"] == dict.fromkeys(launches.GRAPHED_PHASES, 0), \
        r["syncs_by_reason"]
    assert r["host_to_device_copies_by_phase"] == {
        "micro-batch graph": 0, "end graph": 0, "graphed update": 3, "read": 0}
    ops = r["launches_by_op_by_phase"]
    assert ops["graphed update"] == {"fill_": 2, "CUDA graph replay": 2,
                                     "copy to the host (non-blocking)": 1}
    assert r["launches_per_update"] == 5 and ops["read"] == {}
    [(wait, count)] = r["event_waits"].items()
    assert count == 1 and wait.startswith("read at fastattn/train/step.py"), wait
    graph = ops["micro-batch graph"]
    attention_calls = cfg.encoder_layers + 2 * cfg.decoder_layers
    assert graph["triton _attn_bwd_dkdv"] == attention_calls
    assert graph["random_"] == 1  # the seed table's refill: the only draw
    assert "add_" not in graph and "randint" not in graph and "clone" not in graph, graph
    assert ops["end graph"]["_fused_adam_"] >= 1 and "_foreach_zero_" not in ops["end graph"]


def test_multi_tensor_launches_follow_atens_limits():
    """multi_tensor_apply's limits: tensors per launch by the number of lists, 320 blocks of
    65,536 elements, a tensor split across launches when its chunks do not fit."""
    count = launches.multi_tensor_launches
    meta = lambda n: torch.empty(n, device="meta")  # noqa: E731
    assert count([[meta(1)] * 110]) == 1 and count([[meta(1)] * 111]) == 2
    assert count([[meta(1)] * 64] * 2) == 1 and count([[meta(1)] * 65] * 2) == 2
    assert count([[meta(1)] * 36] * 4) == 1 and count([[meta(1)] * 37] * 4) == 2
    assert count([[meta(65536 * 320)]]) == 1 and count([[meta(65536 * 320 + 1)]]) == 2
    assert count([[meta(65536 * 200), meta(65536 * 200)]]) == 2
    assert count([[meta(0), meta(0)]]) == 0


def test_a_run_held_to_avx2_renders_beside_the_native_one():
    from benchmarks.report import render

    def results(cpu_isa, fastattn_rate):
        rows = [decoding_row("multi30k", "fp32", 1, "fastattn", 1, 2, fastattn_rate),
                decoding_row("multi30k", "fp32", 1, "ctranslate2", 1, 2, 4.0)]
        env = {"device": "Test CPU (2 cores)", "cpu_isa": cpu_isa}
        return {"machine_info": {"fastattn_environment": env}, "benchmarks": rows}

    text = render(results("avx512", 6.0), None, "left out", {"avx2": results("avx2", 5.0)})
    native, held = text.split("## Measured with every library held to AVX2")
    assert "1.50×" in native and "1.25×" not in native
    assert "fastattn._C at avx2" in held and "1.25×" in held
