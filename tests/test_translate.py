"""fastattn.inference.translator: the Translator and `python -m fastattn.translate` on a small
random model with a real SentencePiece vocabulary, stored as a checkpoint the way fastattn.train
stores it."""

import io
import itertools
import sys
from dataclasses import asdict

import pytest
import torch

from fastattn import data
from fastattn.checkpoint import load_checkpoint, save_checkpoint
from fastattn.inference import Decoder
from fastattn.inference.search import beam_search
from fastattn.inference.translate_command import main
from fastattn.inference.translator import Translator
from fastattn.model import Transformer

SENTENCES = [
    "A dog runs on the beach.",
    "Two men are playing football in a park while a crowd watches.",
    "",
    "A woman.",
    "Children are sitting at a table and eating ice cream on a sunny afternoon in the city.",
    "A man in a red shirt climbs a rock.",
    "A dog runs on the beach.",
]
SHORT = {"max_len_b": 4}  # an untrained model tends to run to max_len: keep the tests fast


def make_checkpoint(path, **config):
    """A tiny random model (TransformerConfig fields replaced by config) with a 300-piece
    SentencePiece vocabulary of Multi30k's dev text, saved as fastattn.train saves one."""
    text = data.load_multi30k("val", "en", "de")
    proto = data.train_sentencepiece(list(text.src) + list(text.tgt), vocab_size=300)
    torch.manual_seed(0)
    model = Transformer.from_preset("tiny", vocab_size=300, dropout=0.0, **config)
    with torch.no_grad():  # sharper next-token distributions: fewer near-ties between hypotheses
        model.embedding.weight.mul_(4)
    state = {"model": model.state_dict(), "config": asdict(model.cfg), "spm": proto, "meta": {}}
    save_checkpoint(path, state)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("translate") / "checkpoint.pt")


def test_the_length_penalty_defaults_to_the_one_training_chose(checkpoint, tmp_path):
    assert Translator.from_checkpoint(checkpoint).alpha == 0.6  # none stored: the paper's
    state = load_checkpoint(checkpoint)
    state["meta"]["alpha"] = 1.5
    save_checkpoint(tmp_path / "tuned.pt", state)
    assert Translator.from_checkpoint(tmp_path / "tuned.pt").alpha == 1.5
    assert Translator.from_checkpoint(tmp_path / "tuned.pt", alpha=0.0).alpha == 0.0


def test_a_truecased_model_truecases_sources_and_detruecases_translations(checkpoint, tmp_path):
    state = load_checkpoint(checkpoint)
    state["meta"]["truecase"] = {"a": "a", "dog": "dog"}
    save_checkpoint(tmp_path / "truecased.pt", state)
    plain = Translator.from_checkpoint(checkpoint, **SHORT)
    truecased = Translator.from_checkpoint(tmp_path / "truecased.pt", **SHORT)
    assert plain.truecaser is None and truecased.truecaser.forms == {"a": "a", "dog": "dog"}
    # "A dog ..." reaches the model as "a dog ...": both give the same tokens.
    [[lowered]] = plain.stream(["a dog runs on the beach."])
    [[cased]] = truecased.stream(["A dog runs on the beach."])
    assert cased.tokens == lowered.tokens and cased.score == lowered.score
    assert cased.text == data.Truecaser.detruecase(lowered.text)


def test_translator_matches_a_direct_beam_search(checkpoint):
    translator = Translator.from_checkpoint(checkpoint, beam_size=3, nbest=2, max_len_b=7)
    model, sp = translator.model, translator.sp
    sentence = SENTENCES[1]
    source = torch.tensor([sp.encode(sentence) + [sp.eos_id()]])
    decoder = Decoder(model)
    (expected,) = beam_search(
        decoder.step_fn(decoder.start(source)), 1, beam_size=3, nbest=2, bos_id=sp.bos_id(),
        eos_id=sp.eos_id(),
        max_len=source.shape[1] + 7, alpha=0.6,
    )  # fmt: skip
    (found,) = translator.stream([sentence])
    assert [(t.tokens + [sp.eos_id()], t.score) for t in found] == [
        (h.tokens, h.score) for h in expected
    ]
    assert [t.text for t in found] == [sp.decode(h.tokens[:-1]) for h in expected]
    assert all(len(t.tokens) < source.shape[1] + 7 for t in found)


def test_input_order_survives_windows_and_length_sorting(checkpoint):
    alone = Translator.from_checkpoint(checkpoint, batch_tokens=1, window=1, **SHORT)
    windowed = Translator.from_checkpoint(checkpoint, batch_tokens=1, window=3, **SHORT)
    expected = [alone.translate([s])[0] for s in SENTENCES]
    assert windowed.translate(SENTENCES) == expected
    assert expected[0] == expected[-1]


def test_batching_changes_no_translation(checkpoint):
    alone = Translator.from_checkpoint(checkpoint, batch_tokens=1, **SHORT)
    batched = Translator.from_checkpoint(checkpoint, batch_tokens=1000, **SHORT)
    for one, many in zip(alone.stream(SENTENCES), batched.stream(SENTENCES), strict=True):
        assert [t.tokens for t in one] == [t.tokens for t in many]
        assert [t.score for t in one] == pytest.approx([t.score for t in many], rel=1e-4)


