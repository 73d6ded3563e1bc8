"""fastattn.train: the schedule, one update (accumulation, NaN guard), flags, bad input, and an
exact resume after SIGKILL, SIGINT and SIGTERM (tests/test_train_faults.py: the other faults)."""

import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import FrozenInstanceError, asdict, replace
from types import SimpleNamespace

import pytest
import torch

from fastattn import checkpoint, data
from fastattn import train as train_module
from fastattn.model import PRESETS, Transformer
from fastattn.train import (
    BF16_MIN_SPEEDUP,
    LossModule,
    bf16_matmul_speedup,
    launch_step,
    learning_rate,
    model_config,
    parse_args,
    pick_precision,
    train_step,
)
from fastattn.train.config import CONFIG_VERSION, TrainConfig, config_meta, saved_flags


def test_learning_rate_schedule():
    d, warmup = 512, 4000
    peak = d**-0.5 * warmup**-0.5
    assert learning_rate(warmup, d, warmup) == pytest.approx(peak)
    assert learning_rate(warmup // 4, d, warmup) == pytest.approx(peak / 4)  # linear warmup
    assert learning_rate(4 * warmup, d, warmup) == pytest.approx(peak / 2)  # inverse sqrt
    assert learning_rate(100, d, warmup, scale=3.0) == pytest.approx(3 * learning_rate(100, d,
                                                                                         warmup))


def tiny_model(dtype=torch.float32, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    config = replace(PRESETS["tiny"], vocab_size=50, encoder_layers=1, decoder_layers=1,
                     d_model=16, d_ff=32, heads=2, dropout=dropout, label_smoothing=0.1)
    return Transformer(config).to(dtype)


def random_batch(rows, src_len, tgt_len, seed):
    g = torch.Generator().manual_seed(seed)
    src = [torch.randint(4, 50, (int(n),), generator=g).tolist()
           for n in torch.randint(1, src_len, (rows,), generator=g)]
    tgt = [torch.randint(4, 50, (int(n),), generator=g).tolist()
           for n in torch.randint(1, tgt_len, (rows,), generator=g)]
    return src, tgt


def update(model, batches, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient
    result = train_step(LossModule(model), optimizer, batches, **kwargs)
    return result, [p.detach().clone() for p in model.parameters()]


def test_accumulated_micro_batches_equal_one_batch():
    src, tgt = random_batch(7, 6, 8, seed=1)
    whole = data.collate(src, tgt, range(7))
    parts = [data.collate(src, tgt, range(3)), data.collate(src, tgt, range(3, 7))]
    one, after_one = update(tiny_model(), [whole])
    two, after_two = update(tiny_model(), parts)
    assert one.ok and two.ok and one.tokens == two.tokens == sum(len(t) + 1 for t in tgt)
    # The fused loss accumulates in fp32 whatever the input dtype: compare at fp32 precision.
    assert two.loss == pytest.approx(one.loss, rel=1e-6)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    for a, b in zip(after_one, after_two, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_update_changes_the_model_and_the_loss_per_token_is_right():
    src, tgt = random_batch(5, 6, 6, seed=2)
    batch = data.collate(src, tgt, range(5))
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        loss, nll = model.loss(*batch, reduction="mean", return_nll=True)
    result, after = update(model, [batch])
    assert result.loss == pytest.approx(float(loss), rel=1e-6)
    assert result.nll == pytest.approx(float(nll), rel=1e-6)
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True)
               if a.dim() == 2)


def test_rdrop_update_reports_its_loss_and_moves_the_model():
    src, tgt = random_batch(5, 6, 6, seed=5)
    batch = data.collate(src, tgt, range(5))
    model = tiny_model(dropout=0.3)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    torch.manual_seed(3)
    result = train_step(LossModule(model, rdrop=5.0), optimizer, [batch])
    assert result.ok and result.tokens == sum(len(t) + 1 for t in tgt)
    assert math.isfinite(result.loss) and result.loss > result.nll * 0.9
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
               if a.dim() == 2)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN it injects
def test_nan_guard_skips_the_update():
    src, tgt = random_batch(4, 5, 5, seed=3)
    model = tiny_model()
    with torch.no_grad():
        model.encoder.layers[0].feed_forward.w1.weight[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    result, after = update(model, [data.collate(src, tgt, range(4))])
    assert not result.ok
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_fused_adam_skips_a_nan_update_itself_and_the_read_comes_after():
    """With a fused optimiser the NaN guard needs no host read: found_inf skips the update (and
    its step count) where the optimiser runs; the figures are read later, from PendingStep."""
    src, tgt = random_batch(4, 5, 5, seed=3)
    batch = data.collate(src, tgt, range(4))
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    assert launch_step(LossModule(model), optimizer, [batch]).result().ok
    with torch.no_grad():
        model.encoder.layers[0].feed_forward.w1.weight[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    pending = launch_step(LossModule(model), optimizer, [batch])
    assert not hasattr(optimizer, "found_inf")  # GradScaler's protocol: set for the step only
    result = pending.result()
    assert not result.ok and result.tokens == sum(len(t) + 1 for t in tgt)
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a.nan_to_num(), b.detach().nan_to_num())
    assert {int(state["step"]) for state in optimizer.state.values()} == {1}


def test_clipping_bounds_the_update():
    src, tgt = random_batch(4, 5, 5, seed=4)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    result = train_step(LossModule(model), optimizer, [data.collate(src, tgt, range(4))],
                        clip_norm=0.01)
    moved = torch.nn.utils.parameters_to_vector(model.parameters()).detach() - before
    assert result.grad_norm > 0.01  # the norm before clipping is reported
    assert float(moved.norm()) == pytest.approx(0.01, rel=1e-4)


@pytest.mark.parametrize(("has_bf16", "speedup", "expected"), [
    (False, None, None),  # no bf16 instructions: fp32 without measuring
    (True, 0.6, None),  # AVX-512 BF16 without AMX (an Intel Xeon measured 0.5–0.9)
    (True, BF16_MIN_SPEEDUP - 0.01, None),
    (True, BF16_MIN_SPEEDUP, torch.bfloat16),
    (True, 4.0, torch.bfloat16),  # AMX
])
def test_auto_precision_on_cpu_follows_the_measured_speed(monkeypatch, has_bf16, speedup,
                                                          expected):
    """bf16 autocast on a CPU only where bf16 matmuls measure clearly faster than fp32: without
    bf16 instructions they take a generic path far slower, and with AVX-512 BF16 alone they can
    still be slower."""
    def measured() -> float:
        assert has_bf16, "measured on a CPU without bf16 instructions"
        return speedup

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: has_bf16)
    monkeypatch.setattr(train_module.precision, "bf16_matmul_speedup", measured)
    dtype, scaled, why = pick_precision("auto", torch.device("cpu"))
    assert dtype == expected and not scaled
    assert why.startswith("auto")
    assert pick_precision("bf16", torch.device("cpu")) == (torch.bfloat16, False, "as asked")


def test_bf16_matmul_speedup_is_a_measured_ratio():
    speedup = bf16_matmul_speedup()
    assert math.isfinite(speedup) and speedup > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--src", "de", "--tgt", "de"], "must differ"),
        (["--data", "wmt"], "--data must be 'multi30k' or 'files'"),
        (["--data", "files"], "needs --train"),
        (["--src", "cs"], "multi30k languages"),
        (["--dropout", "1.5"], "--dropout must be in"),
        (["--attention-dropout", "-0.1"], "--attention-dropout must be in"),
        (["--activation-dropout", "1"], "--activation-dropout must be in"),
        (["--bpe-dropout", "1"], "--bpe-dropout must be in [0, 1)"),
        (["--word-dropout", "-0.1"], "--word-dropout must be in [0, 1)"),
        (["--label-smoothing", "-0.1"], "--label-smoothing must be in [0, 1)"),
        (["--rdrop", "-1"], "--rdrop must not be negative"),
        (["--bidirectional", "-1"], "--bidirectional must not be negative"),
        (["--d-model", "0"], "--d-model must be at least 1"),
        (["--members", "0"], "--members must be at least 1"),
        (["--jobs", "-1"], "--jobs must not be negative"),
        (["--preset", "huge"], "invalid choice"),
        (["--keep", "3", "--average-last", "5"], "--keep 3 must be at least --average-last 5"),
        (["--warmup", "many"], "invalid int value"),
        (["--alpha", "0.6,-1"], "length penalty exponents must be >= 0"),
        (["--alpha", "0.6;1"], "not a comma-separated list of numbers"),
        (["--output-vocab", "source"], "invalid choice"),
        (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
        (["--adam-betas", "0.9", "1"], "--adam-betas must be in [0, 1)"),
        (["--adam-eps=-1e-9"], "--adam-eps must not be negative"),
        (["--max-len-ratio", "0.5"], "--max-len-ratio must be at least 1"),
        (["--heads", "3"], "--d-model 128 must be divisible by --heads 3"),
        (["--preset", "base", "--d-model", "100"], "--d-model 100 must be divisible by --heads 8"),
        (["--output-vocab", "target", "--bpe-dropout", "0.1"],
         "--output-vocab target needs the text's own segmentation"),
        (["--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a GPU (--device cuda)"),
        (["--cuda-graphs", "--device", "cuda", "--precision", "fp16"],
         "--cuda-graphs: fp16's loss scaling is not graphed"),
        (["--cuda-graphs", "--device", "cuda", "--rdrop", "1"],
         "--cuda-graphs: R-Drop's loss is not graphed"),
        (["--cuda-graphs", "--device", "cuda", "--bpe-dropout", "0.1"],
         "--cuda-graphs: --bpe-dropout gives batches new shapes every epoch"),
    ],
)
def test_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err



def test_checkpoints_store_the_config_versioned_and_read_the_flags_of_older_ones():
    config = parse_args(["--data", "files", "--train", "a.en", "a.de", "--valid", "b.en", "b.de",
                         "--seed", "5", "--alpha", "0.6,1.0"])
    stored = config_meta(config)
    assert stored["version"] == CONFIG_VERSION == 2 and stored["train"] == ("a.en", "a.de")
    assert saved_flags({"config": stored}) == asdict(config)
    assert TrainConfig(**saved_flags({"config": stored})) == config
    with pytest.raises(FrozenInstanceError):
        config.seed = 6  # derived values make new configs (dataclasses.replace)
    before_issue_48 = {"args": {"seed": 5, "train": ["a.en", "a.de"], "truecase": True}}
    assert saved_flags(before_issue_48) == before_issue_48["args"]

def test_plot_without_matplotlib_is_refused_before_training(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: (
        None if name == "matplotlib" else find_spec(name, *rest)))
    with pytest.raises(SystemExit):
        parse_args(["--plot", "curves.png"])
    assert "--plot needs matplotlib (pip install matplotlib)" in capsys.readouterr().err


def test_save_dir_must_be_a_writable_directory(tmp_path, capsys):
    (tmp_path / "file").touch()
    with pytest.raises(SystemExit):
        parse_args(["--save-dir", str(tmp_path / "file" / "run")])
    assert f"{tmp_path / 'file'} is a file, not a directory" in capsys.readouterr().err


def test_help_shows_defaults_and_paper_values(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "[paper: 4000]" in out and "(default: 1000)" in out and "[paper: base]" in out


def test_model_flags_override_the_preset_and_nothing_else():
    preset = PRESETS["multi30k"]
    assert model_config(parse_args([]), 4000) == replace(preset, vocab_size=4000)
    config = model_config(parse_args(["--d-ff", "512", "--attention-dropout", "0.1",
                                      "--activation-dropout", "0.2", "--dropout", "0.25",
                                      "--label-smoothing", "0.2"]), 123)
    assert config == replace(preset, vocab_size=123, d_ff=512, dropout=0.25,
                             attention_dropout=0.1, activation_dropout=0.2, label_smoothing=0.2)
    for name, smoothing in (("table3-D3", 0.0), ("table3-D4", 0.2), ("base", 0.1)):
        config = model_config(parse_args(["--preset", name]), 100)
        assert config.label_smoothing == smoothing, name


# --- the command line, in subprocesses ---------------------------------------------------------

# These runs test the training loop, resume and error handling, not the ops (tests/test_ops*
# cover those under both backends): they always use the PyTorch ops, since Triton's interpreter
# would make a few dozen training updates take many minutes.
TORCH_OPS = {**os.environ, "FASTATTN_BACKEND": "torch"}


def corpus(tmp_path, lines=120):
    """A small real parallel corpus (the first Multi30k lines) as plain files."""
    train = data.load_multi30k("train", "en", "de")
    paths = {}
    for name, rows in [("train", slice(0, lines)), ("valid", slice(lines, lines + 8))]:
        for side, text in [("en", train.src[rows]), ("de", train.tgt[rows])]:
            paths[name, side] = tmp_path / f"{name}.{side}"
            paths[name, side].write_text("\n".join(text) + "\n", encoding="utf-8")
    return paths


def train_command(paths, save_dir, *extra):
    return [
        sys.executable, "-m", "fastattn.train", "--data", "files",
        "--train", str(paths["train", "en"]), str(paths["train", "de"]),
        "--valid", str(paths["valid", "en"]), str(paths["valid", "de"]),
        "--preset", "tiny", "--vocab-size", "200", "--max-tokens", "300", "--precision", "fp32",
        "--threads", "1", "--eval-every", "0", "--log-every", "1", "--no-progress",
        "--average-last", "2", "--keep", "2", "--beam", "2", "--max-len-b", "3", "--members", "1",
        "--save-dir", str(save_dir), *map(str, extra),
    ]


def losses(metrics_path):
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"repeated updates in {metrics_path}"
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


def pairs_of_an_epoch(stream, updates):
    """The (source, target) id tuples of an epoch's batches, with BOS/EOS/padding gone."""
    pairs = []
    for _ in range(updates):
        for source, _inputs, targets in next(stream):
            for s, t in zip(source.tolist(), targets.tolist(), strict=True):
                pairs.append((tuple(s[: s.index(data.EOS_ID)]),
                              tuple(t[: t.index(data.EOS_ID)])))
    return sorted(pairs)


def test_bidirectional_training_sees_both_directions_then_source_to_target(tmp_path):
    paths = corpus(tmp_path, lines=40)
    args = parse_args(train_command(paths, tmp_path / "run", "--bidirectional", 5)[3:])
    args = replace(args, threads=0)  # keep this process's thread count
    run = train_module.Run(args)
    train = run.splits["train"]
    forward = sorted((tuple(s), tuple(t))
                     for s, t in zip(train.src_ids, train.tgt_ids, strict=True))
    reverse = sorted((t, s) for s, t in forward)

    both = len(run.training_pairs.both_batches)
    assert pairs_of_an_epoch(run.updates(), both) == sorted(forward + reverse)
    assert (run.epoch, run.epoch_step) == (1, 0)
    run.step = 5  # past the bidirectional phase
    assert pairs_of_an_epoch(run.updates(), len(run.training_pairs.forward_batches)) == forward


def test_the_next_update_is_launched_before_the_last_is_read_except_at_a_save_or_the_end(
        tmp_path, monkeypatch):
    """Run.train launches update n+1 before reading update n (a GPU never waits on the host's
    read), but settles an update a checkpoint or the end follows; the updates are the same."""
    paths = corpus(tmp_path, lines=40)
    events = []
    real_launch, real_result = train_module.run.launch_step, train_module.PendingStep.result

    def launch(*args, **kwargs):
        pending = real_launch(*args, **kwargs)
        pending.number = sum(e[0] == "L" for e in events) + 1
        events.append(f"L{pending.number}")
        return pending

    def result(self):
        events.append(f"R{self.number}")
        return real_result(self)

    monkeypatch.setattr(train_module.run, "launch_step", launch)
    monkeypatch.setattr(train_module.PendingStep, "result", result)
    metrics = {}
    for save_every in (3, 1):  # 1: every update settles before the next is launched
        save_dir = tmp_path / f"run{save_every}"
        args = parse_args(train_command(paths, save_dir, "--max-updates", 6, "--save-every",
                                        save_every)[3:])
        run = train_module.Run(replace(args, threads=0))
        monkeypatch.setattr(run, "save", lambda *a, run=run, **k: events.append(
            f"S{run.step}") or train_module.Run.save(run, *a, **k))
        events.clear()
        run.train()
        if save_every == 3:
            assert events == ["L1", "L2", "R1", "L3", "R2", "R3", "S3", "L4", "L5", "R4", "L6",
                              "R5", "R6", "S6"]
        else:
            assert events == [e for n in range(1, 7) for e in (f"L{n}", f"R{n}", f"S{n}")]
        metrics[save_every] = losses(save_dir / "metrics.jsonl")
    assert metrics[3] == metrics[1] and len(metrics[3]) == 6


def test_the_metrics_record_spanning_a_resume_averages_every_update_since_the_last_record(
        tmp_path):
    """A checkpoint keeps the sums of the updates since the last metrics record: the record
    after a resume averaged only the updates after it (6.733 against 6.882 uninterrupted). A
    checkpoint written before it kept them gives a record marked with the updates it covers."""
    paths = corpus(tmp_path, lines=40)

    def args(save_dir, *flags):
        command = train_command(paths, tmp_path / save_dir, "--max-updates", 8, "--log-every", 4,
                                "--save-every", 0, *flags)
        return replace(parse_args(command[3:]), threads=0)  # keep this process's thread count

    def training_records(save_dir):
        return [json.loads(line) for line in (tmp_path / save_dir / "metrics.jsonl").read_text()
                .splitlines() if "loss" in line]

    train_module.Run(args("ref")).train()
    expected = training_records("ref")
    assert [r["step"] for r in expected] == [4, 8]
    train_module.Run(args("run")).train(until=6)  # pauses with a checkpoint at update 6
    train_module.Run(args("run", "--resume")).train()
    records = training_records("run")
    assert [r["step"] for r in records] == [4, 8]
    for name in ("loss", "nll", "ppl", "grad_norm"):
        assert records[1][name] == expected[1][name], name
    assert "partial_updates" not in records[1]

    train_module.Run(args("old")).train(until=6)
    saved = tmp_path / "old" / "checkpoint_00000006.pt"
    state = checkpoint.load_checkpoint(saved)
    del state["train"]["window"]  # as a checkpoint written before the window was kept
    checkpoint.save_checkpoint(saved, state)
    train_module.Run(args("old", "--resume")).train()
    old = training_records("old")
    assert old[1]["partial_updates"] == 2 and old[1]["loss"] != expected[1]["loss"]
    assert old[0] == {**expected[0], "tok_per_s": old[0]["tok_per_s"], "time": old[0]["time"]}


@pytest.mark.parametrize("preset", [None, "64"])
def test_run_widens_onednn_kernel_cache_unless_set(tmp_path, monkeypatch, preset):
    """Token buckets give each batch its own shapes; oneDNN's default cache of 1,024 compiled
    kernels overflowed on Multi30k, so the run raises it, before oneDNN first runs."""
    if preset is None:
        monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", preset)
    paths = corpus(tmp_path, lines=20)
    args = parse_args(train_command(paths, tmp_path / "run")[3:])
    args = replace(args, threads=0)  # keep this process's thread count
    train_module.Run(args)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == (preset or "8192")


def test_truecase_trains_on_truecased_text_and_a_resumed_run_keeps_it(tmp_path):
    paths = corpus(tmp_path, lines=40)
    args = parse_args(train_command(paths, tmp_path / "run")[3:])  # truecasing is the default
    args = replace(args, threads=0)  # keep this process's thread count
    run = train_module.Run(args)
    raw = data.read_parallel(paths["train", "en"], paths["train", "de"])
    src, tgt = data.Truecaser.train(raw.src), data.Truecaser.train(raw.tgt)
    assert [src(s) for s in raw.src] != raw.src  # the test means something
    train = run.splits["train"]
    assert train.src_ids == data.encode(run.sp, [src(s) for s in raw.src])
    assert train.tgt_ids == data.encode(run.sp, [tgt(t) for t in raw.tgt])
    valid = run.splits["valid"]
    assert valid.text.tgt == data.read_lines(paths["valid", "de"])  # BLEU is against raw text
    assert valid.tgt_ids == data.encode(run.sp, [tgt(t) for t in valid.text.tgt])
    run.save()
    assert checkpoint.load_checkpoint(checkpoint.list_checkpoints(tmp_path / "run")[-1])[
        "meta"]["truecase"] == src.forms  # what fastattn.Translator truecases sources with

    args = parse_args(train_command(paths, tmp_path / "run", "--resume", "--no-truecase")[3:])
    args = replace(args, threads=0)
    with pytest.raises(checkpoint.CheckpointError, match="trained with --truecase, this command "
                       "gives --no-truecase"):
        train_module.Run(args)
    args = parse_args(train_command(paths, tmp_path / "run", "--resume")[3:])
    args = replace(args, threads=0)
    resumed = train_module.Run(args)
    assert resumed.args.truecase and resumed.splits["train"].src_ids == train.src_ids


def test_output_vocab_is_the_target_side_unless_bpe_dropout_varies_the_pieces():
    assert parse_args([]).output_vocab == "target"
    assert parse_args(["--bpe-dropout", "0.1"]).output_vocab == "all"
    assert parse_args(["--output-vocab", "all"]).output_vocab == "all"


@pytest.mark.parametrize("bidirectional", [0, 5])
def test_output_vocab_target_numbers_the_target_pieces_first_and_a_resumed_run_keeps_it(
        tmp_path, bidirectional):
    paths = corpus(tmp_path, lines=40)
    runs = {}
    for choice in ("all", "target"):
        args = parse_args(train_command(paths, tmp_path / choice, "--output-vocab", choice,
                                        "--bidirectional", bidirectional)[3:])
        args = replace(args, threads=0)  # keep this process's thread count
        runs[choice] = train_module.Run(args)
    full, run = runs["all"], runs["target"]
    assert full.config.output_size == full.config.vocab_size == run.config.vocab_size
    n = run.config.output_size
    train = run.splits["train"]
    outputs = train.tgt_ids + train.src_ids * bool(bidirectional)  # BiT: sources are targets
    assert {i for ids in outputs for i in ids} == set(range(data.EOS_ID + 1, n))
    if not bidirectional:
        assert max(map(max, train.src_ids)) >= n  # English-only pieces come after
    for name, split in run.splits.items():  # the same segmentation, numbered otherwise
        for ours, theirs in ((split.src_ids, full.splits[name].src_ids),
                             (split.tgt_ids, full.splits[name].tgt_ids)):
            assert [list(map(run.sp.id_to_piece, ids)) for ids in ours] == \
                [list(map(full.sp.id_to_piece, ids)) for ids in theirs]
    if not bidirectional:  # dev pieces the model cannot predict count as <unk> in the dev loss
        assert max(map(max, run.splits["valid"].tgt_ids)) >= n
        loss, nll = train_module.dev_loss(run.model, run.splits["valid"], 300, None)
        assert math.isfinite(loss) and math.isfinite(nll)

    run.save()
    resume = train_command(paths, tmp_path / "target", "--resume", "--bidirectional", bidirectional)
    args = parse_args([*resume[3:], "--output-vocab", "all"])
    args = replace(args, threads=0)
    with pytest.raises(checkpoint.CheckpointError, match="--output-vocab target, this command"):
        train_module.Run(args)
    args = parse_args(resume[3:])
    args = replace(args, threads=0)
    resumed = train_module.Run(args)
    assert resumed.config == run.config and resumed.splits["train"].tgt_ids == train.tgt_ids


def test_word_dropout_hides_source_and_decoder_input_pieces_but_not_targets(tmp_path):
    paths = corpus(tmp_path, lines=40)
    batches = {}
    for p in ("0", "0.2"):
        args = parse_args(train_command(paths, tmp_path / p, "--word-dropout", p)[3:])
        args = replace(args, threads=0)
        batches[p] = next(train_module.Run(args).updates())
    for plain, dropped in zip(batches["0"], batches["0.2"], strict=True):
        for ids, kept in zip(plain[:2], dropped[:2], strict=True):  # source, decoder input
            changed = ids != kept
            assert changed.any() and (kept[changed] == data.UNK_ID).all()
        assert torch.equal(plain[2], dropped[2])


def test_no_truecase_trains_on_the_text_as_it_is_and_a_resumed_run_keeps_it(tmp_path):
    paths = corpus(tmp_path, lines=40)
    args = parse_args(train_command(paths, tmp_path / "run", "--no-truecase")[3:])
    args = replace(args, threads=0)
    run = train_module.Run(args)
    raw = data.read_parallel(paths["train", "en"], paths["train", "de"])
    assert run.splits["train"].src_ids == data.encode(run.sp, raw.src)
    run.save()
    assert checkpoint.load_checkpoint(checkpoint.list_checkpoints(tmp_path / "run")[-1])[
        "meta"]["truecase"] is None  # fastattn.Translator neither truecases nor detruecases

    args = parse_args(train_command(paths, tmp_path / "run", "--resume")[3:])  # default: on
    args = replace(args, threads=0)
    resumed = train_module.Run(args)
    assert not resumed.args.truecase and resumed.splits["train"].src_ids == run.splits[
        "train"].src_ids


FLAGS = {"plain": ("--bpe-dropout", "0"),
         "bpe-and-word-dropout": ("--bpe-dropout", "0.1", "--word-dropout", "0.1"),
         "bidirectional": ("--bidirectional", "10"), "no-truecase": ("--no-truecase",)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each flag set's corpus and uninterrupted run of 24 updates, trained once for the tests of
    its signals: flags -> (corpus paths, the run's directory)."""
    runs = {}

    def run(name):
        if name not in runs:
            folder = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            paths = corpus(folder)
            done = subprocess.run(
                train_command(paths, folder / "ref", "--max-updates", 24, "--save-every", 4,
                              *FLAGS[name]),
                capture_output=True, text=True, timeout=600, env=TORCH_OPS)
            assert done.returncode == 0, done.stderr
            if name == "bidirectional":
                assert "update 10: bidirectional phase over" in done.stdout
            runs[name] = paths, folder / "ref"
        return runs[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "signum"), [
    *((name, signal.SIGKILL) for name in FLAGS),  # each signal with the flags that draw most
    ("bpe-and-word-dropout", signal.SIGINT), ("bidirectional", signal.SIGTERM),
], ids=lambda value: value.name if isinstance(value, signal.Signals) else value)
def test_sigkill_and_resume_continue_exactly(tmp_path, uninterrupted, flags, signum):
    """A run killed (SIGKILL: after its checkpoint at update 8) or stopped (SIGINT, SIGTERM: at
    a random update, seeded) and resumed gives the uninterrupted run's every loss, weights and
    final model, bit for bit. A stopped run saves after the update in flight (between its
    regular checkpoints: checkpoint_<step>_interrupted.pt, which the final model does not
    average) and exits 128 + the signal with one line saying how to continue."""
    name, flags = flags, FLAGS[flags]
    paths, reference = uninterrupted(name)
    updates, kill_after = 24, 8
    expected = losses(reference / "metrics.jsonl")
    assert sorted(expected) == list(range(1, updates + 1))

    run_dir = tmp_path / "run"
    command = train_command(paths, run_dir, "--max-updates", updates, "--save-every", 4, *flags)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=TORCH_OPS)
    deadline = time.time() + 600
    if signum == signal.SIGKILL:
        def due():
            return (run_dir / f"checkpoint_{kill_after:08d}.pt").exists()
    else:  # after a random number of updates, up to some before the end
        stop_after = random.Random(f"{name} {signum.name}").randint(2, updates - 10)

        def due():
            log = run_dir / "metrics.jsonl"
            return log.exists() and log.read_text().count("\n") >= stop_after
    while not due():
        assert process.poll() is None, "the run ended before it could be stopped"
        assert time.time() < deadline
        time.sleep(0.02)
    process.send_signal(signum)
    out, err = process.communicate(timeout=600)
    resumed_from = checkpoint.list_resumable(run_dir)[-1]
    start = checkpoint.load_checkpoint(resumed_from)["meta"]["step"]
    if signum == signal.SIGKILL:
        assert kill_after <= start < updates
    else:
        assert process.returncode == 128 + signum and "Traceback" not in err, err
        assert stop_after <= start < updates
        stopped = run_dir / (f"checkpoint_{start:08d}.pt" if start % 4 == 0 else
                             f"checkpoint_{start:08d}_interrupted.pt")
        assert resumed_from == stopped
        assert err.strip().splitlines()[-1] == (
            f"stopped by {signum.name} after update {start}: saved {stopped}; rerun the same "
            "command with --resume to continue")
        assert sorted(losses(run_dir / "metrics.jsonl")) == list(range(1, start + 1))

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True,
                             timeout=600, env=TORCH_OPS)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {resumed_from} at update {start}" in resumed.stdout
    # The log holds every update once: what the killed run logged after its last checkpoint
    # was dropped and logged again by the resumed run, with the same values.
    after = losses(run_dir / "metrics.jsonl")
    assert sorted(after) == list(range(1, updates + 1))
    for step, value in after.items():
        assert value == expected[step], f"update {step} differs"
    for name in (f"checkpoint_{updates:08d}.pt", "checkpoint_final.pt"):
        final_ref = checkpoint.load_checkpoint(reference / name)
        final_run = checkpoint.load_checkpoint(run_dir / name)
        for key, tensor in final_ref["model"].items():
            assert torch.equal(tensor, final_run["model"][key]), f"{name}: {key}"
    assert [p.name for p in checkpoint.list_resumable(run_dir)] == [
        p.name for p in checkpoint.list_resumable(reference)]  # the interrupted one gone


def test_choose_alpha_keeps_the_best_dev_bleu_and_the_first_of_ties(monkeypatch):
    dev_bleu = {0.6: 30.0, 1.0: 31.5, 1.5: 32.0, 2.0: 32.0}
    monkeypatch.setattr(train_module.final, "translate", lambda *_, alpha, **__: [str(alpha)])
    monkeypatch.setattr(train_module.final, "bleu_scores",
                        lambda hyps, *_: {"tok_bleu": dev_bleu[float(hyps[0])]})
    records = []
    run = SimpleNamespace(
        args=parse_args(["--alpha", "0.6,1.0,1.5,2.0"]), splits={"valid": SimpleNamespace(
            text=SimpleNamespace(src=["a"]))}, step=7,
        write_metrics=lambda record, path: records.append(record), log=lambda message: None,
        source_truecaser=None, progress=False)
    assert train_module.choose_alpha(run, model=None, sp=None, metrics=None) == 1.5
    assert records[0]["alpha"] == 1.5 and records[0]["alpha_dev_tok_bleu"] == dev_bleu
    run.args = parse_args(["--alpha", "2"])  # one value: no decoding
    assert train_module.choose_alpha(run, model=None, sp=None, metrics=None) == 2.0
    assert len(records) == 1


@pytest.mark.slow
def test_the_final_model_and_test_decoding_use_the_chosen_alpha(tmp_path):
    paths = corpus(tmp_path)
    result = subprocess.run(
        train_command(paths, tmp_path / "run", "--max-updates", 6, "--alpha", "0,1,3"),
        capture_output=True, text=True, timeout=600, env=TORCH_OPS)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    [choice] = [r for r in records if "alpha_dev_tok_bleu" in r]
    assert [float(a) for a in choice["alpha_dev_tok_bleu"]] == [0.0, 1.0, 3.0]
    assert f"alpha {choice['alpha']}," in result.stdout  # the test set was decoded with it
    [ratio] = [value for r in records for key, value in r.items() if key.endswith("length_ratio")]
    assert ratio > 0 and f"{ratio:.3f} of the references' length" in result.stdout
    final = tmp_path / "run" / "checkpoint_final.pt"
    assert checkpoint.load_checkpoint(final)["meta"]["alpha"] == choice["alpha"]


@pytest.mark.slow
def test_members_train_side_by_side_or_in_turn_and_the_final_model_is_their_ensemble(tmp_path):
    paths = corpus(tmp_path, lines=60)
    run_dir = tmp_path / "run"
    flags = ["--members", 3, "--seed", 5, "--max-updates", 4, "--save-every", 2]
    command = train_command(paths, run_dir, *flags, "--plot", tmp_path / "plots" / "curves.png")
    first = subprocess.run([*command, "--jobs", "2"], capture_output=True, text=True, timeout=600,
                           env=TORCH_OPS)
    assert first.returncode == 0, first.stderr
    reports = [line for line in first.stdout.splitlines() if "checkpoint: " in line]
    # Side by side, the members' lines interleave, each named; the ensemble's come last.
    assert sorted(reports[:3]) == [
        f"member {k}: checkpoint: {run_dir / f'member{k}' / 'checkpoint_final.pt'}"
        for k in (1, 2, 3)]
    assert reports[3:] == [f"checkpoint: {run_dir / 'checkpoint_final.pt'}"]
    # Two jobs share twelve updates: member 2 trains its first two in job 2, before member 3,
    # and its last two in job 1, after member 1, resumed from its checkpoint at update 2.
    assert "member 2: paused at update 2: another job trains the rest" in first.stdout
    assert (f"ensemble member 2 of 3: seed 6, {run_dir / 'member2'}, from update 2"
            in first.stdout)
    assert (f"member 2: resumed from {run_dir / 'member2' / 'checkpoint_00000002.pt'} at "
            "update 2" in first.stdout)
    finals = [checkpoint.load_checkpoint(run_dir / f"member{k}" / "checkpoint_final.pt")
              for k in (1, 2, 3)]
    assert [f["meta"]["config"]["seed"] for f in finals] == [5, 6, 7]
    assert not torch.equal(finals[0]["model"]["embedding.weight"],
                           finals[1]["model"]["embedding.weight"])
    ensemble = checkpoint.load_checkpoint(run_dir / "checkpoint_final.pt")
    assert ensemble["config"] == [f["config"] for f in finals]
    for k, final in enumerate(finals):
        for name, tensor in final["model"].items():
            assert torch.equal(ensemble["model"][f"members.{k}.{name}"], tensor), name
    for k in (1, 2, 3):
        assert sorted(losses(run_dir / f"member{k}" / "metrics.jsonl")) == [1, 2, 3, 4]
    [score] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = first.stdout.splitlines()
    ensemble_score = lines[lines.index(reports[-1]) - 1]
    assert f"valid tokenized BLEU {score['valid_tok_bleu']:.2f}" in ensemble_score
    png = (tmp_path / "plots" / "curves.png").read_bytes()  # its directory made; both members
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    # One after another, in one process, the members and their ensemble are the same, bit for bit.
    in_turn_dir = tmp_path / "in-turn"
    in_turn = subprocess.run(train_command(paths, in_turn_dir, *flags, "--jobs", 1),
                             capture_output=True, text=True, timeout=600, env=TORCH_OPS)
    assert in_turn.returncode == 0, in_turn.stderr
    assert "ensemble member 3 of 3" in in_turn.stdout and "member 2: " not in in_turn.stdout
    same = checkpoint.load_checkpoint(in_turn_dir / "checkpoint_final.pt")
    for name, tensor in ensemble["model"].items():
        assert torch.equal(same["model"][name], tensor), name

    # A run killed in its second member: --resume keeps the first and trains the second again.
    (run_dir / "member2" / "checkpoint_final.pt").unlink()
    for path in checkpoint.list_checkpoints(run_dir / "member2"):
        path.unlink()
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True,
                             timeout=600, env=TORCH_OPS)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir / 'member1' / 'checkpoint_00000004.pt'}" in resumed.stdout
    again = checkpoint.load_checkpoint(run_dir / "checkpoint_final.pt")
    for name, tensor in ensemble["model"].items():
        assert torch.equal(again["model"][name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(("members", "stopped"), [(2, "member 2"), (3, "members 2, 3")])
def test_a_member_that_fails_side_by_side_stops_the_run_and_the_others_work_is_kept(
        tmp_path, members, stopped):
    # With three members on two jobs, member 2's head fails in job 2: member 3 never starts, and
    # job 1, done with member 1, stops instead of waiting to carry member 2 on.
    paths = corpus(tmp_path, lines=40)
    run_dir = tmp_path / "run"
    (run_dir / "member2").mkdir(parents=True)
    (run_dir / "member2" / "checkpoint_00000004.pt").write_bytes(b"fastattn-checkpoint 00 9\nx")
    result = subprocess.run(
        [*train_command(paths, run_dir, "--members", members, "--max-updates", 2,
                        "--save-every", 1), "--jobs", "2", "--resume"],
        capture_output=True, text=True, timeout=600, env=TORCH_OPS)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 2, result.stderr
    assert "checkpoint_00000004.pt" in errors[0] and "truncated or corrupt" in errors[0]
    assert errors[1] == (f"error: ensemble {stopped} stopped before finishing (the error is "
                         "above); --resume continues from the last checkpoints")
    assert (run_dir / "member1" / "checkpoint_final.pt").exists()  # member 1 trained to the end
    assert not (run_dir / "checkpoint_final.pt").exists()


def _children(pid: int) -> list[int]:
    """Live processes whose parent is pid (zombies count as gone)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")
@pytest.mark.slow
def test_member_processes_end_when_the_run_is_killed(tmp_path):
    paths = corpus(tmp_path, lines=40)
    process = subprocess.Popen(
        [*train_command(paths, tmp_path / "run", "--members", 2, "--max-updates", 100000),
         "--jobs", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=TORCH_OPS)
    deadline = time.time() + 300
    while not (tmp_path / "run" / "member2" / "metrics.jsonl").exists():  # member 2 is training
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.1)
    children = _children(process.pid)
    assert children
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.time() + 30
    while any(map(_alive, children)) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, children))


def test_members_share_one_precision_measurement(monkeypatch):
    calls = []
    monkeypatch.setattr(train_module.members, "pick_precision",
                        lambda name, device: calls.append(name) or (torch.bfloat16, False, "why"))
    args = parse_args(["--members", "3", "--device", "cpu"])
    members = [train_module.member_args(args, k) for k in range(3)]
    members = train_module.share_precision(args, members)
    assert calls == ["auto"] and [m.precision for m in members] == ["bf16"] * 3
    assert members[2].precision_why == "measured once for every member"
    fp32 = parse_args(["--members", "2", "--device", "cpu", "--precision", "fp32"])
    members = [train_module.member_args(fp32, k) for k in range(2)]
    members = train_module.share_precision(fp32, members)  # as asked: nothing measured
    assert calls == ["auto"] and [m.precision for m in members] == ["fp32"] * 2


def test_members_train_side_by_side_only_on_a_cpu_outside_torchrun(monkeypatch):
    threads = torch.get_num_threads()
    assert train_module.member_jobs(parse_args([])) == min(3, threads)  # 2 on 2 threads
    assert train_module.member_jobs(parse_args(["--members", "99"])) == threads
    assert train_module.member_jobs(parse_args(["--members", "1"])) == 1
    assert train_module.member_jobs(parse_args(["--members", "3", "--jobs", "5"])) == 3
    assert train_module.member_jobs(parse_args(["--jobs", "1"])) == 1
    assert train_module.member_jobs(parse_args(["--device", "cuda"])) == 1
    with pytest.raises(SystemExit, match="--jobs > 1 trains members side by side on a CPU"):
        train_module.member_jobs(parse_args(["--device", "cuda", "--jobs", "2"]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_module.member_jobs(parse_args([])) == 1
    with pytest.raises(SystemExit, match="not on a GPU or under torchrun"):
        train_module.member_jobs(parse_args(["--jobs", "2"]))


def test_member_stints_share_the_updates_evenly_and_heads_come_before_tails():
    Stint = train_module.Stint
    stints = train_module.member_stints
    # The default on 2 threads: member 2's first half in job 2, its second half after member 1.
    assert stints(3, 8000, 2, 200) == [[Stint(0), Stint(1, start=4000)],
                                       [Stint(1, stop=4000), Stint(2)]]
    assert stints(3, 8000, 1, 200) == [[Stint(0), Stint(1), Stint(2)]]
    assert stints(2, 8000, 2, 200) == [[Stint(0)], [Stint(1)]]
    assert stints(4, 8000, 2, 200) == [[Stint(0), Stint(1)], [Stint(2), Stint(3)]]
    # Cuts round to the checkpoint grid: 32,000 / 3 = 10,666.7 -> 10,600 and 21,400.
    assert stints(4, 8000, 3, 200) == [[Stint(0), Stint(1, start=5400)],
                                       [Stint(1, stop=5400), Stint(2, start=2600)],
                                       [Stint(2, stop=2600), Stint(3)]]
    assert stints(3, 5, 2, 10) == [[Stint(0)], [Stint(1), Stint(2)]]  # a grid wider than members
    for members, updates, jobs, grid in [(5, 1000, 2, 1), (7, 300, 4, 7), (9, 17, 5, 1)]:
        plan = stints(members, updates, jobs, grid)
        spans = sorted((s.member, s.start, s.stop or updates) for job in plan for s in job)
        joined = {}
        for k, start, stop in spans:  # every member's updates exactly once, in order
            assert joined.get(k, 0) == start
            joined[k] = stop
        assert joined == dict.fromkeys(range(members), updates)
        loads = [sum((s.stop or updates) - s.start for s in job) for job in plan]
        assert max(loads) - min(loads) <= 2 * grid
        for job in plan:
            for later, stint in enumerate(job):
                if stint.start:  # a tail: its head opens another job, no longer than what precedes
                    [head] = [h for other in plan for h in other if h.member == stint.member
                              and h.stop == stint.start]
                    before = sum((s.stop or updates) - s.start for s in job[:later])
                    assert head.stop <= before
                assert not stint.stop or later == 0  # a head opens its job


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "fastattn.train", *map(str, argv)],
                          capture_output=True, text=True, timeout=300, env=TORCH_OPS)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    ("problem", "fragments"),
    [("misaligned", ["has 3 lines but", "has 2"]), ("empty", [":2: empty line"]),
     ("utf8", [":1: invalid UTF-8"]), ("missing", ["no such file"])],
)
def test_bad_data_is_one_clear_line(tmp_path, problem, fragments):
    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    src.write_bytes(b"a cat\na dog\na bird\n")
    tgt.write_bytes({"misaligned": b"eine Katze\nein Hund\n",
                     "empty": b"eine Katze\n \nein Vogel\n",
                     "utf8": b"eine \xc3\x28Katze\nein Hund\nein Vogel\n",
                     "missing": b""}[problem])
    if problem == "missing":
        tgt.unlink()
    result = run_cli("--data", "files", "--train", src, tgt, "--valid", src, src,
                     "--save-dir", tmp_path / "out")
    assert_one_line_error(result, str(tgt) if problem != "misaligned" else str(src), *fragments)


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [(["--max-len", "2"], ["no training pair is left after length filtering", "--max-len (2)"]),
     (["--max-tokens", "5"], ["--max-tokens 5 is less than the longest training pair, 10 tokens"]),
     (["--vocab-size", "3"], ["cannot build a 3-piece vocabulary", "too few for the special"])],
)
def test_text_the_flags_cannot_train_on_is_one_clear_line(tmp_path, flags, fragments):
    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    src.write_text("a cat\na dog\na bird\n")
    tgt.write_text("eine Katze\nein Hund\nein Vogel\n")
    result = run_cli("--data", "files", "--train", src, tgt, "--valid", src, tgt, "--vocab-size",
                     "40", "--members", "1", "--save-dir", tmp_path / "out", *flags)
    assert_one_line_error(result, *fragments)


def test_resume_refuses_another_model_and_notes_another_trajectory(tmp_path):
    paths = corpus(tmp_path, lines=20)
    save_dir = tmp_path / "run"

    def train(*flags):
        return subprocess.run(train_command(paths, save_dir, *flags), capture_output=True,
                              text=True, timeout=300, env=TORCH_OPS)

    assert train("--max-updates", 2, "--save-every", 2).returncode == 0
    for flags, given in [(["--d-model", 32], "--d-model 32"), (["--src", "de", "--tgt", "en"],
                         "--src de"), (["--no-truecase"], "--no-truecase")]:
        result = train("--max-updates", 3, "--resume", *flags)
        assert_one_line_error(result, "checkpoint_00000002.pt was trained with", given,
                              "a resumed run keeps its model")
    result = train("--max-updates", 3, "--resume", "--d-model", 64, "--seed", 9)  # tiny's width
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("--resume:")]
    assert notes == ["--resume: --seed 9 instead of the checkpoint's --seed 1; the run goes on "
                     "with it, so it is no longer the uninterrupted run's"]


def test_corrupt_checkpoint_on_resume_is_one_clear_line(tmp_path):
    paths = corpus(tmp_path, lines=20)
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    (save_dir / "checkpoint_00000004.pt").write_bytes(b"fastattn-checkpoint 00 99\nshort")
    result = subprocess.run(train_command(paths, save_dir, "--resume"), capture_output=True,
                            text=True, timeout=300, env=TORCH_OPS)
    assert_one_line_error(result, "checkpoint_00000004.pt", "truncated or corrupt")


def test_repeated_nan_stops_the_run_and_no_checkpoint_holds_nan(tmp_path):
    paths = corpus(tmp_path, lines=40)
    save_dir = tmp_path / "run"
    # An absurd learning rate: the first update gives parameters whose next loss overflows.
    result = subprocess.run(
        train_command(paths, save_dir, "--lr-scale", "1e30", "--max-bad-steps", "3",
                      "--save-every", "1", "--max-updates", "20"),
        capture_output=True, text=True, timeout=300, env=TORCH_OPS)
    assert result.returncode != 0
    assert result.stdout.count("NaN/inf gradients, update skipped") == 3
    assert result.stderr.strip() == (
        "error: 3 updates in a row had NaN/inf gradients; stopping (lower --lr-scale, enable "
        "--clip-norm or use --precision fp32)")
    saved = checkpoint.list_checkpoints(save_dir)
    assert saved
    for path in saved:
        for tensor in checkpoint.load_checkpoint(path)["model"].values():
            assert torch.isfinite(tensor).all()
