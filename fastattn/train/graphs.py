"""The trainer's update replayed from CUDA graphs (--cuda-graphs): a few launches per
micro-batch where dispatching it op by op takes about 400 (benchmarks.launches), for a GPU
fast enough that launching bounds the step (BENCHMARKS.md's projection: base at the paper's
per-GPU batch on an H100 or H200).

A micro-batch's forward and backward is one graph per batch shape (and per role: the first
micro-batch of an update, or one accumulated after it), captured the first time that shape
comes, right after an eager run of the batch (its real contribution to the update, which also
compiles the kernels and counts its dropout seeds). Token buckets make the same
shapes every epoch (scripts.graph_shapes: 51 on Multi30k at --max-tokens 16000, 100 at 6250),
so the graphs are captured in the first epoch; the loss projects every position
(Transformer.loss's every_position) so that shapes do not depend on the token count. The end
of the update (the gradient norm and clipping, the NaN/inf guard, Adam) is one more graph. The
graphs share one memory pool: they replay one at a time, in any order, and keep nothing alive
between replays but the tensors below.

Whatever changes between replays lives in a tensor the graphs read, never in a Python value
they captured: the batch (copied into the shape's buffers), the loss normaliser and learning
rate (filled in), the dropout seeds (a table each graph refills, fastattn.ops.seeds). The
update's gradients and loss sums live in tensors that stay allocated: the backward hands over
fresh gradients (a .grad it would add to costs a kernel per parameter: 194 in base), which
the first micro-batch copies into them and any later one adds, a few multi-tensor kernels
either way (benchmarks.launches --cuda-graphs counts what each graph holds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fastattn.ops import seeds
from fastattn.train.step import PendingStep


@dataclass
class _MicroBatchGraph:
    batch: tuple[torch.Tensor, ...]
    """The graph's input buffers, (source, decoder input, target) of its shape."""
    first: bool
    """Whether it starts an update: it sets the update's gradients and sums, or adds to them."""
    seeds: seeds.DeviceSeeds
    replay: Callable[[], None]


