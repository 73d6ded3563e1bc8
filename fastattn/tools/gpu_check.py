"""python -m fastattn.tools.gpu_check: fastattn's self-check and benchmark on one CUDA GPU, in at
most about 11½ minutes (--part 1 and --part 2: under 10 each; --quick: 4), with only what such a
machine has (CUDA torch and Triton; nothing downloaded).

First a pool of processes (one per CPU core) runs correctness's cases once, so that their kernels
compile side by side into Triton's disk cache (the warm-up; --warm-workers). Then the stages run
in order, each in a process of its own (a crash or a sticky CUDA error ends that
stage only; its stderr goes to <stage>.log under --out) and within its own time budget, which
the process checks before each case and past which, and GRACE_SECONDS more, it is ended. They
run case by case: a case that raises fails its own row, and the report (report.json and
report.md under --out) is rewritten as each case ends, so a run cut short keeps what it measured:

  environment   versions, the GPU, fastattn.tools.info's dispatch table
  correctness   every op x dtype (fp16, bf16, fp32, fp32 with tf32) x variant, forward and every
                gradient, against fp64; graded relative to PyTorch's own error in the same dtype
                (attention's tf32 rows: relative to tf32's, tf32_attention); then the packed
                backward into (B, L, 3·H·D) the model runs, fully masked rows, dropout (keep
                rate, one mask forward and backward) of attention, LayerNorm and the embedding,
                and the training mix (bf16 x beside the fp32 residual, the bf16 copies)
  determinism   two backward passes (and dropout from one seed) bit for bit
  large         B x H > 65,535 heads; rows past 2**31 elements: q and the mask, k, v and dO
                (far apart), and whole tensors past it: attention's eight, attention_packed's
                x and its gradient, LayerNorm's, cross-entropy's logits, the embedding's output
                (each skipped, its reason printed, where the GPU lacks the memory)
  attention     fastattn against SDPA's backends (flash, efficient, cuDNN) and flash_attn if
                installed: ms and TFLOP/s, forward and forward + backward
  fused         LayerNorm + residual, cross-entropy and linear cross-entropy against eager
                PyTorch: ms, GB/s, peak memory
  training      --cuda-graphs' updates against launch_step's (equal, and new dropout masks on
                each replay); base and big training updates as the trainer runs them
                (launch_step): time read at once and in the trainer's loop (the next launched
                before the last is read), launches, host syncs (CUDA's sync debug mode),
                GPU-busy fraction, MFU, beside the paper's 0.4 s and 1.0 s (8 P100s); and the
                loop's time replayed from CUDA graphs (--cuda-graphs); attention captured in a
                graph, its mask changed between replays
  decoding      beam search on the GPU against the CPU: the same translations
  sanitizer     every kernel at ragged shapes (ragged_tails) in a process of its own, then
                under compute-sanitizer's memcheck where the image has it ("not available"
                where not)
  registers     registers and spills of every kernel the JIT built (each stage's process lists
                its own in the report), against the compile report

--dry-run runs every stage at tiny shapes on the CPU with the kernels in Triton's interpreter (CI
runs it, so the check cannot rot), without time budgets; its figures mean nothing.

This module holds the schedule (STAGES), the correctness stages and what grades them, the report
and the command line; fastattn.tools.gpu_bench holds the speed stages, their timers and the state
of a run (Check) that every stage takes.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import math
import multiprocessing
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv[1:] and os.environ.get("TRITON_INTERPRET") != "1":
    # The interpreter must be chosen before triton is imported: start again with it.
    os.execvpe(sys.executable, [sys.executable, "-m", "fastattn.tools.gpu_check", *sys.argv[1:]],
               {**os.environ, "TRITON_INTERPRET": "1", "FASTATTN_BACKEND": "triton"})

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fastattn  # noqa: E402
from fastattn import ops  # noqa: E402
from fastattn.backend import implementation  # noqa: E402
from fastattn.cli import ArgumentParser  # noqa: E402
from fastattn.ops.attention import attention_packed, attention_reference  # noqa: E402
from fastattn.ops.cross_entropy import cross_entropy_reference  # noqa: E402
from fastattn.ops.embedding import embedding as ops_embedding  # noqa: E402
from fastattn.ops.embedding import embedding_reference  # noqa: E402
from fastattn.ops.layer_norm import layer_norm_residual_reference  # noqa: E402
from fastattn.ops.relu import relu_backward_bias  # noqa: E402
from fastattn.tools.gpu_bench import (  # noqa: E402
    Cases,
    Check,
    Rows,
    attention_speed,
    device_name,
    error_line,
    fused_speed,
    training,
)

COMPILE_REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_report.json"


# ---------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().clamp(min=1e-30)
    return float(((x.double() - reference).abs().max() / scale).nan_to_num(float("inf")))


def worst_error(xs: list[torch.Tensor], references: list[torch.Tensor]) -> float:
    return max(relative_error(x, r) for x, r in zip(xs, references, strict=True))


def graded(name: str, ours: list[torch.Tensor], torchs: list[torch.Tensor],
           references: list[torch.Tensor], dtype_name: str, *, expected: float | None = None,
           **row: Any) -> dict[str, Any]:
    """A correctness row: fastattn's worst relative error over outputs and gradients against
    PyTorch's own in the same dtype; it passes within 2x PyTorch's error (floor 1e-5), or within
    2x `expected` where PyTorch computes in another precision: the error of a correct
    computation in this one (tf32_attention)."""
    ours_err, torch_err = worst_error(ours, references), worst_error(torchs, references)
    bound = 2 * (torch_err if expected is None else expected) + 1e-5
    return dict(op=name, dtype=dtype_name, **row, fastattn_error=ours_err, torch_error=torch_err,
                bound=bound, passed=ours_err <= bound)


DTYPES = {"fp16": (torch.float16, False), "bf16": (torch.bfloat16, False),
          "fp32": (torch.float32, False), "fp32+tf32": (torch.float32, True)}


def dtypes(check: Check) -> dict[str, tuple[torch.dtype, bool]]:
    """The DTYPES a run grades: --quick leaves tf32 out (fp32's kernels compiled again), and so
    does the dry run (the interpreter's products read float32 whatever the precision: its tf32
    rows would repeat the fp32 rows; tests/test_gpu_check.py grades tf32 rows on the CPU)."""
    return {k: v for k, v in DTYPES.items()
            if not ((check.quick or check.dry_run) and k == "fp32+tf32")}


@contextmanager
def tf32(allowed: bool) -> Iterator[None]:
    """fp32 matmuls with or without tf32 (the kernels follow torch's setting)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def tf32_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as a tensor core reads a float32 operand in tf32: rounded to float32, its mantissa cut
    to 10 bits (the low 13 ignored; rounding them, as cuBLAS does first, errs half as much), back
    in x's dtype."""
    return (x.float().view(torch.int32) & -(1 << 13)).view(torch.float32).to(x.dtype)


class _Tf32Product(torch.autograd.Function):
    """a @ b whose operands are read in tf32, and so are the backward's products."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return tf32_rounded(a) @ tf32_rounded(b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = (tf32_rounded(t) for t in ctx.saved_tensors)
        grad = tf32_rounded(grad)
        return grad @ b.transpose(-2, -1), a.transpose(-2, -1) @ grad


def tf32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any,
                   attn_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention in float64 but for the products, whose operands are read in tf32 as the
    kernels' single-pass tf32 products read them (Triton hands the tensor cores float32 bits,
    no cvt.rna: they are cut): Q K^T and P V, and in the backward dO V^T, P^T dO, dS K and
    dS^T Q. Its error against the float64 reference is what a correct fp32 + tf32 kernel errs
    (each operand off by up to 2^-10 of itself, against 2^-24 for its float32 sums; a kernel
    computing so on the CPU errs within 1 % of it), so the kernels' tf32 rows are graded
    against it. SDPA's float32 kernels do not read tf32 (or split it three ways): their error,
    about 1e-6, is no bound for single-pass tf32's, about 2e-3 cut and 6e-4 rounded to nearest
    at the dry run's shapes. A real bug (a wrong mask, scale or tile) errs by 1e-1 and more;
    products reading bf16 (7 mantissa bits) 6-9x tf32's error. No fully masked rows
    (make_mask)."""
    lq, lk = q.shape[-2], k.shape[-2]
    s = _Tf32Product.apply(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        shift = lk - lq if causal == "bottom_right" else 0
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(shift)
        s = s.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else s + attn_mask
    return _Tf32Product.apply(torch.softmax(s, dim=-1), v)


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor,
            **constants: torch.Tensor):
    """[fn's output, the gradients of inputs] for the upstream gradient grad; constants go to fn
    as keywords, without gradient."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves, **constants)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


# ---------------------------------------------------------------------------------------------
# Stages (attention, fused and training are fastattn.tools.gpu_bench's)
# ---------------------------------------------------------------------------------------------


def environment(check: Check) -> Cases:
    yield "versions, the GPU, the dispatch table", partial(environment_rows, check)


def environment_rows(check: Check) -> Rows:
    import triton

    from fastattn.tools.info import dispatch_table

    env: dict[str, Any] = dict(device=device_name(check), python=platform.python_version(),
                               torch=torch.__version__, cuda=torch.version.cuda,
                               triton=triton.__version__, fastattn=fastattn.__version__,
                               native_extension=fastattn.native is not None)
    if check.device.type == "cuda":
        props = torch.cuda.get_device_properties(check.device)
        env.update(capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
        try:
            env["driver, max SM clock"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        except OSError as e:
            env["driver, max SM clock"] = f"nvidia-smi: {e.strerror}"
    rows = [dict(item=key, value=value) for key, value in env.items()]
    rows += [dict(item=f"runs {op} {dt} {mode}", value=impl)
             for op, dev, dt, mode, impl in dispatch_table() if dev == check.device.type]
    return rows


def attention_variants(check: Check) -> list[tuple[str, int, int, int, Any, str]]:
    """(name, Lq, Lk, D, causal, mask kind) of what the model and the drop-in launch; --quick:
    the model's three at its head dim and a sentence's length."""
    lengths = (17,) if check.dry_run else (97, 1023)
    d = 16 if check.dry_run else 64
    rows = []
    for length in lengths:
        rows += [("self, key padding", length, length, d, False, "key"),
                 ("decoder, causal", length, length, d, True, None),
                 ("cross, key padding", length // 2 + 1, length, d, False, "key")]
        if check.quick:
            return rows
        rows += [("bool mask per query", length, length, d, False, "bool"),
                 ("float mask", length, length, d, False, "float"),
                 ("bottom-right causal", length // 2 + 1, length, d, "bottom_right", None)]
    wide = 32 if check.dry_run else 128
    rows += [(f"self, key padding, d={wide}", lengths[0], lengths[0], wide, False, "key"),
             (f"decoder, causal, d={wide}", lengths[0], lengths[0], wide, True, None),
             ("one query", 1, lengths[0], d, False, "key")]
    return rows


def make_mask(kind: str | None, b: int, lq: int, lk: int, device: torch.device):
    if kind is None:
        return None
    if kind == "key":
        mask = torch.rand(b, 1, 1, lk, device=device) > 0.3
    else:
        mask = torch.rand(b, 1, lq, lk, device=device) > 0.3
    mask[..., 0] = True  # no empty rows: SDPA gives those NaN, fastattn zeros (documented)
    if kind == "float":
        return torch.randn(b, 1, lq, lk, device=device)
    return mask


def sdpa_mask(mask, causal, lq, lk, device):
    """The mask SDPA takes for fastattn's (mask, causal), bottom-right alignment spelt out."""
    if causal != "bottom_right":
        return mask
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)
    return allowed if mask is None else mask & allowed


def attention_case(check: Check, name: str, lq: int, lk: int, d: int, causal: Any,
                   kind: str | None) -> Rows:
    dev = check.device
    b, h = (2, 3) if check.dry_run else (3, 4)
    mask64 = make_mask(kind, b, lq, lk, dev)
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.float64) for n in (lq, lk, lk))
    grad = torch.randn(b, h, lq, d, device=dev, dtype=torch.float64)
    reference = fwd_bwd(lambda q, k, v: attention_reference(
        q, k, v, causal=causal, attn_mask=mask64), [q, k, v], grad)
    graded_dtypes = dtypes(check)
    if "fp32+tf32" in graded_dtypes:
        tf32_error = worst_error(fwd_bwd(partial(tf32_attention, causal=causal,
                                                 attn_mask=mask64), [q, k, v], grad), reference)
    rows = []
    for dtype_name, (dtype, allow_tf32) in graded_dtypes.items():
        mask = mask64 if mask64 is None or mask64.dtype == torch.bool else mask64.to(dtype)
        torch_mask = sdpa_mask(mask, causal, lq, lk, dev)
        cast = [x.to(dtype) for x in (q, k, v)]
        with tf32(allow_tf32):
            ours = fwd_bwd(partial(ops.attention, causal=causal, attn_mask=mask), cast, grad)
            pytorch = fwd_bwd(partial(F.scaled_dot_product_attention, attn_mask=torch_mask,
                                      is_causal=causal is True), cast, grad)
        rows.append(graded("attention", ours, pytorch, reference, dtype_name, variant=name,
                           shape=f"B={b} H={h} Lq={lq} Lk={lk} D={d}",
                           expected=tf32_error if allow_tf32 else None))
    return rows