def test_stream_reads_only_a_window_ahead(checkpoint):
    translator = Translator.from_checkpoint(checkpoint, beam_size=2, max_len_b=3, window=2)
    consumed = []

    def lines():
        for i in itertools.count():
            consumed.append(i)
            yield f"A dog number {i}."

    first_three = list(itertools.islice(translator.stream(lines()), 3))
    assert len(first_three) == 3 and len(consumed) == 4


def run_cli(monkeypatch, capsys, args, lines):
    text = "".join(f"{line}\n" for line in lines)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    main(args)
    return capsys.readouterr().out.splitlines()


def test_command_line(checkpoint, monkeypatch, capsys):
    base = ["--checkpoint", str(checkpoint), "--max-len-b", "4"]
    best = run_cli(monkeypatch, capsys, base, SENTENCES)
    assert best == Translator.from_checkpoint(checkpoint, **SHORT).translate(SENTENCES)

    scored = run_cli(monkeypatch, capsys, [*base, "--scores"], SENTENCES)
    assert [line.split("\t", 1)[1] for line in scored] == best
    # The empty line (SENTENCES[2]) gives the empty translation, scored 0; the others are decoded.
    assert [float(line.split("\t")[0]) < 0 for line in scored] == [bool(s) for s in SENTENCES]
    assert scored[2] == "0.0000\t"

    nbest = run_cli(monkeypatch, capsys, [*base, "--nbest", "3", "--beam", "5"], SENTENCES[:2])
    fields = [line.split("\t") for line in nbest]
    assert [f[0] for f in fields] == ["0", "0", "0", "1", "1", "1"]
    for sentence in (fields[:3], fields[3:]):
        scores = [float(f[1]) for f in sentence]
        assert scores == sorted(scores, reverse=True)

    greedy = run_cli(monkeypatch, capsys, [*base, "--beam", "1"], SENTENCES[:3])
    assert len(greedy) == 3

    crlf = run_cli(monkeypatch, capsys, base, [f"{s}\r" for s in SENTENCES])  # Windows lines
    assert crlf == best


def test_plot_attention(checkpoint, monkeypatch, capsys, tmp_path):
    for kind in ("encoder", "cross"):
        png = tmp_path / f"{kind}.png"
        args = ["--checkpoint", str(checkpoint), "--max-len-b", "4", "--plot-attention", str(png)]
        args += ["--attention", kind, "--attention-layer", "2", "--attention-heads", "1,3"]
        run_cli(monkeypatch, capsys, args, SENTENCES[:1])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_weights(checkpoint):
    translator = Translator.from_checkpoint(checkpoint, **SHORT)
    queries, keys, weights = translator.attention(SENTENCES[0], 1, "encoder")
    assert queries == keys and weights.shape == (4, len(keys), len(keys))
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, len(keys)))
    queries, keys, weights = translator.attention(SENTENCES[0], 0, "cross")
    best = translator.stream([SENTENCES[0]]).__next__()[0]
    assert len(queries) == len(best.tokens) + 1 and weights.shape == (4, len(queries), len(keys))
    with pytest.raises(ValueError, match="layer"):
        translator.attention(SENTENCES[0], 2)


def test_bad_input_is_named(checkpoint, tmp_path, monkeypatch, capsys):
    broken = tmp_path / "broken.pt"
    broken.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(SystemExit, match="truncated or corrupt"):
        main(["--checkpoint", str(broken)])
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(checkpoint), "--beam", "2", "--nbest", "3"])
    assert "--nbest" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nbest"):
        Translator.from_checkpoint(checkpoint, beam_size=2, nbest=3)
    base = ["--checkpoint", str(checkpoint)]
    for flags, message in [(["--alpha=-1"], "--alpha must not be negative"),
                           (["--device", "gpu"], "--device 'gpu' is not a device"),
                           (["--attention-heads", "1,x"], "--attention-heads takes 1-based")]:
        with pytest.raises(SystemExit):
            main(base + flags)
        assert message in capsys.readouterr().err
    plot = [*base, "--plot-attention", str(tmp_path / "a.png")]
    for flags, message in [(["--attention-layer", "3"], "the model has layers 1 to 2"),
                           (["--attention-layer", "0"], "the model has layers 1 to 2"),
                           (["--attention-heads", "2,5"], "the model has heads 1 to 4")]:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"A dog.\n")))
        with pytest.raises(SystemExit, match=message):
            main(plot + flags)
    with pytest.raises(SystemExit, match=f"--input {tmp_path / 'none'}: No such file"):
        main([*base, "--input", str(tmp_path / "none")])
    latin1 = tmp_path / "latin1.en"
    latin1.write_bytes(SENTENCES[0].encode() + b"\nA caf\xe9.\n")
    with pytest.raises(SystemExit, match=f"{latin1}:2: invalid UTF-8"):
        main([*base, "--input", str(latin1)])
