"""python -m fastattn.tools.info: what this installation runs, as `python -m xformers.info` prints
it.

Versions, the extension fastattn._C, Triton, the backend override, the CPU's vector features, the
instruction-set level the native kernels run at (FASTATTN_CPU_ISA), the GPU, and the dispatch
table: for every op, device, dtype and grad mode, the implementation fastattn.backend.implementation
names, which is the function the ops ask on every call.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

import fastattn
from fastattn import _native, backend
from fastattn.backend import OPS, implementation
from fastattn.cli import ArgumentParser
from fastattn.inference import native

DEVICES = ("cpu", "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
GRAD_MODES = {"inference": False, "training": True}
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile",
                "amx_bf16", "amx_int8")


# Rows beyond one per op: (label, op, keywords for implementation); the label reads as an op.
WIDE_HEAD_DIM = backend.TRITON_MAX_HEAD_DIM + 1
VARIANTS = {f"attention[D>{backend.TRITON_MAX_HEAD_DIM}]": ("attention",
                                                           {"head_dim": WIDE_HEAD_DIM})}


def dispatch_table() -> list[tuple[str, str, str, str, str]]:
    """(op, device, dtype, grad mode, implementation) for every combination, and for attention
    with heads wider than the Triton kernels' (VARIANTS); where the backend override cannot be
    honoured, the implementation is the error's first words."""
    rows = []
    labels = [(op, op, {}) for op in OPS]
    labels += [(label, op, kwargs) for label, (op, kwargs) in VARIANTS.items()]
    for label, op, kwargs in labels:
        for device in DEVICES:
            for dtype_name, dtype in DTYPES.items():
                for mode, requires_grad in GRAD_MODES.items():
                    try:
                        impl = implementation(op, device, dtype, requires_grad, **kwargs)
                    except RuntimeError as e:
                        impl = f"error: {str(e).split(':')[0]}"
                    rows.append((label, device, dtype_name, mode, impl))
    return rows


def _cpu_features() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return "unknown (no /proc/cpuinfo)"
    flags: set[str] = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return " ".join(f"{name}={'yes' if name in flags else 'no'}" for name in CPU_FEATURES)


def _extension() -> str:
    if fastattn.native is None:
        return "not built"
    cuda_search = torch._C._dispatch_has_kernel_for_dispatch_key("fastattn::beam_search_step",
                                                                 "CUDA")
    return f"built ({fastattn.native.__file__}); CUDA beam search compiled in: " \
           f"{'yes' if cuda_search else 'no'}"


def _cpu_isa() -> str:
    """The instruction-set level fastattn._C's CPU kernels run at, and why."""
    if fastattn.native is None:
        return "none (fastattn._C not built)"
    best = torch.ops.fastattn.supported_cpu_isa()
    level = _native.cpu_isa()
    held = os.environ.get("FASTATTN_CPU_ISA")
    why = f"held by FASTATTN_CPU_ISA={held}" if held else "FASTATTN_CPU_ISA unset"
    return f"{level} (this CPU's best: {best}; {why}; levels: {', '.join(_native.CPU_ISA_LEVELS)})"


def _decoding() -> str:
    """The native decoder's precisions and the int8 and bf16 dot products it runs here."""
    if not native.NATIVE_DECODER_STEP:
        return "python (fastattn._C not built): fp32"
    int8 = torch.ops.fastattn.int8_kernel() if native.NATIVE_INT8 else "not built"
    bf16 = torch.ops.fastattn.bf16_kernel() if native.NATIVE_BF16 else "not built"
    return f"native: {', '.join(native.PRECISIONS)}; int8 kernel {int8}, bf16 kernel {bf16}"


def _triton() -> tuple[str, str]:
    if backend.TRITON_PROBLEM is not None:
        return "not usable", backend.TRITON_PROBLEM
    import triton

    interpreter = "on" if backend.interpreter_active() else "off"
    return f"{triton.__version__}, usable", f"interpreter (TRITON_INTERPRET=1) {interpreter}"


def _gpu() -> str:
    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(0)
    return (f"{torch.cuda.device_count()} x {props.name}, sm_{props.major}{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")


def report(all_devices: bool = False) -> str:
    """The machine and the dispatch table: this machine's devices' rows, or every device's."""
    triton_state, interpreter = _triton()
    lines = [
        f"{'python':<28}{platform.python_version()} ({sys.executable})",
        f"{'torch':<28}{torch.__version__}",
        f"{'triton':<28}{triton_state}; {interpreter}",
        f"{'fastattn':<28}{fastattn.__version__}",
        f"{'fastattn._C':<28}{_extension()}",
        f"{'backend (FASTATTN_BACKEND)':<28}{backend.get_backend()}",
        f"{'cpu':<28}{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads",
        f"{'cpu features':<28}{_cpu_features()}",
        f"{'cpu isa (FASTATTN_CPU_ISA)':<28}{_cpu_isa()}",
        f"{'gpu':<28}{_gpu()}",
        f"{'cpu decoding':<28}{_decoding()}",
        "",
        "dispatch: op, device, dtype, grad mode -> implementation (attention masked or causal; "
        f"attention[D>{backend.TRITON_MAX_HEAD_DIM}]: heads wider than the Triton kernels')",
    ]
    rows = dispatch_table()
    here = {"cpu", "cuda"} if all_devices or torch.cuda.is_available() else {"cpu"}
    lines += [f"  {op:<30}{device:<6}{dtype:<6}{mode:<11}{impl}"
              for op, device, dtype, mode, impl in rows if device in here]
    hidden = sum(device not in here for _, device, *_ in rows)
    if hidden:
        lines.append(f"  (and {hidden} cuda rows: no GPU here; --all prints them)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m fastattn.tools.info",
                            description=" ".join(__doc__.split("\n")[:2]))
    parser.add_argument("--all", action="store_true",
                        help="print every device's dispatch rows, not only this machine's")
    print(report(parser.parse_args(argv).all))


if __name__ == "__main__":
    main()