def layer_norm_case(check: Check, residual: bool) -> Rows:
    dev = check.device
    n, features = (33, 40) if check.dry_run else (4097, 1024)
    x, r = (torch.randn(n, features, device=dev, dtype=torch.float64) for _ in range(2))
    w, bias = (torch.randn(features, device=dev, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(n, features, device=dev, dtype=torch.float64)

    def ln(fn, *args):  # (x, residual, weight, bias), or (x, weight, bias) without a residual
        return fn(*args) if residual else fn(args[0], None, *args[1:])

    def eager(x, r, w, b):
        return F.layer_norm(x if r is None else x + r, (features,), w, b)

    inputs = [x, r, w, bias] if residual else [x, w, bias]
    reference = fwd_bwd(lambda *a: ln(layer_norm_residual_reference, *a)[0], inputs, grad)
    rows = []
    for dtype_name in ("fp16", "bf16", "fp32"):
        cast = [t.to(DTYPES[dtype_name][0]) for t in inputs]
        ours = fwd_bwd(lambda *a: ln(ops.layer_norm_residual, *a), cast, grad)
        pytorch = fwd_bwd(lambda *a: ln(eager, *a), cast, grad)
        rows.append(graded("layer_norm_residual", ours, pytorch, reference, dtype_name,
                           variant="with residual" if residual else "no residual",
                           shape=f"{n}x{features}"))
    return rows


def relu_bias_case(check: Check) -> Rows:
    """The feed-forward's ReLU backward with its bias gradient (one kernel) against
    threshold_backward and a sum in the same dtype."""
    dev = check.device
    n, features = (33, 40) if check.dry_run else (4097, 2048)
    h = torch.randn(n, features, device=dev, dtype=torch.float64).relu()
    grad = torch.randn(n, features, device=dev, dtype=torch.float64)

    def eager(grad, h):
        g = torch.ops.aten.threshold_backward(grad, h, 0)
        return [g, g.sum(0)]

    reference = eager(grad, h)
    rows = []
    for dtype_name in ("fp16", "bf16", "fp32"):
        dtype = DTYPES[dtype_name][0]
        ours = list(relu_backward_bias(grad.to(dtype), h.to(dtype), dtype))
        rows.append(graded("relu_backward_bias", ours, eager(grad.to(dtype), h.to(dtype)),
                           reference, dtype_name, variant="g and the bias gradient",
                           shape=f"{n}x{features}"))
    return rows


def embedding_case(check: Check) -> Rows:
    """The fused embedding (gather, scale, positions) and its weight gradient against eager."""
    dev = check.device
    b, length, vocab, d = (3, 17, 97, 40) if check.dry_run else (125, 25, 37000, 512)
    tokens = torch.randint(0, vocab, (b, length), device=dev)
    weight = torch.randn(vocab, d, device=dev, dtype=torch.float64) * d**-0.5
    positions = torch.randn(length, d, device=dev, dtype=torch.float64)
    grad = torch.randn(b, length, d, device=dev, dtype=torch.float64)
    scale = d**0.5

    def eager(w, positions):
        return F.embedding(tokens, w) * scale + positions

    reference = fwd_bwd(eager, [weight], grad, positions=positions)
    rows = []
    for dtype_name in ("fp16", "bf16", "fp32"):
        dtype = DTYPES[dtype_name][0]
        cast, p = [weight.to(dtype)], positions.to(dtype)
        ours = fwd_bwd(lambda w, positions: ops_embedding(tokens, w, positions, scale), cast,
                       grad, positions=p)
        rows.append(graded("embedding", ours, fwd_bwd(eager, cast, grad, positions=p),
                           reference, dtype_name, variant="no dropout",
                           shape=f"{b}x{length} of {vocab}x{d}"))
    return rows


# The cases no GPU had checked (issue 69 item 4): the packed backward the model runs, fully
# masked rows, dropout's keep rate and its one mask forward and backward, the training mix of
# dtypes. Their shapes are the model's (base: 8 heads of 64) and a sentence's length.


def fwd_bwd_all(fn: Callable[..., tuple[torch.Tensor, ...]], inputs: list[torch.Tensor],
                grads: list[torch.Tensor], **constants: torch.Tensor) -> list[torch.Tensor]:
    """[fn's outputs (a tuple), the gradients of inputs] for the upstream gradients grads, one
    per output; constants go to fn as keywords, without gradient."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    outs = fn(*leaves, **constants)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads, strict=True)])
    return [o.detach() for o in outs] + [x.grad for x in leaves]


def packed_views(x: torch.Tensor, kv: torch.Tensor | None, heads: int) -> list[torch.Tensor]:
    """q, k, v (B, H, L, D) as the model unpacks attention_packed's inputs: x (B, L, 3·H·D)'s
    thirds, or x (B, Lq, H·D) and kv (B, Lk, 2·H·D)'s halves."""
    width = x.shape[-1] // 3 if kv is None else x.shape[-1]
    parts = x.split(width, -1) if kv is None else (x, *kv.split(width, -1))
    return [t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in parts]


def packed_forms(check: Check) -> list[tuple[str, bool, str | None]]:
    """(form, causal, mask kind) of the model's packed attentions; --quick: the encoder's."""
    forms = [("self", False, "key")]
    return forms if check.quick else forms + [("self", True, None), ("cross", False, "key")]


def packed_case(check: Check, form: str, causal: bool, kind: str | None) -> Rows:
    """attention_packed against fp64: the forward on views of the packed projection outputs,
    the backward writing dq, dk, dv into the columns of one gradient per packed input (the
    model's path; _PackedAttentionBackward wherever the op runs)."""
    dev = check.device
    b, h, d, lk = (2, 2, 16, 17) if check.dry_run else (3, 8, 64, 97)
    lq = lk if form == "self" else lk // 2 + 1
    shapes = [(b, lq, 3 * h * d)] if form == "self" else [(b, lq, h * d), (b, lk, 2 * h * d)]
    inputs = [torch.randn(s, device=dev, dtype=torch.float64) for s in shapes]
    mask64 = make_mask(kind, b, lq, lk, dev)
    grad = torch.randn(b, h, lq, d, device=dev, dtype=torch.float64)

    def on_views(fn: Callable[..., torch.Tensor], **kwargs: Any) -> Callable[..., torch.Tensor]:
        return lambda *xs: fn(*packed_views(xs[0], xs[1] if len(xs) > 1 else None, h), **kwargs)

    reference = fwd_bwd(on_views(attention_reference, causal=causal, attn_mask=mask64), inputs,
                        grad)
    graded_dtypes = dtypes(check)
    if "fp32+tf32" in graded_dtypes:
        tf32_error = worst_error(fwd_bwd(on_views(tf32_attention, causal=causal,
                                                  attn_mask=mask64), inputs, grad), reference)
    backward_ops: list[str] = []

    def ours(*xs: torch.Tensor) -> torch.Tensor:
        out = attention_packed(xs[0], xs[1] if len(xs) > 1 else None, heads=h,
                                   causal=causal, attn_mask=mask64)
        backward_ops.append(type(out.grad_fn).__name__)
        return out

    rows = []
    for dtype_name, (dtype, allow_tf32) in graded_dtypes.items():
        cast = [x.to(dtype) for x in inputs]
        backward_ops.clear()
        with tf32(allow_tf32):
            got = fwd_bwd(ours, cast, grad)
            pytorch = fwd_bwd(on_views(F.scaled_dot_product_attention, attn_mask=mask64,
                                       is_causal=causal), cast, grad)
        row = graded("attention_packed", got, pytorch, reference, dtype_name,
                     variant=f"{form}-attention{', causal' if causal else ''}"
                             f"{', key padding' if kind else ''}",
                     shape=" + ".join(f"({', '.join(map(str, s))})" for s in shapes),
                     expected=tf32_error if allow_tf32 else None)
        # The op (not the PyTorch path, which the dry run's bf16 takes) runs the packed backward.
        packed = implementation("attention", dev, dtype, True, head_dim=d) == "torch" or \
            backward_ops == ["_PackedAttentionBackward"]
        row.update(backward=backward_ops[0] if backward_ops else None,
                   passed=row["passed"] and packed)
        rows.append(row)
    return rows


def empty_rows_variants(check: Check) -> list[tuple[str, int, int, Any, str | None]]:
    """(name, Lq, Lk, causal, mask kind) with rows allowed no key, which make_mask never makes:
    --quick, a sentence all padding (every row of its batch entry empty)."""
    length = 17 if check.dry_run else 97
    rows = [("a sentence all padding", length, length, False, "padded sentence")]
    if not check.quick:
        rows += [("query rows allowed no key, bool mask", length, length, False, "bool rows"),
                 ("query rows allowed no key, float mask", length, length, False, "float rows"),
                 ("bottom-right causal, Lq > Lk", length, length // 2 + 1, "bottom_right",
                  None)]
    return rows


def empty_rows_mask(kind: str | None, b: int, lq: int, lk: int, device: torch.device):
    """A mask with empty rows: batch entry 0 all padding, or every third query allowed no key
    (float: those rows all -inf)."""
    if kind is None:
        return None
    if kind == "padded sentence":
        mask = make_mask("key", b, lq, lk, device)
        mask[0] = False
        return mask
    mask = make_mask("bool", b, lq, lk, device)
    mask[:, :, 1::3] = False
    if kind == "float rows":
        return torch.randn(mask.shape, device=device, dtype=torch.float64).masked_fill(
            ~mask, float("-inf"))
    return mask


def empty_rows_case(check: Check, name: str, lq: int, lk: int, causal: Any,
                    kind: str | None) -> Rows:
    """Rows allowed no key against fp64: zeros out and zero dq there (SDPA gives NaN, so
    PyTorch's own error is the reference's in the same dtype), and nothing NaN anywhere."""
    dev = check.device
    b, h, d = (2, 3, 16) if check.dry_run else (3, 4, 64)
    mask64 = empty_rows_mask(kind, b, lq, lk, dev)
    allowed = sdpa_mask(mask64, causal, lq, lk, dev)
    if allowed is None or causal is True:
        raise ValueError(f"{name}: no empty rows")
    if allowed.dtype != torch.bool:
        allowed = allowed > float("-inf")
    empty = (~allowed.any(-1)).expand(b, h, lq)
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.float64) for n in (lq, lk, lk))
    grad = torch.randn(b, h, lq, d, device=dev, dtype=torch.float64)
    kwargs = dict(causal=causal)
    reference = fwd_bwd(partial(attention_reference, attn_mask=mask64, **kwargs), [q, k, v], grad)
    rows = []
    for dtype_name in ("fp16", "bf16", "fp32"):
        dtype = DTYPES[dtype_name][0]
        mask = mask64 if mask64 is None or mask64.dtype == torch.bool else mask64.to(dtype)
        cast = [x.to(dtype) for x in (q, k, v)]
        with tf32(False):
            ours = fwd_bwd(partial(ops.attention, attn_mask=mask, **kwargs), cast, grad)
            pytorch = fwd_bwd(partial(attention_reference, attn_mask=mask, **kwargs), cast, grad)
        row = graded("attention", ours, pytorch, reference, dtype_name,
                     variant=f"fully masked rows: {name}",
                     shape=f"B={b} H={h} Lq={lq} Lk={lk} D={d}")
        zeros = bool(ours[0][empty].eq(0).all() and ours[1][empty].eq(0).all())
        finite = all(bool(t.isfinite().all()) for t in ours)
        row.update(empty_rows=int(empty.sum()), zeros_there=zeros, finite=finite,
                   passed=row["passed"] and zeros and finite)
        rows.append(row)
    return rows


