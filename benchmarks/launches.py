"""Kernel launches, host syncs and bytes copied by one training update of the paper's base and
big models on the CUDA dispatch path, counted on a machine without a GPU (issue 49 item 3).

    python -m benchmarks.launches                  # base and big, the paper's batch per GPU
    python -m benchmarks.launches --preset base --sentences 125 --length 25 --json out.json
    python -m benchmarks.launches --cuda-graphs    # the trainer's --cuda-graphs update

How: the model, its batch and the optimiser state are meta tensors (shapes and dtypes, no data),
and fastattn's dispatch answers for them what it answers for CUDA tensors (the Triton kernels).
A TorchDispatchMode sees every ATen op below autograd, forward and backward, and fastattn's own
ops, whose CUDA implementations it runs (their launchers and matrix products) with Triton's
launch replaced by a count. launch_step (fastattn.train.step) runs as the trainer runs it, with
fused Adam, bf16 autocast and one micro-batch, and then its result is read. With --cuda-graphs,
GraphedUpdate (fastattn.train.graphs) runs instead: what each graph's capture records, and what
an update launches around the replays (trace_graphed).

What counts, per op call:
- a launch: every ATen op that is not a view, an allocation or a metadata query (each is one CUDA
  kernel, the usual case; multi-tensor ops count the launches ATen's multi_tensor_apply makes,
  by its limits of tensors per launch and 65,536-element chunks, `multi_tensor_launches`), and
  every Triton kernel launched;
- per phase: the micro-batch (forward and backward; what accumulation repeats), the update's
  end (the gradient norm, the optimiser, the non-blocking copy of the results to the host) and
  the read (PendingStep.result(), which the trainer makes once the next update is launched);
- a host sync: reading a device value on the host (Tensor.item(), .tolist(), float(tensor), a
  blocking copy to the CPU) and the ops whose output size depends on the data (nonzero, boolean
  indexing, masked_select, unique), which wait for the device to know it; apart from them, the
  read's wait on an event recorded after the update's own work (the GPU meanwhile runs the
  next update's, already launched);
- bytes copied: what copies and casts write (copy_, _foreach_copy_, _to_copy, clone,
  contiguous's copy, cat);
- host-to-device copies, counted apart (the batch's own are one per tensor).

Autocast: meta tensors have no autocast of their own, so the mode applies CUDA autocast's rule
for the ops the model calls (the matrix products in bf16; autocast's cast cache keeps one bf16
copy of each weight per forward), counting each cast as the _to_copy launch it is on a GPU.
F.dropout runs as CUDA runs it, one fused native_dropout (meta would decompose it into three).
Limits: DistributedDataParallel's all-reduces are not traced (one GPU); the kernels a cuBLAS
matrix product launches count as one, and so do those of embedding_dense_backward (on CUDA, past
3,072 indices, a sort and a segmented sum: several kernels); eager dispatch costs (5-10 us per
launch) are the reason the count matters, and the CUDA time itself is gpu_check's to measure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import traceback
import types
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
import triton
from torch.fx.experimental import _config as fx_config
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fastattn import backend
from fastattn.kernels.reduction import arrival_counter
from fastattn.model import PRESETS, Transformer
from fastattn.train.graphs import GraphedUpdate
from fastattn.train.step import LossModule, launch_step

aten = torch.ops.aten
# Ops that launch nothing on a GPU: views, allocations, metadata.
NO_LAUNCH = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.detach.default,
    aten.lift_fresh.default, aten.is_same_size.default, aten.sym_size.int,
    aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
    aten._has_compatible_shallow_copy_type.default, aten.is_nonzero.default,
    aten._unsafe_view.default,  # a view whose schema does not say so
}
SYNCS = {
    aten._local_scalar_dense.default: "item()/float()/int() of a device tensor",
    aten.nonzero.default: "nonzero (output size depends on the data)",
    aten.masked_select.default: "masked_select (output size depends on the data)",
    aten._unique2.default: "unique (output size depends on the data)",
}
COPIES = {aten.copy_.default, aten._to_copy.default, aten.clone.default, aten.cat.default,
          aten._foreach_copy_.default}
IN_PLACE_COPIES = {aten.copy_.default, aten._foreach_copy_.default}  # they write their first input
# CUDA autocast's lower-precision list, for the functions the model calls.
AUTOCAST_FUNCTIONS = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                      torch.Tensor.matmul, torch.Tensor.__matmul__}
# ATen's multi_tensor_apply (MultiTensorApply.cuh): per launch at most this many tensors, by the
# number of lists (copy: 2, Adam: 4), and 320 blocks of 65,536 elements each.
MULTI_TENSOR_MAX_TENSORS = (110, 64, 48, 36, 30)
MULTI_TENSOR_MAX_BLOCKS = 320
MULTI_TENSOR_CHUNK = 65536


PHASES = ("micro-batch", "update", "read")


@dataclass
class Counts:
    launches: Counter = field(default_factory=Counter)  # op name -> launches
    syncs: Counter = field(default_factory=Counter)  # "reason at file:line" -> count
    copied: Counter = field(default_factory=Counter)  # op name -> bytes written
    h2d: Counter = field(default_factory=Counter)  # phase -> host-to-device copies
    event_waits: Counter = field(default_factory=Counter)  # "phase at file:line" -> count
    # The micro-batch (forward and backward) until its backward returns, then the update's end
    # (gradient norm, optimiser, the read of the results): launches and syncs per phase.
    phase: str = "micro-batch"
    phase_launches: Counter = field(default_factory=Counter)
    phase_syncs: Counter = field(default_factory=Counter)
    phase_ops: defaultdict = field(default_factory=lambda: defaultdict(Counter))

    def total(self) -> int:
        return sum(self.launches.values())

    def launch(self, name: str, n: int = 1) -> None:
        self.launches[name] += n
        self.phase_launches[self.phase] += n
        self.phase_ops[self.phase][name] += n

    def sync(self, reason: str) -> None:
        self.syncs[reason] += 1
        self.phase_syncs[self.phase] += 1


def _bytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _caller() -> str:
    """The innermost frame in fastattn's own code (or torch's, if none): file:line."""
    frames = [f for f in traceback.extract_stack() if "benchmarks/launches" not in f.filename]
    ours = [f for f in frames if "/fastattn/" in f.filename and "site-packages/torch" not in
            f.filename]
    frame = (ours or frames)[-1]
    name = frame.filename
    name = "fastattn/" + name.split("/fastattn/")[-1] if ours else name.split("site-packages/")[-1]
    return f"{name}:{frame.lineno}"


def multi_tensor_launches(lists: list[list[torch.Tensor]]) -> int:
    """The kernels multi_tensor_apply launches over `lists` (same shapes list by list): it fills
    a launch with tensors and 65,536-element chunks until either limit is met, carrying a
    tensor whose chunks did not all fit into the next launch."""
    max_tensors = MULTI_TENSOR_MAX_TENSORS[len(lists) - 1]
    launches = tensors = blocks = 0
    for t in lists[0]:
        if t.numel() == 0:
            continue
        tensors += 1
        chunks = math.ceil(t.numel() / MULTI_TENSOR_CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if (tensors == max_tensors and last) or blocks == MULTI_TENSOR_MAX_BLOCKS:
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (blocks > 0)


def _fastattn_cuda_impl(func):
    """The CUDA implementation of a fastattn custom op (torch.library.custom_op's own table)."""
    opdef = torch._library.custom_ops.OPDEFS.get(func._schema.name)
    return None if opdef is None else opdef._backend_fns.get("cuda")


class CudaPathCounter(TorchDispatchMode):
    """Counts what the dispatched ops would launch, sync and copy on a GPU; runs them on meta."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.removeprefix("aten::")
        if func._schema.name.startswith("fastattn::"):
            impl = _fastattn_cuda_impl(func)
            if impl is not None:  # its launchers and products, counted op by op
                with self:
                    return impl(*args, **kwargs)
        if func in SYNCS and any(t.device.type == "meta" for t in _tensors(list(args))):
            self.counts.sync(f"{SYNCS[func]} at {_caller()}")
            if func is aten._local_scalar_dense.default:  # the copy of one value
                x = args[0]
                return x.numel() if not x.dtype.is_floating_point else 1.0
            self.counts.launch(name)
            return _data_dependent(func, args)
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                t.dtype in (torch.bool, torch.uint8) for t in _tensors(list(args[1]))):
            self.counts.sync(f"boolean indexing (output size depends on the data) at {_caller()}")
        if func is aten._to_copy.default:
            source = args[0].device.type
            target = kwargs.get("device")
            target = source if target is None else torch.device(target).type
            if source == "meta" and target == "cpu":
                if kwargs.get("non_blocking"):  # into pinned memory, behind the stream's work
                    self.counts.launch("copy to the host (non-blocking)")
                else:  # .tolist(), .cpu(): the host waits for the device
                    self.counts.sync(f"copy to the host (.tolist(), .cpu()) at {_caller()}")
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            if source == "cpu" and target == "meta":
                self.counts.h2d[self.counts.phase] += 1
                return func(*args, **kwargs)
        if func is aten.copy_.default and args[0].device.type == "meta" and \
                args[1].device.type == "cpu":  # into a device buffer (GraphedUpdate's batch)
            self.counts.h2d[self.counts.phase] += 1
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        on_device = any(t.device.type == "meta" for t in _tensors(out)) or any(
            t.device.type == "meta" for t in _tensors(list(args)))
        if func in NO_LAUNCH or func.is_view or not on_device:  # host work launches nothing
            return out
        if name.startswith("_foreach") or name.startswith("_fused"):
            # the fused optimisers pass their step counts beside the lists, not as one
            lists = [a for a, arg in zip(args, func._schema.arguments, strict=False)
                     if isinstance(a, (list, tuple)) and a and arg.name != "state_steps"]
            # _foreach_norm reduces each tensor's partial norms in a second kernel
            cleanup = func is aten._foreach_norm.Scalar
            self.counts.launch(name, multi_tensor_launches(lists) + cleanup)
        else:
            self.counts.launch(name)
        if func in COPIES:
            self.counts.copied[name] += _bytes(args[0] if func in IN_PLACE_COPIES else out)
        return out


class MetaAutocast(TorchFunctionMode):
    """CUDA autocast's rule for meta tensors, above autograd as autocast is: inside an enabled
    region the matrix products take bf16 copies of their float32 inputs (one per weight per
    region: autocast's cast cache, unless the region turns it off, as a CUDA graph's capture
    does), so the casts and their backward are dispatched and counted."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled: list[bool] = []
        self.caching: list[bool] = []
        self.cache: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def region(self, enabled: bool, cache_enabled: bool = True):
        self.enabled.append(enabled)
        self.caching.append(cache_enabled)
        try:
            yield
        finally:
            self.enabled.pop()
            self.caching.pop()
            if not self.enabled:
                self.cache.clear()

    def on(self) -> bool:
        return bool(self.enabled) and self.enabled[-1]

    def cast(self, x):
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32):
            return x
        cached = x.is_leaf and x.requires_grad and self.caching[-1]
        if cached and id(x) in self.cache:
            return self.cache[id(x)]
        y = x.to(torch.bfloat16)
        if cached:
            self.cache[id(x)] = y
        return y

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in AUTOCAST_FUNCTIONS and self.on():
            args = tuple(self.cast(a) for a in args)
            kwargs = {k: self.cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _data_dependent(func, args):
    """A plausible result for an op whose output size depends on the data: as if every element
    were selected (the count, not the size, is what matters here)."""
    x = args[0]
    if func is aten.nonzero.default:
        return torch.empty((x.numel(), x.dim()), dtype=torch.long, device="meta")
    if func is aten.masked_select.default:
        return torch.empty(x.numel(), dtype=x.dtype, device="meta")
    return (torch.empty(x.numel(), dtype=x.dtype, device="meta"),) + (
        torch.empty(0, dtype=torch.long, device="meta"),) * 2


@contextlib.contextmanager
def cuda_dispatch(counts: Counts, sm: tuple[int, int] = (9, 0), sms: int = 132):
    """fastattn dispatches meta tensors as CUDA ones; Triton launches are counted, not run;
    the launchers' device queries answer for an H100 (sm_90, 132 SMs)."""
    names = ("autocast", "is_autocast_enabled", "get_autocast_dtype")
    saved = (backend._triton_on, triton.runtime.jit.JITFunction.run,
             torch.cuda.get_device_capability, torch.cuda.get_device_properties,
             *(getattr(torch, n) for n in names))
    on, real_autocast, real_enabled, real_dtype = saved[0], *saved[4:]
    emulated = MetaAutocast()

    def autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "meta":
            return emulated.region(enabled, cache_enabled is not False)
        return real_autocast(device_type, dtype, enabled, cache_enabled)

    torch.autocast = autocast
    torch.is_autocast_enabled = lambda *a: emulated.on() if a and a[0] == "meta" \
        else real_enabled(*a)
    torch.get_autocast_dtype = lambda t: torch.bfloat16 if t == "meta" else real_dtype(t)

    def run(self, *args, grid, warmup, **kwargs):
        counts.launch(f"triton {self.fn.__name__}")

    real_dropout = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        # ATen's dropout is one fused kernel on CUDA (native_dropout, is_fused_kernel_acceptable);
        # on meta it decomposes into bernoulli_, div_ and mul.
        if x.device.type == "meta" and training and 0 < p < 1 and x.numel() > 0 and not inplace:
            return torch.native_dropout(x, p, True)[0]
        return real_dropout(x, p, training, inplace)

    F.dropout = dropout
    backend._triton_on = lambda device_type: "triton" if device_type == "meta" else on(device_type)
    triton.runtime.jit.JITFunction.run = run
    torch.cuda.get_device_capability = lambda device=None: sm
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=sms)
    foreach = torch.utils._foreach_utils
    saved_foreach = foreach._get_foreach_kernels_supported_devices
    # clip_grad_norm_ takes the multi-tensor kernels on CUDA, as on meta here
    foreach._get_foreach_kernels_supported_devices = lambda: [*saved_foreach(), "meta"]
    real_event = torch.Event

    class Event:  # a CUDA event: recorded on the stream, waited for by the host
        def __init__(self, device=None, **kwargs) -> None:
            pass

        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            counts.event_waits[f"{counts.phase} at {_caller()}"] += 1

    torch.Event = Event
    saved_nonzero = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True  # boolean indexing on meta: all selected
    try:
        with emulated:
            yield
    finally:
        (backend._triton_on, triton.runtime.jit.JITFunction.run,
         torch.cuda.get_device_capability, torch.cuda.get_device_properties) = saved[:4]
        for name, value in zip(names, saved[4:], strict=True):
            setattr(torch, name, value)
        fx_config.meta_nonzero_assume_all_nonzero = saved_nonzero
        F.dropout = real_dropout
        torch.Event = real_event
        foreach._get_foreach_kernels_supported_devices = saved_foreach


