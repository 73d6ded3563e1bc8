"""fastattn.inference.workers (threads decoding batches at once) and the translator's workers,
threads and precision: order, errors, the threads' counts, the GIL released by native decoding,
and the same translations with two workers as with one."""

from __future__ import annotations

import gc
import io
import sys
import threading
import time

import pytest
import torch
from test_translate import SENTENCES, SHORT, make_checkpoint

from fastattn.inference import Decoder, native
from fastattn.inference.native import PRECISIONS, NativeEngine
from fastattn.inference.translate_command import main
from fastattn.inference.translator import LONG_SOURCE, Translator
from fastattn.inference.workers import Workers, choose
from fastattn.model import Transformer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("workers") / "checkpoint.pt")


# -- Workers ---------------------------------------------------------------------------------


def test_results_come_in_input_order_when_later_calls_finish_first():
    finished = []
    second_done = threading.Event()

    def fn(i):
        if i == 0:  # the first call finishes only after the second
            assert second_done.wait(10)
        time.sleep(0.001 * (i % 3))
        finished.append(i)
        if i == 1:
            second_done.set()
        return i * i

    with Workers(3, 1) as pool:
        assert list(pool.map(fn, range(7))) == [i * i for i in range(7)]
    assert finished.index(1) < finished.index(0) and sorted(finished) == list(range(7))


def test_map_is_lazy_and_keeps_a_bounded_number_in_flight():
    read = []

    def items():
        for i in range(100):
            read.append(i)
            yield i

    with Workers(2, 1) as pool:
        results = pool.map(lambda i: -i, items())
        assert read == []  # nothing read before the first result is asked for
        assert next(results) == 0 and len(read) == 4  # 2 · workers in flight
        assert list(results) == [-i for i in range(1, 100)]


def test_an_exception_is_raised_at_its_position_and_the_pool_goes_on():
    def fn(i):
        if i == 2:
            raise ValueError("item 2")
        return i

    with Workers(2, 1) as pool:
        got = []
        with pytest.raises(ValueError, match="item 2"):
            for result in pool.map(fn, range(6)):
                got.append(result)
        assert got == [0, 1]

        def items():
            yield from range(3)
            raise OSError("reading failed")

        got = []
        with pytest.raises(OSError, match="reading failed"):
            for result in pool.map(lambda i: i, items()):
                got.append(result)
        assert got == [0, 1, 2]  # the items read before the failure come first
        assert list(pool.map(fn, [0, 1])) == [0, 1]


def test_close_stops_the_threads_and_so_does_dropping_the_pool():
    with Workers(2, 1) as pool:
        threads = list(pool._threads)
        assert list(pool.map(str, [1, 2, 3])) == ["1", "2", "3"]
    assert not any(thread.is_alive() for thread in threads)
    with pytest.raises(RuntimeError, match="after close"):
        pool.map(str, [1])
    pool.close()  # a second close is harmless

    dropped = Workers(2, 1)
    threads = list(dropped._threads)
    del dropped
    gc.collect()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)


def test_each_worker_keeps_its_thread_count_and_the_callers_stays():
    caller = torch.get_num_threads()
    try:
        with Workers(2, 1) as ones, Workers(1, 3) as threes:
            counts = lambda _: torch.get_num_threads()  # noqa: E731
            # Both pools at once: each one's calls see its own count.
            both = zip(ones.map(counts, range(8)), threes.map(counts, range(8)), strict=True)
            assert list(both) == [(1, 3)] * 8
            assert torch.get_num_threads() == caller
        fresh = []  # a thread started afterwards begins with the caller's count, as before
        thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert fresh == [caller]
    finally:
        torch.set_num_threads(caller)


def test_choose_is_a_one_thread_worker_per_core():
    assert [choose(batch, 2) for batch in (1, 16, 64, 1000)] == [(2, 1)] * 4
    assert choose(64, 8) == (8, 1) and choose(1, 1) == (1, 1)
    with pytest.raises(ValueError, match="batch_size and cores"):
        choose(0, 2)
    with pytest.raises(ValueError, match="workers and threads"):
        Workers(0, 1)


# -- native decoding on workers ----------------------------------------------------------------


