"""fastattn.inference.search: beam search against an exhaustive search and an independent
per-sentence reference, native (fastattn._C) against the PyTorch step, beam 1 against greedy, the
step_fn contract, and the CUDA sources compiling with nvcc."""

import math
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from fastattn.inference import Decoder, native
from fastattn.inference.search import Hypothesis, beam_search, greedy_search, length_penalty_table
from fastattn.model import Transformer

BOS, EOS = 5, 1
CSRC = Path(__file__).resolve().parents[1] / "csrc"
NATIVE_BUILT = torch._C._dispatch_has_kernel_for_dispatch_key("fastattn::beam_search_step", "CPU")
needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="fastattn._C is not built")


class ToyDecoder:
    """A deterministic stand-in for a cached decoder: log-probabilities depend on the sentence and
    the whole prefix, and which sentence a row belongs to is known only through `reorder`, so a
    wrong reorder gives wrong results. Checks the step_fn contract on every call."""

    def __init__(self, batch_size: int, vocab: int, seed: int, ties: bool = False):
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(509, vocab, generator=g, dtype=torch.float64) * 2
        if ties:  # many equal log-probabilities, within rows and across beams
            table = table.round()
        self.logprob_table = torch.log_softmax(table, -1).float()
        self.batch_size, self.calls, self.rows, self.previous = batch_size, [], None, None

    def state(self, sentence: int, prefix: list[int]) -> int:
        h = sentence * 7919 + 3
        for token in prefix:
            h = (h * 31 + token + 1) % 509
        return h

    def logprobs(self, sentence: int, prefix: list[int]) -> torch.Tensor:
        return self.logprob_table[self.state(sentence, prefix)]

    def __call__(self, tokens: torch.Tensor, reorder: torch.Tensor | None) -> torch.Tensor:
        if reorder is None:
            assert self.rows is None and tokens.shape == (self.batch_size, 1)
            self.rows = torch.arange(self.batch_size)
        else:
            assert reorder.dtype == torch.long and reorder.shape == (tokens.size(0),)
            assert torch.equal(tokens[:, :-1], self.previous[reorder])
            self.rows = self.rows[reorder]
        assert (tokens[:, 0] == BOS).all()
        self.previous = tokens
        self.calls.append(tokens.size(0))
        h = self.rows * 7919 + 3
        for p in range(tokens.size(1)):
            h = (h * 31 + tokens[:, p] + 1) % 509
        return self.logprob_table[h]


def reference_beam_search(decoder, sentence, beam, max_len, penalty, nbest):
    """The same rules as fastattn.inference.search for one sentence at a time, in plain Python
    lists and float32 arithmetic, stopping only at beam hypotheses or max_len (no bound)."""
    beams, finished = [([], np.float32(0))], []
    for t in range(1, max_len + 1):
        candidates = []
        for k, (prefix, score) in enumerate(beams):
            lp = decoder.logprobs(sentence, [BOS] + prefix).numpy()
            vocab = len(lp)
            for v in range(vocab):
                if t < max_len or v == EOS:
                    candidates.append((np.float32(score + lp[v]), k * vocab + v, prefix, v))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        beams = []
        for j, (score, _, prefix, v) in enumerate(candidates[: 2 * beam]):
            if v == EOS:
                if j < beam and score > -math.inf and len(finished) < beam:
                    normalized = float(np.float32(float(score) / penalty[t]))
                    finished.append(Hypothesis(prefix + [EOS], normalized))
            elif len(beams) < beam:
                beams.append((prefix + [v], score))
        if len(finished) >= beam:
            break
    return sorted(finished, key=lambda h: -h.score)[:nbest]