class MetaAdam:
    """What torch.optim.Adam(fused=True) does per step on a GPU: one _fused_adam_ over the
    parameter, gradient and moment lists, skipping the update where found_inf says so (torch
    refuses fused Adam on meta tensors)."""

    _step_supports_amp_scaling = True  # the found_inf protocol launch_step uses

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.param_groups = [{"params": params, "lr": 1e-4}]
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.steps = [torch.zeros((), device=p.device) for p in params]

    def step(self) -> None:
        grads = [p.grad for p in self.params]
        # A learning rate in a tensor (GraphedUpdate's) launches the same kernel; meta has no
        # implementation of that overload, so the count takes a number.
        torch._fused_adam_(self.params, grads, self.exp_avg, self.exp_avg_sq, [], self.steps,
                           lr=1e-4, beta1=0.9, beta2=0.98, weight_decay=0.0, eps=1e-9,
                           amsgrad=False, maximize=False,
                           found_inf=getattr(self, "found_inf", None))

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # in place, as torch.optim does on CUDA: one multi-tensor zero
            torch._foreach_zero_([p.grad for p in self.params if p.grad is not None])
            return
        for p in self.params:
            p.grad = None


def _setup(preset: str, sentences: int, length: int, vocab: int):
    """The meta model of `preset` as the trainer wraps it, a batch of `sentences` pairs of
    `length` source and target tokens (on the CPU, as the trainer's batches are) and MetaAdam."""
    if backend.interpreter_active():
        raise RuntimeError("the launch count needs Triton's compiled launch path: unset "
                           "TRITON_INTERPRET")
    config = replace(PRESETS[preset], vocab_size=vocab)
    with torch.device("meta"):
        model = Transformer(config).train()
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(4, vocab, (sentences, length), generator=generator)
    target = torch.randint(4, vocab, (sentences, length + 1), generator=generator)
    batch = (source, target[:, :-1], target[:, 1:])
    arrival_counter(torch.device("meta"))  # made once per process (its zeros), not per step
    return model, LossModule(model), batch, MetaAdam(list(model.parameters()))