@pytest.fixture
def timed_native_search(monkeypatch):
    """A random multi30k-size model whose native beam search records (start, end) of each call."""
    if not native.NATIVE_BEAM_SEARCH:
        pytest.skip("fastattn._C is not built: no native beam search")
    torch.manual_seed(0)
    decoder = Decoder(Transformer.from_preset("multi30k", vocab_size=8000, dropout=0.0).eval())
    source = torch.randint(4, 8000, (8, 20))
    calls = []
    native_search = NativeEngine.beam_search

    def timed(*args, **kwargs):
        start = time.perf_counter()
        native_search(*args, **kwargs)
        calls.append((start, time.perf_counter()))

    monkeypatch.setattr(NativeEngine, "beam_search", timed)

    def search(_=None):  # about 0.1 s on one thread of a 2023 Xeon: 40 steps of 32 rows
        decoder.beam_search(source, beam_size=4, bos_id=1, eos_id=2, max_len=41)

    search()  # the packed weights are built here, not in the timed calls
    calls.clear()
    return search, calls


def test_native_decoding_releases_the_gil(timed_native_search):
    search, calls = timed_native_search
    beats = []
    thread = threading.Thread(target=search)
    thread.start()
    while thread.is_alive():  # this thread runs Python while the other one decodes
        beats.append(time.perf_counter())
        time.sleep(0.001)
    [(start, end)] = calls
    inside = [beat for beat in beats if start < beat < end]
    # Holding the GIL, the native call would leave this thread no beat inside it (one at most,
    # taken in the instant before the call); released, one every millisecond or so.
    assert len(inside) >= 10, (len(inside), end - start)


def test_two_workers_decode_at_once(timed_native_search):
    search, calls = timed_native_search
    with Workers(2, 1) as pool:
        list(pool.map(search, [None, None]))
    (start_a, end_a), (start_b, end_b) = sorted(calls)
    assert start_b < end_a  # the second search started before the first ended


# -- the translator ------------------------------------------------------------------------------


@pytest.fixture
def decodings(monkeypatch):
    """(method, thread name, precision) of each Decoder.beam_search and Decoder.start call."""
    seen = []
    for name in ("beam_search", "start"):
        original = getattr(Decoder, name)

        def recorded(self, *args, name=name, original=original, **kwargs):
            seen.append((name, threading.current_thread().name, self.precision))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Decoder, name, recorded)
    return seen


def test_two_workers_translate_as_one_does(checkpoint, decodings):
    # batch_tokens=1: a batch per sentence, decoded on the workers, in windows of 4 and 3 lines.
    options = dict(batch_tokens=1, window=4, threads=1, **SHORT)
    for beam, nbest in ((3, 2), (1, 1)):  # beam search and greedy search
        one = Translator.from_checkpoint(checkpoint, workers=1, beam_size=beam, nbest=nbest,
                                         **options)
        two = Translator.from_checkpoint(checkpoint, workers=2, beam_size=beam, nbest=nbest,
                                         **options)
        expected = [[(t.text, t.tokens, t.score) for t in found] for found in one.stream(SENTENCES)]
        decodings.clear()
        found = [[(t.text, t.tokens, t.score) for t in found] for found in two.stream(SENTENCES)]
        assert found == expected and len(expected[0]) == nbest
        calls = [thread for method, thread, _ in decodings if method != "start"
                 or beam == 1]  # a batch's one call: beam_search, or greedy's start
        assert len(calls) == 6 and all(name.startswith("fastattn-worker-") for name in calls)
    one = Translator.from_checkpoint(checkpoint, workers=1, threads=1, batch_tokens=1, **SHORT)
    default = Translator.from_checkpoint(checkpoint, batch_tokens=1, **SHORT)
    assert default.translate(SENTENCES) == one.translate(SENTENCES)


def test_the_default_takes_choose_for_the_windows_batches(checkpoint):
    translator = Translator.from_checkpoint(checkpoint)
    cores = translator.cores = 4
    one, many = [0], list(range(64))
    assert translator._configuration([one] * 6) == choose(1, cores) == (4, 1)
    assert translator._configuration([many] * 5) == choose(64, cores) == (4, 1)
    # No more workers than batches: the cores go to the workers there are.
    assert translator._configuration([many] * 2) == (2, 2)
    assert translator._configuration([one]) == (1, 4)
    given = Translator.from_checkpoint(checkpoint, workers=2)
    given.cores = 4
    assert given._configuration([one]) == (2, 2)
    given = Translator.from_checkpoint(checkpoint, threads=1)
    given.cores = 4
    assert given._configuration([many]) == (4, 1)