def exhaustive_search(decoder, sentence, vocab, max_len, penalty, nbest):
    """Every hypothesis up to max_len, scored like beam search; the nbest best."""
    hypotheses, frontier = [], [([], np.float32(0))]
    for t in range(1, max_len + 1):
        grown = []
        for prefix, score in frontier:
            lp = decoder.logprobs(sentence, [BOS] + prefix).numpy()
            total = float(np.float32(score + lp[EOS]))
            hypotheses.append(Hypothesis(prefix + [EOS], float(np.float32(total / penalty[t]))))
            grown += [(prefix + [v], np.float32(score + lp[v])) for v in range(vocab) if v != EOS]
        frontier = grown
    return sorted(hypotheses, key=lambda h: -h.score)[:nbest]


def recomputed_score(decoder, sentence, tokens, penalty):
    total = np.float32(0)
    for i, token in enumerate(tokens):
        total = np.float32(total + decoder.logprobs(sentence, [BOS] + tokens[:i]).numpy()[token])
    return float(np.float32(float(total) / penalty[len(tokens)]))


def search(impl, batch_size, vocab, seed, ties=False, **kwargs):
    decoder = ToyDecoder(batch_size, vocab, seed, ties)
    kwargs = {"bos_id": BOS, "eos_id": EOS, **kwargs}
    return beam_search(decoder, batch_size, impl=impl, **kwargs), decoder


PROBLEMS = [  # batch, vocab, beam, max_len, nbest, alpha, penalty, ties
    (1, 7, 4, 9, 1, 0.6, "gnmt", False),
    (3, 3, 4, [1, 4, 6], 2, 0.6, "gnmt", True),
    (5, 11, 3, [8, 2, 11, 5, 7], 3, 1.0, "pow", False),
    (4, 6, 5, 8, 5, 0.0, "pow", True),
    (2, 40, 8, [12, 9], 4, 2.0, "gnmt", False),
    (6, 4, 1, [5, 1, 7, 3, 6, 2], 1, 0.6, "pow", True),
    (3, 2, 4, 6, 3, 0.6, "gnmt", False),
    (3, 8, 4, 16, 1, 2.0, "pow", False),  # long hypotheses win late: a loose bound would show
]


@pytest.mark.parametrize("impl", ["python", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_matches_reference_search(impl, problem):
    batch, vocab, beam, max_len, nbest, alpha, kind, ties = problem
    for seed in range(3):
        limits = torch.tensor(max_len) if isinstance(max_len, list) else max_len
        results, decoder = search(
            impl, batch, vocab, seed, ties, beam_size=beam, max_len=limits, nbest=nbest,
            alpha=alpha, length_penalty=kind,
        )  # fmt: skip
        penalty = length_penalty_table(20, alpha, kind)
        for sentence, hypotheses in enumerate(results):
            limit = max_len[sentence] if isinstance(max_len, list) else max_len
            expected = reference_beam_search(decoder, sentence, beam, limit, penalty, nbest)
            assert hypotheses == expected, f"sentence {sentence}, seed {seed}"
            for h in hypotheses:
                assert len(h.tokens) <= limit and h.tokens[-1] == EOS
                assert EOS not in h.tokens[:-1]


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_native_equals_python(at_every_cpu_isa, seed):
    g = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high, (1,), generator=g))
    # Vocabularies past the native scan's 64-score chunks, which it skips when none can enter.
    batch, vocab, beam = draw(1, 9), draw(2, 300), draw(1, 7)
    nbest, limits = draw(1, beam + 1), torch.randint(1, 14, (batch,), generator=g)
    for kind in ("gnmt", "pow"):
        for ties in (False, True):
            kwargs = dict(beam_size=beam, max_len=limits, nbest=nbest, length_penalty=kind)
            kwargs["ties"] = ties
            python, python_decoder = search("python", batch, vocab, seed, **kwargs)
            native, native_decoder = search("native", batch, vocab, seed, **kwargs)
            assert native == python
            assert native_decoder.calls == python_decoder.calls