def trace(preset: str, sentences: int, length: int, vocab: int) -> dict:
    """The counts of one update (one micro-batch of `sentences` pairs of `length` source and
    target tokens) of `preset` on the CUDA path, in all and by phase: the micro-batch (its forward
    and backward), the update's end (gradient norm, optimiser, the copy of the results) and the
    read of the results."""
    model, loss_module, batch, optimizer = _setup(preset, sentences, length, vocab)
    counts = Counts()
    # The phase turns to the update's end when the micro-batch's backward returns.
    loss_module.register_forward_pre_hook(lambda *_: setattr(counts, "phase", "micro-batch"))
    real_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        real_backward(self, *args, **kwargs)
        counts.phase = "update"

    torch.Tensor.backward = backward
    try:
        with cuda_dispatch(counts), CudaPathCounter(counts):
            pending = launch_step(loss_module, optimizer, [batch], autocast_dtype=torch.bfloat16)
            counts.phase = "read"
            pending.result()
    finally:
        torch.Tensor.backward = real_backward
    return {
        "preset": preset, "sentences": sentences, "length": length, "vocab": vocab,
        "parameters": sum(p.numel() for p in model.parameters()),
        "launches": counts.total(), "host_syncs": sum(counts.syncs.values()),
        "launches_by_phase": dict(counts.phase_launches),
        "host_syncs_by_phase": {phase: counts.phase_syncs[phase] for phase in PHASES},
        "event_waits": dict(counts.event_waits),
        "bytes_copied": sum(counts.copied.values()),
        "host_to_device_copies": sum(counts.h2d.values()),
        "launches_by_op": dict(counts.launches.most_common()),
        "syncs_by_reason": dict(counts.syncs.most_common()),
        "bytes_copied_by_op": dict(counts.copied.most_common()),
    }


