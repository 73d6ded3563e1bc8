"""Decoding throughput against CTranslate2: beam 4, "pow" length penalty (α = 0.6) for
comparability, the same weights in both systems, Multi30k test2016 sources.

Every cell is (model, precision, batch size) and times each system in each of its
configurations of the CPU's cores, decoding the same batches:
- fastattn: fastattn.Decoder.beam_search (the translator's path: on CPU the cached decoder and the
  search in one native call), as 1 worker x all cores' threads, and as one worker per core with
  one thread each (fastattn.inference.workers.Workers, several batches at once);
- CTranslate2 (the model converted by fastattn.tools.ctranslate2_convert): inter_threads=1 x
  intra_threads=cores, and inter_threads=cores x intra_threads=1, every batch submitted
  asynchronously so that its workers decode at once.
The report (benchmarks/report.py) sets fastattn's best configuration against CTranslate2's best in
the same cell. "cores busy" (process CPU seconds / wall seconds over the timed calls) shows
whether a configuration kept every core working.

Models: `multi30k`, the default preset: the shipped model (fastattn/models/multi30k-en-de, the
default run's final ensemble, trained), or FASTATTN_BENCH_CHECKPOINT's checkpoint if set ("random":
the random model); and `d512-6+6`, always random: d_model 512, 6+6 layers, 8 heads, d_ff 2048,
8000 pieces. A random model's outputs run to MAX_LEN tokens (EOS is as unlikely as any other of
8000 pieces), so every sentence is the same work in both systems; a trained one's stop where the
search says. The mean output length is recorded per row, and the share of outputs identical to
fastattn's (all of them in fp32: same weights, same search; greedy outputs are compared too, in
fp32). An ensemble gives its first member as the model and its first two as the ensemble timed
alone (fastattn only, fp32); otherwise the ensemble is the model twice.

Precisions: fp32 against CTranslate2's float32, int8 against its int8 (fastattn's
`precision="int8"`), bf16 against its bfloat16; fastattn's cells run for the precisions
fastattn.inference.native.PRECISIONS lists, CTranslate2's for those it supports on this CPU
(ctranslate2.get_supported_compute_types). Each row records the CPU time other processes took
while it ran (the machine's busy time in /proc/stat less this process's own, which holds every
worker and CTranslate2 thread): CTranslate2's OpenMP threads collapse when another process
shares the cores, and the report says when a run was not quiet.

Duration: a full run (FASTATTN_BENCH_QUICK unset) takes about 10 minutes on 2 quiet cores, and
should stay under 16. d512-6+6 is most of it: 128 sentences at batch 64, 32 at 16 and 8 at 1,
each configuration called four times (a warm-up, measure()'s profiled call, two timed rounds).
The estimate: CPU seconds per sentence measured at one thread on this file's d512-6+6 cells
(Sapphire Rapids class, 40-token outputs: 0.15 fp32 and 0.07 int8 at batch 16, 0.54-0.67 and
0.11-0.13 at batch 1) give 7 minutes for it, multi30k, the ensemble and the loading about 3; the
bound is the same count at issue 51's slower sentences/s. fastattn bf16 cells, where they run,
add 2-4 minutes. The quick mode runs every cell on 8-token outputs and batches of 4, 2 and 1:
about 2.5 minutes.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from benchmarks.common import CORES, QUICK, measure
from fastattn import data
from fastattn.checkpoint import load_model
from fastattn.inference import native, pretrained
from fastattn.inference.ensemble import Ensemble, decoder_of
from fastattn.inference.search import beam_search_step_python
from fastattn.inference.workers import Workers, choose
from fastattn.model import Transformer

BEAM, ALPHA = 4, 0.6
MAX_LEN = 8 if QUICK else 40
BATCHES = (4, 2, 1) if QUICK else (64, 16, 1)
# One batch per worker at the larger sizes: each worker has a batch to itself. Batch 1 takes four
# per worker, to average over source lengths.
BATCHES_PER_WORKER = {BATCHES[0]: 1, BATCHES[1]: 1, 1: 1 if QUICK else 4}
# (workers, threads per worker): one worker with every core's threads, and one worker per core.
CONFIGS = sorted({(1, CORES), (CORES, 1)})
# fastattn's name of a precision -> CTranslate2's compute_type.
COMPUTE_TYPES = {"fp32": "float32", "int8": "int8", "bf16": "bfloat16"}

SHIPPED = "multi30k-en-de"  # fastattn.inference.pretrained's name of the multi30k model


@dataclass
class Model:
    model: Transformer
    ensemble: Ensemble
    sp: object  # sentencepiece.SentencePieceProcessor
    kind: str  # what it is, for the report

    def sources(self, n: int) -> list[list[int]]:
        text = data.load_multi30k("test2016", "en", "de").src[:n]
        return [self.sp.encode(s) + [self.sp.eos_id()] for s in text]


@functools.cache
def random_sentencepiece():
    text = data.load_multi30k("train", "en", "de")
    return data.load_sentencepiece(data.train_sentencepiece(list(text.src) + list(text.tgt), 8000))


@functools.cache
def load(name: str) -> Model:
    """The model of that name (see the module docstring), built on first use."""
    if name == "multi30k":
        path = os.environ.get("FASTATTN_BENCH_CHECKPOINT")
        if path != "random":
            model, sp, _ = load_model(path) if path else pretrained.load(SHIPPED)
            kind = f"multi30k, trained ({Path(path).name if path else f'shipped {SHIPPED}'})"
            if isinstance(model, Ensemble):
                first, second = model.members[:2]
                return Model(first, Ensemble([first, second]).eval(), sp, f"{kind}, 1st member")
            return Model(model.eval(), Ensemble([model, copy.deepcopy(model)]).eval(), sp, kind)
        shape = {}
    else:
        shape = dict(d_model=512, encoder_layers=6, decoder_layers=6, heads=8, d_ff=2048)
    torch.manual_seed(0)
    model = Transformer.from_preset("multi30k", vocab_size=8000, dropout=0.0, **shape).eval()
    return Model(model, Ensemble([model, copy.deepcopy(model)]).eval(), random_sentencepiece(),
                 f"{name}, random (untrained)")


MODELS = ("multi30k", "d512-6+6")


def padded(model: Model, batch: list[list[int]]) -> torch.Tensor:
    source = torch.full((len(batch), max(map(len, batch))), model.sp.pad_id(), dtype=torch.long)
    for i, ids in enumerate(batch):
        source[i, : len(ids)] = torch.tensor(ids)
    return source


def fastattn_decoder(model: Model, precision: str, beam: int = BEAM, ensemble: bool = False):
    """One batch through the product's path (fastattn.Translator's): Decoder.beam_search, one
    native call (an Ensemble's: fastattn.beam_search over its members' cached steps)."""
    decoder = decoder_of(model.ensemble if ensemble else model.model, precision)
    def decode(batch):
        return decoder.beam_search(padded(model, batch), beam_size=beam, bos_id=model.sp.bos_id(),
                                   eos_id=model.sp.eos_id(), max_len=MAX_LEN + 1, alpha=ALPHA,
                                   length_penalty="pow")

    return decode


def fastattn_pieces(model: Model, outputs) -> list[list[str]]:
    """Each sentence's best output as pieces without EOS, CTranslate2's form."""
    eos = model.sp.eos_id()
    best = [hyps[0].tokens for batch in outputs for hyps in batch]
    return [model.sp.id_to_piece(t[:-1] if t and t[-1] == eos else t) for t in best]


@functools.cache
def ctranslate2_model(name: str) -> str:
    """The model converted to CTranslate2 (float32; CTranslate2 quantizes when it loads)."""
    from fastattn.tools.ctranslate2_convert import convert

    model = load(name)
    return str(convert(model.model, model.sp, tempfile.mkdtemp(prefix="fastattn-ct2-")))


def ctranslate2_translator(name: str, precision: str, workers: int, threads: int):
    ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 (bench extra) missing")
    compute_type = COMPUTE_TYPES[precision]
    if compute_type not in ctranslate2.get_supported_compute_types("cpu"):
        pytest.skip(f"CTranslate2 has no {compute_type} on this CPU")
    # CTranslate2 sets the calling thread's OpenMP thread count to intra_threads, which is
    # torch's count in this thread too: every benchmark after it would run on one thread.
    previous = torch.get_num_threads()
    try:
        return ctranslate2.Translator(ctranslate2_model(name), device="cpu",
                                      compute_type=compute_type, inter_threads=workers,
                                      intra_threads=threads)
    finally:
        torch.set_num_threads(previous)


def ctranslate2_decoder(model: Model, translator, beam: int = BEAM):
    """Decodes batches of ids: each submitted at once (asynchronous), so that every one of the
    translator's workers takes one; returns each sentence's best output as pieces."""

    def decode_all(batches):
        pending = [translator.translate_batch([model.sp.id_to_piece(ids) for ids in batch],
                                              asynchronous=True, beam_size=beam,
                                              length_penalty=ALPHA, max_decoding_length=MAX_LEN,
                                              min_decoding_length=0)
                   for batch in batches]
        return [result.result().hypotheses[0] for batch in pending for result in batch]

    return decode_all


def share_same(ours: list[list[str]], theirs: list[list[str]]) -> float:
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


# Each cell's outputs from fastattn's first configuration, which the later rows compare with.
REFERENCE_OUTPUTS: dict[tuple[str, str, int], list[list[str]]] = {}


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy since boot (/proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(benchmark, decode_all, batches, *, group: str, model: Model,
          torch_in_this_thread: bool = True, **info) -> list:
    """measure() of decode_all(batches), recording sentences/s, cores busy, the mean output
    length and the cores other processes kept busy meanwhile; returns the last call's outputs.
    The peak memory
    only where decode_all allocates with torch in this thread (torch_in_this_thread): the
    profiler sees no other thread's allocations (the workers'), and none of CTranslate2's."""
    last, clock = {}, {"cpu": 0.0, "wall": 0.0}

    def call():
        cpu, wall = time.process_time(), time.perf_counter()
        last["outputs"] = decode_all(batches)
        clock["cpu"] += time.process_time() - cpu
        clock["wall"] += time.perf_counter() - wall

    sentences = sum(map(len, batches))
    busy, own, wall = busy_seconds(), time.process_time(), time.perf_counter()
    measure(benchmark, call, group=group, min_rounds=2, sentences=sentences, beam=BEAM,
            length_penalty="pow", alpha=ALPHA, max_len=MAX_LEN, model=model.kind, **info)
    if not torch_in_this_thread:  # no figure rather than a false one
        del benchmark.extra_info["peak_memory_bytes"]
    if busy is not None:  # cores' worth of CPU time others took while this row ran
        others = busy_seconds() - busy - (time.process_time() - own)
        benchmark.extra_info["other_cores"] = max(others, 0.0) / (time.perf_counter() - wall)
    benchmark.extra_info["cores_busy"] = clock["cpu"] / clock["wall"]
    if benchmark.stats is not None:
        benchmark.extra_info["sentences_per_s"] = sentences / benchmark.stats.stats.median
    return last["outputs"]