@pytest.mark.parametrize("impl", ["python", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("kind, alpha", [("gnmt", 0.6), ("pow", 1.0), ("gnmt", 0.0)])
def test_wide_beam_finds_the_best_hypotheses(impl, kind, alpha):
    vocab, max_len, nbest = 3, 5, 4  # 31 hypotheses; a beam of 32 prunes nothing
    penalty = length_penalty_table(max_len, alpha, kind)
    results, decoder = search(
        impl, 3, vocab, 11, beam_size=32, max_len=max_len, nbest=nbest, alpha=alpha,
        length_penalty=kind,
    )  # fmt: skip
    for sentence, hypotheses in enumerate(results):
        assert hypotheses == exhaustive_search(decoder, sentence, vocab, max_len, penalty, nbest)


@pytest.mark.parametrize("impl", ["python", pytest.param("native", marks=needs_native)])
def test_scores_are_summed_logprobs_over_the_penalty(impl):
    for kind, alpha in (("gnmt", 0.6), ("pow", 0.8)):
        penalty = length_penalty_table(15, alpha, kind)
        results, decoder = search(
            impl, 4, 30, 2, beam_size=4, max_len=15, nbest=4, alpha=alpha, length_penalty=kind
        )
        for sentence, hypotheses in enumerate(results):
            assert len(hypotheses) == 4
            scores = [h.score for h in hypotheses]
            assert scores == sorted(scores, reverse=True)
            for h in hypotheses:
                assert h.score == recomputed_score(decoder, sentence, h.tokens, penalty)


def test_length_penalties():
    gnmt, power = length_penalty_table(10, 0.6, "gnmt"), length_penalty_table(10, 0.6, "pow")
    assert gnmt[7] == pytest.approx(((5 + 7) / 6) ** 0.6) and power[7] == pytest.approx(7**0.6)
    with pytest.raises(ValueError, match="length_penalty"):
        length_penalty_table(10, 0.6, "wu")


@pytest.mark.parametrize("impl", ["python", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("kind", ["gnmt", "pow"])
def test_beam_one_is_greedy(impl, kind):
    limits = torch.tensor([1, 9, 4, 12, 7])
    kwargs = dict(bos_id=BOS, eos_id=EOS, max_len=limits, alpha=0.7, length_penalty=kind)
    for seed in range(3):
        beam = beam_search(ToyDecoder(5, 9, seed, seed == 2), 5, beam_size=1, impl=impl, **kwargs)
        greedy = greedy_search(ToyDecoder(5, 9, seed, seed == 2), 5, **kwargs)
        assert [hypotheses[0] for hypotheses in beam] == greedy


@pytest.mark.parametrize("impl", ["python", pytest.param("native", marks=needs_native)])
def test_finished_sentences_leave_the_batch(impl):
    _, decoder = search(impl, 2, 9, 0, beam_size=3, max_len=torch.tensor([1, 6]))
    assert decoder.calls[:2] == [2, 3]  # sentence 0 is done after one token; 3 beams remain
    assert len(decoder.calls) <= 6


class EndsAtOnce:
    """EOS is nearly certain after BOS; everything else is very unlikely."""

    def __init__(self):
        self.calls = 0

    def __call__(self, tokens, reorder):
        self.calls += 1
        logprobs = torch.full((tokens.size(0), 6), -30.0)
        logprobs[:, EOS] = -1e-6
        return logprobs


@pytest.mark.parametrize("impl", ["python", pytest.param("native", marks=needs_native)])
def test_stops_early_only_when_the_bound_proves_it(impl):
    kwargs = dict(bos_id=BOS, eos_id=EOS, max_len=20, beam_size=4, impl=impl)
    decoder = EndsAtOnce()
    ((best,),) = beam_search(decoder, 1, nbest=1, **kwargs)
    assert best.tokens == [EOS] and decoder.calls == 1  # no live prefix can catch up
    decoder = EndsAtOnce()
    (two_best,) = beam_search(decoder, 1, nbest=2, **kwargs)
    assert decoder.calls > 1 and two_best[0].tokens == [EOS] and len(two_best[1].tokens) == 2


@pytest.mark.parametrize("impl", ["python", pytest.param("native", marks=needs_native)])
def test_bad_input_is_named(impl):
    kwargs = dict(bos_id=BOS, eos_id=EOS, max_len=5, impl=impl)
    decoder = ToyDecoder(2, 6, 0)
    with pytest.raises(ValueError, match="nbest"):
        beam_search(decoder, 2, beam_size=2, nbest=3, **kwargs)
    with pytest.raises(ValueError, match="max_len"):
        beam_search(decoder, 2, **{**kwargs, "max_len": torch.tensor([3, 0])})
    with pytest.raises(ValueError, match="max_len"):
        beam_search(decoder, 2, **{**kwargs, "max_len": torch.tensor([3, 4, 5])})
    with pytest.raises(ValueError, match="log-probabilities"):
        beam_search(lambda tokens, reorder: torch.rand(tokens.size(0), 6), 2, **kwargs)
    with pytest.raises(ValueError, match="log-probabilities"):
        beam_search(lambda tokens, reorder: torch.full((tokens.size(0), 6), math.nan), 2, **kwargs)
    for bad in (math.nan, 0.5):  # one value inside a vocabulary the native step screens in chunks

        def one_bad_value(tokens, reorder, bad=bad):
            logprobs = torch.log_softmax(torch.randn(tokens.size(0), 200), -1)
            logprobs[-1, 131] = bad
            return logprobs

        with pytest.raises(ValueError, match="log-probabilities"):
            beam_search(one_bad_value, 2, **kwargs)
    with pytest.raises(ValueError, match="shape"):
        beam_search(lambda tokens, reorder: torch.zeros(tokens.size(0) + 1, 6), 2, **kwargs)
    with pytest.raises(ValueError, match="impl"):
        beam_search(decoder, 2, **{**kwargs, "impl": "fast"})


def test_cuda_sources_compile_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None
    )
    if nvcc is None or not os.path.exists(nvcc):
        pytest.skip("nvcc not found (no CUDA toolkit): csrc/beam_search.cu was not compiled")
    from torch.utils.cpp_extension import include_paths

    command = [nvcc, "-c", str(CSRC / "beam_search.cu"), "-o", str(tmp_path / "beam_search.o")]
    command += ["-O3", "-std=c++17", "-DFASTATTN_WITH_CUDA", f"-I{CSRC}"]
    command += [f"-I{path}" for path in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    # CPU builds of torch ship c10/cuda without its CMake-generated macro header, which on Linux
    # only sets Windows DLL export flags; this tells c10 to go without it.
    command.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("native_loop", [pytest.param(True, marks=needs_native), False])
def test_transformer_beam_search_names_a_bos_or_eos_id_outside_the_vocabulary(monkeypatch,
                                                                               native_loop):
    """BOS is an input of the decoder (ids below vocab_size), EOS an output (ids below the output
    vocabulary's size): the native loop raised a bare IndexError for a BOS outside."""
    monkeypatch.setattr(native, "NATIVE_BEAM_SEARCH", native_loop)
    torch.manual_seed(0)
    net = Decoder(Transformer.from_preset("tiny", vocab_size=50, output_vocab_size=40).eval())
    src = torch.randint(4, 50, (2, 5))
    kwargs = dict(beam_size=2, max_len=4)
    for bos_id in (50, -1):
        with pytest.raises(ValueError, match=rf"^bos_id {bos_id} is outside the vocabulary of 50 "
                           r"\(ids 0 to 49\)$"):
            net.beam_search(src, bos_id=bos_id, eos_id=2, **kwargs)
    with pytest.raises(ValueError, match=r"^eos_id 45 is outside the output vocabulary of 40 "
                       r"\(ids 0 to 39\)$"):
        net.beam_search(src, bos_id=45, eos_id=45, **kwargs)  # BOS 45 is an input token
    net.beam_search(src, bos_id=45, eos_id=39, **kwargs)
