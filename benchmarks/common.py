"""The measurement protocol every benchmark follows: one device, one timing rule, one honest peak
memory figure, and the device's peak FLOP/s for utilisation.

Timing: untimed calls first (lazy initialisation, allocator warm-up, autotuning): three, one of
them profiled for memory, plus a warm-up round, for calls under a second; two for slower ones.
Then rounds of `iterations` calls each, sized so a round lasts about ROUND_SECONDS and the whole
benchmark about BUDGET_SECONDS, never fewer than MIN_ROUNDS rounds (callers lower that for calls
of several seconds). CUDA work is synchronised
inside every timed call. FASTATTN_BENCH_QUICK=1 shrinks shapes and rounds to a smoke run (its
numbers mean nothing).

Peak memory: bytes allocated by one call above what was allocated when it started, at the
high-water mark. On CUDA from torch.cuda.max_memory_allocated; on CPU from the allocation events
torch's profiler records for every CPU tensor allocation and free (profile_memory=True), replayed
in time order — the CPU equivalent of max_memory_allocated, not the process RSS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

QUICK = os.environ.get("FASTATTN_BENCH_QUICK", "0") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CORES = len(os.sched_getaffinity(0))

# What holds every library of a run to an instruction-set level (set before the process starts:
# each reads its variable when it loads): fastattn._C, ATen's kernels, MKL, oneDNN, CTranslate2.
HELD_ISA = {
    "avx2": {"FASTATTN_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "CT2_FORCE_CPU_ISA": "AVX2"},
    "avx512": {"FASTATTN_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
               "CT2_FORCE_CPU_ISA": "AVX512"},
    # AVX-512 with AMX's tiles (MKL and CTranslate2 name no AMX level of their own).
    "amx": {"FASTATTN_CPU_ISA": "amx", "ATEN_CPU_CAPABILITY": "avx512",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
            "CT2_FORCE_CPU_ISA": "AVX512"},
}


def run_held(module: str, level: str, *args: str, one_thread: bool = False) -> str:
    """The last line `python -m module *args` prints, run with every library held to `level`
    (HELD_ISA) and, with one_thread, OpenMP at one thread: the scripts' per-level children."""
    env = {**os.environ, **HELD_ISA[level], **({"OMP_NUM_THREADS": "1"} if one_thread else {})}
    done = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


ROUND_SECONDS = 0.01 if QUICK else 0.05
BUDGET_SECONDS = 0.05 if QUICK else 1.0
MIN_ROUNDS = 2 if QUICK else 5
MAX_ROUNDS = 5 if QUICK else 200


def low_precision() -> torch.dtype:
    """The 16-bit dtype training uses on this device: bf16 where supported, else fp16."""
    if DEVICE.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def low_precision_has_hardware() -> bool:
    """Every CUDA GPU has fast 16-bit math; a CPU only with bf16 instructions (AVX-512 BF16,
    AMX): elsewhere bf16 matmuls take a generic path (a multi30k training step measured 20x
    slower than fp32 on an AVX2 CPU), and fastattn.train uses fp32."""
    return DEVICE.type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Names, so pytest-benchmark's JSON keeps them. The 16-bit dtype only where the device has
