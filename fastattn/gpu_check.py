"""python -m fastattn.gpu_check: fastattn's self-check and benchmark on one CUDA GPU, in at most
about 9 minutes, with only what such a machine has (CUDA torch and Triton; nothing downloaded).

First a pool of processes (one per CPU core) runs correctness's cases once, so that their kernels
compile side by side into Triton's disk cache (the warm-up; --warm-workers). Then the stages run
in order, each in a process of its own (a crash or a sticky CUDA error ends that
stage only; its stderr goes to <stage>.log under --out) and within its own time budget, which
the process checks before each case and past which, and GRACE_SECONDS more, it is ended. They
run case by case: a case that raises fails its own row, and the report (report.json and
report.md under --out) is rewritten as each case ends, so a run cut short keeps what it measured:

  environment   versions, the GPU, fastattn.info's dispatch table
  correctness   every op x dtype (fp16, bf16, fp32, fp32 with tf32) x variant, forward and every
                gradient, against fp64; graded relative to PyTorch's own error in the same dtype
                (attention's tf32 rows: relative to tf32's, tf32_attention)
  determinism   two backward passes (and dropout from one seed) bit for bit
  large         B x H > 65,535 heads, and offsets past 2**31 elements
  attention     fastattn against SDPA's backends (flash, efficient, cuDNN) and flash_attn if
                installed: ms and TFLOP/s, forward and forward + backward
  fused         LayerNorm + residual, cross-entropy and linear cross-entropy against eager
                PyTorch: ms, GB/s, peak memory
  training      --cuda-graphs' updates against launch_step's (equal, and new dropout masks on
                each replay); base and big training updates as the trainer runs them
                (launch_step): time read at once and in the trainer's loop (the next launched
                before the last is read), launches, host syncs (CUDA's sync debug mode),
                GPU-busy fraction, MFU, beside the paper's 0.4 s and 1.0 s (8 P100s); and the
                loop's time replayed from CUDA graphs (--cuda-graphs)
  decoding      beam search on the GPU against the CPU: the same translations
  registers     registers and spills of every kernel the JIT built (each stage's process lists
                its own in the report), against the compile report

--dry-run runs every stage at tiny shapes on the CPU with the kernels in Triton's interpreter (CI
runs it, so the check cannot rot), without time budgets; its figures mean nothing.

This module holds the schedule (STAGES), the correctness stages and what grades them, the report
and the command line; fastattn.gpu_bench holds the speed stages, their timers and the state of a
run (Check) that every stage takes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing
import os
import platform
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
    os.execvpe(sys.executable, [sys.executable, "-m", "fastattn.gpu_check", *sys.argv[1:]],
               {**os.environ, "TRITON_INTERPRET": "1", "FASTATTN_BACKEND": "triton"})

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fastattn  # noqa: E402
from fastattn import ops  # noqa: E402
from fastattn.cli import ArgumentParser  # noqa: E402
from fastattn.gpu_bench import (  # noqa: E402
    Cases,
    Check,
    Rows,
    attention_speed,
    device_name,
    error_line,
    fused_speed,
    training,
)
from fastattn.ops.attention import attention_reference  # noqa: E402
from fastattn.ops.cross_entropy import cross_entropy_reference  # noqa: E402
from fastattn.ops.embedding import embedding as ops_embedding  # noqa: E402
from fastattn.ops.layer_norm import layer_norm_residual_reference  # noqa: E402
from fastattn.ops.relu import relu_backward_bias  # noqa: E402

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
    """The DTYPES a run grades: --quick leaves tf32 out (fp32's kernels compiled again)."""
    return {k: v for k, v in DTYPES.items() if not (check.quick and k == "fp32+tf32")}


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
# Stages (attention, fused and training are fastattn.gpu_bench's)
# ---------------------------------------------------------------------------------------------


def environment(check: Check) -> Cases:
    yield "versions, the GPU, the dispatch table", partial(environment_rows, check)


def environment_rows(check: Check) -> Rows:
    import triton

    from fastattn.info import dispatch_table

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


def correctness(check: Check) -> Cases:
    for case in attention_variants(check):
        yield f"attention, {case[0]}", partial(attention_case, check, *case)
    for residual in (True, False):
        yield (f"layer_norm_residual, {'with' if residual else 'no'} residual",
               partial(layer_norm_case, check, residual))
    yield "cross-entropy, linear cross-entropy", partial(cross_entropy_cases, check)
    yield "relu_backward_bias", partial(relu_bias_case, check)
    yield "embedding", partial(embedding_case, check)


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


def far_rows(check: Check) -> Rows:
    """A query and a mask whose row 2 lies past element 2**31 of its buffer."""
    dev = check.device
    dtype = torch.float16
    lq, lk, d, row = 3, 17, 64, 2**30 + 64

    def far_apart(compact: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(row * (lq - 1) + compact.shape[-1], dtype=compact.dtype, device=dev)
        return buffer.as_strided(compact.shape, (0, 0, row, 1)).copy_(compact)

    q = torch.randn(1, 1, lq, d, device=dev, dtype=dtype)
    k, v = (torch.randn(1, 1, lk, d, device=dev, dtype=dtype) for _ in range(2))
    mask = make_mask("bool", 1, lq, lk, dev)
    grad = torch.randn_like(q)
    compact = fwd_bwd(lambda q, k, v: ops.attention(q, k, v, attn_mask=mask), [q, k, v], grad)
    far = fwd_bwd(lambda q, k, v: ops.attention(q, k, v, attn_mask=far_apart(mask)),
                  [far_apart(q), k, v], grad)
    return [dict(op="attention", variant="q and mask rows past 2**31 elements", dtype="fp16",
                 bitwise_equal=all(torch.equal(a, b) for a, b in zip(compact, far, strict=True)))]


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
    # Seconds each, 540 in all with the warm-up's 60; the first stages include Triton's compiles
    # (cached on disk, most of correctness's by the warm-up).
    ("environment", environment, 20), ("correctness", correctness, 120),
    ("determinism", determinism, 30), ("large", large, 30),
    ("attention", attention_speed, 120), ("fused", fused_speed, 40),
    ("training", training, 90), ("decoding", decoding, 20), ("registers", registers, 10),
]
# --quick: these stages only, with these budgets (205 s with the warm-up's 30, and a process start
# each), for a first
# look, a fix and a second look within a GPU lease of 15 minutes: every op's correctness in
# fp16, bf16 and fp32 at the model's shapes, one speed row per op against SDPA or eager, one
# graphed training update against the eager one.
QUICK_BUDGETS = {"environment": 10, "correctness": 75, "attention": 20, "fused": 20,
                 "training": 40, "registers": 10}


# Before the stages: the cases of WARM_STAGES run once, spread over a pool of processes (one per
# CPU core: 16 on the GPU machine), their results discarded, so that Triton's JIT compiles their
# kernels side by side into its disk cache (~/.triton/cache), where the stage's own process finds
# them (the same cases, hence the same specialisations) instead of compiling them one after the
# other inside its budget. Best effort: a case that raises is counted (the stage reports it), and
# the pool is ended at its budget.
WARM_STAGES = ("correctness",)
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
    return [sys.executable, "-m", "fastattn.gpu_check", "--out", str(check.out),
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
    parser = ArgumentParser(prog="python -m fastattn.gpu_check",
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
                                         "(default: all, or --quick's)")
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
        QUICK_BUDGETS if args.quick else (name for name, _, _ in STAGES))
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
                        command=" ".join(["python -m fastattn.gpu_check", *(argv or sys.argv[1:])]),
                        stages={})
    workers = (0 if args.dry_run else os.cpu_count() or 1) if args.warm_workers is None \
        else args.warm_workers
    warm = [stage for name, stage, _ in STAGES if name in WARM_STAGES and name in chosen]
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
