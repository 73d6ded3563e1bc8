"""DistributedDataParallel training on gloo: one update at world size 2 equals one update on the
same total batch in a single process; and torchrun runs python -m fastattn.train end to end."""

import gc
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from fastattn import checkpoint, data
from fastattn.model import PRESETS, Transformer
from fastattn.train import LossModule, train_step

pytestmark = pytest.mark.multiprocess


def make_model():
    torch.manual_seed(0)
    return Transformer(replace(PRESETS["tiny"], vocab_size=60, encoder_layers=1,
                               decoder_layers=1, d_model=16, d_ff=32, heads=2, dropout=0.0))


def shards():
    """Two ranks' batches of different sizes and lengths (so token counts differ per rank)."""
    g = torch.Generator().manual_seed(1)

    def sentences(n, longest):
        return [torch.randint(4, 60, (int(k),), generator=g).tolist()
                for k in torch.randint(1, longest, (n,), generator=g)]

    src, tgt = sentences(7, 7), sentences(7, 9)
    return src, tgt, [list(range(0, 3)), list(range(3, 7))]


def sgd(model):
    # Plain SGD: the update is the gradient itself. (Adam would turn the numerically-zero
    # gradient of the key bias, which softmax ignores, into full-size steps of random sign.)
    return torch.optim.SGD(model.parameters(), lr=1.0)


def one_update(rank, out):
    src, tgt, parts = shards()
    model = make_model()
    trainer = DistributedDataParallel(LossModule(model))
    result = train_step(trainer, sgd(model), [data.collate(src, tgt, parts[rank])])
    if rank == 0:
        torch.save({"params": [p.detach() for p in model.parameters()],
                    "loss": result.loss, "tokens": result.tokens}, out)


def worker(rank, world, rendezvous, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        one_update(rank, out)
        # DDP's reducer is freed by now, while the process group is registered (as train.command
        # does): freed after it, its gloo destructor joins threads that wait for the GIL.
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    out = tmp_path / "rank0.pt"
    ranks = mp.spawn(worker, args=(2, f"file://{tmp_path / 'rendezvous'}", str(out)), nprocs=2,
                     join=False)
    deadline = time.monotonic() + 300
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two gloo ranks did not exit within 300 s (teardown hang)")
    distributed = torch.load(out)

    src, tgt, _ = shards()
    model = make_model()
    single = train_step(LossModule(model), sgd(model), [data.collate(src, tgt, range(7))])
    assert distributed["tokens"] == single.tokens == sum(len(t) + 1 for t in tgt)
    assert distributed["loss"] == pytest.approx(single.loss, rel=1e-6)
    for a, b in zip(distributed["params"], model.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    # The update did something: a distributed update that skipped a rank would differ.
    assert not torch.equal(distributed["params"][0], make_model().embedding.weight)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_trains_an_ensemble_end_to_end(tmp_path):
    train = data.load_multi30k("train", "en", "de")
    paths = []
    for name, rows in [("train", slice(0, 100)), ("valid", slice(100, 106))]:
        for side, text in [("en", train.src[rows]), ("de", train.tgt[rows])]:
            paths.append(tmp_path / f"{name}.{side}")
            paths[-1].write_text("\n".join(text) + "\n", encoding="utf-8")
    save_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), "-m", "fastattn.train", "--data", "files",
        "--train", *map(str, paths[:2]), "--valid", *map(str, paths[2:]),
        "--preset", "tiny", "--vocab-size", "150", "--max-tokens", "300", "--precision",
        "fp32", "--threads", "1", "--max-updates", "4", "--save-every", "2", "--eval-every", "0",
        "--log-every", "1", "--no-progress", "--average-last", "2", "--keep", "2", "--beam", "2",
        "--max-len-b", "3", "--members", "2", "--save-dir", str(save_dir),
    ]
    # The PyTorch ops: this tests the launch, sharding and saving, not the kernels (see
    # tests/test_train.py on why the training subprocesses do not run Triton's interpreter).
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "FASTATTN_BACKEND": "torch"})
    assert result.returncode == 0, result.stderr[-3000:]
    # Only rank 0 reports: the two members' final models, then their ensemble's.
    assert result.stdout.count("checkpoint: ") == 3
    for member in ("member1", "member2"):  # one process group serves both members
        state = checkpoint.load_checkpoint(save_dir / member / "checkpoint_00000004.pt")
        assert state["train"]["world_size"] == 2 and len(state["train"]["rng"]) == 2
        log = (save_dir / member / "metrics.jsonl").read_text().splitlines()
        assert [r["step"] for r in map(json.loads, log) if "loss" in r] == [1, 2, 3, 4]
    assert isinstance(checkpoint.load_checkpoint(save_dir / "checkpoint_final.pt")["config"], list)
