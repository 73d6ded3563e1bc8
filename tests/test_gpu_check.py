"""python -m fastattn.gpu_check: its dry run (every stage at tiny shapes on the CPU, the kernels in
Triton's interpreter) passes and writes its report; a failed row fails the check."""

import json
import subprocess
import sys

from fastattn import gpu_check


def test_dry_run_runs_every_stage_and_writes_its_report(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fastattn.gpu_check", "--dry-run", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dry_run"] is True
    assert list(report["stages"]) == [name for name, _, _ in gpu_check.STAGES]
    assert all(stage["status"] == "ok" for stage in report["stages"].values()), report
    correctness = report["stages"]["correctness"]["rows"]
    ops = {row["op"] for row in correctness}
    assert ops == {"attention", "layer_norm_residual", "label_smoothed_cross_entropy",
                   "linear_cross_entropy", "relu_backward_bias", "embedding"}
    assert {row["dtype"] for row in correctness} == set(gpu_check.DTYPES)
    assert all(row["passed"] for row in correctness)
    large = {row["variant"]: row for row in report["stages"]["large"]["rows"]}
    assert large["q and mask rows past 2**31 elements"]["bitwise_equal"] is True
    assert all(row["bitwise_equal"] for row in report["stages"]["determinism"]["rows"])
    assert "## training: ok" in (tmp_path / "report.md").read_text()


def test_a_failed_row_or_a_broken_stage_is_a_failure():
    report = {"stages": {
        "correctness": {"status": "ok", "rows": [{"op": "attention", "passed": True},
                                                 {"op": "layer_norm_residual", "passed": False}]},
        "large": {"status": "error", "error": "Traceback ...\nRuntimeError: launch failed",
                  "rows": []},
        "determinism": {"status": "ok", "rows": [{"op": "attention", "bitwise_equal": False}]},
    }}
    bad = gpu_check.failures(report)
    assert len(bad) == 3
    assert "layer_norm_residual" in bad[0] and "launch failed" in bad[1]


def test_without_a_gpu_it_says_so_in_one_line():
    result = subprocess.run([sys.executable, "-m", "fastattn.gpu_check"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: torch sees no CUDA GPU; --dry-run checks the stages "
                                     "on the CPU")