# Dropout: the model's rate; a keep rate further than KEEP_SIGMAS standard deviations from
# 1 - p fails (a correct mask fails so about once in 10^6 rows).
DROPOUT_P = 0.1
KEEP_SIGMAS = 5.0


def dropout_dtypes(check: Check) -> tuple[str, ...]:
    """Dropout's dtypes: --quick, the training's bf16; else the dry run, fp16 (its interpreter
    draws the same philox stream for every dtype, and reads bf16 as float32: three dtypes were a
    third of its correctness stage)."""
    if check.quick:
        return ("bf16",)
    return ("fp16",) if check.dry_run else ("fp16", "bf16", "fp32")


def keep_row(keep: torch.Tensor, again: torch.Tensor, p: float) -> dict[str, Any]:
    """What a keep mask says of the generator: its rate against 1 - p, and whether the next
    call (the next seed) drew another."""
    rate = float(keep.float().mean())
    sigma = (p * (1 - p) / keep.numel()) ** 0.5
    return dict(keep_rate=rate, keep_rate_sigmas=abs(rate - (1 - p)) / sigma,
                fresh_mask=not torch.equal(keep, again))


def with_keep(row: dict[str, Any], keep: torch.Tensor, again: torch.Tensor,
              p: float) -> dict[str, Any]:
    row.update(keep_row(keep, again, p))
    row["passed"] = bool(row["passed"] and row["keep_rate_sigmas"] <= KEEP_SIGMAS
                         and row["fresh_mask"])
    return row


def attention_dropout_variants(check: Check) -> list[tuple[str, int, Any, str | None]]:
    """(name, length, causal, mask kind): the encoder's self-attention, and (not --quick) the
    decoder's over more keys than any tile (where Hopper's forward and backward tiles differ)."""
    rows = [("self, key padding", 17 if check.dry_run else 97, False, "key")]
    if not check.quick:
        rows.append(("decoder, causal", 33 if check.dry_run else 257, True, None))
    return rows


