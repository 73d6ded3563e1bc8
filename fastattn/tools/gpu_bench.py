"""The speed half of python -m fastattn.tools.gpu_check, and what every one of its stages takes.

  Check         the state of one run: device, dry run, report so far, the stage's deadline
  device_name   the GPU's name, or the CPU's in the dry run
  timing        synchronize, seconds (median of timed calls), peak_bytes (peak GPU memory)
  stages        attention (fastattn against SDPA's backends and flash_attn), fused (LayerNorm +
                residual, cross-entropy, linear cross-entropy against eager PyTorch), training
                (base and big steps beside the paper's)

The schedule, the correctness stages, the report and the command line are
fastattn.tools.gpu_check's; this module never imports it.
"""

from __future__ import annotations

import platform
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import fastattn
from fastattn import ops
from fastattn.train.graphs import GraphedUpdate
from fastattn.train.step import LossModule, PendingStep, launch_step

Rows = list[dict[str, Any]]
Cases = Iterator[tuple[str, Callable[[], Rows]]]
"""What a stage yields: its cases, each a name and what measures it into report rows. The cases
run one by one (gpu_check.run_stage): one that raises fails its row alone."""

PAPER_STEP_SECONDS = {"base": 0.4, "big": 1.0}  # 8 P100s, about 25k + 25k tokens per step
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}  # dense, datasheets


@dataclass
class Check:
    """The state of one run that every stage takes: where it runs, whether it is the dry run or
    the quick profile (gpu_check --quick: fewer cases, each stage's essentials), the report so
    far (gpu_check writes it under `out` as each case ends) and the deadline of the stage
    running."""
    device: torch.device
    dry_run: bool
    out: Path
    report: dict[str, Any] = field(default_factory=dict)
    deadline: float = 0.0  # of the stage running
    quick: bool = False

    def time_left(self) -> bool:
        return time.monotonic() < self.deadline


def device_name(check: Check) -> str:
    if check.device.type == "cuda":
        return torch.cuda.get_device_name(check.device)
    return f"CPU ({platform.processor() or platform.machine()}, Triton interpreter)"


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def error_line(error: BaseException) -> str:
    """The line that says what went wrong: an exception's type and first line; for a Triton
    CompilationError, whose message is a source excerpt ending in a `^` line and which wraps the
    one of each function it compiled through (raise ... from), the innermost one's message and
    source line: what failed, and where."""
    def compiling(e: BaseException | None) -> bool:
        return hasattr(e, "src") and hasattr(e, "node")

    while compiling(error) and compiling(error.__cause__):
        error = error.__cause__
    src, node = getattr(error, "src", None), getattr(error, "node", None)
    if getattr(error, "error_message", None) and src and hasattr(node, "lineno"):
        line = src.split("\n")[node.lineno - 1].strip()
        return f"{type(error).__name__}: {error.error_message} at `{line}`"
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device, budget: float = 0.3) -> float:
    """The median time of one call, after two untimed ones, over calls filling about `budget`;
    on the CPU (the dry run, where figures mean nothing) one call."""
    if device.type == "cpu":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    for _ in range(2):
        fn()
    synchronize(device)
    times: list[float] = []
    end = time.monotonic() + budget
    while len(times) < 3 or (time.monotonic() < end and len(times) < 200):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


