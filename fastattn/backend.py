"""Which implementation runs an op: the one place that answers it (`implementation`), asked by
the op layer (fastattn.ops) on every call and printed by `python -m fastattn.tools.info`.

Implementations: "triton" (the kernels in kernels/, on CUDA), "triton-interpreter" (the same
kernels on CPU tensors through Triton's interpreter), "fastattn._C" (the extension's CPU
kernels) and "torch" (PyTorch's own ops, always available; float64 always runs there).

The backend override, read from FASTATTN_BACKEND at import and changed with set_backend():
"auto" (the default) picks per device as documented in `implementation`; "triton" runs the
Triton kernels everywhere, on CPU tensors through the interpreter, which only works if
TRITON_INTERPRET=1 was set before triton was imported; "torch" runs PyTorch everywhere, except
that fastattn._C's CPU kernels still run where they apply. Besides the seed table that
fastattn.ops.seeds.from_device sets for a block, this is the only global state in fastattn.
"""

from __future__ import annotations

import os
import warnings

import torch

from fastattn._native import native

BACKENDS = ("auto", "triton", "torch")
OPS = ("attention", "dropout", "layer_norm_residual", "label_smoothed_cross_entropy",
       "linear_cross_entropy", "relu_backward_bias", "embedding")
# Supported: >= 3.6, < 3.10, what is tested: CI runs 3.9 and compiles the kernels' subset under
# 3.6 too (the GPU machine's image; tests/test_compile_report.py); 3.7 and 3.8 compiled it once.
TRITON_RANGE = ((3, 6), (3, 10))
TRITON_REQUIREMENT = "triton>={}.{},<{}.{}".format(*TRITON_RANGE[0], *TRITON_RANGE[1])
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The widest attention head the Triton kernels cover (kernels/attention.py's MAX_HEAD_DIM, which
# tests/test_info.py checks it equals); wider heads run where the Triton backend is off.
TRITON_MAX_HEAD_DIM = 256
# The floating dtypes every op takes (float64 runs PyTorch); check_float names them.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"fastattn backend must be one of {BACKENDS}, got {name!r}")
    return name


def _check_triton() -> str | None:
    """Returns why Triton cannot be used, or None when it can."""
    try:
        import triton
    except ImportError as e:
        return f"triton is not installed ({e}); install {TRITON_REQUIREMENT}"
    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
    low, high = TRITON_RANGE
    if not low <= version < high:
        return f"triton {triton.__version__} is not supported: fastattn needs {TRITON_REQUIREMENT}"
    return None


_backend = _check_backend(os.environ.get("FASTATTN_BACKEND", "auto"))
TRITON_PROBLEM = _check_triton()
if TRITON_PROBLEM is not None:
    warnings.warn(f"{TRITON_PROBLEM}; fastattn runs its ops with PyTorch", stacklevel=2)


def set_backend(name: str) -> None:
    """Selects "auto", "triton" or "torch" for every fastattn op from now on."""
    global _backend
    _backend = _check_backend(name)


def get_backend() -> str:
    return _backend


def _interpreter_on() -> bool:
    if TRITON_PROBLEM is not None:
        return False
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Fixed when triton is imported, so it is read once: a plain global that torch.compile may bake
# in (torch.compiler.assume_constant_result would do the same but imports dynamo, 1.5 s).
_INTERPRETER = _interpreter_on()


def interpreter_active() -> bool:
    """True if Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRETER


def _triton_on(device_type: str) -> str | None:
    """The Triton implementation the backend runs on this device ("triton" or
    "triton-interpreter"), or None; raises if FASTATTN_BACKEND=triton cannot be honoured."""
    if _backend == "torch":
        return None
    if _backend == "auto":
        return "triton" if device_type == "cuda" and TRITON_PROBLEM is None else None
    if TRITON_PROBLEM is not None:
        raise RuntimeError(f"FASTATTN_BACKEND=triton but {TRITON_PROBLEM}")
    if device_type != "cpu":
        return "triton"
    if not interpreter_active():
        raise RuntimeError(
            "FASTATTN_BACKEND=triton on CPU tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton is imported"
        )
    return "triton-interpreter"


def check_float(op: str, **tensors: torch.Tensor | None) -> None:
    """Raises TypeError naming the first tensor (keyword name) whose dtype is not one of
    FLOAT_DTYPES, and the dtypes accepted: one clear error before any kernel sees it."""
    for name, x in tensors.items():
        if x is not None and x.dtype not in FLOAT_DTYPES:
            accepted = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
            raise TypeError(f"{op}: {name} has dtype {str(x.dtype).removeprefix('torch.')}; "
                            f"accepted: {accepted}")


def _native_takes(device_type: str, *dtypes: torch.dtype | None,
                  allowed: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether fastattn._C's CPU kernels take tensors of these dtypes (None: tensor absent)."""
    return (native is not None and device_type == "cpu"
            and all(d is None or d in allowed for d in dtypes))


# Dtypes fastattn._C's attention and cross-entropy kernels read as they are (float32 inside).
NATIVE_DTYPES = (torch.float32, torch.bfloat16)
# Dtypes the float32 fastattn._C kernels take after a conversion to float32: on CPU the
# conversions cost less than the unfused PyTorch chain (serial dropout generator) they replace.
UPCAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native_reads_as_is(device_type: str, dtype: torch.dtype, residual_dtype: torch.dtype | None,
                       param_dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether fastattn._C's layer_norm_residual reads its inputs without fp32 copies: all fp32,
    or (post-norm under CPU autocast) a bf16 x beside an fp32 residual stream and parameters."""
    stream = (residual_dtype, *param_dtypes)
    return (_native_takes(device_type, dtype, *stream)
            or (residual_dtype is not None and dtype == torch.bfloat16
                and _native_takes(device_type, *stream)))


def implementation(op: str, device: torch.device | str, dtype: torch.dtype,
                   requires_grad: bool = False, *, masked: bool = True,
                   residual_dtype: torch.dtype | None = None,
                   param_dtypes: tuple[torch.dtype, ...] = (),
                   head_dim: int | None = None) -> str:
    """The implementation that runs `op` (one of OPS) on inputs of `device` and `dtype`.

    requires_grad: a backward will follow (grad mode on and an input requires grad).
    masked: attention with a mask or causal. head_dim: attention's D (None: any the Triton
    kernels cover). residual_dtype, param_dtypes: layer_norm_residual's residual (None: none)
    and weight/bias dtypes. Raises RuntimeError where FASTATTN_BACKEND=triton cannot be
    honoured. Per op, where the Triton kernels do not run:
    - attention: fastattn._C for fp32/bf16 calls needing a gradient that are masked, causal or
      fp32 (benchmarks/bench_attention.py measured it faster there; unmasked bf16 runs PyTorch's
      faster bf16 matrix products, inference PyTorch's fused kernel), else PyTorch. Heads wider
      than TRITON_MAX_HEAD_DIM never run the Triton kernels: they run what the "torch" backend
      runs (PyTorch on GPUs; fastattn._C or PyTorch on CPU, as above).
    - dropout: fastattn._C's counter-based mask on CPU fp32/bf16/fp16 (computed in fp32),
      PyTorch elsewhere. Under the Triton backend, PyTorch.
    - layer_norm_residual: fastattn._C on CPU when native_reads_as_is, or when x and residual
      are not all fp32 but every tensor is fp32/bf16/fp16 (run on fp32 copies); else PyTorch.
    - label_smoothed_cross_entropy: PyTorch.
    - linear_cross_entropy: fastattn._C's chunk gradient on CPU fp32/bf16 with a gradient, else
      PyTorch.
    - relu_backward_bias: PyTorch.
    - embedding: PyTorch."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: expected one of {OPS}")
    device_type = torch.device(device).type
    if dtype == torch.float64 and op != "dropout":
        return "torch"  # the reference precision: the kernels have no fp64
    if op == "dropout":  # the Triton backend draws PyTorch's masks (raising where it cannot run)
        if device_type != "cpu" or _triton_on(device_type) is not None:
            return "torch"
        return "fastattn._C" if _native_takes(device_type, dtype, allowed=UPCAST_DTYPES) \
            else "torch"
    triton = _triton_on(device_type)
    wide = op == "attention" and head_dim is not None and head_dim > TRITON_MAX_HEAD_DIM
    if triton is not None and not wide:
        return triton if dtype in TRITON_DTYPES else "torch"
    if op == "attention":
        faster = requires_grad and (masked or dtype == torch.float32)
        return "fastattn._C" if faster and _native_takes(device_type, dtype,
                                                         allowed=NATIVE_DTYPES) else "torch"
    if op == "layer_norm_residual":
        stream = (residual_dtype, *param_dtypes)
        mixed = dtype != torch.float32 or residual_dtype not in (None, dtype)
        upcast = mixed and _native_takes(device_type, dtype, *stream, allowed=UPCAST_DTYPES)
        return "fastattn._C" if native_reads_as_is(device_type, dtype, residual_dtype,
                                                   param_dtypes) or upcast else "torch"
    if op == "linear_cross_entropy":
        return "fastattn._C" if requires_grad and _native_takes(
            device_type, dtype, allowed=NATIVE_DTYPES) else "torch"
    return "torch"