def test_a_long_line_waits_for_the_workers_to_finish_the_lines_before_it(checkpoint,
                                                                          monkeypatch):
    translator = Translator.from_checkpoint(checkpoint, workers=2, threads=1, batch_tokens=1,
                                            max_source_len=LONG_SOURCE + 44,
                                            on_truncated=lambda *a: None, **SHORT)
    searched = []
    search = translator._search
    monkeypatch.setattr(translator, "_search",
                        lambda sources: searched.append(len(sources[0])) or search(sources))
    huge = " ".join(["a dog runs on the beach"] * 100)
    stream = translator.stream([SENTENCES[0], huge, *SENTENCES[3:6]])
    assert next(stream) and max(searched) <= LONG_SOURCE  # the long line is not decoded yet
    assert len(list(stream)) == 4 and searched[-1] == LONG_SOURCE + 44 and len(searched) == 5


def test_precision_is_checked_and_int8_is_the_models_int8_search(checkpoint, decodings):
    with pytest.raises(ValueError, match="precision must be one of .*, got 'int4'"):
        Translator.from_checkpoint(checkpoint, precision="int4")
    with pytest.raises(ValueError, match="workers must be an integer >= 1 or None, got 0"):
        Translator.from_checkpoint(checkpoint, workers=0)
    translator = Translator.from_checkpoint(checkpoint, precision="int8", beam_size=3, nbest=2,
                                            **SHORT)
    sp, model = translator.sp, translator.model
    source = torch.tensor([sp.encode(SENTENCES[1]) + [sp.eos_id()]])
    [expected] = Decoder(model, "int8").beam_search(
        source, beam_size=3, nbest=2, bos_id=sp.bos_id(), eos_id=sp.eos_id(),
        max_len=source.shape[1] + 4, alpha=0.6)
    decodings.clear()
    [found] = translator.stream([SENTENCES[1]])
    assert [(t.tokens + [sp.eos_id()], t.score) for t in found] == [
        (h.tokens, h.score) for h in expected]
    assert [p for method, _, p in decodings if method == "beam_search"] == ["int8"]


def run_cli(monkeypatch, capsys, args, lines):
    text = "".join(f"{line}\n" for line in lines)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    main(args)
    return capsys.readouterr().out.splitlines()


def test_command_line_flags(checkpoint, monkeypatch, capsys, decodings):
    base = ["--checkpoint", str(checkpoint), "--max-len-b", "4", "--batch-tokens", "1"]
    expected = Translator.from_checkpoint(checkpoint, **SHORT).translate(SENTENCES)
    for flags, thread in ((["--workers", "2", "--threads", "1"], "fastattn-worker-"),
                          (["--workers", "1", "--threads", str(torch.get_num_threads())],
                           "MainThread")):
        decodings.clear()
        assert run_cli(monkeypatch, capsys, base + flags, SENTENCES) == expected
        assert {name.rstrip("0123456789") for _, name, _ in decodings} == {thread}
    for flags, message in [(["--precision", "int4"], "invalid choice: 'int4'"),
                           (["--workers", "0"], "--workers must be >= 1, got 0"),
                           (["--threads", "-1"], "--threads must be >= 1, got -1")]:
        with pytest.raises(SystemExit):
            main(base + flags)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out
    assert f"--precision {{{','.join(PRECISIONS)}}}" in usage
    assert "--workers WORKERS" in usage and "--threads THREADS" in usage
    # Needs the int8 decoder (issue 51): greedy search and beam search.
    for beam in ("1", "4"):
        decodings.clear()
        run_cli(monkeypatch, capsys, [*base, "--precision", "int8", "--beam", beam], SENTENCES)
        called = "start" if beam == "1" else "beam_search"  # the translator's call
        assert [p for method, _, p in decodings if method == called] == ["int8"] * 6
