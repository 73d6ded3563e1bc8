"""The numeric precision of training: --precision auto measures on a CPU what bf16 gains."""

from __future__ import annotations

import time

import torch

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
