"""The numeric precision of training: --precision auto measures on a CPU what bf16 gains; a
resumed run keeps its checkpoint's."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BF16_MIN_SPEEDUP = 1.25  # a bf16 step also pays for casts, so its matmuls must win clearly


def bf16_matmul_speedup() -> float:
    """fp32 time / bf16 time of a matmul shaped like a training step's (2048 tokens, 256 to
    1024 features) on this CPU, best of five each: AMX makes bf16 several times faster, AVX-512
    BF16 alone can make it slower (0.5–0.9× on an Intel Xeon without AMX)."""
    a, b = torch.randn(2048, 256), torch.randn(256, 1024)

    def best_time(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)  # the first call picks and prepares the kernel
        times = []
        for _ in range(5):
            started = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - started)
        return min(times)

    return best_time(a, b) / best_time(a.bfloat16(), b.bfloat16())


def pick_precision(name: str, device: torch.device) -> tuple[torch.dtype | None, bool, str]:
    """(autocast dtype or None, whether to scale the loss, what was chosen and why) for
    --precision on a device. `auto` on a CPU measures instead of trusting the instruction set."""
    why = "as asked"
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
            why = "auto on this GPU"
        elif not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            # Without bf16 instructions (AVX-512 BF16, AMX) bf16 matmuls take a slow generic
            # path: measured 30× slower than fp32 on an AVX2-only CPU.
            name, why = "fp32", "auto: this CPU has no bf16 instructions"
        else:
            speedup = bf16_matmul_speedup()
            name = "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"
            why = (f"auto: bf16 matmuls measured {speedup:.2f}× the speed of fp32 here "
                   f"(bf16 from {BF16_MIN_SPEEDUP}×)")
    if name == "fp16" and device.type != "cuda":
        raise SystemExit("error: --precision fp16 needs a GPU; use bf16 or fp32 on CPU")
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    return dtypes[name], name == "fp16", why


def choose_precision(args, state: dict[str, Any] | None, resume: Path | None,
                     device: torch.device, distributed: bool, log: Callable[[str], None]
                     ) -> tuple[torch.dtype | None, torch.amp.GradScaler | None, str]:
    """(autocast dtype or None, loss scaler or None, "fp32", "bf16" or "fp16") of a run
    (args: its TrainConfig), logged. A run resumed from the checkpoint `state` keeps the
    precision that trained it (--precision auto is not measured again: a busier machine could
    choose otherwise and the run would no longer be the uninterrupted one's), unless
    --precision names another."""
    saved = None
    if state is not None:
        saved = state["meta"].get("precision")
        flags = state["meta"].get("config") or state["meta"].get("args") or {}
        if saved is None and flags.get("precision", "auto") != "auto":
            saved = flags["precision"]  # asked for by name
    name = args.precision
    if saved is not None and name == "auto":
        name, why = saved, f"kept from {resume.name}"
    elif saved is not None and name != saved:
        log(f"--resume: --precision {name} instead of the checkpoint's {saved}; the run goes "
            "on with it, so it is no longer the uninterrupted run's")
    autocast, use_scaler, measured = pick_precision(name, device)
    if name == args.precision:
        why = args.precision_why or measured  # measured once for every member
    if distributed and device.type == "cpu":  # each rank measured: rank 0 decides
        use_bf16 = torch.tensor([autocast is not None])
        dist.broadcast(use_bf16, 0)
        autocast = torch.bfloat16 if use_bf16.item() else None
    scaler = torch.amp.GradScaler(device.type) if use_scaler else None
    chosen = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[autocast]
    described = {"fp32": "fp32", "bf16": "bf16 autocast",
                 "fp16": "fp16 autocast with dynamic loss scaling"}[chosen]
    log(f"device {device}, {torch.get_num_threads()} threads per process, {described} ({why})")
    return autocast, scaler, chosen