GRAPHED_PHASES = ("micro-batch graph", "end graph", "graphed update", "read")


def trace_graphed(preset: str, sentences: int, length: int, vocab: int) -> dict:
    """The counts of --cuda-graphs' update (fastattn.train.GraphedUpdate) of one micro-batch
    on the CUDA path: what each graph holds ("micro-batch graph", "end graph"), counted as its
    capture records it (after the eager run that precedes a capture, not counted), then what
    an update launches around the replays once its graphs exist ("graphed update"; a replay
    is one launch) and the read. A captured host sync or host-to-device copy would fail the
    capture on a GPU (the copy would also freeze the batch it copied): both must be 0 inside
    the graphs."""
    model, loss_module, batch, optimizer = _setup(preset, sentences, length, vocab)
    update = GraphedUpdate(loss_module, optimizer, autocast_dtype=torch.bfloat16)
    counts = Counts()

    def warm_and_capture(work):
        outside = counts.phase
        counts.phase = "eager run before capture"
        work()
        counts.phase = "end graph" if work == update._end else "micro-batch graph"
        work()
        counts.phase = outside
        return lambda: counts.launch("CUDA graph replay")

    update._warm_and_capture = warm_and_capture
    with cuda_dispatch(counts), CudaPathCounter(counts):
        counts.phase = "first update"
        update.launch([batch], lr=1e-4)
        counts.phase = "graphed update"
        pending = update.launch([batch], lr=1e-4)
        counts.phase = "read"
        pending.result()
    return {
        "preset": preset, "sentences": sentences, "length": length, "vocab": vocab,
        "launches_per_update": sum(counts.phase_launches[p] for p in GRAPHED_PHASES[2:]),
        "launches_by_phase": {p: counts.phase_launches[p] for p in GRAPHED_PHASES},
        "host_syncs_by_phase": {p: counts.phase_syncs[p] for p in GRAPHED_PHASES},
        "host_to_device_copies_by_phase": {p: counts.h2d[p] for p in GRAPHED_PHASES},
        "event_waits": dict(counts.event_waits),
        "launches_by_op_by_phase": {p: dict(counts.phase_ops[p].most_common())
                                    for p in GRAPHED_PHASES},
        "syncs_by_reason": dict(counts.syncs.most_common()),
    }


