"""fastattn.bleu and python -m fastattn.tools.evaluate: detokenized sacreBLEU, Multi30k tokenized
BLEU, the paper's compound split."""

import math

import pytest

from fastattn import bleu, data
from fastattn.tools import evaluate


@pytest.mark.parametrize("lang", ["en", "de"])
def test_multi30k_tokenize_reproduces_the_official_references(lang):
    raw = data.read_lines(data.multi30k_path("test2016", lang))
    official = data.read_lines(data.multi30k_path("test2016", lang, tokenized=True))
    assert [bleu.multi30k_tokenize(line, lang) for line in raw] == official


def test_references_score_100_against_themselves():
    raw = data.read_lines(data.multi30k_path("test2016", "de"))
    official = data.read_lines(data.multi30k_path("test2016", "de", tokenized=True))
    assert bleu.multi30k_bleu(raw, official, "de") == pytest.approx(100.0)
    assert bleu.sacre_bleu(raw, raw)[0] == pytest.approx(100.0)
    assert bleu.wmt_bleu(raw, raw, "de") == pytest.approx(100.0)


def test_tokenized_bleu_known_case():
    # Clipped n-gram precisions 5/6, 3/5, 2/4, 1/3, equal lengths (no brevity penalty).
    score = bleu.tokenized_bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert score == pytest.approx(expected)


def test_tokenized_bleu_brevity_penalty():
    score = bleu.tokenized_bleu(["a b c d"], ["a b c d e f"])
    assert score == pytest.approx(100 * math.exp(1 - 6 / 4))


def test_tokenized_bleu_keeps_tokens_as_they_are():
    # tokenize="none": "mat." is one token, so it does not match "mat".
    assert bleu.tokenized_bleu(["a b c mat."], ["a b c mat"]) < 100


def test_multi30k_bleu_lowercases_and_tokenizes_hypotheses():
    assert bleu.multi30k_bleu(["Ein Hund läuft, schnell!"], ["ein hund läuft , schnell !"],
                                  "de") == pytest.approx(100.0)


def test_sacre_bleu_signature():
    line = "Ein kleiner Hund läuft über eine Wiese."
    score, signature = bleu.sacre_bleu([line], [line])
    assert score == pytest.approx(100.0)
    assert bleu.sacre_bleu([line.lower()], [line])[0] < 100
    assert "tok:13a" in signature and "case:mixed" in signature


@pytest.mark.parametrize(
    ("line", "split"),
    [
        ("a-b", "a ##AT##-##AT## b"),
        ("Rhein-Main-Gebiet", "Rhein ##AT##-##AT## Main ##AT##-##AT## Gebiet"),
        ("a-b-c", "a ##AT##-##AT## b-c"),  # one non-overlapping pass, as the perl does
        ("a - b", "a - b"),
        ("-x", "-x"),
    ],
)
def test_split_compounds(line, split):
    assert bleu.split_compounds(line) == split


def test_wmt_tokenize_splits_compounds_after_moses():
    assert bleu.wmt_tokenize("Das E-Mail-Konto.", "de") == \
        "Das E ##AT##-##AT## Mail ##AT##-##AT## Konto ."


def test_misaligned_inputs_are_an_error():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        bleu.tokenized_bleu(["a", "b"], ["a"])


def test_cli_scores_a_translation_file_against_multi30k(tmp_path, capsys):
    references = data.read_lines(data.multi30k_path("test2016", "de"))
    hypotheses = references[:-1] + [""]  # an empty translation is a valid (bad) translation
    path = tmp_path / "hyp.de"
    path.write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    evaluate.main(["--hyp", str(path), "--multi30k", "test2016", "--lang", "de"])
    lines = capsys.readouterr().out.splitlines()
    official = data.read_lines(data.multi30k_path("test2016", "de", tokenized=True))
    sacre, signature = bleu.sacre_bleu(hypotheses, references)
    assert lines[0] == f"BLEU {sacre:.2f}  {signature}"
    tokenized = bleu.multi30k_bleu(hypotheses, official, "de")
    assert lines[1].startswith(f"tokenized BLEU {tokenized:.2f}  (lowercased")
    ratio, penalty = bleu.length_ratio(hypotheses, references)
    assert lines[2].startswith(f"length ratio {ratio:.3f}  (")
    assert lines[2].endswith(f"penalty {penalty:.3f})")
    assert sacre < 100 and ratio < 1 and penalty < 1  # the empty translation made it too short


def test_length_ratio_counts_13a_tokens_and_gives_the_brevity_penalty():
    ratio, penalty = bleu.length_ratio(["a b, c", "d"], ["a b , c d", "e f g"])  # 5 / 8
    assert ratio == pytest.approx(5 / 8) and penalty == pytest.approx(math.exp(1 - 8 / 5))
    assert bleu.length_ratio(["a b c"], ["a b"]) == (pytest.approx(1.5), 1.0)


def test_cli_with_plain_references_uses_the_wmt_convention(tmp_path, capsys):
    (tmp_path / "ref").write_text("Ein Links-Rechts-Test.\nZwei Hunde.\n", encoding="utf-8")
    (tmp_path / "hyp").write_text("Ein Links-Rechts-Test.\nDrei Hunde.\n", encoding="utf-8")
    evaluate.main(["--hyp", str(tmp_path / "hyp"), "--ref", str(tmp_path / "ref"), "--lang", "de"])
    expected = bleu.wmt_bleu(["Ein Links-Rechts-Test.", "Drei Hunde."],
                                 ["Ein Links-Rechts-Test.", "Zwei Hunde."], "de")
    assert f"tokenized BLEU {expected:.2f}  (cased" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--ref", "REF"], "3 hypotheses but 2 references"),
    (["--ref", "MISSING"], "MISSING: no such file"),
    (["--multi30k", "train"], "tokenized references for val and test2016 only"),
    (["--ref", "REF", "--hyp", "LATIN1"], "LATIN1:2: invalid UTF-8 at byte 3 of the line"),
])
def test_cli_bad_input_is_a_clear_error(tmp_path, capsys, argv, message):
    (tmp_path / "hyp").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "LATIN1").write_bytes(b"a\ncaf\xe9\n")
    (tmp_path / "REF").write_text("a\nb\n", encoding="utf-8")
    argv = [str(tmp_path / a) if a in ("REF", "MISSING", "LATIN1") else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(["--hyp", str(tmp_path / "hyp"), "--lang", "de", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
