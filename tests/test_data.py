"""fastattn.data: strict reading, the embedded corpus, SentencePiece, length filtering, batches."""

import gzip
import random

import numpy as np
import pytest
import torch

from fastattn import data


def write(path, content: bytes, gz: bool = False):
    path.write_bytes(gzip.compress(content) if gz else content)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_read_lines_strips_and_keeps_tabs(tmp_path, gz):
    path = write(tmp_path / "a.txt", b"  one\ttwo \r\nthree\n", gz)
    assert data.read_lines(path) == ["one\ttwo", "three"]


def test_read_lines_without_final_newline(tmp_path):
    assert data.read_lines(write(tmp_path / "a", b"x\ny")) == ["x", "y"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"ok\n   \nok\n", ":2: empty line"),
        (b"ok\nok\n\n", ":3: empty line"),
        (b"ok\nbad \xff byte\n", ":2: invalid UTF-8 at byte 4"),
        (b"", ": empty file"),
    ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_bad_lines_name_file_and_line(tmp_path, content, expected, gz):
    path = write(tmp_path / "bad.txt", content, gz)
    with pytest.raises(data.DataError) as error:
        data.read_lines(path)
    message = str(error.value)
    assert message == f"{path}{expected}" or message.startswith(f"{path}{expected}")
    assert "\n" not in message


def test_missing_file(tmp_path):
    with pytest.raises(data.DataError, match="no such file") as error:
        data.read_lines(tmp_path / "nope.de")
    assert str(tmp_path / "nope.de") in str(error.value)


def test_truncated_gzip(tmp_path):
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(b"line\n" * 1000)[:-20])
    with pytest.raises(data.DataError, match="cannot read"):
        data.read_lines(path)


def test_unequal_line_counts(tmp_path):
    src = write(tmp_path / "s.en", b"a\nb\nc\n")
    tgt = write(tmp_path / "t.de", b"a\nb\n")
    with pytest.raises(data.DataError) as error:
        data.read_parallel(src, tgt)
    message = str(error.value)
    assert f"{src} has 3 lines but {tgt} has 2" in message
    assert "line 2" in message and "\n" not in message


def test_parallel_pair(tmp_path):
    pair = data.read_parallel(write(tmp_path / "s", b"a b\nc\n"), write(tmp_path / "t", b"x\ny\n"))
    assert (pair.src, pair.tgt, len(pair)) == (["a b", "c"], ["x", "y"], 2)


@pytest.mark.parametrize(("split", "pairs"), [("train", 29000), ("val", 1014), ("test2016", 1000)])
def test_embedded_multi30k(split, pairs):
    for src, tgt in [("en", "de"), ("fr", "en")]:
        corpus = data.load_multi30k(split, src, tgt)
        assert len(corpus) == pairs
    tokenized = data.read_lines(data.multi30k_path(split, "de", tokenized=True)) \
        if split != "train" else None
    assert tokenized is None or len(tokenized) == pairs


def test_multi30k_quirk_tab_inside_a_sentence():
    train = data.load_multi30k("train", "en", "de")
    assert "\t" in train.tgt[7365]  # line 7366
    assert all(line == line.strip() for line in train.tgt)


@pytest.mark.parametrize(
    ("args", "match"),
    [(("dev", "en", "de"), "splits"), (("val", "en", "cs"), "languages"),
     (("val", "de", "de"), "both")],
)
def test_multi30k_bad_names(args, match):
    with pytest.raises(data.DataError, match=match):
        data.load_multi30k(*args)


def test_truecaser_recases_only_the_first_word():
    truecaser = data.Truecaser.train([
        "Ein Hund sieht ein Auto.", "Der Hund und der Mann.", "Da ist Der Hund.",
        "Zwei Männer sehen Männer.",
    ])
    assert truecaser("Ein Mann sieht Ein Auto.") == "ein Mann sieht Ein Auto."
    assert truecaser('"Hund bellt"') == '"Hund bellt"'  # nouns keep their capital
    assert truecaser("Der Hund") == "der Hund"  # 2 "der" inside against 1 "Der": the majority
    assert truecaser("Zwei Hunde") == "Zwei Hunde"  # never seen inside a sentence: unchanged
    assert truecaser("...") == "..." and truecaser("") == ""


