"""Runs the benchmark suite and writes BENCHMARKS.md from its results.

    python -m benchmarks.report                    # run everything, then write BENCHMARKS.md
    python -m benchmarks.report --json PATH        # only rewrite BENCHMARKS.md from saved results
    python -m benchmarks.report --quick            # smoke run: tiny shapes, meaningless numbers
    python -m benchmarks.report --isa avx2 -- -k "training or decoding"
                                                   # the same held to AVX2, shown beside it
    python -m benchmarks.report -- -k attention    # arguments after -- go to pytest

A run is `pytest benchmarks/ --benchmark-only --benchmark-json=benchmarks/results.json`; the
static GPU compile report joins it (`python -m fastattn.kernels.compile_report --json
benchmarks/compile_report.json`, slow the first time, then served from Triton's cache), and a
roofline projection of the training step on P100, V100, A100 and H100 follows, kept apart from
everything measured.

Conventions the tables rely on, for every bench_*.py: the benchmark's group names the case and
starts with the family ("attention fwd float32 ..."); extra_info["impl"] names the
implementation and extra_info["baseline"] the impl of the same group that ratios are taken
against (speed-up = baseline median / median); extra_info may carry flop_per_s, bytes_per_s,
tokens_per_s, mfu, peak_memory_bytes and any other *_per_s rate, each shown when present.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
COMPILE_REPORT = ROOT / "benchmarks" / "compile_report.json"
OUTPUT = ROOT / "BENCHMARKS.md"


# --- running ---------------------------------------------------------------------------------


def run_suite(results: Path, quick: bool, pytest_args: list[str],
              isa: str | None = None) -> tuple[int, float]:
    """Runs the benchmarks into `results`, every library held to `isa` if given (HELD_ISA);
    returns pytest's exit code and the wall time."""
    from benchmarks.common import HELD_ISA

    env = {**os.environ, "FASTATTN_BENCH_QUICK": "1" if quick else "0", **HELD_ISA.get(isa, {})}
    command = [sys.executable, "-m", "pytest", str(ROOT / "benchmarks"), "--benchmark-only"]
    command += [f"--benchmark-json={results}", "--benchmark-columns=median,iqr,rounds"]
    command += ["-p", "no:cacheprovider", *pytest_args]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    return code, time.perf_counter() - start


def run_compile_report(path: Path) -> str:
    """Writes the static GPU compile report's JSON to `path`; returns why it failed, or ""."""
    command = [sys.executable, "-m", "fastattn.kernels.compile_report", "--json", str(path)]
    print("$", " ".join(command[1:]), flush=True)
    path.unlink(missing_ok=True)
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0 or not path.exists():
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"`python -m fastattn.kernels.compile_report` failed: {tail[0]}"
    return ""


# --- formatting ------------------------------------------------------------------------------


def seconds(x: float) -> str:
    if x >= 1:
        return f"{x:.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} µs"


def rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}/s"
    return f"{x:.3g} {unit}/s"