@pytest.mark.parametrize("workers,threads", CONFIGS, ids=[f"{w}x{t}" for w, t in CONFIGS])
@pytest.mark.parametrize("system", ["fastattn", "ctranslate2"])
@pytest.mark.parametrize("batch_size", BATCHES, ids=lambda n: f"batch{n}")
@pytest.mark.parametrize("precision", list(COMPUTE_TYPES))
@pytest.mark.parametrize("name", MODELS)
def test_decoding_throughput(benchmark, name, precision, batch_size, system, workers, threads):
    """One row of a cell: `system` in one configuration (`workers` x `threads`)."""
    if system == "fastattn" and precision not in native.PRECISIONS:
        pytest.skip(f"fastattn.inference.native.PRECISIONS has no {precision}")
    model = load(name)
    sources = model.sources(batch_size * CORES * BATCHES_PER_WORKER[batch_size])
    batches = [sources[i : i + batch_size] for i in range(0, len(sources), batch_size)]
    info = dict(group=f"decoding {name} {precision} batch{batch_size}", model=model,
                impl=f"{system} {workers}×{threads}", system=system, model_name=name,
                precision=precision, batch_size=batch_size, workers=workers, threads=threads)

    if system == "fastattn":
        info["default"] = choose(batch_size, CORES) == (workers, threads)
        decode = fastattn_decoder(model, precision)
        if workers == 1:
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                outputs = timed(benchmark, lambda bs: [decode(b) for b in bs], batches, **info)
            finally:
                torch.set_num_threads(previous)
        else:
            with Workers(workers, threads) as pool:
                outputs = timed(benchmark, lambda bs: list(pool.map(decode, bs)), batches,
                                torch_in_this_thread=False, **info)
        outputs = fastattn_pieces(model, outputs)
    else:
        translator = ctranslate2_translator(name, precision, workers, threads)
        outputs = timed(benchmark, ctranslate2_decoder(model, translator), batches,
                        torch_in_this_thread=False, **info)
        if precision == "fp32" and workers == 1:  # greedy search agrees too
            greedy = fastattn_pieces(model, [fastattn_decoder(model, "fp32", 1)(b)
                                             for b in batches])
            theirs = ctranslate2_decoder(model, translator, 1)(batches)
            benchmark.extra_info["same_greedy_outputs"] = share_same(greedy, theirs)
        del translator  # its threads and weights go before the next row's

    benchmark.extra_info["output_tokens"] = sum(map(len, outputs)) / len(outputs)
    key = (name, precision, batch_size)
    if key in REFERENCE_OUTPUTS:
        benchmark.extra_info["same_beam_outputs"] = share_same(REFERENCE_OUTPUTS[key], outputs)
    elif system == "fastattn":
        REFERENCE_OUTPUTS[key] = outputs