class GraphedUpdate:
    """launch_step for one process on a GPU, from CUDA graphs (module docstring). The optimiser
    must be a fused one (its found_inf skips a NaN/inf update on the device); its learning rate
    becomes a device tensor that launch() fills."""

    def __init__(self, loss_module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 autocast_dtype: torch.dtype | None = None, clip_norm: float = 0.0) -> None:
        if getattr(loss_module, "rdrop", 0):
            raise ValueError("--cuda-graphs: R-Drop's loss is not graphed; train without one "
                             "of the two")
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(f"--cuda-graphs needs a fused optimiser, not "
                             f"{type(optimizer).__name__} without fused=True")
        self.module, self.optimizer = loss_module, optimizer
        self.autocast_dtype, self.clip_norm = autocast_dtype, clip_norm
        self.params = [p for p in loss_module.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.pad_id = loss_module.pad_id
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        """Where each graph's work is warmed up and then captured: state made lazily per stream
        (kernels/reduction.py's arrival counters) exists for the capture before it begins."""
        self.grads = [torch.zeros_like(p) for p in self.params]
        """The update's gradients (the params' .grad between micro-batches): graphs hold them."""
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad
        self.sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        """Loss and NLL summed over the update's micro-batches so far."""
        self.normaliser = torch.ones((), device=self.device)
        self.values = torch.zeros(3, dtype=torch.float64, device=self.device)
        """Loss sum, NLL sum and gradient norm of the last update: the end graph's output."""
        self.lr = torch.zeros((), device=self.device)
        for group in optimizer.param_groups:  # read by the captured step: a tensor, capturable
            self.lr.fill_(float(group["lr"]))
            group["lr"], group["capturable"] = self.lr, True
        self.micro_batches: dict[tuple[tuple[torch.Size, ...], bool], _MicroBatchGraph] = {}
        """By (batch shape, first of its update)."""
        self.end: Callable[[], None] | None = None

    def launch(self, batches: Sequence[tuple[torch.Tensor, ...]], lr: float) -> PendingStep:
        """One update at learning rate `lr` from host micro-batches (source, decoder input,
        target); read it with .result(), as launch_step's."""
        if not batches:
            raise ValueError("GraphedUpdate.launch: no micro-batches to train on")
        tokens = sum(int((b[2] != self.pad_id).sum()) for b in batches)
        self.normaliser.fill_(max(tokens, 1))
        self.lr.fill_(lr)
        for i, batch in enumerate(batches):
            if self.device.type == "cuda":  # from pageable memory the copy may wait
                batch = tuple(t.pin_memory() for t in batch)
            key = (tuple(t.shape for t in batch), i == 0)
            graph = self.micro_batches.get(key)
            if graph is None:
                buffers = tuple(torch.empty_like(t, device=self.device) for t in batch)
                graph = _MicroBatchGraph(buffers, i == 0, seeds.DeviceSeeds(self.device), None)
                self._copy_in(graph.batch, batch)
                graph.replay = self._warm_and_capture(lambda g=graph: self._micro_batch(g))
                self.micro_batches[key] = graph
                continue
            self._copy_in(graph.batch, batch)
            graph.replay()
        if self.end is None:
            self.end = self._warm_and_capture(self._end)
        else:
            self.end()
        values, copied = self.values, None
        if self.device.type != "cpu":
            values = values.to("cpu", non_blocking=True)  # into pinned memory, on the stream
            copied = torch.Event(self.device.type)
            copied.record()
        else:
            values = values.clone()
        return PendingStep(values, tokens, copied)

    @staticmethod
    def _copy_in(buffers: Sequence[torch.Tensor], batch: Sequence[torch.Tensor]) -> None:
        for buffer, t in zip(buffers, batch, strict=True):
            buffer.copy_(t, non_blocking=True)

    def _micro_batch(self, graph: _MicroBatchGraph) -> None:
        """A micro-batch's forward and backward, from its buffers: its gradients, loss and NLL
        sums become the update's (the first micro-batch) or are added to them."""
        graph.seeds.refill()
        autocast = torch.autocast(self.device.type, self.autocast_dtype,
                                  enabled=self.autocast_dtype is not None,
                                  cache_enabled=False)  # its cache cannot outlive a capture
        with seeds.from_device(graph.seeds), autocast:
            loss, nll = self.module(*graph.batch, every_position=True)
        for p in self.params:
            p.grad = None
        try:
            (loss / self.normaliser).backward()
            fresh = [p.grad for p in self.params]
        finally:
            for p, grad in zip(self.params, self.grads, strict=True):
                p.grad = grad
        sums = torch.stack([loss.detach(), nll.detach()]).double()
        got = [(grad, new) for grad, new in zip(self.grads, fresh, strict=True) if new is not None]
        none = [grad for grad, new in zip(self.grads, fresh, strict=True) if new is None]
        if graph.first:
            self.sums.copy_(sums)
            torch._foreach_copy_([grad for grad, _ in got], [new for _, new in got])
            if none:  # parameters this batch does not reach (none in the model's own use)
                torch._foreach_zero_(none)
        else:
            self.sums += sums
            torch._foreach_add_([grad for grad, _ in got], [new for _, new in got])

    def _end(self) -> None:
        """Clipping, the NaN/inf guard and the optimiser's step: launch_step's end."""
        if self.clip_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params])
        self.values.copy_(torch.cat([self.sums, grad_norm.double().reshape(1)]))
        # The fused optimiser skips the update when found_inf is 1 (launch_step's guard).
        self.optimizer.found_inf = (self.values - self.values).sum(dtype=torch.float32).ne_(0)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    def _warm_and_capture(self, work: Callable[[], None]) -> Callable[[], None]:
        """Runs `work` once (on a GPU on the capture stream, off the default one, as capture
        wants the kernels compiled and lazily made state allocated first, for that stream) and
        returns what runs it again: its CUDA graph's replay, or on other devices `work` itself."""
        if self.device.type != "cuda":
            work()
            return work
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            work()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # records the work, does not run it
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            work()
        return graph.replay