def mebibytes(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB" if x >= 2**20 else f"{x / 2**10:,.1f} KiB"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# Optional columns: extra_info key -> (title, formatter).
COLUMNS = {
    "flop_per_s": ("FLOP/s", lambda v: rate(v, "FLOP")),
    "bytes_per_s": ("bandwidth", lambda v: rate(v, "B")),
    "tokens_per_s": ("tokens/s", lambda v: f"{v:,.0f}"),
    "sentences_per_s": ("sentences/s", lambda v: f"{v:.3g}"),
    "mfu": ("MFU", lambda v: f"{100 * v:.1f}%"),
    "peak_memory_bytes": ("peak memory", mebibytes),
    "same_greedy_outputs": ("same greedy outputs as fastattn", lambda v: f"{100 * v:.0f}%"),
    "same_beam_outputs": ("same beam outputs as fastattn", lambda v: f"{100 * v:.0f}%"),
    "output_tokens": ("tokens/sentence", lambda v: f"{v:.1f}"),
    "cores_busy": ("cores busy", lambda v: f"{v:.2f}"),
    "model": ("model", str),
}


# --- measured results ------------------------------------------------------------------------


def family(bench: dict) -> str:
    return (bench.get("group") or bench["name"].split("[")[0]).split(" ")[0]


def impl(bench: dict) -> str:
    return str(bench["extra_info"].get("impl", bench.get("param") or bench["name"]))


def measured_tables(benchmarks: list[dict]) -> list[str]:
    families: dict[str, list[dict]] = defaultdict(list)
    for bench in benchmarks:
        families[family(bench)].append(bench)
    medians = {(b.get("group"), impl(b)): b["stats"]["median"] for b in benchmarks}
    out = []
    for name, benches in families.items():
        keys = [k for k in COLUMNS if any(k in b["extra_info"] for b in benches)]
        keys += sorted(
            {k for b in benches for k in b["extra_info"] if k.endswith("_per_s")} - set(keys)
        )
        baselines = sorted(
            {b["extra_info"]["baseline"] for b in benches if "baseline" in b["extra_info"]}
        )
        header = ["case", "impl", "median", "spread (IQR/2)", "rounds × iters"]
        header += [f"speed-up vs {' / '.join(baselines)}"] if baselines else []
        header += [COLUMNS[k][0] if k in COLUMNS else k for k in keys]
        rows = []
        order = {g: i for i, g in enumerate(dict.fromkeys(b.get("group") for b in benches))}
        for b in sorted(benches, key=lambda b: order[b.get("group")]):  # stable: run order
            s, info = b["stats"], b["extra_info"]
            row = [
                (b.get("group") or "").removeprefix(name).strip() or "–",
                impl(b),
                seconds(s["median"]),
                f"±{50 * s['iqr'] / s['median']:.1f}%",
                f"{s['rounds']} × {s['iterations']}",
            ]
            if baselines:
                base = medians.get((b.get("group"), info.get("baseline")))
                row.append(f"{base / s['median']:.2f}×" if base else "–")
            for k in keys:
                v = info.get(k)
                fmt = COLUMNS[k][1] if k in COLUMNS else (lambda v: f"{v:,.3g}")
                row.append(fmt(v) if isinstance(v, int | float | str) else "–")
            rows.append(row)
        out.append(f"### {name}\n\n{table(header, rows)}")
    return out


# Other processes' CPU use, in cores, above which a decoding row counts as not quiet.
QUIET_CORES = 0.1


def decoding_summary(benchmarks: list[dict]) -> str | None:
    """bench_decoding's cells, (model, precision, batch): each configuration's sentences/s,
    fastattn's best against CTranslate2's best, and whether the machine was quiet."""
    rows = [b for b in benchmarks if family(b) == "decoding" and "system" in b["extra_info"]]
    if not rows:
        return None
    configs = list(dict.fromkeys(  # fastattn's first, then CTranslate2's, each in run order
        (i["system"], i["workers"], i["threads"])
        for i in sorted((b["extra_info"] for b in rows), key=lambda i: i["system"] != "fastattn")
    ))
    cells: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for b in rows:
        i = b["extra_info"]
        cells[(i["model_name"], i["precision"], i["batch_size"])][
            (i["system"], i["workers"], i["threads"])] = i
    names = {"fastattn": "fastattn", "ctranslate2": "CT2"}
    header = ["model", "precision", "batch"] + [f"{names[s]} {w}×{t}" for s, w, t in configs]
    header += ["fastattn best / CT2 best", "same outputs (CT2 best, fastattn)",
               "tokens/sentence (fastattn, CT2)"]
    table_rows = []
    for (model, precision, batch), found in cells.items():
        best = {}
        for system in names:
            ran = [i for (s, *_), i in found.items() if s == system and "sentences_per_s" in i]
            best[system] = max(ran, key=lambda i: i["sentences_per_s"], default=None)
        row = [model, precision, str(batch)]
        for config in configs:
            i = found.get(config)
            row.append(f"{i['sentences_per_s']:.3g}" + (" (default)" if i.get("default") else "")
                       if i and "sentences_per_s" in i else "–")
        ours, theirs = best["fastattn"], best["ctranslate2"]
        row.append(f"{ours['sentences_per_s'] / theirs['sentences_per_s']:.2f}×"
                   if ours and theirs else "–")
        row.append(f"{100 * theirs['same_beam_outputs']:.0f}%"
                   if theirs and "same_beam_outputs" in theirs else "–")
        row.append(", ".join(f"{i['output_tokens']:.1f}" if i and "output_tokens" in i else "–"
                             for i in (ours, theirs)))
        table_rows.append(row)

    others = [b["extra_info"]["other_cores"] for b in rows if "other_cores" in b["extra_info"]]
    text = (
        "Sentences per second of each configuration (workers × threads per worker) decoding the "
        "same batches, beam 4 (see benchmarks/bench_decoding.py); the ratio sets fastattn's "
        "best configuration against CTranslate2's best in the same precision, model and batch "
        "(> 1: fastattn faster). (default): the configuration "
        "fastattn.inference.workers.choose picks."
    )
    if others:
        text += (
            "\n\nOther processes kept at most "
            f"{max(others):.2f} cores busy during a row (the machine's busy CPU time from "
            "/proc/stat less the benchmark's own), on average "
            f"{sum(others) / len(others):.2f}."
        )
        if max(others) > QUIET_CORES:
            text += (
                f"\n\n> **Not a quiet run**: other processes took up to {max(others):.2f} cores "
                "while a row ran; CTranslate2's OpenMP threads (and fastattn's) slow down badly "
                "when the cores are shared. Rerun on a quiet machine before quoting these ratios."
            )
    else:
        text += "\n\nThese results did not record whether other processes shared the cores."
    return text + "\n\n" + table(header, table_rows)


def memory_growth(benchmarks: list[dict]) -> str | None:
    """Peak memory of attention against sequence length, with the fitted exponent."""
    sweep = [b for b in benchmarks if family(b) == "attention_memory"]
    if not sweep:
        return None
    peaks: dict[str, dict[int, float]] = defaultdict(dict)
    for b in sweep:
        peaks[impl(b)][b["extra_info"]["length"]] = b["extra_info"]["peak_memory_bytes"]
    lengths = sorted({n for p in peaks.values() for n in p})
    rows = [
        [str(n)] + [mebibytes(peaks[i][n]) if n in peaks[i] else "–" for i in peaks]
        for n in lengths
    ]
    rows.append(["growth: peak ∝ L^k, k ="] + [f"{exponent(peaks[i]):.2f}" for i in peaks])
    return (
        "Extra memory of one forward+backward (B=1, H=8, D=64, fp32) above its inputs, as the "
        "sequence grows; k is the least-squares slope of log(peak) against log(L) (1 = linear, "
        "2 = quadratic).\n\n" + table(["L"] + list(peaks), rows)
    )


def exponent(points: dict[int, float]) -> float:
    xs = [math.log(n) for n in points]
    ys = [math.log(max(p, 1.0)) for p in points.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return (
        sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else float("nan")
    )


def step_targets(benchmarks: list[dict], env: dict) -> str:
    """Measured seconds per step of base and big beside the paper's P100 figures, with a row
    saying so for a preset this device did not run."""
    from benchmarks.step_cost import PAPER_BATCH, PAPER_STEP_SECONDS

    rows = []
    for preset, target in PAPER_STEP_SECONDS.items():
        target = f"{target} s"
        steps = [b for b in benchmarks if b["extra_info"].get("gpu_target_s") and
                 b["extra_info"]["preset"] == preset]  # fmt: skip
        if not steps:
            rows.append([preset, "–", "–", "not run on this device", "–", "–", target])
        for b in steps:
            info, stats = b["extra_info"], b["stats"]
            rows.append([
                preset, info["precision"], f"{info['tokens']:,}", seconds(stats["median"]),
                f"±{50 * stats['iqr'] / stats['median']:.1f}%",
                f"{100 * info['mfu']:.1f}%" if "mfu" in info else "–", target,
            ])  # fmt: skip
    device = env.get("device", "this device")
    header = f"preset|precision|tokens/step|s/step on {device}|spread|MFU|the paper, 8 P100"
    note = f"The paper's batch per GPU ({PAPER_BATCH}), forward + backward + Adam."
    if env.get("device_type") != "cuda":
        note += (
            " The paper's GPU step times are quoted, not measured: this run had no GPU, so the "
            "rows are this CPU's own step time on the same batch (big, 3.4x base's FLOP, runs on "
            "GPUs only). The projection below gives what the step's cost model predicts on GPUs."
        )
    return note + "\n\n" + table(header.split("|"), rows)


# --- projection ------------------------------------------------------------------------------


# Host time per eager kernel launch (PyTorch's dispatch plus the CUDA launch), the range.
LAUNCH_SECONDS = (5e-6, 10e-6)


def projection() -> str:
    """Roofline lower bounds of the step time on GPUs, from the cost model, and the bound the
    host's launches set on the mixed-precision step (benchmarks.launches; not measured)."""
    from benchmarks import launches
    from benchmarks.gpus import GPUS
    from benchmarks.step_cost import (
        PAPER_BATCH,
        PAPER_STEP_SECONDS,
        SENTENCES,
        SRC_LEN,
        model_flop,
        paper_shape,
        roofline_seconds,
    )

    shapes = {name: paper_shape(name) for name in ("base", "big")}
    counted = {name: launches.trace(name, SENTENCES, SRC_LEN, s.vocab)["launches"]
               for name, s in shapes.items()}
    rows = []
    for gpu in GPUS:
        row = [gpu.name]
        for name, shape in shapes.items():
            fp32 = roofline_seconds(
                shape,
                matmul_flop_per_s=gpu.fp32,
                other_flop_per_s=gpu.fp32,
                bytes_per_s=gpu.bandwidth,
                e=4,
            )
            half = roofline_seconds(
                shape,
                matmul_flop_per_s=gpu.half,
                other_flop_per_s=gpu.fp32,
                bytes_per_s=gpu.bandwidth,
                e=2,
            )
            # The host enqueues while the GPU runs (one sync per update): the slower one bounds.
            low, high = (max(half, counted[name] * t) for t in LAUNCH_SECONDS)
            bound = seconds(low) if low == high else f"{seconds(low)} to {seconds(high)}"
            row += [seconds(fp32), f"{seconds(half)} ({gpu.half_dtype})", bound]
        rows.append(row)
    header = ["GPU"] + [f"{n} {p}" for n in shapes
                        for p in ("fp32", "mixed", "mixed with launches")]
    flops = ", ".join(
        f"{n} {model_flop(s) / 1e12:.2f} TFLOP per step (the paper's {PAPER_STEP_SECONDS[n]} s "
        f"on a P100 means {model_flop(s) / PAPER_STEP_SECONDS[n] / GPUS[0].fp32:.0%} of its fp32 "
        "peak)"
        for n, s in shapes.items()
    )
    counts = ", ".join(f"{n} {c:,}" for n, c in counted.items())
    return (
        "**Projection, not a measurement.** Lower bounds on one training step at the paper's "
        f"per-GPU batch ({PAPER_BATCH}), from the op-by-op FLOP and bytes of "
        "`benchmarks/step_cost.py`: each op at the slower of peak compute and peak bandwidth "
        "(published dense figures in `benchmarks/gpus.py`), no communication. \"mixed with "
        "launches\" bounds the mixed-precision step by the host as well: the kernel launches of "
        f"one bf16 update that `python -m benchmarks.launches` counts ({counts}) at "
        f"{LAUNCH_SECONDS[0] * 1e6:.0f} to {LAUNCH_SECONDS[1] * 1e6:.0f} µs of eager dispatch "
        "each, overlapped with the GPU's work (no host sync: the trainer reads an update after "
        "launching the next). The paper: "
        f"{PAPER_STEP_SECONDS['base']} s (base) and {PAPER_STEP_SECONDS['big']} s (big) per step "
        "on 8 P100s. Real steps take longer; no GPU was used to produce this table. "
        f"Model FLOPs: {flops}.\n\n" + table(header, rows)
    )


def compile_summary(rows: list[dict]) -> str:
    per: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        per[(r["module"].rsplit(".", 1)[-1], r["arch"])].append(r)
    summary = [
        [
            module,
            f"sm_{arch}",
            str(len(rs)),
            str(max(r["registers"] for r in rs)),
            str(sum(r["spill_bytes"] > 0 for r in rs)),
            mebibytes(max(r["shared_bytes"] for r in rs)),
            f"{sum(r['mma'] or r['wgmma'] or r.get('tcgen05', False) for r in rs)}/{len(rs)}",
        ]
        for (module, arch), rs in sorted(per.items())
    ]
    detail = [
        [
            r["module"].rsplit(".", 1)[-1],
            r["name"],
            f"sm_{r['arch']}",
            str(r["num_warps"]),
            str(r["num_stages"]),
            str(r["registers"]),
            str(r["spill_bytes"]),
            mebibytes(r["shared_bytes"]),
            next((kind for kind in ("tcgen05", "wgmma", "mma") if r.get(kind)), "no"),
        ]
        for r in rows
    ]
    return (
        "Every shipped kernel configuration compiled with `triton.compile` for each architecture "
        "(`python -m fastattn.kernels.compile_report`); static facts of the binaries, no GPU "
        "run.\n\n"
        + table(
            "kernels|arch|configs|max registers|configs spilling|max shared memory|"
            "tensor-core configs".split("|"),
            summary,
        )
        + "\n\n<details><summary>every configuration</summary>\n\n"
        + table(
            "kernels|config|arch|warps|stages|registers|spill bytes|shared memory|"
            "tensor cores".split("|"),
            detail,
        )
        + "\n\n</details>"
    )


# --- the document ----------------------------------------------------------------------------

HOW_TO_READ = (
    "Times are medians over rounds (each round the mean of `iters` calls), after untimed "
    "warm-up calls (three and a warm-up round for calls under a second, two for slower ones; "
    "see benchmarks/common.py); spread is half the "
    "interquartile range relative to the median. Speed-up = the baseline's median / this "
    "median (> 1: faster). FLOP/s and bandwidth credit every implementation of a case with the "
    "same useful work (see each bench_*.py), so they compare like times. Peak memory is what "
    "one call allocates above its inputs at its high-water mark (CUDA: max_memory_allocated; "
    "CPU: torch's allocation events from the profiler)."
)


def held_section(level: str, results: dict) -> list[str]:
    """The training and decoding tables of a run held to `level`, beside the native ones."""
    env = results["machine_info"].get("fastattn_environment", {})
    benchmarks = [b for b in results["benchmarks"] if family(b) in ("train_step", "decoding")]
    lines = [f"## Measured with every library held to {level.upper()}", "",
             f"`python -m benchmarks.report --isa {level}` on {env.get('device', '?')} "
             f"(fastattn._C at {env.get('cpu_isa', '?')}; {env.get('held', {})}), "
             f"{results.get('datetime', '?')[:19].replace('T', ' ')} UTC: the figures an "
             f"{level.upper()} CPU of this kind would see.", ""]
    decoding = decoding_summary(benchmarks)
    if decoding:
        lines += ["### Decoding against CTranslate2", "", decoding, ""]
    for section in measured_tables(benchmarks):
        lines += [section, ""]
    return lines


def render(results: dict, compile_rows: list[dict] | None, compile_problem: str,
           held: dict[str, dict] | None = None) -> str:
    env = results["machine_info"].get("fastattn_environment", {})
    benchmarks = results["benchmarks"]
    device = env.get("device", "unknown device")
    commit = results.get("commit_info", {})
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.report` — do not edit by hand; rerun it. Raw results: "
        "`benchmarks/results.json` (pytest-benchmark JSON).",
        "",
    ]
    if env.get("quick_mode"):
        lines += ["> **QUICK MODE**: a smoke run on tiny shapes; these numbers mean nothing.", ""]
    lines += [
        f"- device: {device}, {env.get('torch_threads')} torch threads; fastattn backend "
        f"`{env.get('fastattn_backend')}`"
        + (
            " (on CPU: Triton's interpreter, so fastattn rows time a simulator, not kernels)"
            if env.get("fastattn_backend") == "triton" and env.get("device_type") == "cpu"
            else ""
        ),
        f"- torch {env.get('torch')}, triton {env.get('triton')}, fastattn {env.get('fastattn')}, "
        f"Python {env.get('python')}" + (f", CUDA {env['cuda']}" if env.get("cuda") else ""),
        f"- date {results.get('datetime', '?')[:19].replace('T', ' ')} UTC, commit "
        f"{commit.get('id', '?')[:10]}{' (uncommitted changes)' if commit.get('dirty') else ''}",
    ]
    if env.get("low_precision_measured") is False:
        lines.append(
            "- float32 only: this CPU has no bf16 instructions (AVX-512 BF16, AMX), so bf16 "
            "would time a generic fallback that fastattn.train does not use here"
        )
    for key, basis in env.items():
        if key.endswith("_basis"):
            lines.append(
                f"- peak {key.removeprefix('peak_').removesuffix('_basis')} for MFU: {basis}"
            )
    if "suite_seconds" in results:
        lines.append(
            f"- the suite ran for {results['suite_seconds'] / 60:.1f} min"
            + (
                f" (pytest exit code {results['pytest_exit_code']}: some benchmarks "
                "failed, see its output)"
                if results.get("pytest_exit_code")
                else ""
            )
        )
    lines += [
        "",
        HOW_TO_READ,
        "",
        "## Measured",
        "",
    ]
    lines += [
        "### Training step beside the paper's step times",
        "",
        step_targets(benchmarks, env),
        "",
    ]
    decoding = decoding_summary(benchmarks)
    if decoding:
        lines += ["### Decoding against CTranslate2", "", decoding, ""]
    growth = memory_growth(benchmarks)
    if growth:
        lines += ["### Attention memory as the sequence grows", "", growth, ""]
    for section in measured_tables(benchmarks):
        lines += [section, ""]
    for level, held_results in (held or {}).items():
        lines += held_section(level, held_results)
    lines += ["## Projected (not measured): step time on GPUs", "", projection(), ""]
    lines += ["## Static GPU compile report (not measured: compiled, never run)", ""]
    lines += [
        compile_summary(compile_rows) if compile_rows else f"Not available: {compile_problem}"
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--json", type=Path, help="render these results instead of running")
    parser.add_argument("--save", type=Path, default=RESULTS, help="where a run writes its JSON")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the Markdown to write")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny shapes, few rounds")
    parser.add_argument("--isa", choices=["avx2"],
                        help="run with every library held to this instruction-set level "
                             "(FASTATTN_CPU_ISA, ATEN_CPU_CAPABILITY, MKL, oneDNN, CTranslate2) "
                             "into benchmarks/results_<isa>.json; BENCHMARKS.md shows it beside "
                             "the native run")
    parser.add_argument(
        "--compile-report",
        type=Path,
        default=COMPILE_REPORT,
        metavar="JSON",
        help="the compile report's JSON: a run rewrites it, rendering --json results reuses it",
    )
    parser.add_argument(
        "--no-compile-report", action="store_true", help="leave the static GPU compile report out"
    )
    args = parser.parse_args(argv)

    if args.isa:  # a held run is saved beside the native one and rendered with it
        held_path = RESULTS.with_name(f"results_{args.isa}.json")
        code, wall = run_suite(held_path, args.quick, pytest_args, args.isa)
        if not held_path.exists():
            sys.exit(f"the benchmark run wrote no results (pytest exit code {code})")
        args.json = args.json or RESULTS
    if args.json is None:
        code, wall = run_suite(args.save, args.quick, pytest_args)
        if not args.save.exists():
            sys.exit(f"the benchmark run wrote no results (pytest exit code {code})")
        results = json.loads(args.save.read_text())
        results["suite_seconds"], results["pytest_exit_code"] = wall, code
        args.save.write_text(json.dumps(results, indent=1))
    else:
        results = json.loads(args.json.read_text())

    problem = "left out (--no-compile-report)" if args.no_compile_report else ""
    if not problem and (args.json is None or not args.compile_report.exists()):
        problem = run_compile_report(args.compile_report)
    compile_rows = None if problem else json.loads(args.compile_report.read_text())
    # Held runs sit beside the native results they are shown with (benchmarks/results_avx2.json
    # beside results.json): rendering other results shows only the held runs saved beside them.
    native = args.json or args.save
    held = {level: json.loads(path.read_text()) for level in ("avx2",)
            if (path := native.with_name(f"results_{level}.json")).exists()}
    args.output.write_text(render(results, compile_rows, problem, held))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