def attention_dropout_case(check: Check, name: str, length: int, causal: Any,
                           kind: str | None) -> Rows:
    """The keep mask attention draws (_dropout_keep_mask, at the same RNG state) explains the
    output and every gradient against fp64: the forward and both backward passes drew one mask;
    its rate is 1 - p and the next call draws another."""
    from fastattn.ops.attention import _dropout_keep_mask

    dev, p = check.device, DROPOUT_P
    b, h, d = (2, 3, 16) if check.dry_run else (3, 4, 64)
    mask = make_mask(kind, b, length, length, dev)
    q, k, v = (torch.randn(b, h, length, d, device=dev, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(b, h, length, d, device=dev, dtype=torch.float64)
    rows = []
    for dtype_name in dropout_dtypes(check):
        dtype = DTYPES[dtype_name][0]
        cast = [x.to(dtype) for x in (q, k, v)]
        torch.manual_seed(11)
        keep, again = (_dropout_keep_mask(cast[0], cast[1], p) for _ in range(2))
        torch.manual_seed(11)
        kwargs = dict(causal=causal, attn_mask=mask, dropout_p=p)
        with tf32(False):
            ours = fwd_bwd(partial(ops.attention, **kwargs), cast, grad)
            pytorch = fwd_bwd(partial(attention_reference, dropout_keep=keep, **kwargs), cast,
                              grad)
        reference = fwd_bwd(partial(attention_reference, dropout_keep=keep, **kwargs),
                            [q, k, v], grad)
        rows.append(with_keep(graded("attention", ours, pytorch, reference, dtype_name,
                                     variant=f"dropout {p}: {name}",
                                     shape=f"B={b} H={h} L={length} D={d}"), keep, again, p))
    return rows


def layer_norm_keep(x: torch.Tensor, residual: torch.Tensor, p: float) -> torch.Tensor:
    """The keep mask layer_norm_residual(x, residual, ...) draws at the current RNG state: the
    op's own sum of dropout(ones) and zeros."""
    _, s = ops.layer_norm_residual(torch.ones_like(x), torch.zeros_like(residual), None, None,
                                   dropout_p=p, return_residual=True)
    return s != 0


def embedding_keep(tokens: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                   p: float) -> torch.Tensor:
    """The keep mask embedding(tokens, weight, positions, ...) draws at the current RNG state:
    the op's own output for one token of ones and zero positions."""
    ones = torch.ones((1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return ops_embedding(torch.zeros_like(tokens), ones, torch.zeros_like(positions),
                         dropout_p=p) != 0


def layer_norm_shape(check: Check) -> tuple[int, int]:
    return (33, 40) if check.dry_run else (4097, 1024)


def embedding_shape(check: Check) -> tuple[int, int, int, int]:
    return (3, 17, 97, 40) if check.dry_run else (125, 25, 37000, 512)


def layer_norm_dropout_case(check: Check) -> Rows:
    """LayerNorm(residual + dropout(x)) against fp64 given the mask the op draws (recovered at
    the same RNG state): the forward's and the backward's masks agree; the rate is 1 - p."""
    dev, p = check.device, DROPOUT_P
    n, features = layer_norm_shape(check)
    inputs = [torch.randn(*s, device=dev, dtype=torch.float64)
              for s in ((n, features), (n, features), (features,), (features,))]
    grad = torch.randn(n, features, device=dev, dtype=torch.float64)
    rows = []
    for dtype_name in dropout_dtypes(check):
        cast = [t.to(DTYPES[dtype_name][0]) for t in inputs]
        torch.manual_seed(12)
        keep, again = (layer_norm_keep(cast[0], cast[1], p) for _ in range(2))
        torch.manual_seed(12)
        ours = fwd_bwd(lambda x, r, w, b: ops.layer_norm_residual(x, r, w, b, dropout_p=p),
                       cast, grad)

        def reference(x, r, w, b, keep=keep):
            return layer_norm_residual_reference(x, r, w, b, 1e-5, keep, p)[0]

        rows.append(with_keep(graded(
            "layer_norm_residual", ours, fwd_bwd(reference, cast, grad),
            fwd_bwd(reference, inputs, grad), dtype_name, variant=f"dropout {p}",
            shape=f"{n}x{features}"), keep, again, p))
    return rows


def embedding_dropout_case(check: Check) -> Rows:
    """dropout(weight[tokens] · scale + positions) and the weight gradient against fp64 given
    the op's mask: forward and backward agree on it; the rate is 1 - p."""
    dev, p = check.device, DROPOUT_P
    b, length, vocab, d = embedding_shape(check)
    tokens = torch.randint(0, vocab, (b, length), device=dev)
    weight = torch.randn(vocab, d, device=dev, dtype=torch.float64) * d**-0.5
    positions = torch.randn(length, d, device=dev, dtype=torch.float64)
    grad = torch.randn(b, length, d, device=dev, dtype=torch.float64)
    scale = d**0.5
    rows = []
    for dtype_name in dropout_dtypes(check):
        dtype = DTYPES[dtype_name][0]
        w, pos = weight.to(dtype), positions.to(dtype)
        torch.manual_seed(13)
        keep, again = (embedding_keep(tokens, w, pos, p) for _ in range(2))
        torch.manual_seed(13)
        ours = fwd_bwd(lambda w, positions: ops_embedding(tokens, w, positions, scale, p), [w],
                       grad, positions=pos)

        def reference(w, positions, keep=keep):
            return embedding_reference(tokens, w, positions, scale, keep, p)

        rows.append(with_keep(graded(
            "embedding", ours, fwd_bwd(reference, [w], grad, positions=pos),
            fwd_bwd(reference, [weight], grad, positions=positions), dtype_name,
            variant=f"dropout {p}", shape=f"{b}x{length} of {vocab}x{d}"), keep, again, p))
    return rows


def mix_dtypes(check: Check) -> tuple[str, ...]:
    """The 16-bit dtype of the training mix: bf16 (the trainer's autocast), and fp16 but for
    --quick. The dry run: fp16 only (its interpreter has no bf16, and rounds float32 to a bf16
    copy toward zero, where a GPU, as y.to(), rounds to nearest even)."""
    if check.dry_run:
        return ("fp16",)
    return ("bf16",) if check.quick else ("bf16", "fp16")


def layer_norm_mix_case(check: Check) -> Rows:
    """The post-norm sub-layer connection as the model trains it under autocast: a 16-bit
    sub-layer output x beside the float32 residual stream, float32 parameters, the bias of the
    map that made x (x_bias), dropout, and y's 16-bit copy for the next products. y and the copy
    against fp64 (the copy's gradient added to y's), the copy equal to y rounded, every
    gradient in its input's dtype."""
    dev, p = check.device, DROPOUT_P
    n, features = layer_norm_shape(check)
    inputs = [torch.randn(*s, device=dev, dtype=torch.float64)
              for s in ((n, features), (n, features), (features,), (features,), (features,))]
    rows = []
    for low_name in mix_dtypes(check):
        low = DTYPES[low_name][0]
        dy, dc = (torch.randn(n, features, device=dev, dtype=torch.float64).to(low).double()
                  for _ in range(2))
        cast = [inputs[0].to(low), *(t.float() for t in inputs[1:])]
        torch.manual_seed(14)
        keep, again = (layer_norm_keep(cast[0], cast[1], p) for _ in range(2))
        torch.manual_seed(14)
        ours = fwd_bwd_all(lambda x, r, w, b, xb, low=low: ops.layer_norm_residual(
            x, r, w, b, dropout_p=p, copy_dtype=low, x_bias=xb), cast, [dy, dc])

        def reference(x, r, w, b, xb, keep=keep, low=low):
            y = layer_norm_residual_reference(x.to(r.dtype) + xb, r, w, b, 1e-5, keep, p)[0]
            return y, y if y.dtype == torch.float64 else y.to(low)

        row = with_keep(graded(
            "layer_norm_residual", ours, fwd_bwd_all(reference, cast, [dy, dc]),
            fwd_bwd_all(reference, inputs, [dy, dc]), low_name,
            variant=f"training mix: {low_name} x + fp32 residual, x_bias, dropout {p}, "
                    f"{low_name} copy", shape=f"{n}x{features}"), keep, again, p)
        copy_rounded = torch.equal(ours[1], ours[0].to(low))
        dtypes_kept = [t.dtype for t in ours[2:]] == [t.dtype for t in cast]
        row.update(copy_is_y_rounded=copy_rounded, grad_dtypes_kept=dtypes_kept,
                   passed=row["passed"] and copy_rounded and dtypes_kept)
        rows.append(row)
    return rows


def embedding_mix_case(check: Check) -> Rows:
    """The model's embedding under autocast: float32 weight and positions, dropout, and y's
    16-bit copy for the first products; y and the copy against fp64, the weight gradient with
    the copy's gradient added to y's, the copy equal to y rounded."""
    dev, p = check.device, DROPOUT_P
    b, length, vocab, d = embedding_shape(check)
    tokens = torch.randint(0, vocab, (b, length), device=dev)
    weight = torch.randn(vocab, d, device=dev, dtype=torch.float64) * d**-0.5
    positions = torch.randn(length, d, device=dev, dtype=torch.float64)
    scale = d**0.5
    rows = []
    for low_name in mix_dtypes(check):
        low = DTYPES[low_name][0]
        dy, dc = (torch.randn(b, length, d, device=dev, dtype=torch.float64).to(low).double()
                  for _ in range(2))
        w, pos = weight.float(), positions.float()
        torch.manual_seed(15)
        keep, again = (embedding_keep(tokens, w, pos, p) for _ in range(2))
        torch.manual_seed(15)
        ours = fwd_bwd_all(lambda w, positions, low=low: ops_embedding(
            tokens, w, positions, scale, p, copy_dtype=low), [w], [dy, dc], positions=pos)

        def reference(w, positions, keep=keep, low=low):
            y = embedding_reference(tokens, w, positions, scale, keep, p)
            return y, y if y.dtype == torch.float64 else y.to(low)

        row = with_keep(graded(
            "embedding", ours, fwd_bwd_all(reference, [w], [dy, dc], positions=pos),
            fwd_bwd_all(reference, [weight], [dy, dc], positions=positions), low_name,
            variant=f"training mix: fp32 weight, dropout {p}, {low_name} copy",
            shape=f"{b}x{length} of {vocab}x{d}"), keep, again, p)
        copy_rounded = torch.equal(ours[1], ours[0].to(low))
        row.update(copy_is_y_rounded=copy_rounded, passed=row["passed"] and copy_rounded)
        rows.append(row)
    return rows


def correctness(check: Check) -> Cases:
    for case in attention_variants(check):
        yield f"attention, {case[0]}", partial(attention_case, check, *case)
    for residual in (True, False):
        yield (f"layer_norm_residual, {'with' if residual else 'no'} residual",
               partial(layer_norm_case, check, residual))
    yield "cross-entropy, linear cross-entropy", partial(cross_entropy_cases, check)
    yield "relu_backward_bias", partial(relu_bias_case, check)
    yield "embedding", partial(embedding_case, check)
    for form in packed_forms(check):
        yield (f"attention_packed, {form[0]}-attention{', causal' if form[1] else ''}",
               partial(packed_case, check, *form))
    for case in empty_rows_variants(check):
        yield f"attention, fully masked rows: {case[0]}", partial(empty_rows_case, check, *case)
    for case in attention_dropout_variants(check):
        yield f"attention, dropout: {case[0]}", partial(attention_dropout_case, check, *case)
    yield "layer_norm_residual, dropout", partial(layer_norm_dropout_case, check)
    yield "embedding, dropout", partial(embedding_dropout_case, check)
    yield "layer_norm_residual, training mix", partial(layer_norm_mix_case, check)
    yield "embedding, training mix", partial(embedding_mix_case, check)


def cross_entropy_cases(check: Check) -> Rows:
    dev = check.device
    n, vocab, width = (33, 97, 32) if check.dry_run else (4097, 37000, 512)
    target = torch.randint(0, vocab, (n,), device=dev)
    target[::7] = 0  # the ignored padding id
    logits = torch.randn(n, vocab, device=dev, dtype=torch.float64) * 3
    grad = torch.tensor(1.7, device=dev, dtype=torch.float64)
    reference = fwd_bwd(lambda x: cross_entropy_reference(
        x, target, 0.1, ignore_index=0)[0], [logits], grad)
    hidden = torch.randn(n, width, device=dev, dtype=torch.float64)
    weight = torch.randn(vocab, width, device=dev, dtype=torch.float64) * width**-0.5
    linear_reference = fwd_bwd(lambda x, w: cross_entropy_reference(
        x @ w.T, target, 0.1, ignore_index=0)[0], [hidden, weight], grad)
    rows = []
    for dtype_name, (dtype, allow_tf32) in dtypes(check).items():
        with tf32(allow_tf32):
            ours = fwd_bwd(lambda x: ops.label_smoothed_cross_entropy(
                x, target, 0.1, ignore_index=0), [logits.to(dtype)], grad)
            pytorch = fwd_bwd(lambda x: F.cross_entropy(x, target, ignore_index=0,
                                                        label_smoothing=0.1), [logits.to(dtype)],
                              grad)
            rows.append(graded("label_smoothed_cross_entropy", ours, pytorch, reference,
                               dtype_name, variant="smoothing 0.1, padding ignored",
                               shape=f"{n}x{vocab}"))
            cast = [hidden.to(dtype), weight.to(dtype)]
            ours = fwd_bwd(lambda x, w: ops.linear_cross_entropy(
                x, w, target, smoothing=0.1, ignore_index=0), cast, grad)
            pytorch = fwd_bwd(lambda x, w: F.cross_entropy(
                x @ w.T, target, ignore_index=0, label_smoothing=0.1), cast, grad)
            rows.append(graded("linear_cross_entropy", ours, pytorch, linear_reference,
                               dtype_name, variant="smoothing 0.1, padding ignored",
                               shape=f"{n}x{width} -> {vocab}"))
    return rows


def determinism(check: Check) -> Cases:
    dev = check.device
    b, h, length, d = (2, 2, 17, 16) if check.dry_run else (8, 8, 1023, 64)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def twice(op: str, variant: str, fn: Callable[..., torch.Tensor],
              inputs: list[torch.Tensor], grad: torch.Tensor) -> Rows:
        runs = []
        for _ in range(2):
            torch.manual_seed(7)
            runs.append(fwd_bwd(fn, inputs, grad))
        return [dict(op=op, variant=variant, dtype=str(dtype),
                     bitwise_equal=all(torch.equal(a, b) for a, b in zip(*runs, strict=True)))]

    q, k, v = (torch.randn(b, h, length, d, device=dev, dtype=dtype) for _ in range(3))
    grad = torch.randn_like(q)
    mask = make_mask("key", b, length, length, dev)
    for name, kwargs in (("key padding", dict(attn_mask=mask)), ("causal", dict(causal=True)),
                         ("key padding, dropout 0.1", dict(attn_mask=mask, dropout_p=0.1))):
        yield (f"attention, {name}",
               partial(twice, "attention", name, partial(ops.attention, **kwargs), [q, k, v], grad))
    x = torch.randn(b * length, 512, device=dev, dtype=dtype)
    w = torch.ones(512, device=dev, dtype=dtype)
    yield "layer_norm_residual, dropout 0.1", partial(
        twice, "layer_norm_residual", "dropout 0.1",
        lambda x, r, w: ops.layer_norm_residual(x, r, w, None, dropout_p=0.1), [x, x.flip(0), w], x)


def large(check: Check) -> Cases:
    yield "B x H past the grid's 65,535", partial(many_heads, check)
    yield "rows past 2**31 elements", partial(far_rows, check)
    yield "k, v and dO rows past 2**31 elements", partial(far_rows, check, ("k", "v", "grad"))
    yield "attention past 2**31 elements", partial(big_attention, check)
    yield "attention_packed past 2**31 elements", partial(big_packed, check)
    yield "layer_norm_residual past 2**31 elements", partial(big_layer_norm, check)
    yield "cross-entropy past 2**31 elements", partial(big_cross_entropy, check)
    yield "embedding past 2**31 elements", partial(big_embedding, check)


def many_heads(check: Check) -> Rows:
    dev = check.device
    dtype = torch.float16
    b, h = (5, 3) if check.dry_run else (4097, 16)  # 65,552 heads past CUDA's 65,535 grid cap
    q, k, v = (torch.randn(b, h, n, 64, device=dev, dtype=dtype) for n in (1, 3, 3))
    grad = torch.randn_like(q)
    mask = make_mask("key", b, 1, 3, dev)
    ours = fwd_bwd(lambda q, k, v: ops.attention(q, k, v, attn_mask=mask), [q, k, v], grad)
    pytorch = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                      [q, k, v], grad)
    reference = fwd_bwd(lambda q, k, v: attention_reference(q, k, v, attn_mask=mask),
                        [x.double() for x in (q, k, v)], grad)
    return [graded("attention", ours, pytorch, reference, "fp16",
                   variant=f"B x H = {b * h} heads", shape=f"B={b} H={h} Lq=1 Lk=3 D=64")]


def far_rows(check: Check, far: tuple[str, ...] = ("q", "mask")) -> Rows:
    """A query and a mask (or keys, values and the output's gradient: far) whose row 2 lies past
    element 2**31 of its buffer (4 GiB each, 2 for the mask), bit for bit as compact ones."""
    dev = check.device
    dtype = torch.float16
    lq, d, row = 3, 64, 2**30 + 64
    lk = 3 if "k" in far else 17
    names = {"q": "q", "mask": "mask", "k": "k", "v": "v", "grad": "dO"}
    variant = " and ".join([", ".join(names[t] for t in far[:-1]), names[far[-1]]]) \
        + " rows past 2**31 elements"
    nbytes = sum(row * (lq - 1) * (1 if t == "mask" else 2) for t in far)
    if skip := memory_short(check, f"attention: {variant}", nbytes):
        return skip

    def far_apart(compact: torch.Tensor, name: str) -> torch.Tensor:
        if name not in far:
            return compact
        buffer = torch.empty(row * (compact.shape[-2] - 1) + compact.shape[-1],
                             dtype=compact.dtype, device=dev)
        return buffer.as_strided(compact.shape, (0, 0, row, 1)).copy_(compact)

    q = torch.randn(1, 1, lq, d, device=dev, dtype=dtype)
    k, v = (torch.randn(1, 1, lk, d, device=dev, dtype=dtype) for _ in range(2))
    mask = make_mask("bool", 1, lq, lk, dev)
    grad = torch.randn_like(q)
    compact = fwd_bwd(lambda q, k, v: ops.attention(q, k, v, attn_mask=mask), [q, k, v], grad)
    far_mask = far_apart(mask, "mask")
    apart = fwd_bwd(lambda q, k, v: ops.attention(q, k, v, attn_mask=far_mask),
                    [far_apart(q, "q"), far_apart(k, "k"), far_apart(v, "v")],
                    far_apart(grad, "grad"))
    result = dict(op="attention", variant=variant, dtype="fp16",
                  bitwise_equal=all(torch.equal(a, b) for a, b in zip(compact, apart, strict=True)))
    del apart
    return past_row(check, result, row * (lq - 1))


# Rows past 2**31 elements: tensors of more elements than an int32 offset reaches, each case
# sized to fit an 80 GB H100 (its bytes below) and skipped, with its reason printed, where the
# GPU has less memory free; the dry run runs the same code past PAST_ELEMENTS_DRY elements.
PAST_ELEMENTS = 2**31
PAST_ELEMENTS_DRY = 2**12


def past_elements(check: Check) -> int:
    return PAST_ELEMENTS if check.device.type == "cuda" else PAST_ELEMENTS_DRY


def units_past(check: Check, unit: int, last: int = 1) -> int:
    """How many units (batch entries, rows) of `unit` elements each make a tensor whose `last`
    units lie wholly past past_elements(check) elements."""
    return past_elements(check) // unit + 1 + last


def memory_short(check: Check, case: str, nbytes: int) -> Rows | None:
    """None where the GPU has room for nbytes (and 10 % and 4 GiB more); else the case's row,
    skipped (neither passed nor failed), its reason printed."""
    if check.device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(check.device)
    need = nbytes * 1.1 + 4 * 2**30  # and the references' slices
    if free >= need:
        return None
    reason = (f"needs about {need / 2**30:.0f} GiB of GPU memory, {free / 2**30:.0f} GiB free of "
              f"{total / 2**30:.0f}")
    print(f"gpu_check: {case}: skipped: {reason}", flush=True)
    return [dict(case=case, skipped=reason)]


def past_row(check: Check, row: dict[str, Any], elements: int) -> Rows:
    """row with the elements of its largest tensor; its memory given back for the next case."""
    if check.device.type == "cuda":
        torch.cuda.empty_cache()
    return [row | dict(elements=elements, past_2_31=elements > 2**31)]


def big_attention(check: Check) -> Rows:
    """q, k, v, dO and so the output, dq, dk, dv of more than 2**31 elements each (fp16, 4 GiB
    each; 8 of them, and room for 4 more: heads-last copies), key padding: the first and the
    last batch entry against fp64."""
    case = "attention: q, k, v, dO, out, dq, dk, dv past 2**31 elements"
    h, length, d = (16, 97, 64) if check.device.type == "cuda" else (2, 17, 16)
    b = units_past(check, h * length * d)
    elements = b * h * length * d
    if skip := memory_short(check, case, 12 * 2 * elements):
        return skip
    dev, dtype = check.device, torch.float16
    q, k, v, grad = (torch.randn(b, h, length, d, device=dev, dtype=dtype) for _ in range(4))
    mask = make_mask("key", b, length, length, dev)
    ours = fwd_bwd(partial(ops.attention, attn_mask=mask), [q, k, v], grad)
    ends = [0, b - 1]
    picked = [t[ends] for t in (q, k, v)]
    reference = fwd_bwd(partial(attention_reference, attn_mask=mask[ends]),
                        [t.double() for t in picked], grad[ends].double())
    pytorch = fwd_bwd(partial(F.scaled_dot_product_attention, attn_mask=mask[ends]), picked,
                      grad[ends])
    row = graded("attention", [t[ends] for t in ours], pytorch, reference, "fp16",
                 variant=case.split(": ")[1] + " (first and last batch entry)",
                 shape=f"B={b} H={h} L={length} D={d}")
    del q, k, v, grad, ours
    return past_row(check, row, elements)


def big_packed(check: Check) -> Rows:
    """attention_packed over x (B, L, 3·H·D) of more than 2**31 elements (fp16, 4 GiB), so its
    gradient too, written by the packed backward: the last batch entry against fp64."""
    case = "attention_packed: x and its gradient past 2**31 elements"
    h, length, d = (8, 97, 64) if check.device.type == "cuda" else (2, 17, 16)
    b = units_past(check, length * 3 * h * d)
    elements = b * length * 3 * h * d
    if skip := memory_short(check, case, 4 * 2 * elements):  # x, dx, out, dO, copies
        return skip
    dev, dtype = check.device, torch.float16
    x = torch.randn(b, length, 3 * h * d, device=dev, dtype=dtype)
    grad = torch.randn(b, h, length, d, device=dev, dtype=dtype)
    mask = make_mask("key", b, length, length, dev)
    ours = fwd_bwd(lambda x: attention_packed(x, heads=h, attn_mask=mask), [x], grad)
    last = [b - 1]
    reference = fwd_bwd(lambda x: attention_reference(*packed_views(x, None, h),
                                                      attn_mask=mask[last]),
                        [x[last].double()], grad[last].double())
    pytorch = fwd_bwd(lambda x: F.scaled_dot_product_attention(*packed_views(x, None, h),
                                                               attn_mask=mask[last]),
                      [x[last]], grad[last])
    row = graded("attention_packed", [t[last] for t in ours], pytorch, reference, "fp16",
                 variant=case.split(": ")[1] + " (last batch entry)",
                 shape=f"({b}, {length}, {3 * h * d}), {h} heads")
    del x, grad, ours
    return past_row(check, row, elements)


def big_layer_norm(check: Check) -> Rows:
    """layer_norm_residual over x and residual (N, 1024) of more than 2**31 elements (fp16, 4
    GiB each; 6 such tensors): y, dx, dresidual of the first and last rows, and dweight, dbias
    summed over every row, against fp64 (computed a slice at a time)."""
    case = "layer_norm_residual: x, residual, y, dy, dx, dresidual past 2**31 elements"
    features = 1024 if check.device.type == "cuda" else 40
    rows = 16
    n = units_past(check, features, rows)
    elements = n * features
    if skip := memory_short(check, case, 8 * 2 * elements):  # and the sum's, a copy
        return skip
    dev, dtype = check.device, torch.float16
    x, r, dy = (torch.randn(n, features, device=dev, dtype=dtype) for _ in range(3))
    w, bias = (torch.randn(features, device=dev, dtype=dtype) for _ in range(2))
    ours = fwd_bwd(lambda x, r, w, b: ops.layer_norm_residual(x, r, w, b), [x, r, w, bias], dy)

    def ln(x, r, w, b):
        return layer_norm_residual_reference(x, r, w, b)[0]

    ends = torch.cat([torch.arange(rows), torch.arange(n - rows, n)]).to(dev)
    wanted = []
    for precision in (torch.float64, dtype):  # the reference, then PyTorch's own in fp16
        params = [t.to(precision) for t in (w, bias)]
        picked = fwd_bwd(ln, [x[ends].to(precision), r[ends].to(precision), *params], dy[ends])
        sums = [torch.zeros(features, device=dev, dtype=torch.float64) for _ in range(2)]
        step = max(1, 2**26 // features) if check.device.type == "cuda" else 7
        for start in range(0, n, step):
            part = slice(start, start + step)
            got = fwd_bwd(ln, [x[part].to(precision), r[part].to(precision), *params], dy[part])
            for total, g in zip(sums, got[3:], strict=True):
                total += g.double()
        wanted.append(picked[:3] + [s.to(precision) for s in sums])
    ours = [t[ends] for t in ours[:3]] + ours[3:]
    row = graded("layer_norm_residual", ours, wanted[1], wanted[0], "fp16",
                 variant=case.split(": ")[1] + f" (y, dx, dr of the first and last {rows} rows; "
                                               "dweight, dbias)",
                 shape=f"{n}x{features}")
    del x, r, dy, ours
    return past_row(check, row, elements)


def big_cross_entropy(check: Check) -> Rows:
    """label_smoothed_cross_entropy over logits (N, 37000) of more than 2**31 elements (fp16, 4
    GiB, and its gradient): the loss and the gradient of the first and last rows against fp64
    (the loss summed a slice at a time)."""
    case = "label_smoothed_cross_entropy: logits and their gradient past 2**31 elements"
    vocab = 37000 if check.device.type == "cuda" else 97
    rows = 16
    n = units_past(check, vocab, rows)
    elements = n * vocab
    if skip := memory_short(check, case, 3 * 2 * elements):
        return skip
    dev, dtype = check.device, torch.float16
    logits = torch.randn(n, vocab, device=dev, dtype=dtype) * 3
    target = torch.randint(0, vocab, (n,), device=dev)
    grad = torch.tensor(1.7, device=dev, dtype=torch.float64)
    ours = fwd_bwd(lambda x: ops.label_smoothed_cross_entropy(x, target, 0.1), [logits], grad)
    ends = torch.cat([torch.arange(rows), torch.arange(n - rows, n)]).to(dev)

    def summed(x, target):  # the mean's share of these rows
        return cross_entropy_reference(x, target, 0.1, reduction="sum")[0] / n

    wanted = []
    for precision in (torch.float64, dtype):
        loss = torch.zeros((), device=dev, dtype=torch.float64)
        step = max(1, 2**26 // vocab) if check.device.type == "cuda" else 7
        for start in range(0, n, step):
            part = slice(start, start + step)
            loss += summed(logits[part].to(precision), target[part]).double()
        picked = fwd_bwd(lambda x: summed(x, target[ends]), [logits[ends].to(precision)], grad)
        wanted.append([loss.to(precision), picked[1]])
    row = graded("label_smoothed_cross_entropy", [ours[0], ours[1][ends]], wanted[1], wanted[0],
                 "fp16", variant=case.split(": ")[1] + f" (loss; gradient of the first and "
                                                       f"last {rows} rows)",
                 shape=f"{n}x{vocab}")
    del logits, ours
    return past_row(check, row, elements)


def big_embedding(check: Check) -> Rows:
    """embedding of tokens (B, 97) at d = 512 into y of more than 2**31 elements (fp16, 4 GiB,
    and its gradient): the first and last sentences' rows and the weight gradient, summed from
    every row, against fp64 (summed a slice at a time)."""
    case = "embedding: y and dy past 2**31 elements"
    length, vocab, d = (97, 37000, 512) if check.device.type == "cuda" else (17, 97, 16)
    b = units_past(check, length * d)
    elements = b * length * d
    if skip := memory_short(check, case, 3 * 2 * elements):
        return skip
    dev, dtype = check.device, torch.float16
    tokens = torch.randint(0, vocab, (b, length), device=dev)
    weight = (torch.randn(vocab, d, device=dev) * d**-0.5).to(dtype)
    positions = torch.randn(length, d, device=dev, dtype=dtype)
    dy = torch.randn(b, length, d, device=dev, dtype=dtype)
    scale = d**0.5
    ours = fwd_bwd(lambda w, positions: ops_embedding(tokens, w, positions, scale), [weight], dy,
                   positions=positions)
    ends = [0, b - 1]
    step = max(1, 2**26 // (length * d)) if check.device.type == "cuda" else 2
    dw = {}
    for precision in (torch.float64, torch.float32):  # the reference; eager's sum in fp32
        dw[precision] = torch.zeros(vocab, d, device=dev, dtype=precision)
        for start in range(0, b, step):
            part = slice(start, start + step)
            dw[precision].index_add_(0, tokens[part].flatten(),
                                     dy[part].flatten(0, 1).to(precision) * scale)
    reference = [embedding_reference(tokens[ends], weight.double(), positions.double(), scale),
                 dw[torch.float64]]
    eager = [embedding_reference(tokens[ends], weight, positions, scale),
             dw[torch.float32].to(dtype)]
    row = graded("embedding", [ours[0][ends], ours[1]], eager, reference, "fp16",
                 variant=case.split(": ")[1] + " (the first and last sentences; dweight)",
                 shape=f"{b}x{length} of {vocab}x{d}")
    del dy, ours
    return past_row(check, row, elements)


def decoding(check: Check) -> Cases:
    yield "beam search, GPU against CPU", partial(decoding_rows, check)


def decoding_rows(check: Check) -> Rows:
    cfg = replace(fastattn.PRESETS["base"], vocab_size=101, encoder_layers=2, decoder_layers=2,
                  d_model=64, d_ff=128, heads=4, dropout=0.0)
    torch.manual_seed(3)
    model = fastattn.Transformer(cfg).eval()
    src = torch.randint(4, 101, (6, 11))
    src[3:, 8:] = cfg.pad_id
    results = {}
    for dev in dict.fromkeys([torch.device("cpu"), check.device]):
        with torch.no_grad():
            hyps = fastattn.Decoder(model.to(dev)).beam_search(src.to(dev), beam_size=4, bos_id=2,
                                                               eos_id=3, max_len=20)
        results[dev.type] = [h[0].tokens for h in hyps]
    if len(results) == 1:  # the dry run: the CPU is the device
        return [dict(sentences=len(src), beam=4, identical_to_cpu=None)]
    same = sum(a == b for a, b in zip(*results.values(), strict=True))
    return [dict(sentences=len(src), beam=4, identical_to_cpu=same,
                 passed=same == len(src))]


# ---------------------------------------------------------------------------------------------
# compute-sanitizer: every kernel at ragged shapes, its memory accesses checked
# ---------------------------------------------------------------------------------------------


def ragged_tails(device: str = "cuda") -> None:
    """The sanitizer stage's workload: every kernel, forward and backward, at shapes whose last
    tile is ragged (lengths 1, 17, 33; head dims 64 and 40; rows of 1000 and 997 features),
    with masks, dropout and copies; raises if anything is not finite. On a GPU in fp16 and
    bf16 (mostly the specialisations correctness compiled), on the CPU (the dry run,
    interpreted) in fp16."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    outputs: list[torch.Tensor] = []
    for dtype in (torch.float16, torch.bfloat16) if cuda else (torch.float16,):
        ragged_ops(dev, dtype, outputs, head_dims=(64, 40) if dtype == torch.float16 else (64,))
    if cuda:
        torch.cuda.synchronize(dev)
    bad = sum(not bool(t.isfinite().all()) for t in outputs)
    if bad:
        raise RuntimeError(f"{bad} of {len(outputs)} outputs and gradients not finite")
    print(f"ragged tails: {len(outputs)} outputs and gradients, all finite", flush=True)


def ragged_ops(dev: torch.device, dtype: torch.dtype, outputs: list[torch.Tensor],
               head_dims: tuple[int, ...]) -> None:
    """ragged_tails in one dtype: each op's outputs and gradients appended to outputs."""
    def randn(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype)

    def run(fn: Callable[..., Any], *inputs: torch.Tensor) -> None:
        leaves = [x.detach().requires_grad_() for x in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
        outputs.extend([*outs, *(x.grad for x in leaves)])

    b, h, n, features, vocab = 3, 2, 17, 1000, 997
    for d in head_dims:
        for lq, lk in ((17, 33), (33, 17), (1, 33)):
            mask = make_mask("key", b, lq, lk, dev)
            q, k, v = randn(b, h, lq, d), randn(b, h, lk, d), randn(b, h, lk, d)
            run(partial(ops.attention, attn_mask=mask, dropout_p=0.1), q, k, v)
            run(partial(ops.attention, causal="bottom_right"), q, k, v)
    d = head_dims[0]
    run(partial(attention_packed, heads=h, attn_mask=make_mask("key", b, 17, 17, dev),
                dropout_p=0.1), randn(b, 17, 3 * h * d))
    run(partial(attention_packed, heads=h, attn_mask=make_mask("key", b, 17, 33, dev)),
        randn(b, 17, h * d), randn(b, 33, 2 * h * d))
    run(partial(ops.layer_norm_residual, dropout_p=0.1, copy_dtype=dtype),
        randn(n, features), *(randn(*s, dtype=torch.float32)
                              for s in ((n, features), (features,), (features,))))
    run(lambda x, r: ops.layer_norm_residual(x, r, None, None, return_residual=True),
        randn(n, features), randn(n, features))
    target = torch.randint(0, vocab, (n,), device=dev)
    target[::5] = 0
    run(partial(ops.label_smoothed_cross_entropy, target=target, smoothing=0.1, ignore_index=0),
        randn(n, vocab))
    run(partial(ops.linear_cross_entropy, target=target, smoothing=0.1, ignore_index=0),
        randn(n, 40), randn(vocab, 40))
    outputs.extend(relu_backward_bias(randn(n, features), randn(n, features).relu(), dtype))
    tokens = torch.randint(0, vocab, (3, 17), device=dev)
    run(partial(ops_embedding, tokens, positions=randn(17, 24, dtype=torch.float32), scale=4.9,
                dropout_p=0.1, copy_dtype=dtype), randn(vocab, 24, dtype=torch.float32))


SANITIZER_EXIT = 86  # compute-sanitizer's exit code when it found an error (--error-exitcode)


def sanitizer_path() -> str | None:
    """compute-sanitizer, on PATH or where a CUDA toolkit puts it."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidates = ["/usr/local/cuda/bin/compute-sanitizer",
                  *sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)]
    return next((path for path in candidates if os.access(path, os.X_OK)), None)


def ragged_command(check: Check) -> list[str]:
    return [sys.executable, "-c",
            "from fastattn.tools.gpu_check import ragged_tails; "
            f"ragged_tails({check.device.type!r})"]


def seconds_left(check: Check, floor: float = 10.0) -> float | None:
    """The stage's time left (at least floor), for a subprocess's timeout; None: no deadline."""
    return None if math.isinf(check.deadline) else max(floor, check.deadline - time.monotonic())


def memcheck_result(returncode: int, output: str) -> dict[str, Any]:
    """A memcheck run's row from its exit code and output: its error count (ERROR SUMMARY), the
    first error it printed; passed with no error and the workload's own exit code 0."""
    found = re.findall(r"ERROR SUMMARY: (\d+) error", output)
    errors = int(found[-1]) if found else None
    lines = [line.removeprefix("=========").strip() for line in output.splitlines()]
    first = next((line for line in lines if line.startswith(("Invalid", "Program hit", "Error",
                                                             "Out-of-range", "Misaligned"))),
                 None)
    if first is None and returncode != 0:
        first = next((line for line in reversed(lines) if line), None)
    return dict(tool="compute-sanitizer --tool memcheck", exit_code=returncode, errors=errors,
                first_error=first, passed=returncode == 0 and errors == 0)


def memcheck_rows(check: Check) -> Rows:
    """ragged_tails in a process of its own under compute-sanitizer's memcheck, PyTorch's
    caching allocator off (an access past a tensor's end lands outside any allocation, where
    memcheck sees it); its output in sanitizer.out under --out. Where the image has no
    compute-sanitizer (and in the dry run) the workload runs alone, and the row says the
    sanitizer was not available."""
    tool = sanitizer_path() if check.device.type == "cuda" else None
    command, env = ragged_command(check), dict(os.environ)
    if tool is not None:
        command = [tool, "--tool", "memcheck", "--error-exitcode", str(SANITIZER_EXIT),
                   "--print-limit", "20", *command]
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    returncode, output = run_group(command, env, seconds_left(check))
    (check.out / "sanitizer.out").write_text(output)
    if returncode is None:  # cut at the stage's deadline: what it found so far, if anything
        row = memcheck_result(-1, output)
        return [row | dict(status="cut at the stage's deadline", exit_code=None,
                           passed=False if row["errors"] or any(
                               "Invalid" in line for line in output.splitlines()) else None)]
    if tool is not None:
        return [memcheck_result(returncode, output) | dict(status="ran")]
    said = [line.strip() for line in output.splitlines() if line.strip()]
    return [dict(tool="compute-sanitizer --tool memcheck",
                 status="not available" + (" (the dry run)" if check.dry_run else
                                           ": not on PATH nor in /usr/local/cuda*/bin"),
                 exit_code=returncode, first_error=None if returncode == 0
                 else (said[-1] if said else "nothing said"),
                 workload_passed=returncode == 0, passed=None if returncode == 0 else False)]


def run_group(command: list[str], env: dict[str, str], timeout: float | None
              ) -> tuple[int | None, str]:
    """(exit code, stdout + stderr) of command run in a process group of its own; past timeout
    the whole group (compute-sanitizer and the Python it runs) is killed: (None, what it said)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def sanitizer(check: Check) -> Cases:
    yield "ragged tails under compute-sanitizer memcheck", partial(memcheck_rows, check)


def ragged_warm(check: Check) -> Cases:
    """What the warm-up runs for the sanitizer stage: its workload, compiling its kernels into
    Triton's cache beside correctness's (the sanitized process then loads them)."""
    yield "ragged tails", partial(ragged_tails, check.device.type)


def registers(check: Check) -> Cases:
    yield "compiled kernels", partial(registers_rows, check)


def registers_rows(check: Check) -> Rows:
    """What the JIT built in the stages above (each stage's process lists its kernels in the
    report: compiled_kernels), against the compile report's worst case for the same kernel."""
    report: dict[str, int] = {}
    if COMPILE_REPORT.exists():
        for row in json.loads(COMPILE_REPORT.read_text()):
            name = row["name"].split()[0]
            report[name] = max(report.get(name, 0), row.get("registers") or 0)
    return [row | dict(report_max_registers=report.get(row["function"]))
            for row in check.report.get("kernels", [])]


def compiled_kernels() -> Rows:
    """The kernels this process's JIT built (Triton keeps each in its JITFunction's cache)."""
    from fastattn.kernels import attention, cross_entropy, layer_norm

    return [dict(kernel=compiled.metadata.name, function=fn.__name__,
                 registers=compiled.n_regs, spills=compiled.n_spills,
                 num_warps=compiled.metadata.num_warps)
            for module in (attention, cross_entropy, layer_norm)
            for fn in vars(module).values()
            for cache in getattr(fn, "device_caches", {}).values()
            for compiled in cache[0].values()]


STAGES: list[tuple[str, Callable[[Check], Cases], float]] = [
    # Seconds each, 630 in all with the warm-up's 60; the first stages include Triton's compiles
    # (cached on disk, most of correctness's by the warm-up).
    ("environment", environment, 20), ("correctness", correctness, 140),
    ("determinism", determinism, 30), ("large", large, 50),
    ("attention", attention_speed, 120), ("fused", fused_speed, 40),
    ("training", training, 90), ("decoding", decoding, 20), ("sanitizer", sanitizer, 50),
    ("registers", registers, 10),
]
# --quick: these stages only, with these budgets (205 s with the warm-up's 30, and a process start
# each), for a first
# look, a fix and a second look within a GPU lease of 15 minutes: every op's correctness in
# fp16, bf16 and fp32 at the model's shapes, one speed row per op against SDPA or eager, one
# graphed training update against the eager one.
QUICK_BUDGETS = {"environment": 10, "correctness": 75, "attention": 20, "fused": 20,
                 "training": 40, "registers": 10}
# --part N: the full profile in two halves, each within one 10-minute command on a lent GPU
# machine (benchmarks/gpu/check.sh's 590 s; the whole, 11½ minutes, is more than one).
PARTS = {1: ("environment", "correctness", "determinism", "large", "attention"),
         2: ("fused", "training", "decoding", "sanitizer", "registers")}


# Before the stages: the cases of WARM_STAGES run once, spread over a pool of processes (one per
# CPU core: 16 on the GPU machine), their results discarded, so that Triton's JIT compiles their
# kernels side by side into its disk cache (~/.triton/cache), where the stage's own process finds
# them (the same cases, hence the same specialisations) instead of compiling them one after the
# other inside its budget. Best effort: a case that raises is counted (the stage reports it), and
# the pool is ended at its budget.
WARM_STAGES = ("correctness", "sanitizer")
# What the warm-up runs for each of WARM_STAGES: correctness's cases, the sanitizer's workload.
WARMED: dict[str, Callable[[Check], Cases]] = {"correctness": correctness,
                                               "sanitizer": ragged_warm}
# Seconds, by --quick: taken from correctness's budget, whose compiles it runs ahead (a warm-up
# cut short keeps every kernel it finished: Triton writes each to its cache as it compiles).
WARM_BUDGETS = {False: 60.0, True: 30.0}


def warm_case(module: str, qualname: str, index: int, device: str, dry_run: bool, quick: bool,
              out: str) -> str | None:
    """Runs case `index` of the stage function module.qualname in this process, its rows
    discarded; returns its error line, or None."""
    stage = getattr(importlib.import_module(module), qualname)
    check = Check(torch.device(device), dry_run, Path(out), quick=quick)
    for i, (_, measure) in enumerate(stage(check)):
        if i == index:
            try:
                measure()
            except Exception as e:
                return error_line(e)
            return None
    return f"no case {index}"


def warm_up(check: Check, stages: Sequence[Callable[[Check], Cases]], workers: int,
            seconds: float | None) -> dict[str, Any]:
    """Runs every case of `stages` once on up to `workers` spawned processes (fresh
    interpreters: no forked CUDA state), ended after `seconds` (None: no limit); what it did,
    for the report."""
    start = time.monotonic()
    units = [(stage.__module__, stage.__qualname__, i, str(check.device), check.dry_run,
              check.quick, str(check.out))
             for stage in stages for i, _ in enumerate(stage(check))]
    workers = max(1, min(workers, len(units)))
    pool = multiprocessing.get_context("spawn").Pool(workers)
    try:
        errors = pool.starmap_async(warm_case, units).get(seconds)
        status = "ok"
    except multiprocessing.TimeoutError:
        errors, status = [], "cut at its time budget"
    finally:
        pool.terminate()
        pool.join()
    return dict(status=status, cases=len(units), workers=workers,
                errors=[e for e in errors if e], seconds=time.monotonic() - start)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def run_stage(check: Check, name: str, stage: Callable[[Check], Cases]) -> None:
    """Runs a stage's cases one by one into check.report["stages"][name], rewriting the report
    as each ends: a case that raises is a failed row of its own (the next cases still run), past
    the stage's deadline the rest are skipped, and an exception setting the cases up ends the
    stage with the rows it has."""
    start = time.monotonic()
    entry: dict[str, Any] = dict(status="running", rows=[], seconds=0.0)
    check.report["stages"][name] = entry
    try:
        for case, measure in stage(check):
            if not check.time_left():
                entry["status"] = "cut at its time budget"
                break
            try:
                entry["rows"] += measure()
            except Exception as e:
                entry["rows"].append(dict(case=case, error=error_line(e), passed=False,
                                          traceback=traceback.format_exc()))
            entry["seconds"] = time.monotonic() - start
            write_report(check)
        else:
            entry["status"] = "ok"
    except Exception as e:
        entry.update(status="error", error=error_line(e), traceback=traceback.format_exc())
    entry["seconds"] = time.monotonic() - start
    write_report(check)


# A stage's process may take this long past its budget (starting Python, torch and CUDA, the
# case running at the deadline) before it is ended.
GRACE_SECONDS = 30.0


def stage_command(check: Check, name: str, deadline: float | None) -> list[str]:
    """The command line of the process that runs stage `name` into check.out's report."""
    return [sys.executable, "-m", "fastattn.tools.gpu_check", "--out", str(check.out),
            *(["--dry-run"] if check.dry_run else []), *(["--quick"] if check.quick else []),
            "--stage-process", name,
            *([] if deadline is None else ["--deadline", repr(deadline)])]


def run_in_process(check: Check, name: str, seconds: float | None) -> None:
    """Runs stage `name` in a process of its own (a sticky CUDA error or a crash ends that stage
    only), given `seconds` (None: no limit), past which and GRACE_SECONDS more it is ended. The
    process rewrites the report as each case ends; what it wrote is kept, and a process that
    died or was ended says so in its stage's status."""
    write_report(check)
    deadline = None if seconds is None else time.time() + seconds
    log = check.out / f"{name}.log"
    start = time.monotonic()
    with open(log, "w") as err:
        process = subprocess.Popen(stage_command(check, name, deadline), stderr=err)
        try:
            code: int | str = process.wait(None if seconds is None else seconds + GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = "killed"
    check.report = json.loads((check.out / "report.json").read_text())
    entry = check.report["stages"].setdefault(name, dict(rows=[]))
    if code != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        died = (f"ended {GRACE_SECONDS:.0f} s past its budget" if code == "killed"
                else f"its process died (exit code {code})")
        said = lines[-1].strip() if lines else "nothing"
        entry.update(status="error", error=f"{died}; last said: {said}",
                     traceback="\n".join(lines[-20:]))
    entry["seconds"] = time.monotonic() - start
    write_report(check)


def stage_process(check: Check, name: str, deadline: float | None) -> None:
    """What runs in a stage's process: the stage into the report so far, then the kernels its
    JIT built."""
    check.report = json.loads((check.out / "report.json").read_text())
    check.deadline = math.inf if deadline is None else time.monotonic() + deadline - time.time()
    torch.manual_seed(0)
    run_stage(check, name, dict((n, stage) for n, stage, _ in STAGES)[name])
    check.report["kernels"] = check.report.get("kernels", []) + [
        dict(stage=name, **row) for row in compiled_kernels()]
    write_report(check)


def write_report(check: Check) -> None:
    """report.json and report.md under --out, each replaced whole: a run cut short keeps both."""
    check.out.mkdir(parents=True, exist_ok=True)
    for name, text in (("report.json", json.dumps(check.report, indent=1, default=str)),
                       ("report.md", markdown(check.report))):
        tmp = check.out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, check.out / name)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# fastattn gpu_check: {report.get('device', '?')}", "",
             f"{report.get('started', '')}; dry run: {report.get('dry_run')}; "
             f"command: `{report.get('command', '')}`", ""]
    if warm := report.get("warm_up"):
        lines += [f"Warm-up: {warm['status']} in {warm['seconds']:.1f} s, {warm['cases']} cases "
                  f"on {warm['workers']} processes, {len(warm['errors'])} raised.", ""]
    for name, stage in report.get("stages", {}).items():
        lines += [f"## {name}: {stage['status']} in {stage['seconds']:.1f} s", ""]
        if stage.get("error"):
            lines += [stage["error"], "", "```", stage["traceback"], "```", ""]
        rows = stage.get("rows", [])
        if not rows:
            continue
        columns = list(dict.fromkeys(key for row in rows for key in row if key != "traceback"))
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for row in rows:
            lines.append("| " + " | ".join(cell(row.get(c)) for c in columns) + " |")
        lines.append("")
    return "\n".join(lines)


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def failures(report: dict[str, Any]) -> list[str]:
    """The stages that raised, and every correctness row that failed."""
    bad = []
    for name, stage in report["stages"].items():
        if stage["status"] == "error":
            bad.append(f"{name}: {stage['error']}")
        for row in stage.get("rows", []):
            if row.get("passed") is False or row.get("bitwise_equal") is False:
                bad.append(f"{name}: {row['case']}: {row['error']}" if "error" in row and
                           "case" in row else f"{name}: {row}")
    return bad


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m fastattn.tools.gpu_check",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check", help="directory of report.json/.md")
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage at tiny shapes on the CPU, kernels interpreted, "
                             "without time budgets")
    parser.add_argument("--quick", action="store_true",
                        help=f"the quick profile (budgets of 205 s in all with the warm-up, for 4 "
                             f"minutes): stages "
                             f"{', '.join(QUICK_BUDGETS)} with fewer cases (QUICK_BUDGETS)")
    parser.add_argument("--stages", help="comma-separated stages to run, in the order above "
                                         "(default: all, or --quick's, or --part's)")
    parser.add_argument("--part", type=int, choices=sorted(PARTS),
                        help="half of the full profile, each within 10 minutes: "
                             + "; ".join(f"{n}: {', '.join(stages)}"
                                         for n, stages in PARTS.items()))
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiplies every stage's time budget")
    parser.add_argument("--warm-workers", type=int, default=None, metavar="N",
                        help="processes that run the cases of "
                             f"{', '.join(WARM_STAGES)} first, compiling their kernels side by "
                             "side into Triton's cache (default: one per CPU core; the dry run: "
                             "0, none)")
    # What run_in_process starts: one stage, until a deadline (seconds since the epoch).
    parser.add_argument("--stage-process", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = args.stages.split(",") if args.stages else list(
        QUICK_BUDGETS if args.quick else PARTS[args.part] if args.part
        else (name for name, _, _ in STAGES))
    unknown = set(chosen) - {name for name, _, _ in STAGES}
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; the stages are "
                     f"{', '.join(name for name, _, _ in STAGES)}")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA GPU; --dry-run checks the stages on the CPU")
    check = Check(torch.device("cpu" if args.dry_run else "cuda"), args.dry_run, Path(args.out),
                  quick=args.quick)
    if args.stage_process:
        stage_process(check, args.stage_process, args.deadline)
        return
    check.report = dict(device=device_name(check), dry_run=args.dry_run, quick=args.quick,
                        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                        command=" ".join(["python -m fastattn.tools.gpu_check",
                                          *(argv or sys.argv[1:])]),
                        stages={})
    workers = (0 if args.dry_run else os.cpu_count() or 1) if args.warm_workers is None \
        else args.warm_workers
    warm = [WARMED[name] for name in WARM_STAGES if name in chosen]
    if workers > 0 and warm:
        budget = None if args.dry_run else WARM_BUDGETS[args.quick] * args.budget_scale
        check.report["warm_up"] = warm_up(check, warm, workers, budget)
        write_report(check)
        print(f"gpu_check: warm-up: {check.report['warm_up']['status']} in "
              f"{check.report['warm_up']['seconds']:.1f} s", flush=True)
    for name, _, budget in STAGES:
        if name not in chosen:
            continue
        # The dry run has no deadline: it checks that each stage runs, not how fast (on a busy
        # 2-core machine its training stage took 306 s against a 90 s budget).
        budget = QUICK_BUDGETS.get(name, budget) if args.quick else budget
        run_in_process(check, name, None if args.dry_run else budget * args.budget_scale)
        entry = check.report["stages"][name]
        print(f"gpu_check: {name}: {entry['status']} in {entry['seconds']:.1f} s", flush=True)
    bad = failures(check.report)
    print(f"gpu_check: report in {check.out / 'report.md'}; "
          f"{len(bad)} failure{'s' * (len(bad) != 1)}", flush=True)
    for line in bad:
        print(f"  {line}"[:300])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
