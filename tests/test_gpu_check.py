"""python -m fastattn.tools.gpu_check: its dry run (every stage at tiny shapes on the CPU, the
kernels in Triton's interpreter) passes and writes its report; a failed row fails the check."""

import ast
import json
import os
import subprocess
import sys
import time
import types
from functools import partial

import pytest
import torch

from fastattn.ops.attention import attention_reference
from fastattn.tools import gpu_bench, gpu_check


def test_dry_run_runs_every_stage_and_writes_its_report(tmp_path):
    """However busy the machine: the dry run has no time budgets (the timeout only ends a hang;
    the run takes 2 to 7 minutes on 2 cores, quiet to loaded)."""
    result = subprocess.run([sys.executable, "-m", "fastattn.tools.gpu_check", "--dry-run", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dry_run"] is True
    assert list(report["stages"]) == [name for name, _, _ in gpu_check.STAGES]
    assert all(stage["status"] == "ok" for stage in report["stages"].values()), report
    correctness = report["stages"]["correctness"]["rows"]
    ops = {row["op"] for row in correctness}
    assert ops == {"attention", "attention_packed", "layer_norm_residual",
                   "label_smoothed_cross_entropy", "linear_cross_entropy", "relu_backward_bias",
                   "embedding"}
    assert {row["dtype"] for row in correctness} == {"fp16", "bf16", "fp32"}  # no tf32 on a CPU
    assert all(row["passed"] for row in correctness)
    # The cases no GPU had checked, each run (interpreted) at the dry run's shapes.
    variants = {row["variant"] for row in correctness}
    assert {"fully masked rows: a sentence all padding", "dropout 0.1: self, key padding",
            "dropout 0.1", "training mix: fp16 x + fp32 residual, x_bias, dropout 0.1, fp16 copy",
            "training mix: fp32 weight, dropout 0.1, fp16 copy"} <= variants
    assert all(row["backward"] == "_PackedAttentionBackward" for row in correctness
               if row["op"] == "attention_packed" and row["dtype"] != "bf16")
    assert all(row["zeros_there"] and row["finite"] for row in correctness if "empty_rows" in row)
    assert all(row["fresh_mask"] for row in correctness if "keep_rate" in row)
    large = {row["variant"]: row for row in report["stages"]["large"]["rows"]}
    assert large["q and mask rows past 2**31 elements"]["bitwise_equal"] is True
    assert large["k, v and dO rows past 2**31 elements"]["bitwise_equal"] is True
    assert sum(row.get("passed") is True for row in large.values()) == 6  # the whole tensors
    assert all(row["bitwise_equal"] for row in report["stages"]["determinism"]["rows"])
    assert "## training: ok" in (tmp_path / "report.md").read_text()
    replays = [row for row in report["stages"]["training"]["rows"]
               if row.get("variant", "").startswith("mask replayed")]
    assert len(replays) == 4 and all(row["bitwise_equal"] for row in replays)
    sanitizer, = report["stages"]["sanitizer"]["rows"]
    assert sanitizer["status"] == "not available (the dry run)" and sanitizer["workload_passed"]


def test_a_failed_row_or_a_broken_stage_is_a_failure():
    report = {"stages": {
        "correctness": {"status": "ok", "rows": [{"op": "attention", "passed": True},
                                                 {"op": "layer_norm_residual", "passed": False}]},
        "large": {"status": "error", "error": "RuntimeError: launch failed",
                  "traceback": "Traceback ...\nRuntimeError: launch failed", "rows": []},
        "determinism": {"status": "ok", "rows": [{"op": "attention", "bitwise_equal": False}]},
    }}
    bad = gpu_check.failures(report)
    assert len(bad) == 3
    assert "layer_norm_residual" in bad[0] and "launch failed" in bad[1]


def test_without_a_gpu_it_says_so_in_one_line():
    result = subprocess.run([sys.executable, "-m", "fastattn.tools.gpu_check"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: torch sees no CUDA GPU; --dry-run checks the stages "
                                     "on the CPU")


def attention_stand_in(bits, cut):
    """ops.attention as a single-pass kernel would compute it without a mask: float32, and
    with torch's tf32 allowed every product's operands read with `bits` mantissa bits, the rest
    cut (as tensor cores read float32 bits) or rounded to nearest (as cuBLAS converts first)."""
    shift = 23 - bits

    def rounded(x):
        bits = x.float().view(torch.int32)
        return ((bits if cut else bits + (1 << shift - 1)) & -(1 << shift)).view(torch.float32)

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return rounded(a) @ rounded(b)

        @staticmethod
        def backward(ctx, grad):
            a, b = (rounded(t) for t in ctx.saved_tensors)
            return rounded(grad) @ b.mT, a.mT @ rounded(grad)

    def attention(q, k, v, causal=False, attn_mask=None):
        assert not causal and attn_mask is None
        if not torch.backends.cuda.matmul.allow_tf32:
            return torch.softmax(q @ k.mT * q.shape[-1] ** -0.5, -1) @ v
        return Product.apply(torch.softmax(Product.apply(q, k.mT) * q.shape[-1] ** -0.5, -1), v)

    return types.SimpleNamespace(attention=attention)


@pytest.mark.parametrize(("bits", "cut", "passes"), [(10, True, True), (10, False, True),
                                                     (7, True, False)],
                         ids=["tf32 cut", "tf32 rounded", "bf16 cut"])
def test_tf32_rows_are_graded_against_tf32s_own_error(tmp_path, monkeypatch, bits, cut, passes):
    """A correct single-pass tf32 attention errs 6e-4 to 2e-3, hundreds of times SDPA's float32
    error: its row passes, graded against tf32_attention's error; products reading bf16 fail."""
    monkeypatch.setattr(gpu_check, "ops", attention_stand_in(bits, cut))
    monkeypatch.setattr(gpu_check, "dtypes", lambda check: gpu_check.DTYPES)  # tf32 too
    check = gpu_check.Check(torch.device("cpu"), True, tmp_path)
    rows = {row["dtype"]: row for row in gpu_check.attention_case(
        check, "self", 64, 64, 64, False, None)}
    row = rows["fp32+tf32"]
    assert row["fastattn_error"] > 30 * row["torch_error"]
    assert row["passed"] is passes, row
    assert rows["fp32"]["passed"]


@pytest.mark.parametrize("variant", gpu_check.attention_variants(
    gpu_check.Check(torch.device("cpu"), True, None)), ids=lambda case: case[0])
def test_tf32_attention_errs_as_tf32_does_with_every_mask(variant, monkeypatch):
    """tf32_attention, the tf32 rows' bound, against the float64 reference with every variant's
    mask and causality: off by tf32's rounding (not float32's, 2e-7, nor a wrong mask's, 0.6 and
    more), and equal to it without the rounding."""
    _, lq, lk, d, causal, kind = variant
    torch.manual_seed(0)
    mask = gpu_check.make_mask(kind, 2, lq, lk, torch.device("cpu"))
    q, k, v = (torch.randn(2, 3, n, d, dtype=torch.float64) for n in (lq, lk, lk))
    grad = torch.randn(2, 3, lq, d, dtype=torch.float64)
    reference = gpu_check.fwd_bwd(partial(attention_reference, causal=causal, attn_mask=mask),
                                  [q, k, v], grad)
    emulated = partial(gpu_check.tf32_attention, causal=causal, attn_mask=mask)
    error = gpu_check.worst_error(gpu_check.fwd_bwd(emulated, [q, k, v], grad), reference)
    assert 5e-4 < error < 1e-2
    monkeypatch.setattr(gpu_check, "tf32_rounded", lambda x: x)
    assert gpu_check.worst_error(gpu_check.fwd_bwd(emulated, [q, k, v], grad), reference) < 1e-12


def compilation_error():
    """What Triton 3.6 raised for a kernel calling tl.to_tensor: a CompilationError at the call
    in the kernel (its message a source excerpt ending in a `^` line) from one at the failing
    line of the function it called."""
    from triton.compiler.errors import CompilationError

    def at(line, column):
        node = ast.parse("x").body[0]
        node.lineno, node.col_offset = line, column
        return node

    try:
        try:
            raise CompilationError("def scalar(x):\n    x = tl.to_tensor(x)\n", at(2, 8),
                                   "AttributeError(\"module 'triton.language' has no attribute "
                                   "'to_tensor'\")")
        except CompilationError as e:
            raise CompilationError("def _attn_fwd(Q):\n    seed = scalar(seed)\n",
                                   at(2, 11)) from e
    except CompilationError as e:
        return e


def test_a_speed_case_that_raises_any_exception_is_its_row_error():
    def call():
        raise compilation_error()

    row = gpu_bench.attention_timing(call, 1.0, torch.device("cpu"))
    assert row == {"error": "CompilationError: AttributeError(\"module 'triton.language' has no "
                            "attribute 'to_tensor'\") at `x = tl.to_tensor(x)`"}


def test_the_first_error_line_of_a_broken_stage_is_the_real_error(tmp_path):
    def broken(check):
        raise compilation_error()
        yield

    check = gpu_check.Check(torch.device("cpu"), True, tmp_path)
    check.report, check.deadline = {"stages": {}}, float("inf")
    gpu_check.run_stage(check, "broken", broken)
    report = json.loads((tmp_path / "report.json").read_text())
    assert gpu_check.failures(report) == [
        "broken: CompilationError: AttributeError(\"module 'triton.language' has no attribute "
        "'to_tensor'\") at `x = tl.to_tensor(x)`"]
    assert "^" in report["stages"]["broken"]["traceback"]  # the whole story stays in the report


def test_a_case_that_raises_fails_its_row_and_each_row_is_written_as_it_ends(tmp_path):
    """run_stage: the cases before and after the one that raises keep their rows, which reach
    report.json as each case ends; an exception setting up cases ends the stage, rows kept."""
    check = gpu_check.Check(torch.device("cpu"), True, tmp_path)
    check.report, check.deadline = {"stages": {}}, float("inf")

    def rows_on_disk():
        report = json.loads((tmp_path / "report.json").read_text())
        return [dict(rows_written=len(report["stages"]["stage"]["rows"]))]

    def stage(check):
        yield "first", lambda: [dict(op="first", passed=True)]
        yield "broken", lambda: [][1]
        yield "on disk", rows_on_disk
        raise ValueError("no more inputs")

    gpu_check.run_stage(check, "stage", stage)
    entry = json.loads((tmp_path / "report.json").read_text())["stages"]["stage"]
    assert [row.get("op") or row.get("case") for row in entry["rows"][:2]] == ["first", "broken"]
    assert entry["rows"][1]["error"] == "IndexError: list index out of range"
    assert entry["rows"][2] == {"rows_written": 2}
    assert entry["status"] == "error" and entry["error"] == "ValueError: no more inputs"
    assert gpu_check.failures(json.loads((tmp_path / "report.json").read_text())) == [
        "stage: ValueError: no more inputs", "stage: broken: IndexError: list index out of range"]


def test_past_its_deadline_a_stage_skips_the_cases_left(tmp_path):
    check = gpu_check.Check(torch.device("cpu"), True, tmp_path)
    check.report, check.deadline = {"stages": {}}, float("inf")

    def stage(check):
        yield "one", lambda: [dict(case="one")]
        check.deadline = 0.0  # the deadline passes during the first case
        yield "two", lambda: [dict(case="two")]

    gpu_check.run_stage(check, "stage", stage)
    assert check.report["stages"]["stage"]["rows"] == [{"case": "one"}]
    assert check.report["stages"]["stage"]["status"] == "cut at its time budget"


STAGE_SCRIPT = """
import json, os, sys, time
out, name, end = sys.argv[1], sys.argv[2], sys.argv[3]
report = json.load(open(os.path.join(out, "report.json")))
report["stages"][name] = dict(status="running", rows=[dict(case="before it ended")])
json.dump(report, open(os.path.join(out, "report.json"), "w"))
if end == "crash":
    print("RuntimeError: CUDA error: an illegal memory access was encountered", file=sys.stderr)
    os._exit(3)
if end == "hang":
    time.sleep(600)
"""


def test_a_stage_process_that_dies_or_overruns_ends_its_stage_only(tmp_path, monkeypatch):
    """run_in_process: the rows a stage's process wrote are kept; one that dies or runs past its
    budget and the grace is ended with its stage's status saying so; the next stage runs."""
    check = gpu_check.Check(torch.device("cpu"), True, tmp_path)
    check.report = {"stages": {}}
    ends = {"first": "crash", "second": "hang", "third": "ok"}
    monkeypatch.setattr(gpu_check, "stage_command", lambda check, name, deadline: [
        sys.executable, "-c", STAGE_SCRIPT, str(check.out), name, ends[name]])
    monkeypatch.setattr(gpu_check, "GRACE_SECONDS", 1.0)
    for name in ends:
        gpu_check.run_in_process(check, name, 1.0)
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert all(stage["rows"] == [{"case": "before it ended"}] for stage in stages.values())
    assert stages["first"]["status"] == "error"
    assert stages["first"]["error"] == ("its process died (exit code 3); last said: RuntimeError: "
                                        "CUDA error: an illegal memory access was encountered")
    assert stages["second"]["status"] == "error"
    assert stages["second"]["error"].startswith("ended 1 s past its budget")
    assert stages["third"]["status"] == "running"  # as the process left it, exit code 0


def test_quick_runs_each_stages_essentials(tmp_path):
    """--quick: every op's correctness in fp16, bf16 and fp32 at the model's attention variants,
    one speed row per op against SDPA or eager, one graphed update against the eager one, in
    budgets that leave a process start per stage within 4 minutes."""
    check = gpu_check.Check(torch.device("cpu"), True, tmp_path, quick=True)
    cases = {name: [case for case, _ in stage(check)] for name, stage, _ in gpu_check.STAGES
             if name in gpu_check.QUICK_BUDGETS}
    assert cases["correctness"] == [
        "attention, self, key padding", "attention, decoder, causal",
        "attention, cross, key padding", "layer_norm_residual, with residual",
        "layer_norm_residual, no residual", "cross-entropy, linear cross-entropy",
        "relu_backward_bias", "embedding",
        # the cases never checked before, one each: their kernels are those above but dropout's
        "attention_packed, self-attention", "attention, fully masked rows: a sentence all padding",
        "attention, dropout: self, key padding", "layer_norm_residual, dropout",
        "embedding, dropout", "layer_norm_residual, training mix", "embedding, training mix"]
    assert set(gpu_check.dtypes(check)) == {"fp16", "bf16", "fp32"}
    assert gpu_check.dropout_dtypes(check) == ("bf16",)
    assert cases["attention"] == ["fastattn L=64 D=16 causal=False", "sdpa L=64 D=16 causal=False"]
    assert len(cases["fused"]) == 6  # three ops, each against eager
    assert cases["training"] == ["--cuda-graphs updates = launch_step's",
                                 "attention in a CUDA graph, its mask changed between replays"]
    # the tensors past 2**31 elements and compute-sanitizer: the full profile's
    assert not {"large", "sanitizer"} & set(gpu_check.QUICK_BUDGETS)
    # the stages, the warm-up, and five seconds to start each process (the warm-up's pool too)
    assert sum(gpu_check.QUICK_BUDGETS.values()) + gpu_check.WARM_BUDGETS[True] \
        + 5 * (len(gpu_check.QUICK_BUDGETS) + 1) <= 240
    assert "--quick" in gpu_check.stage_command(check, "training", None)


def mark(out, index):
    """A warm-up case: writes the id of the process that ran it to a file of its own."""
    (out / f"case{index}").write_text(str(os.getpid()))
    return []


def raise_value_error():
    raise ValueError("a case that fails")


def warm_stage(check):
    """A stage for warm_up's spawned processes, which import it from this module by name."""
    for index in range(4):
        yield f"case {index}", partial(mark, check.out, index)
    yield "raises", raise_value_error
    if (check.out / "hang").exists():
        yield "hangs", partial(time.sleep, 600)


def test_the_warm_up_runs_each_case_once_in_a_pool_of_processes(tmp_path):
    """warm_up: every case of the stages runs once, in processes other than this one, at most
    `workers` of them; a case that raises is counted, not fatal."""
    check = gpu_check.Check(torch.device("cpu"), True, tmp_path)
    done = gpu_check.warm_up(check, [warm_stage], workers=2, seconds=None)
    assert (done["status"], done["cases"], done["workers"]) == ("ok", 5, 2)
    assert done["errors"] == ["ValueError: a case that fails"]
    pids = {int((tmp_path / f"case{index}").read_text()) for index in range(4)}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_the_warm_up_is_ended_at_its_budget(tmp_path):
    """A case that hangs does not hold the check: the pool is ended after `seconds`."""
    check = gpu_check.Check(torch.device("cpu"), True, tmp_path)
    (tmp_path / "hang").touch()
    start = time.monotonic()
    done = gpu_check.warm_up(check, [warm_stage], workers=2, seconds=5.0)
    assert done["status"] == "cut at its time budget" and done["cases"] == 6
    assert time.monotonic() - start < 60


def test_a_warm_up_case_runs_the_real_stages_case(tmp_path):
    """warm_case finds a real stage by module and name and runs the case it is given (the dry
    run's first correctness case: self-attention with key padding), its rows discarded; the
    check's command line starts the pool before the stages (--warm-workers, off in the dry
    run: the CI runs its stages, not twice)."""
    assert gpu_check.warm_case(gpu_check.correctness.__module__, "correctness", 0, "cpu", True,
                               True, str(tmp_path)) is None
    assert gpu_check.warm_case(gpu_check.correctness.__module__, "correctness", 99, "cpu", True,
                               True, str(tmp_path)) == "no case 99"
    assert gpu_check.WARM_STAGES == ("correctness", "sanitizer")
    assert [case for case, _ in gpu_check.ragged_warm(
        gpu_check.Check(torch.device("cpu"), True, tmp_path))] == ["ragged tails"]
    assert "--warm-workers" in subprocess.run(
        [sys.executable, "-m", "fastattn.tools.gpu_check", "--help"], capture_output=True,
        text=True, timeout=300).stdout


def test_each_part_of_the_full_profile_fits_one_device_command():
    """--part 1 and 2 together run every stage once, in order, each within benchmarks/gpu/
    check.sh's 590 s: its stages' budgets, the warm-up's where it warms one, five seconds a
    process start."""
    names = [name for name, _, _ in gpu_check.STAGES]
    assert [*gpu_check.PARTS[1], *gpu_check.PARTS[2]] == names
    budgets = {name: budget for name, _, budget in gpu_check.STAGES}
    for stages in gpu_check.PARTS.values():
        warm = gpu_check.WARM_BUDGETS[False] if set(stages) & set(gpu_check.WARM_STAGES) else 0
        assert sum(budgets[n] for n in stages) + warm + 5 * (len(stages) + 1) <= 590


def test_the_full_profile_fits_twelve_minutes():
    """Every stage's budget, the warm-up's, and five seconds to start each process: 11.4
    minutes, the quick run's 4 leaving room in a 15-minute lease for the full run's first
    stages at least."""
    assert sum(budget for _, _, budget in gpu_check.STAGES) + gpu_check.WARM_BUDGETS[False] \
        + 5 * (len(gpu_check.STAGES) + 1) <= 12 * 60


def test_a_case_past_the_gpus_free_memory_is_skipped_with_its_reason(monkeypatch, capsys):
    """A case needing more memory than the GPU has free says so (printed, and a row neither
    passed nor failed); the CPU (the dry run's small sizes) never skips."""
    check = gpu_check.Check(torch.device("cpu"), True, None)
    assert gpu_check.memory_short(check, "case", 2**40) is None
    check.device = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * 2**30, 80 * 2**30))
    rows = gpu_check.memory_short(check, "attention: q past 2**31 elements", 40 * 2**30)
    assert rows == [{"case": "attention: q past 2**31 elements",
                     "skipped": "needs about 48 GiB of GPU memory, 40 GiB free of 80"}]
    assert "skipped: needs about 48 GiB" in capsys.readouterr().out
    assert gpu_check.failures({"stages": {"large": {"status": "ok", "rows": rows}}}) == []
    assert gpu_check.memory_short(check, "case", 30 * 2**30) is None
    # Each whole-tensor case sized past 2**31 elements, its last unit (batch entry, row) wholly.
    on_gpu = gpu_check.Check(torch.device("cuda"), False, None)
    b = gpu_check.units_past(on_gpu, 16 * 97 * 64)
    assert (b - 1) * 16 * 97 * 64 > 2**31
    n = gpu_check.units_past(on_gpu, 1024, 16)
    assert (n - 16) * 1024 > 2**31


MEMCHECK_ERRORS = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at _attn_fwd+0x1c30
=========     by thread (5,0,0) in block (1,0,0)
=========     Address 0x7f3c0000fffe is out of bounds
ragged tails: 73 outputs and gradients, all finite
========= ERROR SUMMARY: 3 errors
"""


def test_memcheck_output_gives_its_error_count_and_first_error():
    row = gpu_check.memcheck_result(gpu_check.SANITIZER_EXIT, MEMCHECK_ERRORS)
    assert (row["errors"], row["passed"]) == (3, False)
    assert row["first_error"] == "Invalid __global__ read of size 2 bytes"
    clean = gpu_check.memcheck_result(0, "========= COMPUTE-SANITIZER\nragged tails: ok\n"
                                         "========= ERROR SUMMARY: 0 errors\n")
    assert (clean["errors"], clean["first_error"], clean["passed"]) == (0, None, True)
    crashed = gpu_check.memcheck_result(1, "Traceback ...\nRuntimeError: 2 of 73 outputs and "
                                           "gradients not finite\n")
    assert crashed["passed"] is False and crashed["errors"] is None
    assert crashed["first_error"] == "RuntimeError: 2 of 73 outputs and gradients not finite"


FAKE_SANITIZER = """#!/bin/sh
echo "========= COMPUTE-SANITIZER"
echo "========= Invalid __global__ write of size 4 bytes"
echo "=========     at _layer_norm_fwd_kernel+0x3a0"
if [ -n "$HANG" ]; then sleep 60; fi
echo "========= ERROR SUMMARY: 1 error"
exit 86
"""


def test_a_sanitized_run_reports_its_errors_and_one_cut_short_keeps_them(tmp_path, monkeypatch):
    """memcheck_rows with a stand-in compute-sanitizer: its errors fail the row, with the first
    one named and the output kept; a run past the stage's deadline is killed with the process
    it started (its process group), and what it printed before still fails the row."""
    tool = tmp_path / "compute-sanitizer"
    tool.write_text(FAKE_SANITIZER)
    tool.chmod(0o755)
    monkeypatch.setattr(gpu_check, "sanitizer_path", lambda: str(tool))
    check = gpu_check.Check(torch.device("cuda"), False, tmp_path)
    check.deadline = float("inf")
    row, = gpu_check.memcheck_rows(check)
    assert (row["status"], row["errors"], row["exit_code"], row["passed"]) == (
        "ran", 1, gpu_check.SANITIZER_EXIT, False)
    assert row["first_error"] == "Invalid __global__ write of size 4 bytes"
    assert "ERROR SUMMARY" in (tmp_path / "sanitizer.out").read_text()
    monkeypatch.setenv("HANG", "1")
    monkeypatch.setattr(gpu_check, "seconds_left", lambda check: 1.0)
    start = time.monotonic()
    row, = gpu_check.memcheck_rows(check)
    assert time.monotonic() - start < 30
    assert row["status"] == "cut at the stage's deadline" and row["passed"] is False
    assert row["first_error"] == "Invalid __global__ write of size 4 bytes"