def test_truecaser_ties_go_to_the_form_seen_first():
    assert data.Truecaser.train(["x Ball y ball"]).forms == {"ball": "Ball", "y": "y"}
    assert data.Truecaser.train(["x ball y Ball"]).forms == {"ball": "ball", "y": "y"}


def test_detruecase_capitalises_the_first_letter_only():
    assert data.Truecaser.detruecase("ein Hund bellt.") == "Ein Hund bellt."
    assert data.Truecaser.detruecase('"ein" Hund') == '"Ein" Hund'
    assert data.Truecaser.detruecase("3 hunde") == "3 hunde"
    assert data.Truecaser.detruecase("...") == "..."


def test_truecasing_multi30k_lowers_articles_and_keeps_nouns():
    train = data.load_multi30k("train", "en", "de")
    truecaser = data.Truecaser.train(train.tgt)
    cased = [truecaser(s) for s in train.tgt]
    assert cased[0].startswith("zwei junge") and train.tgt[0].startswith("Zwei junge")
    starts = [s.split()[0] for s in cased]
    assert starts.count("ein") > 10_000 and "Ein" not in starts
    assert starts.count("Männer") == [s.split()[0] for s in train.tgt].count("Männer") > 0
    # Truecasing changed the case of first letters and nothing else.
    detruecase = data.Truecaser.detruecase
    assert [detruecase(s) for s in cased] == [detruecase(s) for s in train.tgt]


SENTENCES = [f"the {a} {b} is {c} today." for a in ("red", "big", "old", "small", "new")
             for b in ("dog", "house", "car", "tree") for c in ("here", "there", "gone")]


def test_sentencepiece_joint_model_is_deterministic_and_round_trips():
    proto = data.train_sentencepiece(SENTENCES, vocab_size=60)
    assert proto == data.train_sentencepiece(SENTENCES, vocab_size=60)
    sp = data.load_sentencepiece(proto)
    assert sp.get_piece_size() == 60
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (
        data.PAD_ID, data.UNK_ID, data.BOS_ID, data.EOS_ID)
    ids = data.encode(sp, SENTENCES[:3])
    assert all(min(s) > data.EOS_ID for s in ids)
    assert sp.decode(ids) == SENTENCES[:3]


@pytest.fixture(scope="module")
def multi30k_bpe():
    """A 1000-piece BPE model of the first 2000 Multi30k en-de pairs, and those sentences' ids."""
    train = data.load_multi30k("train", "en", "de")
    sentences = train.src[:2000] + train.tgt[:2000]
    sp = data.load_sentencepiece(data.train_sentencepiece(sentences, vocab_size=1000))
    return sp, data.encode(sp, sentences)


def test_pieces_first_renumbers_the_pieces_and_keeps_the_segmentation():
    train = data.load_multi30k("train", "en", "de")
    en, de = train.src[:2000], train.tgt[:2000]
    proto = data.train_sentencepiece(en + de, vocab_size=1000)
    sp = data.load_sentencepiece(proto)
    german = {i for ids in data.encode(sp, de) for i in ids}
    renumbered, first = data.pieces_first(proto, german)
    assert first == data.EOS_ID + 1 + len(german) < 1000  # the test means something
    sp2 = data.load_sentencepiece(renumbered)
    assert sp2.get_piece_size() == 1000
    assert (sp2.pad_id(), sp2.unk_id(), sp2.bos_id(), sp2.eos_id()) == (
        data.PAD_ID, data.UNK_ID, data.BOS_ID, data.EOS_ID)
    assert [sp2.id_to_piece(i) for i in range(4, first)] == \
        [sp.id_to_piece(i) for i in sorted(german)]
    for text in (en, de):
        assert sp2.encode(text, out_type=str) == sp.encode(text, out_type=str)
    assert {i for ids in data.encode(sp2, de) for i in ids} == set(range(4, first))
    assert data.pieces_first(proto, []) == (proto, 4)  # nothing chosen: the same numbering
    with pytest.raises(ValueError, match="piece id 1000 is outside the vocabulary of 1000"):
        data.pieces_first(proto, [5, 1000])


