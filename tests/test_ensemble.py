"""fastattn.inference.ensemble: decoding with the mean of several models' distributions, ensemble
checkpoints, and python -m fastattn.ensemble."""

import copy
import math
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from fastattn import checkpoint, data
from fastattn.inference import Decoder, Ensemble, EnsembleDecoder
from fastattn.inference.search import length_penalty_table
from fastattn.inference.translator import Translator
from fastattn.model import Transformer

VOCAB = 300


def member(seed: int, vocab_size: int = VOCAB, output_vocab_size: int | None = None
           ) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer.from_preset("tiny", vocab_size=vocab_size,
                                    output_vocab_size=output_vocab_size, dropout=0.0).eval()
    with torch.no_grad():  # sharper next-token distributions: fewer near-ties between hypotheses
        model.embedding.weight.mul_(4)
    return model


def sources(rows: int = 3, seed: int = 5) -> torch.Tensor:
    """Random source ids with EOS and some padding, lengths 1, 17, ..."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 17, 9][:rows]
    src = torch.full((rows, max(lengths)), data.PAD_ID)
    for row, n in enumerate(lengths):
        src[row, : n - 1] = torch.randint(4, VOCAB, (n - 1,), generator=generator)
        src[row, n - 1] = data.EOS_ID
    return src


def test_decode_step_is_the_log_of_the_mean_probability_over_members():
    members = [member(1), member(2), member(3)]
    ensemble = EnsembleDecoder(Ensemble(members))
    decoders = [Decoder(m) for m in members]
    src = sources()
    state = ensemble.start(src, capacity=6)
    singles = [d.start(src, capacity=6) for d in decoders]
    tokens = torch.full((3,), data.BOS_ID)
    for position in range(4):
        if position == 2:  # rows reordered like a beam search would: the caches follow
            rows = torch.tensor([2, 0, 0])
            state.reorder(rows)
            for s in singles:
                s.reorder(rows)
        got = ensemble.step(tokens, state)
        probabilities = [d.step(tokens, s).double().exp()
                         for d, s in zip(decoders, singles, strict=True)]
        expected = (sum(probabilities) / 3).log()
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)
        tokens = torch.randint(4, VOCAB, (3,), generator=torch.Generator().manual_seed(position))


def test_ensemble_of_one_is_the_model_and_of_copies_is_the_same_search():
    model = member(1)
    src = sources()
    options = dict(beam_size=3, nbest=2, bos_id=data.BOS_ID, eos_id=data.EOS_ID, max_len=8)
    alone = Decoder(model).beam_search(src, **options)
    assert EnsembleDecoder(Ensemble([model])).beam_search(src, **options) == alone
    # The mean of equal distributions is that distribution: same hypotheses, same scores.
    copies = EnsembleDecoder(Ensemble([model, member(1)])).beam_search(src, **options)
    assert [[h.tokens for h in hs] for hs in copies] == [[h.tokens for h in hs] for hs in alone]
    for got, expected in zip(copies, alone, strict=True):
        for g, e in zip(got, expected, strict=True):
            assert math.isclose(g.score, e.score, rel_tol=1e-5)


def test_beam_search_scores_are_the_ensembles_log_probability_of_the_hypothesis():
    members = [member(1), member(2)]
    src = sources()
    alpha = 0.6
    found = EnsembleDecoder(Ensemble(members)).beam_search(
        src, beam_size=4, nbest=3, bos_id=data.BOS_ID, eos_id=data.EOS_ID, max_len=7,
        alpha=alpha)
    penalty = length_penalty_table(7, alpha, "gnmt")
    references = [copy.deepcopy(m).double() for m in members]
    for row, hypotheses in enumerate(found):
        assert len(hypotheses) == 3
        for h in hypotheses:
            # Scored again by teacher forcing through each member's full forward pass, in fp64.
            target = torch.tensor([[data.BOS_ID, *h.tokens[:-1]]])
            with torch.no_grad():
                probabilities = [torch.log_softmax(m(src[row:row + 1].clone(), target), -1).exp()
                                 for m in references]
            mean = (sum(probabilities) / 2)[0]
            logprob = mean.log().gather(-1, torch.tensor(h.tokens)[:, None]).sum().item()
            assert math.isclose(h.score, logprob / penalty[len(h.tokens)], rel_tol=1e-4)


def test_members_must_share_a_vocabulary():
    with pytest.raises(ValueError, match="one vocabulary"):
        Ensemble([member(1), member(2, vocab_size=VOCAB + 1)])
    with pytest.raises(ValueError, match=r"output vocabulary, got \(vocabulary, output\) sizes "
                       rf"\[\({VOCAB}, 200\), \({VOCAB}, {VOCAB}\)\]"):
        Ensemble([member(1), member(2, output_vocab_size=200)])
    with pytest.raises(ValueError, match="at least one member"):
        Ensemble([])


@pytest.fixture(scope="module")
def spm_proto():
    text = data.load_multi30k("val", "en", "de")
    return data.train_sentencepiece(list(text.src) + list(text.tgt), vocab_size=VOCAB)


def save_member(path, model, spm, truecase=None):
    meta = {"alpha": 0.6, "truecase": truecase}
    checkpoint.save_checkpoint(path, {"model": model.state_dict(), "config": asdict(model.cfg),
                                      "spm": spm, "meta": meta})
    return path


def test_ensemble_checkpoint_loads_as_its_members(tmp_path, spm_proto):
    models = [member(1), member(2)]
    paths = [save_member(tmp_path / f"m{k}.pt", m, spm_proto) for k, m in enumerate(models)]
    checkpoint.save_checkpoint(tmp_path / "ens.pt", checkpoint.ensemble_checkpoints(paths))
    loaded, sp, meta = checkpoint.load_model(tmp_path / "ens.pt")
    assert isinstance(loaded, Ensemble) and not loaded.training
    assert sp.get_piece_size() == VOCAB and meta["members"] == [str(p) for p in paths]
    for got, expected in zip(loaded.members, models, strict=True):
        for name, tensor in expected.state_dict().items():
            assert torch.equal(got.state_dict()[name], tensor), name
    # The translator takes it like a single model; attention shows the first member's.
    translator = Translator.from_checkpoint(tmp_path / "ens.pt", max_len_b=4)
    assert len(translator.translate(["A dog runs.", "Two men."])) == 2
    first = Translator(models[0], sp, max_len_b=4)
    torch.testing.assert_close(translator.attention("A dog runs.", 1)[2],
                               first.attention("A dog runs.", 1)[2])


@pytest.mark.parametrize("beam", [1, 4])
def test_translator_with_an_ensemble_of_copies_translates_like_the_model(spm_proto, beam):
    sp = data.load_sentencepiece(spm_proto)
    sentences = ["A dog runs on the beach.", "", "Two men are playing football in a park."]
    alone = Translator(member(1), sp, beam_size=beam, max_len_b=6).stream(sentences)
    pair = Translator(Ensemble([member(1), member(1)]), sp, beam_size=beam,
                      max_len_b=6).stream(sentences)
    for got, expected in zip(pair, alone, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in expected]
        assert [h.score for h in got] == pytest.approx([h.score for h in expected], rel=1e-5)


def test_ensemble_checkpoints_refuse_members_of_another_text(tmp_path, spm_proto):
    a = save_member(tmp_path / "a.pt", member(1), spm_proto)
    other = data.train_sentencepiece(["other words entirely here"] * 50, vocab_size=40)
    b = save_member(tmp_path / "b.pt", member(2, vocab_size=40), other)
    with pytest.raises(checkpoint.CheckpointError, match="b.pt: its SentencePiece model"):
        checkpoint.ensemble_checkpoints([a, b])
    c = save_member(tmp_path / "c.pt", member(2), spm_proto, truecase={"a": "a"})
    with pytest.raises(checkpoint.CheckpointError, match="c.pt: its truecaser"):
        checkpoint.ensemble_checkpoints([a, c])
    checkpoint.save_checkpoint(tmp_path / "ens.pt", checkpoint.ensemble_checkpoints([a, a]))
    with pytest.raises(checkpoint.CheckpointError, match="is an ensemble itself"):
        checkpoint.ensemble_checkpoints([a, tmp_path / "ens.pt"])


def run_module(module, *args, stdin=None):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_command_line_builds_an_ensemble_that_translate_reads(tmp_path, spm_proto):
    paths = [save_member(tmp_path / f"m{k}.pt", member(k + 1), spm_proto) for k in range(2)]
    result = run_module("fastattn.ensemble", "--inputs", *paths, "--output", tmp_path / "e.pt")
    assert result.returncode == 0, result.stderr
    expected = Translator.from_checkpoint(tmp_path / "e.pt", max_len_b=4).translate(
        ["A dog runs.", "A woman."])
    result = run_module("fastattn.translate", "--checkpoint", tmp_path / "e.pt",
                        "--max-len-b", 4, stdin="A dog runs.\nA woman.\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == expected
    result = run_module("fastattn.translate", "--checkpoint", tmp_path / "e.pt", "--max-len-b", 4,
                        "--plot-attention", tmp_path / "a.png", stdin="A dog runs.\n")
    assert result.returncode == 0, result.stderr  # the first member's attention
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"

    result = run_module("fastattn.tools.ctranslate2_convert", "--checkpoint", tmp_path / "e.pt",
                        "--output-dir", tmp_path / "ct2")  # CTranslate2 has no ensembles
    assert result.returncode == 1 and "is an ensemble; convert one of its members" in result.stderr
    result = run_module("fastattn.tools.ctranslate2_convert", "--checkpoint", tmp_path / "none.pt",
                        "--output-dir", tmp_path / "ct2")
    assert result.returncode == 1 and result.stderr.strip() == (
        f"error: {tmp_path / 'none.pt'}: no such checkpoint")

    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(paths[0].read_bytes()[:500])
    result = run_module("fastattn.ensemble", "--inputs", paths[0], damaged,
                        "--output", tmp_path / "x.pt")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and str(damaged) in result.stderr
    assert not (tmp_path / "x.pt").exists()