def attention_speed(check: Check) -> Cases:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = check.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    systems: dict[str, Callable[..., torch.Tensor]] = {"fastattn": ops.attention}
    if check.quick:  # one row against SDPA as it picks its backend
        systems["sdpa"] = lambda q, k, v, causal=False: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal)
        backends = ()
    else:
        backends = (("sdpa flash", SDPBackend.FLASH_ATTENTION),
                    ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION),
                    ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION))
    for name, backend in backends:
        def sdpa(q, k, v, causal=False, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        systems[name] = sdpa
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        flash_attn_func = None
    if flash_attn_func is not None and not check.quick:
        systems["flash_attn"] = lambda q, k, v, causal=False: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    tokens = 256 if check.dry_run else 16384
    lengths = (64,) if check.dry_run else (512,) if check.quick else (128, 512, 2048, 8192)

    def case(name: str, fn: Callable[..., torch.Tensor], b: int, heads: int, length: int,
             d: int, causal: bool) -> Rows:
        q, k, v = (torch.randn(b, heads, length, d, device=dev, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        flop = 4 * b * heads * length * length * d * (0.5 if causal else 1.0)
        row = dict(system=name, shape=f"B={b} H={heads} L={length} D={d}", causal=causal)
        row |= attention_timing(partial(fn, q, k, v, causal=causal), flop, dev)
        if name == "fastattn" and "error" in row:  # an SDPA backend may refuse a shape
            row["passed"] = False
        return [row]

    for d in ((16,) if check.dry_run else (64,) if check.quick else (64, 128)):
        heads = 1024 // d if not check.dry_run else 2
        for length in lengths:
            for causal in (False,) if check.quick else (False, True):
                b = max(1, tokens // length)
                for name, fn in systems.items():
                    yield (f"{name} L={length} D={d} causal={causal}",
                           partial(case, name, fn, b, heads, length, d, causal))


def attention_timing(call: Callable[[], torch.Tensor], flop: float,
                     dev: torch.device) -> dict[str, Any]:
    try:
        with torch.no_grad():
            fwd = seconds(call, dev)
        both = seconds(lambda: call().sum().backward(), dev)
    except Exception as e:  # an SDPA backend that does not take the shape, a kernel that fails
        return dict(error=error_line(e)[:300])
    # The backward is 2.5 forwards of matmul work (five products against two).
    return dict(forward_ms=fwd * 1e3, forward_tflops=flop / fwd / 1e12, fwd_bwd_ms=both * 1e3,
                fwd_bwd_tflops=3.5 * flop / both / 1e12)


def fused_speed(check: Check) -> Cases:
    dev = check.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    size = dtype.itemsize
    n, features, vocab = (64, 40, 97) if check.dry_run else (8192, 1024, 37000)
    x, r = (torch.randn(n, features, device=dev, dtype=dtype, requires_grad=True)
            for _ in range(2))
    w, b = (torch.ones(features, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    logits = torch.randn(n, vocab, device=dev, dtype=dtype, requires_grad=True)
    hidden = torch.randn(n, 512, device=dev, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, 512, device=dev, dtype=dtype, requires_grad=True)
    target = torch.randint(1, vocab, (n,), device=dev)
    cases = {
        "layer_norm_residual": (
            lambda: ops.layer_norm_residual(x, r, w, b).sum().backward(),
            lambda: F.layer_norm(x + r, (features,), w, b).sum().backward(),
            7 * n * features * size),  # x, r, y read and written across both passes
        "label_smoothed_cross_entropy": (
            lambda: ops.label_smoothed_cross_entropy(logits, target, 0.1).backward(),
            lambda: F.cross_entropy(logits, target, label_smoothing=0.1).backward(),
            3 * n * vocab * size),
        "linear_cross_entropy": (
            lambda: ops.linear_cross_entropy(hidden, weight, target, smoothing=0.1).backward(),
            lambda: F.cross_entropy(hidden @ weight.T, target, label_smoothing=0.1).backward(),
            None),
    }

    def case(name: str, system: str, fn: Callable[[], None], moved: int | None) -> Rows:
        t = seconds(fn, dev)
        return [dict(op=name, system=system, dtype=str(dtype), ms=t * 1e3,
                     gb_per_s=moved / t / 1e9 if moved else None,
                     peak_mib=(peak_bytes(fn, dev) or 0) / 2**20)]

    for name, (ours, eager, moved) in cases.items():
        for system, fn in (("fastattn", ours), ("eager", eager)):
            yield f"{name} {system}", partial(case, name, system, fn, moved)


def training(check: Check) -> Cases:
    yield "--cuda-graphs updates = launch_step's", lambda: [graphs_match(check)]
    yield "attention in a CUDA graph, its mask changed between replays", partial(
        mask_replays, check)
    if check.quick:
        return
    for preset in ("base",) if check.dry_run else ("base", "big"):  # the same tiny model dry
        yield f"{preset} update", partial(lambda preset: [training_step(check, preset)], preset)


def training_step(check: Check, preset: str) -> dict[str, Any]:
    dev = check.device
    cfg = fastattn.PRESETS[preset]
    if check.dry_run:
        cfg = replace(cfg, vocab_size=97, encoder_layers=1, decoder_layers=1, d_model=32,
                      d_ff=64, heads=2)
    model = fastattn.Transformer(cfg).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                 fused=True)
    b, length = (2, 6) if check.dry_run else (125, 25)  # the paper's 3,125 + 3,125 per GPU
    src = torch.randint(4, cfg.vocab_size, (b, length))
    tgt = torch.randint(4, cfg.vocab_size, (b, length + 1))
    # The trainer's update as it runs it: host batches copied in, bf16 autocast on a GPU, the
    # NaN guard on the device, the results read back.
    update = partial(launch_step, LossModule(model), optimizer, [(src, tgt[:, :-1], tgt[:, 1:])],
                     autocast_dtype=torch.bfloat16 if dev.type == "cuda" else None)

    def step() -> None:
        update().result()

    n, budget = (2, 0.5) if check.dry_run else (8, 5.0)
    t = seconds(step, dev, budget=budget)
    t_loop = seconds(partial(in_loop, update, n), dev, budget=budget) / n
    launches = busy = syncs = None
    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            synchronize(dev)
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        launches = len(kernels)
        busy = sum(e.device_time for e in kernels) / 1e6 / t
        # CUDA's own count of what makes the host wait while an update is launched (0 expected:
        # benchmarks.launches), not counting the read, which waits on the update's event.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pending = update()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        pending.result()
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    graphed = graphed_loop(check, model, [(src, tgt[:, :-1], tgt[:, 1:])], n, budget)
    params = sum(p.numel() for p in model.parameters())
    flop = 6 * params * b * length  # the usual 6 N per token, attention's small share aside
    peak = next((v for k, v in PEAK_BF16.items() if k in device_name(check)), None)
    return dict(preset=preset, tokens=f"{b * length} + {b * length}", step_s=t,
                step_in_loop_s=t_loop, paper_step_s=PAPER_STEP_SECONDS[preset],
                launches=launches, host_syncs=syncs, gpu_busy=busy,
                mfu=flop / t_loop / peak if peak else None, **graphed)


def in_loop(update: Callable[[], PendingStep], n: int) -> None:
    """n updates as the trainer's loop runs them: update i+1 launched before i is read."""
    pending = update()
    for _ in range(n - 1):
        launched = update()
        pending.result()
        pending = launched
    pending.result()


def graphed_loop(check: Check, model: torch.nn.Module, batches: list[tuple[torch.Tensor, ...]],
                 n: int, budget: float) -> dict[str, Any]:
    """The same updates replayed from CUDA graphs (--cuda-graphs, dropout on) in the trainer's
    loop, on a copy of the model; a capture that fails is reported, not raised."""
    dev = check.device
    copy = fastattn.Transformer(model.cfg).to(dev)
    copy.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(copy.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                 fused=True)
    try:
        graphed = GraphedUpdate(LossModule(copy), optimizer,
                                autocast_dtype=torch.bfloat16 if dev.type == "cuda" else None)
        t = seconds(partial(in_loop, partial(graphed.launch, batches, 1e-4), n), dev,
                    budget=budget) / n
        return dict(graphed_in_loop_s=t, graph_error=None)
    except Exception as e:  # what stops capture is the finding
        return dict(graphed_in_loop_s=None, graph_error=error_line(e)[:300])


def graphs_match(check: Check) -> dict[str, Any]:
    """--cuda-graphs' updates against launch_step's from one model, in fp32 without dropout
    and with SGD (its update is the gradient): three updates over micro-batches of two shapes,
    each coming again (replays). Then with dropout, one batch twice at learning rate 0: new
    dropout masks on the replay, so two losses."""
    dev = check.device
    cfg = replace(fastattn.PRESETS["base"], vocab_size=1000, encoder_layers=2, decoder_layers=2,
                  dropout=0.0)
    if check.dry_run:
        cfg = replace(cfg, vocab_size=97, encoder_layers=1, decoder_layers=1, d_model=32, d_ff=64,
                      heads=2)
    generator = torch.Generator().manual_seed(1)

    def batch(rows: int, src_len: int, tgt_len: int) -> tuple[torch.Tensor, ...]:
        src = torch.randint(4, cfg.vocab_size, (rows, src_len), generator=generator)
        tgt = torch.randint(4, cfg.vocab_size, (rows, tgt_len + 1), generator=generator)
        # Padding too, its length drawn: a shape's replays read other masks than its capture.
        src[-1, int(torch.randint(1, src_len, (), generator=generator)):] = cfg.pad_id
        tgt[-1, int(torch.randint(2, tgt_len + 1, (), generator=generator)):] = cfg.pad_id
        return src, tgt[:, :-1], tgt[:, 1:]

    a, b = ((5, 7, 9), (16, 12, 13)) if not check.dry_run else ((2, 5, 6), (3, 9, 4))
    updates = [[batch(*a)], [batch(*b), batch(*a)], [batch(*b)]]
    models = [fastattn.Transformer(cfg).to(dev)]
    models.append(fastattn.Transformer(cfg).to(dev))
    models[1].load_state_dict(models[0].state_dict())
    start = torch.nn.utils.parameters_to_vector(models[0].parameters()).detach().clone()
    eager_opt, graphed_opt = (torch.optim.SGD(m.parameters(), lr=0.1, fused=True)
                              for m in models)
    graphed = GraphedUpdate(LossModule(models[1]), graphed_opt)
    worst = 0.0
    for batches in updates:
        want = launch_step(LossModule(models[0]), eager_opt, batches).result()
        got = graphed.launch(batches, 0.1).result()
        for name in ("loss", "nll", "grad_norm"):
            x, y = getattr(got, name), getattr(want, name)
            worst = max(worst, abs(x - y) / abs(y))
    eager_moved, graphed_moved = (torch.nn.utils.parameters_to_vector(m.parameters()).detach()
                                  - start for m in models)
    moved = float((graphed_moved - eager_moved).norm() / eager_moved.norm())
    dropout_model = fastattn.Transformer(replace(cfg, dropout=0.1)).to(dev)
    dropout = GraphedUpdate(LossModule(dropout_model),
                            torch.optim.SGD(dropout_model.parameters(), lr=0.0, fused=True))
    first, replayed = (dropout.launch(updates[0], 0.0).result().loss for _ in range(2))
    passed = worst < 1e-3 and moved < 1e-2 and first != replayed
    return dict(case="--cuda-graphs updates = launch_step's", shapes=len(graphed.micro_batches),
                worst_rel_error=worst, update_rel_error=moved,
                dropout_losses_differ=first != replayed, passed=passed)


def mask_replays(check: Check) -> list[dict[str, Any]]:
    """Attention forward and backward captured once in a CUDA graph (the dry run: called again),
    then replayed with other masks copied into the captured one (other padding, a sentence all
    padding, none padded): each replay equals an eager call with that mask, bit for bit (the
    same kernels). A graph that read the mask of its capture, or a stale copy, differs."""
    dev = check.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    b, h, length, d = (2, 2, 17, 16) if check.dry_run else (3, 4, 97, 64)
    generator = torch.Generator().manual_seed(5)

    def padding(lengths: list[int]) -> torch.Tensor:
        return (torch.arange(length)[None] < torch.tensor(lengths)[:, None])[:, None, None].to(dev)

    masks = {"the capture's": padding([length] + [length // 2] * (b - 1)),
             "other padding": padding(torch.randint(1, length, (b,), generator=generator).tolist()),
             "a sentence all padding": padding([0] + [length] * (b - 1)),
             "none padded": padding([length] * b)}
    q, k, v, grad = (torch.randn(b, h, length, d, generator=generator).to(dev, dtype)
                     for _ in range(4))
    static_mask = masks["the capture's"].clone()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step() -> list[torch.Tensor]:
        out = ops.attention(*leaves, attn_mask=static_mask)
        return [out, *torch.autograd.grad(out, leaves, grad)]

    if dev.type == "cuda":
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # compiled and warmed on the capture stream first
            step()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()

        def replay() -> list[torch.Tensor]:
            graph.replay()
            return [t.clone() for t in captured]
    else:
        replay = step
    rows = []
    for name, mask in masks.items():
        static_mask.copy_(mask)
        got = replay()
        out = ops.attention(*leaves, attn_mask=mask)
        want = [out, *torch.autograd.grad(out, leaves, grad)]
        rows.append(dict(op="attention", variant=f"mask replayed: {name}", dtype=str(dtype),
                         graphed=dev.type == "cuda",
                         bitwise_equal=all(torch.equal(a, b)
                                           for a, b in zip(got, want, strict=True))))
    return rows