def test_bpe_dropout_at_zero_is_sentencepiece_bpe(multi30k_bpe):
    sp, ids = multi30k_bpe
    dropout = data.BPEDropout(sp, ids[:10], p=0.5, samples=1)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    words = {word for sentence in ids for word in data._words(sentence, pieces)}
    assert len(words) > 3000
    rng = np.random.default_rng(0)
    for word in words:
        segmented = dropout._segment("".join(pieces[i] for i in word), 0.0, rng)
        assert segmented == [pieces[i] for i in word]


def test_bpe_dropout_samples_keep_the_text_and_depend_only_on_the_seeds(multi30k_bpe):
    sp, ids = multi30k_bpe
    dropout = data.BPEDropout(sp, ids, p=0.1, seed=3)
    assert dropout.segmentations == data.BPEDropout(sp, ids, p=0.1, seed=3).segmentations
    indices = list(range(0, len(ids), 5))
    first = dropout.sample(indices, np.random.default_rng([1, 2]))
    assert first == dropout.sample(indices, np.random.default_rng([1, 2]))
    assert first != dropout.sample(indices, np.random.default_rng([1, 3]))
    assert [sp.decode(s) for s in first] == [sp.decode(ids[i]) for i in indices]
    sampled, plain = sum(map(len, first)), sum(len(ids[i]) for i in indices)
    assert 1.02 * plain < sampled < 1.5 * plain  # perturbed: longer, but not characters
    expected = sum(dropout.expected_lengths[i] for i in indices)
    assert sampled == pytest.approx(expected, rel=0.03)


def test_drop_words_replaces_pieces_at_the_rate_and_leaves_special_ids():
    ids = torch.randint(4, 1000, (64, 97))
    ids[:, 0], ids[:, 50], ids[:, 60:] = data.BOS_ID, data.EOS_ID, data.PAD_ID
    ids[3, 5] = data.UNK_ID
    dropped = data.drop_words(ids, 0.3, np.random.default_rng([1, 2]))
    assert torch.equal(dropped, data.drop_words(ids, 0.3, np.random.default_rng([1, 2])))
    changed = dropped != ids
    special = ids <= data.EOS_ID
    assert not changed[special].any() and (dropped[changed] == data.UNK_ID).all()
    assert changed[~special].float().mean().item() == pytest.approx(0.3, abs=0.02)
    assert torch.equal(data.drop_words(ids, 0.0, np.random.default_rng(0)), ids)


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1])
def test_bpe_dropout_rate_out_of_range(multi30k_bpe, p):
    sp, ids = multi30k_bpe
    with pytest.raises(ValueError, match="BPE-dropout p must be in"):
        data.BPEDropout(sp, ids, p=p)


@pytest.mark.parametrize("vocab_size, reason", [
    (5, "smaller than required_chars"),  # fewer pieces than distinct characters
    (100_000, "too high"),  # more pieces than the text can give
])
def test_impossible_vocabulary_size_is_a_clear_error(vocab_size, reason):
    message = f"cannot build a {vocab_size}-piece vocabulary.*{reason}"
    with pytest.raises(data.DataError, match=message):
        data.train_sentencepiece(SENTENCES, vocab_size=vocab_size)


def test_filter_by_length_counts():
    src = [[5] * n for n in (1, 4, 9, 2, 3)]
    tgt = [[5] * n for n in (1, 4, 2, 7, 0)]
    keep, counts = data.filter_by_length(src, tgt, max_len=8, max_ratio=3.0)
    assert keep == [0, 1]
    assert counts == {"kept": 2, "too_long": 2, "bad_ratio": 1}


def lengths(n=997, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 40, n)
    return src, np.maximum(1, src + rng.integers(-5, 6, n))


def padded_cost(src, tgt, batch):
    return len(batch) * (src[batch].max() + tgt[batch].max())