@pytest.mark.parametrize("batch_size", BATCHES, ids=lambda n: f"batch{n}")
def test_ensemble_decoding_throughput(benchmark, batch_size):
    """The multi30k ensemble of two (what `./run train` makes and fastattn ships), fp32, one
    worker with every core's threads: what an ensemble costs beside its one member above."""
    model = load("multi30k")
    sources = model.sources(batch_size * CORES * BATCHES_PER_WORKER[batch_size])
    batches = [sources[i : i + batch_size] for i in range(0, len(sources), batch_size)]
    decode = fastattn_decoder(model, "fp32", ensemble=True)
    timed(benchmark, lambda bs: [decode(b) for b in bs], batches,
          group=f"decoding_ensemble multi30k fp32 batch{batch_size}", model=model,
          impl=f"fastattn-ensemble-of-2 1×{CORES}", batch_size=batch_size)


@pytest.mark.parametrize("impl", ["native", "python"])
def test_bookkeeping_per_step_batch1(benchmark, impl):
    """One search step's bookkeeping at batch 1 (beam rows × 37000-token vocabulary), EOS kept
    unlikely so every call does the same work."""
    vocab, beam = 37000, BEAM
    logprobs = torch.log_softmax(torch.randn(beam, vocab), -1)
    logprobs[:, 3] = -1e4
    state = (torch.full((beam, 10), 2), torch.zeros(beam), torch.zeros(1, dtype=torch.long),
             torch.tensor([50]), torch.ones(51, dtype=torch.float64),
             torch.zeros(1, beam, 50, dtype=torch.long), torch.zeros(1, beam),
             torch.zeros(1, beam, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    step = torch.ops.fastattn.beam_search_step if impl == "native" else beam_search_step_python
    measure(benchmark, lambda: step(logprobs, *state, 3, 1), group="beam-bookkeeping-batch1",
            impl=impl)