def markdown(results: list[dict]) -> str:
    lines = ["| preset | tokens (src + tgt) | launches | of which the micro-batch | host syncs "
             "(micro-batch + update + read) | event waits (read) | bytes copied | "
             "host-to-device copies |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        tokens = r["sentences"] * r["length"]
        syncs = r["host_syncs_by_phase"]
        lines.append(f"| {r['preset']} | {tokens:,} + {tokens:,} | {r['launches']:,} | "
                     f"{r['launches_by_phase'].get('micro-batch', 0):,} | "
                     f"{syncs['micro-batch']} + {syncs['update']} + {syncs['read']} | "
                     f"{sum(r['event_waits'].values())} | "
                     f"{r['bytes_copied'] / 1e9:.2f} GB | {r['host_to_device_copies']} |")
    for r in results:
        lines += ["", f"{r['preset']}: launches by op", ""]
        lines += [f"- {op}: {n}" for op, n in r["launches_by_op"].items()]
        lines += ["", f"{r['preset']}: host syncs", ""]
        lines += [f"- {why}: {n}" for why, n in r["syncs_by_reason"].items()] or ["- none"]
        lines += ["", f"{r['preset']}: bytes copied by op", ""]
        lines += [f"- {op}: {n / 1e6:,.1f} MB" for op, n in r["bytes_copied_by_op"].items()]
    return "\n".join(lines)


def markdown_graphed(results: list[dict]) -> str:
    lines = ["| preset | tokens (src + tgt) | kernels in the micro-batch graph | in the end graph "
             "| launches per update (graph replays included) | host-to-device copies | "
             "host syncs (in the graphs + outside + read) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        tokens = r["sentences"] * r["length"]
        phase, syncs = r["launches_by_phase"], r["host_syncs_by_phase"]
        lines.append(f"| {r['preset']} | {tokens:,} + {tokens:,} | "
                     f"{phase['micro-batch graph']:,} | {phase['end graph']:,} | "
                     f"{r['launches_per_update']} | "
                     f"{r['host_to_device_copies_by_phase']['graphed update']} | "
                     f"{syncs['micro-batch graph'] + syncs['end graph']} + "
                     f"{syncs['graphed update']} + {syncs['read']} |")
    for r in results:
        lines += ["", f"{r['preset']}: launches per update outside the graphs", ""]
        lines += [f"- {op}: {n}" for op, n in
                  r["launches_by_op_by_phase"]["graphed update"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launches",
                                     description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", nargs="+", default=["base", "big"], choices=sorted(PRESETS))
    # The paper's batch per GPU: about 25,000 + 25,000 tokens over 8 GPUs (section 5.1).
    parser.add_argument("--sentences", type=int, default=125)
    parser.add_argument("--length", type=int, default=25)
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="count the trainer's --cuda-graphs update instead: what each graph "
                        "holds and what an update launches around the replays")
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args(argv)
    count, render = (trace_graphed, markdown_graphed) if args.cuda_graphs else (trace, markdown)
    results = [count(p, args.sentences, args.length, args.vocab) for p in args.preset]
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