# hardware for it: timing a generic fallback measures nothing a user would run.
DTYPES = ("float32",) + ((dtype_name(low_precision()),) if low_precision_has_hardware() else ())


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def measure(
    benchmark,
    fn: Callable[[], object],
    *,
    group: str,
    flop: float | None = None,
    bytes_moved: float | None = None,
    min_rounds: int = MIN_ROUNDS,
    **info,
) -> None:
    """Times fn with pytest-benchmark and records FLOP, bytes moved, their rates and peak memory
    in extra_info; `info` adds descriptive fields (impl, shape, dtype, ...)."""

    def call():
        fn()
        synchronize()

    once = seconds(call)
    if once < 1.0:  # time a warm call too; for slower ones the profiled call below warms up
        once = seconds(call)
    iterations = max(1, round(ROUND_SECONDS / once))
    rounds = round(BUDGET_SECONDS / (once * iterations))
    rounds = min(MAX_ROUNDS, max(MIN_ROUNDS if QUICK else min_rounds, rounds))

    benchmark.group = group
    benchmark.extra_info.update(info)
    benchmark.extra_info["peak_memory_bytes"] = peak_memory(fn)
    if flop is not None:
        benchmark.extra_info["flop"] = flop
    if bytes_moved is not None:
        benchmark.extra_info["bytes_moved"] = bytes_moved
    warmup_rounds = 1 if once * iterations < 1.0 else 0
    benchmark.pedantic(call, rounds=rounds, iterations=iterations, warmup_rounds=warmup_rounds)
    if benchmark.stats is None:  # --benchmark-disable: nothing was timed
        return
    median = benchmark.stats.stats.median
    if flop is not None:
        benchmark.extra_info["flop_per_s"] = flop / median
    if bytes_moved is not None:
        benchmark.extra_info["bytes_per_s"] = bytes_moved / median


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def peak_memory(fn: Callable[[], object]) -> int:
    """The high-water mark of the bytes fn allocates above the level at its start, whether or not
    it frees them before returning. See the module docstring for how."""
    if DEVICE.type == "cuda":
        synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        synchronize()
        return torch.cuda.max_memory_allocated() - start

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocations = sorted(
        (event.start_time_ns, event.extra_fields.alloc_size)
        for event in walk(tree)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu"
    )
    level = peak = 0
    for _, size in allocations:
        level += size
        peak = max(peak, level)
    return peak


def attention_flop(
    batch: int, heads: int, lq: int, lk: int, head_dim: int, *, causal: bool, backward: bool
) -> float:
    """FLOP of softmax(q k^T) v: two matmuls of 2 FLOP per multiply-add over the (query, key)
    pairs attended, all of them or the lower triangle (top-left aligned) when causal. Backward
    adds 2.5x forward (five matmuls against two), the FlashAttention convention. Every
    implementation is credited with the same useful FLOP, so rates compare like times do."""
    pairs = lq * lk
    if causal:
        pairs = sum(min(i + 1, lk) for i in range(lq))
    forward = 4 * batch * heads * pairs * head_dim
    return forward * (3.5 if backward else 1.0)


def cpu_peak_flop_per_s(dtype: torch.dtype) -> tuple[float, str]:
    """An estimate of the CPU's peak dense FLOP/s for `dtype` from /proc/cpuinfo, with the
    arithmetic spelled out: cores x FMA lanes per cycle x 2 FLOP x clock. It is an estimate (the
    clock is the one /proc/cpuinfo reports, turbo and throttling are ignored)."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    ghz = float(fields.get("cpu MHz", "0")) / 1000
    zen4 = fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"
    if "avx512f" in flags and not zen4:
        lanes, why = 32, "two 512-bit FMA pipes"
    elif "avx512f" in flags or "avx2" in flags:
        lanes, why = 16, "two 256-bit FMA pipes"
    else:
        lanes, why = 8, "two 128-bit FMA pipes"
    per_cycle = 2 * lanes
    if dtype in (torch.bfloat16, torch.float16):
        if "amx_bf16" in flags:
            per_cycle, why = 1024, "AMX bf16 tiles"
        elif "avx512_bf16" in flags:
            per_cycle, why = 2 * per_cycle, f"{why} with AVX-512 BF16 pair dot products"
    peak = CORES * per_cycle * ghz * 1e9
    text = (
        f"{CORES} cores x {per_cycle} {dtype_name(dtype)} FLOP/cycle ({why}) x {ghz:.2f} GHz"
        f" = {peak / 1e9:.0f} GFLOP/s (estimate from /proc/cpuinfo)"
    )
    return peak, text


def device_peak_flop_per_s(dtype: torch.dtype) -> tuple[float, str] | None:
    """Peak FLOP/s of the device benchmarks run on, or None for an unknown GPU."""
    if DEVICE.type == "cpu":
        return cpu_peak_flop_per_s(dtype)
    from benchmarks.gpus import GPUS

    name = torch.cuda.get_device_name()
    for gpu in GPUS:
        if gpu.match in name:
            peak = gpu.fp32 if dtype == torch.float32 else gpu.half
            return peak, f"{gpu.name} published dense {dtype_name(dtype)} peak"
    return None


def device_name() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.partition(':')[2].strip()} ({CORES} cores)"
    return f"CPU ({CORES} cores)"
