"""Decoding throughput, beam 4, "pow" length penalty (α = 0.6) for comparability, same weights:
fastattn (Transformer.beam_search, the translator's path: on CPU the cached decoder and the
search in one native call) against CTranslate2 float32 (the converted model,
fastattn.ctranslate2_convert) and against a plain PyTorch beam search that re-runs the decoder on
the whole prefix every step (no cache) and keeps finished sentences in the batch; batch 64 and
batch 1 on Multi30k test2016 sources, with the share of sentences whose greedy and beam outputs
are the same in CTranslate2 as in fastattn. Also an ensemble of two such models
(fastattn.Ensemble, what `./run train` makes), and the per-step bookkeeping of native against
python.

The model: FASTATTN_BENCH_CHECKPOINT if set, else the default run's final checkpoint
(checkpoints/multi30k-en-de/checkpoint_final.pt, from `./run train`) if present, else a random
model of the same shape (`multi30k` preset, 8000 pieces; outputs then run to max_len: the
throughput is comparable, the translations meaningless). An ensemble checkpoint gives its first
member as the model and its first two as the ensemble; otherwise the ensemble is the model twice.
Ratios come from one run.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.common import CORES, QUICK, measure
from fastattn import data
from fastattn.ensemble import Ensemble
from fastattn.search import beam_search_step_python

BEAM, ALPHA, MAX_LEN = 4, 0.6, 40
SENTENCES = {64: 8 if QUICK else 64, 1: 2 if QUICK else 8}


DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / \
    "multi30k-en-de" / "checkpoint_final.pt"


def load():
    """(model, ensemble of two, SentencePiece model, what the model is)."""
    path = os.environ.get("FASTATTN_BENCH_CHECKPOINT") or (
        DEFAULT_CHECKPOINT if DEFAULT_CHECKPOINT.exists() else None)
    if path:
        from fastattn.checkpoint import load_model

        model, sp, _ = load_model(path)
        kind = f"trained ({Path(path).name})"
        if isinstance(model, Ensemble):
            first, second = model.members[:2]
            return first, Ensemble([first, second]).eval(), sp, f"{kind}, its first member"
        return model.eval(), Ensemble([model, copy.deepcopy(model)]).eval(), sp, kind
    from fastattn.model import Transformer

    text = data.load_multi30k("train", "en", "de")
    sp = data.load_sentencepiece(data.train_sentencepiece(list(text.src) + list(text.tgt), 8000))
    torch.manual_seed(0)
    model = Transformer.from_preset("multi30k", vocab_size=8000, dropout=0.0).eval()
    return model, Ensemble([model, copy.deepcopy(model)]).eval(), sp, "random (untrained)"


MODEL, ENSEMBLE, SP, MODEL_KIND = load()
SOURCES = [SP.encode(s) + [SP.eos_id()] for s in data.load_multi30k("test2016", "en", "de").src]


def padded(batch):
    source = torch.full((len(batch), max(map(len, batch))), SP.pad_id(), dtype=torch.long)
    for i, ids in enumerate(batch):
        source[i, : len(ids)] = torch.tensor(ids)
    return source


def fastattn_decode(batch, beam=BEAM, model=MODEL):
    """The product's path (fastattn.Translator's): Transformer.beam_search, one native call
    (an Ensemble's: fastattn.beam_search over its members' cached decoder steps)."""
    return model.beam_search(padded(batch), beam_size=beam, bos_id=SP.bos_id(),
                             eos_id=SP.eos_id(), max_len=MAX_LEN + 1, alpha=ALPHA,
                             length_penalty="pow")


def ensemble_decode(batch, beam=BEAM):
    return fastattn_decode(batch, beam, ENSEMBLE)


@torch.inference_mode()
def plain_decode(batch):
    """Straightforward batched beam search: no cache, finished sentences stay in the batch."""
    n, eos = len(batch), SP.eos_id()
    memory, mask = MODEL.encode(padded(batch))
    memory, mask = memory.repeat_interleave(BEAM, 0), mask.repeat_interleave(BEAM, 0)
    tokens = torch.full((n * BEAM, 1), SP.bos_id())
    scores = torch.zeros(n, BEAM)
    scores[:, 1:] = -torch.inf
    finished = [[] for _ in range(n)]
    for t in range(1, MAX_LEN + 2):
        hidden = MODEL.decode(tokens, memory, mask)[:, -1]
        logprobs = torch.log_softmax(torch.nn.functional.linear(hidden, MODEL.embedding.weight), -1)
        vocab = logprobs.shape[1]
        candidates = (scores.view(-1, 1) + logprobs).view(n, -1)
        top, index = candidates.topk(2 * BEAM, 1)
        rows, next_tokens, next_scores = [], [], []
        for s in range(n):
            live = []
            for j in range(2 * BEAM):
                row, token = s * BEAM + int(index[s, j]) // vocab, int(index[s, j]) % vocab
                if token == eos or t == MAX_LEN + 1:
                    if j < BEAM and len(finished[s]) < BEAM:
                        finished[s].append((float(top[s, j]) / t**ALPHA, tokens[row, 1:].tolist()))
                elif len(live) < BEAM:
                    live.append((row, token, float(top[s, j])))
            if len(finished[s]) >= BEAM:
                live = [(s * BEAM, eos, -torch.inf)] * BEAM
            for row, token, score in live:
                rows.append(row), next_tokens.append(token), next_scores.append(score)
        if all(len(f) >= BEAM for f in finished):
            break
        tokens = torch.cat([tokens[rows], torch.tensor(next_tokens)[:, None]], 1)
        scores = torch.tensor(next_scores).view(n, BEAM)
    return [max(f) for f in finished]


def ctranslate2_decoder():
    ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 (bench extra) missing")
    from fastattn.ctranslate2_convert import convert

    directory = tempfile.mkdtemp(prefix="fastattn-ct2-")
    convert(MODEL, SP, directory, force=True)
    translator = ctranslate2.Translator(directory, device="cpu", compute_type="float32",
                                        intra_threads=torch.get_num_threads())

    def decode(batch, beam=BEAM):
        pieces = [SP.id_to_piece(ids) for ids in batch]
        return translator.translate_batch(pieces, beam_size=beam, length_penalty=ALPHA,
                                          max_decoding_length=MAX_LEN, min_decoding_length=0)

    return decode


def same_outputs(ctranslate2_decode, sources, beam):
    """The fraction of sentences whose best output is the same token sequence in fastattn and
    CTranslate2 (beam 1: greedy)."""
    ours = [hyps[0].tokens for hyps in fastattn_decode(sources, beam)]
    theirs = [r.hypotheses[0] for r in ctranslate2_decode(sources, beam)]
    eos = SP.eos_id()
    ours = [SP.id_to_piece(t[:-1] if t and t[-1] == eos else t) for t in ours]
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(sources)


SYSTEMS = {"fastattn": lambda: fastattn_decode, "fastattn-ensemble-of-2": lambda: ensemble_decode,
           "pytorch-plain": lambda: plain_decode, "ctranslate2-float32": ctranslate2_decoder}


@pytest.fixture
def threads(request):
    """Every system runs with this many threads (CTranslate2's intra_threads, torch's threads):
    all cores, and one, where a batch-1 search loses less to synchronisation."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", sorted({CORES, 1}, reverse=True), indirect=True,
                         ids=lambda n: f"{n}threads")
@pytest.mark.parametrize("batch_size", [64, 1])
@pytest.mark.parametrize("system", list(SYSTEMS))
def test_decoding_throughput(benchmark, system, batch_size, threads):
    decode = SYSTEMS[system]()
    sources = SOURCES[: SENTENCES[batch_size]]
    batches = [sources[i : i + batch_size] for i in range(0, len(sources), batch_size)]
    info = {}
    if system == "ctranslate2-float32":  # the outputs compared, as well as the speed
        info = {"same_greedy_outputs": same_outputs(decode, sources, 1),
                "same_beam_outputs": same_outputs(decode, sources, BEAM)}
    measure(benchmark, lambda: [decode(b) for b in batches],
            group=f"decoding-batch{batch_size}-{threads}thread{'s' if threads > 1 else ''}",
            min_rounds=2, impl=system, baseline="ctranslate2-float32", sentences=len(sources),
            threads=threads, beam=BEAM, length_penalty="pow", alpha=ALPHA, model=MODEL_KIND,
            **info)


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
