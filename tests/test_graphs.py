"""fastattn.train.graphs (--cuda-graphs) on the CPU, where a "graph" is its work run again: an
update that reads everything that changes from tensors, equal to launch_step's. The capture
itself is gpu_check's (a GPU)."""

import copy
import types
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from fastattn import data
from fastattn.train.graphs import GraphedUpdate
from fastattn.train.step import LossModule, launch_step
from tests.test_train import random_batch, tiny_model


def batch(rows, src_len, tgt_len, seed):
    src, tgt = random_batch(rows, src_len, tgt_len, seed)
    return data.collate(src, tgt, range(rows))


def other_words(b, seed):
    """A batch of b's shape and padding with other words."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.where(t > 3, torch.randint(4, 50, t.shape, generator=g), t) for t in b)


def test_the_loss_over_every_position_has_the_gathered_loss_and_gradients():
    model = tiny_model()
    b = batch(3, 5, 7, seed=2)
    grads = []
    for kwargs in ({}, {"every_position": True}):
        model.zero_grad()
        loss, nll = LossModule(model)(*b, **kwargs)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        grads[-1].append(torch.stack([loss.detach(), nll]))
    # The same float32 terms summed in another order (every position, then masked): each
    # element within a few dozen roundings of its tensor's scale. Not of its own size: an element
    # near cancellation keeps no relative accuracy (one of 1.25e-3 moved by 1e-4 of itself on a
    # Xeon held to AVX2).
    for a, g in zip(*grads, strict=True):
        assert (a - g).abs().max() <= 1e-5 * g.abs().max()


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9, fused=True)


@pytest.mark.parametrize("clip_norm", [0.0, 0.05])
def test_graphed_updates_equal_launch_step(clip_norm):
    """Shapes come again (the replays), micro-batches accumulate, the rate changes: each update
    as launch_step makes it."""
    a, b, c = batch(3, 5, 6, seed=3), batch(9, 4, 12, seed=4), batch(10, 5, 12, seed=5)
    updates = [[a], [b, other_words(a, seed=6)], [other_words(a, seed=7)],
               [other_words(b, seed=8), c]]
    eager_model = tiny_model()
    graphed_model = copy.deepcopy(eager_model)
    # SGD: the update is the gradient (Adam would blow up the rounding of the keys' bias
    # gradients, which are 0 but for it, to steps of the learning rate's size).
    eager_opt, graphed_opt = (torch.optim.SGD(m.parameters(), lr=0.0, fused=True)
                              for m in (eager_model, graphed_model))
    graphed = GraphedUpdate(LossModule(graphed_model), graphed_opt, clip_norm=clip_norm)
    for i, batches in enumerate(updates):
        lr = 0.1 * (i + 1)
        for group in eager_opt.param_groups:
            group["lr"] = lr
        want = launch_step(LossModule(eager_model), eager_opt, batches,
                           clip_norm=clip_norm).result()
        got = graphed.launch(batches, lr).result()
        assert got.ok and got.tokens == want.tokens
        for name in ("loss", "nll", "grad_norm"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-5)
    # six micro-batches of three shapes: a, b first in an update; a, c added to one
    assert len(graphed.micro_batches) == 4
    assert float(graphed.lr) == pytest.approx(0.4) and graphed_opt.param_groups[0]["capturable"]
    for a, b in zip(eager_model.parameters(), graphed_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_nan_update_is_skipped_and_the_next_starts_clean():
    model = tiny_model()
    graphed = GraphedUpdate(LossModule(model), adam(model))
    b = batch(4, 5, 5, seed=9)
    assert graphed.launch([b], 1e-3).result().ok
    w = model.encoder.layers[0].feed_forward.w1.weight
    with torch.no_grad():
        saved, w[0, 0] = w[0, 0].item(), float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    assert not graphed.launch([b], 1e-3).result().ok
    for a, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(a.nan_to_num(), p.detach().nan_to_num())
    with torch.no_grad():
        w[0, 0] = saved
    result = graphed.launch([b], 1e-3).result()  # no NaN left behind in the sums or gradients
    assert result.ok and result.loss == pytest.approx(result.loss)


def test_dropout_draws_new_masks_on_every_replay():
    """The fused ops' seeds come from the graph's table, refilled per replay: the same batch
    twice, two different losses, and the seeds the eager run counted are what replays take."""
    model = tiny_model(dropout=0.3)
    graphed = GraphedUpdate(LossModule(model), adam(model))
    b = batch(4, 5, 5, seed=10)
    graphed.optimizer.param_groups[0]["lr"].zero_()  # compare losses of one model
    first = graphed.launch([b], 0.0).result().loss
    second = graphed.launch([b], 0.0).result().loss
    assert first != second
    (graph,) = graphed.micro_batches.values()
    assert 0 < graph.seeds.taken == len(graph.seeds.table)


def test_each_graph_is_warmed_up_on_the_stream_it_is_captured_on(monkeypatch):
    """State a kernel makes lazily per stream (kernels/reduction.py's arrival counters, which
    refuse to be made while capturing) must exist for the capture stream before the capture:
    torch.cuda's streams and graphs are faked on the CPU, and the work makes its stream's state
    the first time it runs on a stream."""
    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    state = types.SimpleNamespace(current=Stream(), capturing=False)

    @contextmanager
    def on(stream):
        before, state.current = state.current, stream if stream is not None else state.current
        try:
            yield
        finally:
            state.current = before

    default_capture_stream = Stream()  # torch.cuda.graph's when it is given none

    @contextmanager
    def graph(cuda_graph, pool=None, stream=None):
        with on(stream or default_capture_stream):
            state.capturing = True
            try:
                yield
            finally:
                state.capturing = False

    for name, fake in (("Stream", Stream), ("stream", on), ("graph", graph),
                       ("current_stream", lambda device=None: state.current),
                       ("CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))):
        monkeypatch.setattr(torch.cuda, name, fake)
    model = tiny_model()
    graphed = GraphedUpdate(LossModule(model), adam(model))
    graphed.device, graphed.stream = torch.device("cuda"), Stream()
    made = []

    def work():
        if state.current not in made:
            assert not state.capturing, "per-stream state made while capturing"
            made.append(state.current)

    for _ in range(2):  # two graphs: the second finds its stream's state made
        graphed._warm_and_capture(work)
    assert made == [graphed.stream]


def test_r_drop_and_an_unfused_optimiser_are_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="R-Drop"):
        GraphedUpdate(LossModule(model, rdrop=1.0), adam(model))
    with pytest.raises(ValueError, match="needs a fused optimiser, not Adam without fused"):
        GraphedUpdate(LossModule(model), torch.optim.Adam(model.parameters()))


def test_a_run_with_cuda_graphs_trains_as_the_eager_one_and_resumes_without(tmp_path):
    """Run's --cuda-graphs path (allowed on the CPU here, past the flag check): the losses of the
    eager run without dropout, and a checkpoint (its learning rate a tensor now) that an eager
    run resumes from."""
    from fastattn import train as train_module
    from fastattn.train import parse_args
    from tests.test_train import corpus, losses, train_command

    paths = corpus(tmp_path, lines=40)
    no_dropout = ("--dropout", 0, "--attention-dropout", 0, "--activation-dropout", 0)
    runs = {}
    for graphs in (False, True):
        save_dir = tmp_path / f"graphs-{graphs}"
        args = parse_args(train_command(paths, save_dir, "--max-updates", 4, "--save-every", 2,
                                        *no_dropout)[3:])
        train_module.Run(replace(args, threads=0, cuda_graphs=graphs)).train()
        runs[graphs] = (args, losses(save_dir / "metrics.jsonl"))
    (_, eager), (args, graphed) = runs[False], runs[True]
    assert sorted(graphed) == [1, 2, 3, 4]
    for step, (loss, grad_norm) in eager.items():
        assert graphed[step][0] == pytest.approx(loss, rel=1e-5)
        assert graphed[step][1] == pytest.approx(grad_norm, rel=1e-4)
    resumed = train_module.Run(replace(args, threads=0, resume=True, max_updates=6))
    assert resumed.step == 4
    resumed.train()
    assert sorted(losses(tmp_path / "graphs-True" / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