def test_token_batches_cover_every_pair_once_within_budget():
    src, tgt = lengths()
    batches = data.TokenBatches(src, tgt, max_tokens=300, seed=3)
    epoch = batches.epoch(0)
    assert sorted(np.concatenate(epoch).tolist()) == list(range(len(src)))
    assert all(padded_cost(src, tgt, b) <= 300 for b in epoch)
    # Full batches: adding the next sentence of the sorted order would exceed the budget, so
    # the batches are many fewer than the sentences and padding is small.
    assert len(epoch) < len(src) / 4
    assert 0 <= batches.padding_fraction(0) < 0.15


def test_token_batches_pad_little_on_multi30k():
    """Batches sorted by the longer side pad both sides little: on the embedded corpus's word
    counts, 5.3% of a 16000-token batch is padding (sorted by target length alone: 10.3%)."""
    train = data.load_multi30k("train", "en", "de")
    src = [len(s.split()) + 1 for s in train.src]
    tgt = [len(t.split()) + 1 for t in train.tgt]
    assert data.TokenBatches(src, tgt, 16000, seed=1).padding_fraction(0) < 0.07


def test_token_batches_deterministic_per_seed_and_shuffled_per_epoch():
    src, tgt = lengths()
    a, b = data.TokenBatches(src, tgt, 300, seed=1), data.TokenBatches(src, tgt, 300, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a.epoch(2), b.epoch(2), strict=True))
    first, second = a.epoch(0), a.epoch(1)
    assert [x.tolist() for x in first] != [x.tolist() for x in second]
    other = data.TokenBatches(src, tgt, 300, seed=2).epoch(0)
    assert [x.tolist() for x in first] != [x.tolist() for x in other]


def test_token_batches_resume_from_a_position():
    src, tgt = lengths()
    batches = data.TokenBatches(src, tgt, 300, seed=5)
    n = len(batches)
    stream = batches.iterate()
    full = [next(stream) for _ in range(n + 7)]
    resumed = batches.iterate(epoch=1, step=3)
    for expected in full[n + 3 :]:
        epoch, step, batch = next(resumed)
        assert (epoch, step) == expected[:2] and np.array_equal(batch, expected[2])


def test_token_batches_shards():
    src, tgt = lengths()
    whole = data.TokenBatches(src, tgt, 300, seed=7).epoch(4)
    shards = [data.TokenBatches(src, tgt, 300, seed=7, rank=r, world_size=3).epoch(4)
              for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    interleaved = [shards[i % 3][i // 3] for i in range(3 * len(shards[0]))]
    assert all(np.array_equal(x, y) for x, y in zip(interleaved, whole, strict=False))


def test_token_batches_bad_arguments():
    with pytest.raises(ValueError, match="longest pair"):
        data.TokenBatches([10, 50], [10, 60], max_tokens=100)
    with pytest.raises(ValueError, match="rank"):
        data.TokenBatches([1], [1], 10, rank=2, world_size=2)


def test_collate_places_bos_eos_and_padding():
    src, tgt = [[7, 8, 9], [10]], [[11], [12, 13]]
    source, inputs, targets = data.collate(src, tgt, [1, 0])
    assert source.tolist() == [[10, data.EOS_ID, 0, 0], [7, 8, 9, data.EOS_ID]]
    assert inputs.tolist() == [[data.BOS_ID, 12, 13], [data.BOS_ID, 11, 0]]
    assert targets.tolist() == [[12, 13, data.EOS_ID], [11, data.EOS_ID, 0]]
    assert source.dtype == torch.long


def test_collate_matches_a_row_by_row_reference():
    rng = random.Random(0)
    sentences = [[rng.randrange(4, 100) for _ in range(rng.randrange(0, 30))] for _ in range(40)]
    indices = rng.sample(range(20), 17)
    batch = data.collate(sentences[:20], sentences[20:], indices)

    def reference(rows, before, after):
        rows = [before + row + after for row in rows]
        width = max(map(len, rows))
        return torch.tensor([row + [data.PAD_ID] * (width - len(row)) for row in rows])

    src = [sentences[i] for i in indices]
    tgt = [sentences[20 + i] for i in indices]
    expected = (reference(src, [], [data.EOS_ID]), reference(tgt, [data.BOS_ID], []),
                reference(tgt, [], [data.EOS_ID]))
    for got, want in zip(batch, expected, strict=True):
        assert got.dtype == torch.long and torch.equal(got, want)
