"""fastattn.model: the paper's Transformer. Causality, padding, cached decoding
(fastattn.inference.Decoder) equal to the teacher-forced forward (through reorders, beam expansion
and finished sentences leaving), the fused loss, and parameter counts against Table 3."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import fastattn.fused_model
import fastattn.inference.native
import fastattn.model
from fastattn.backend import implementation
from fastattn.inference import Decoder
from fastattn.model import PRESETS, Transformer, TransformerConfig, sinusoids
from fastattn.rdrop import rdrop_loss

V, PAD = 23, 0
TINY = TransformerConfig(vocab_size=V, encoder_layers=2, decoder_layers=2, d_model=16, d_ff=24,
                         heads=2, dropout=0.1, pad_id=PAD)
VARIANTS = {
    "paper": TINY,
    "pre_norm": replace(TINY, pre_norm=True),
    "learned_positions": replace(TINY, positions="learned", max_len=16),
    "d_k_ne_d_v": replace(TINY, d_k=4, d_v=6, encoder_layers=1),
    "output_vocab": replace(TINY, output_vocab_size=17),
}
TOL = {"atol": 2e-5, "rtol": 1e-4}


def make_model(cfg=TINY, seed=0):
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def tokens(*shape, seed=1):
    return torch.randint(1, V, shape, generator=torch.Generator().manual_seed(seed))


def pad_after(x, lengths):
    """Pads row i of x after lengths[i] tokens."""
    x = x.clone()
    for i, n in enumerate(lengths):
        x[i, n:] = PAD
    return x


@pytest.fixture(params=["native", "python"])
def decoder_path(request, monkeypatch):
    """Cached decoding through fastattn._C's decoder_step (CPU, float32/64, post-norm) and
    through the per-layer PyTorch steps."""
    if request.param == "native" and not fastattn.inference.native.NATIVE_DECODER_STEP:
        pytest.skip("fastattn._C is not built: no native decoder step")
    monkeypatch.setattr(fastattn.inference.native, "NATIVE_DECODER_STEP", request.param == "native")
    return request.param


# The variants that change what the tests below exercise (the interpreter backend is slow).
ATTENTION_VARIANTS = {k: VARIANTS[k] for k in ("paper", "d_k_ne_d_v")}


@pytest.mark.parametrize("cfg", ATTENTION_VARIANTS.values(), ids=ATTENTION_VARIANTS.keys())
def test_decoder_is_causal(cfg):
    model = make_model(cfg)
    src, tgt = pad_after(tokens(2, 7), [7, 4]), tokens(2, 6, seed=2)
    logits = model(src, tgt)
    for j in (0, 2, 5):
        changed = tgt.clone()
        changed[:, j:] = tokens(2, 6 - j, seed=3 + j)
        other = model(src, changed)
        torch.testing.assert_close(other[:, :j], logits[:, :j], **TOL)
        assert not torch.allclose(other[:, j:], logits[:, j:])  # the change itself is seen


@pytest.mark.parametrize("cfg", ATTENTION_VARIANTS.values(), ids=ATTENTION_VARIANTS.keys())
def test_padding_changes_nothing(cfg):
    """A sentence gives the same logits alone, in a batch, and with extra padding."""
    model = make_model(cfg)
    src = pad_after(tokens(3, 6), [6, 3, 5])
    tgt = pad_after(tokens(3, 5, seed=2), [5, 2, 4])
    logits = model(src, tgt)
    longer = model(F.pad(src, (0, 3), value=PAD), F.pad(tgt, (0, 2), value=PAD))
    for i, (s, t) in enumerate([(6, 5), (3, 2), (5, 4)]):
        alone = model(src[i : i + 1, :s], tgt[i : i + 1, :t])[0]
        torch.testing.assert_close(logits[i, :t], alone, **TOL)
        torch.testing.assert_close(longer[i, :t], alone, **TOL)


def reference_logprobs(model, src, prefixes):
    """Teacher-forced log-probabilities of the next token after each prefix (rows x (t,))."""
    return model(src, prefixes)[:, -1].log_softmax(-1)


@pytest.mark.parametrize("cfg", VARIANTS.values(), ids=VARIANTS.keys())
def test_cached_decoding_equals_teacher_forcing(cfg, decoder_path):
    model = make_model(cfg)
    src = pad_after(tokens(3, 6), [6, 2, 4])
    tgt = tokens(3, 7, seed=2)
    expected = model(src, tgt).log_softmax(-1)
    decoder = Decoder(model)
    state = decoder.start(src, capacity=3)  # grows twice on the way
    steps = [decoder.step(tgt[:, t], state) for t in range(tgt.shape[1])]
    torch.testing.assert_close(torch.stack(steps, dim=1), expected, **TOL)
    assert state.length == 7 and state.capacity >= 7


def test_decoding_follows_weights_updated_in_place(decoder_path):
    """The native engine keeps packed copies of the weights: an in-place update (which bumps
    the weights' versions) must reach the next decoding of the same Decoder."""
    model = make_model()
    decoder = Decoder(model)
    src, tgt = tokens(2, 5), tokens(2, 4, seed=3)
    for _ in range(2):
        state = decoder.start(src)
        steps = [decoder.step(tgt[:, t], state) for t in range(tgt.shape[1])]
        torch.testing.assert_close(torch.stack(steps, dim=1), model(src, tgt).log_softmax(-1),
                                   **TOL)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.1)


def test_decoding_follows_a_fused_optimiser(decoder_path):
    """Fused Adam (the trainer's) writes the weights without bumping their version counters: a
    Decoder made after a training step (train(), step, eval(), as the trainer's dev evaluation
    makes its Translator) must use the new weights."""
    model = make_model()
    optimiser = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    src, tgt = tokens(2, 5), tokens(2, 4, seed=3)
    for _ in range(3):
        decoder = Decoder(model)
        state = decoder.start(src)
        steps = [decoder.step(tgt[:, t], state) for t in range(tgt.shape[1])]
        torch.testing.assert_close(torch.stack(steps, dim=1), model(src, tgt).log_softmax(-1),
                                   **TOL)
        model.train()
        model(src, tgt).logsumexp(-1).mean().backward()
        optimiser.step()
        optimiser.zero_grad()
        model.eval()


@pytest.mark.parametrize("cfg", ATTENTION_VARIANTS.values(), ids=ATTENTION_VARIANTS.keys())
def test_cached_decoding_follows_beam_search_reorders(cfg, decoder_path):
    """Rows are expanded, shuffled, duplicated and dropped, and sentences finish and leave, as
    in beam search; every step equals the teacher-forced forward of the row's prefix."""
    model = make_model(cfg)
    src = pad_after(tokens(3, 6), [6, 2, 4])
    beam = 2
    g = torch.Generator().manual_seed(7)
    decoder = Decoder(model)
    state = decoder.start(src)
    sentence = torch.arange(3).repeat_interleave(beam)  # first call: 2 rows per sentence
    prefixes = torch.ones(6, 1, dtype=torch.long)
    reorders = [
        None,
        torch.tensor([1, 1, 2, 3, 5, 4]),  # grouped, rows duplicated within a sentence
        torch.tensor([2, 3, 4, 5]),  # sentence 0 finished
        torch.tensor([3, 2, 0, 0, 1]),  # sentences out of memory order, uneven rows
        torch.tensor([1, 1, 1]),  # back to one sentence, three rows
    ]
    for rows in reorders:
        if rows is not None:
            state.reorder(rows)
            sentence, prefixes = sentence[rows], prefixes[rows]
        logprobs = decoder.step(prefixes[:, -1], state)
        torch.testing.assert_close(logprobs, reference_logprobs(model, src[sentence], prefixes),
                                   **TOL)
        step_tokens = torch.randint(1, V, (len(prefixes), 1), generator=g)
        prefixes = torch.cat([prefixes, step_tokens], dim=1)
    assert state.num_sentences == 1  # finished sentences' encoder memory was dropped


@pytest.mark.parametrize("lengths", [[5, 3], [5, 5]], ids=["padded", "no_padding"])
def test_decoding_one_row_per_sentence_then_beams(lengths, decoder_path):
    """The search may start with one row per sentence and expand to the beam on reorder."""
    model = make_model()
    src = pad_after(tokens(2, 5), lengths)
    decoder = Decoder(model)
    state = decoder.start(src)
    assert (state.memory_bias is None) == (lengths == [5, 5])
    bos = torch.ones(2, dtype=torch.long)
    decoder.step(bos, state)
    state.reorder(torch.tensor([0, 0, 0, 1, 1, 1]))
    assert state.sentences is None  # grouped: cross-attention reads memory without copies
    next_tokens = tokens(6, 1, seed=4)
    logprobs = decoder.step(next_tokens[:, 0], state)
    prefixes = torch.cat([torch.ones(6, 1, dtype=torch.long), next_tokens], dim=1)
    expected = reference_logprobs(model, src.repeat_interleave(3, dim=0), prefixes)
    torch.testing.assert_close(logprobs, expected, **TOL)
    rows = torch.tensor([4, 0, 5, 1])  # sentences interleaved: rows read memory by index
    state.reorder(rows)
    assert state.sentences is not None
    prefixes = torch.cat([prefixes[rows], tokens(4, 1, seed=5)], dim=1)
    logprobs = decoder.step(prefixes[:, -1], state)
    expected = reference_logprobs(model, src[torch.tensor([1, 0, 1, 0])], prefixes)
    torch.testing.assert_close(logprobs, expected, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("beam", "nbest", "penalty"), [(1, 1, "gnmt"), (3, 2, "pow"),
                                                        (5, 1, "gnmt")])
@pytest.mark.parametrize("per_sentence_max_len", [False, True])
@pytest.mark.parametrize("output_vocab_size", [None, 61])
def test_native_beam_search_equals_search_over_decode_step(dtype, beam, nbest, penalty,
                                                           per_sentence_max_len,
                                                           output_vocab_size, monkeypatch):
    """Decoder.beam_search's one native call (fastattn::transformer_beam_search) returns the
    tokens and scores, bit for bit, of fastattn.beam_search over Decoder.step: sentences of
    different lengths finish at different steps and leave the batch. With an output vocabulary
    smaller than the input's, both predict from its pieces only."""
    if not fastattn.inference.native.NATIVE_BEAM_SEARCH:
        pytest.skip("fastattn._C is not built: no native beam search")
    cfg = replace(TINY, vocab_size=97, output_vocab_size=output_vocab_size)
    model = make_model(cfg).to(dtype)
    src = pad_after(tokens(5, 9), [9, 1, 4, 7, 2])
    max_len = torch.tensor([3, 12, 1, 8, 6]) if per_sentence_max_len else 9
    options = dict(beam_size=beam, nbest=nbest, bos_id=1, eos_id=2, max_len=max_len, alpha=0.8,
                   length_penalty=penalty)
    native = Decoder(model).beam_search(src, **options)
    monkeypatch.setattr(fastattn.inference.native, "NATIVE_BEAM_SEARCH", False)
    stepwise = Decoder(model).beam_search(src, **options)
    assert [[(h.tokens, h.score) for h in hyps] for hyps in native] == \
        [[(h.tokens, h.score) for h in hyps] for hyps in stepwise]
    assert len(native[1]) == nbest  # (a max_len of 1 leaves room for one hypothesis: EOS)
    assert {len(hyps[0].tokens) for hyps in native} != {1}  # not all EOS at once
    assert max(max(h.tokens) for hyps in native for h in hyps) < cfg.output_size


@pytest.mark.parametrize("precision", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("tied", ["none", "half", "all", "close"])
@pytest.mark.parametrize("vocab", [97, 1000])
def test_native_search_over_largest_logits_equals_search_over_whole_rows(at_every_cpu_isa,
                                                                         precision, tied, vocab,
                                                                         monkeypatch):
    """Through panels the native search reads each row's log-sum-exp and 2·beam + 8 largest
    logits, never the rows themselves, and recomputes a row only where those cannot settle its
    candidates. Tied output rows make tokens of equal logits ("all": a tie at the edge of every
    top, "half": of some), "close" ones logits a few ulp apart, rising with the token, that
    round to equal scores: the lower token wins such a tie, though its logit may not be among
    the largest (without the check for it, fp32 and int8 fail here). Tokens and scores equal the
    search over whole rows (Decoder.step's log-probabilities) bit for bit, at every
    instruction-set level; with two threads, each computing the largest logits of half the
    output panels at a vocabulary of 1000."""
    if not fastattn.inference.native.NATIVE_BEAM_SEARCH:
        pytest.skip("fastattn._C is not built: no native beam search")
    model = make_model(replace(TINY, vocab_size=vocab))
    first = {"none": vocab, "half": vocab // 2, "all": 3, "close": 3}[tied]
    with torch.no_grad():  # the embedding is the output projection too
        model.embedding.weight[first:] = model.embedding.weight[first - 1]
        if tied == "close":  # logits a few ulp apart, rising with the token
            model.embedding.weight[first:] *= 1 + 1.5e-7 * torch.arange(vocab - first)[:, None]
    src = pad_after(tokens(5, 9), [9, 1, 4, 7, 2])
    options = dict(beam_size=4, nbest=2, bos_id=1, eos_id=2, max_len=torch.tensor([3, 12, 1, 8, 6]),
                   alpha=0.8)

    def search():
        return [[(h.tokens, h.score) for h in hyps]
                for hyps in Decoder(model, precision=precision).beam_search(src, **options)]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native = search()
        monkeypatch.setattr(fastattn.inference.native, "NATIVE_BEAM_SEARCH", False)
        assert native == search()
    finally:
        torch.set_num_threads(threads)


def test_native_beam_search_does_not_depend_on_earlier_searches():
    """The native search keeps its buffers from call to call (per thread): a search after
    larger ones, longer ones and float64 ones returns what it returned the first time."""
    if not fastattn.inference.native.NATIVE_BEAM_SEARCH:
        pytest.skip("fastattn._C is not built: no native beam search")
    model = make_model(replace(TINY, vocab_size=97))
    small, large = pad_after(tokens(2, 5), [5, 3]), pad_after(tokens(7, 11, seed=3), [11] * 7)
    options = dict(beam_size=3, bos_id=1, eos_id=2, alpha=0.6)

    def search(model, src, max_len):
        return [[(h.tokens, h.score) for h in hyps]
                for hyps in Decoder(model).beam_search(src, max_len=max_len, **options)]

    first = search(model, small, 6)
    search(model, large, 30)
    search(model.double(), large, 20)
    assert search(model.float(), small, 6) == first


def test_decode_step_does_not_rerun_the_prefix(monkeypatch):
    """The matrix products of a step (projections, feed-forward, output) do not grow with the
    length: earlier positions come from the cache. (Attention itself reads O(length) keys.) On
    the PyTorch path, whose every matmul the counter sees."""
    monkeypatch.setattr(fastattn.inference.native, "NATIVE_DECODER_STEP", False)
    decoder = Decoder(make_model())
    state = decoder.start(tokens(2, 5))
    flops = []
    for _ in range(6):
        with FlopCounterMode(display=False) as counter:
            decoder.step(torch.ones(2, dtype=torch.long), state)
        by_op = counter.get_flop_counts()["Global"]
        flops.append(sum(n for op, n in by_op.items() if op is not torch.ops.aten.bmm))
    assert flops[0] > 0 and flops[-1] == flops[0]


def test_decoding_errors_are_clear():
    model = make_model()
    src = tokens(2, 5)
    decoder = Decoder(model)
    state = decoder.start(src)
    with pytest.raises(RuntimeError, match="before the first Decoder.step"):
        state.reorder(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="multiple of the 2 sentences"):
        decoder.step(torch.ones(3, dtype=torch.long), state)
    decoder.step(torch.ones(4, dtype=torch.long), state)
    with pytest.raises(ValueError, match="reorder"):
        decoder.step(torch.ones(3, dtype=torch.long), state)
    model.train()
    with pytest.raises(RuntimeError, match="eval"):
        decoder.start(src)


def test_attention_weights_are_the_ones_the_model_uses():
    model = make_model()
    src = pad_after(tokens(2, 6), [6, 4])
    tgt = tokens(2, 5, seed=2)
    maps = model.attention_weights(src, tgt)
    assert [len(maps[k]) for k in ("encoder", "decoder", "cross")] == [2, 2, 2]
    enc, dec, cross = maps["encoder"][0], maps["decoder"][1], maps["cross"][1]
    assert enc.shape == (2, 2, 6, 6) and dec.shape == (2, 2, 5, 5) and cross.shape == (2, 2, 5, 6)
    torch.testing.assert_close(cross.sum(-1), torch.ones(2, 2, 5))
    assert torch.all(enc[1, :, :, 4:] == 0) and torch.all(cross[1, :, :, 4:] == 0)  # padding
    assert torch.all(dec.triu(1) == 0)  # causal
    # Applied to the values, the first encoder layer's weights give its attention output.
    attention = model.encoder.layers[0].self_attention
    x = model.embedding(src)
    _, _, v = attention.qkv(x).split(attention.split, dim=-1)
    heads = enc @ v.unflatten(-1, (2, -1)).transpose(1, 2)
    expected = attention.out(heads.transpose(1, 2).flatten(2))
    torch.testing.assert_close(attention(x, model.padding_mask(src)), expected, **TOL)


def test_loss_returns_the_unsmoothed_nll_too():
    model = make_model(replace(TINY, dropout=0.0))
    src, tgt = tokens(2, 5), tokens(2, 6, seed=2)
    loss, nll = model.loss(src, tgt[:, :-1], tgt[:, 1:], return_nll=True)
    logits = model(src, tgt[:, :-1])
    expected = F.cross_entropy(logits.transpose(1, 2), tgt[:, 1:])
    torch.testing.assert_close(nll, expected.detach(), atol=1e-5, rtol=1e-5)
    smoothed = F.cross_entropy(logits.transpose(1, 2), tgt[:, 1:], label_smoothing=0.1)
    torch.testing.assert_close(loss, smoothed, atol=1e-5, rtol=1e-5)
    assert loss.requires_grad and not nll.requires_grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_loss_equals_label_smoothed_cross_entropy_of_logits(reduction):
    cfg = replace(TINY, dropout=0.0, label_smoothing=0.1)
    model = make_model(cfg)
    src = pad_after(tokens(3, 6), [6, 3, 5])
    tgt = pad_after(tokens(3, 6, seed=2), [6, 2, 4])
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    loss = model.loss(src, tgt_in, tgt_out, reduction=reduction)
    logits = model(src, tgt_in)
    expected = F.cross_entropy(logits.transpose(1, 2), tgt_out, ignore_index=PAD,
                               label_smoothing=0.1, reduction=reduction)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    params = list(model.parameters())
    grads = torch.autograd.grad(loss * 1.7, params)
    expected_grads = torch.autograd.grad(expected * 1.7, params)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rdrop", [False, True])
def test_loss_with_the_token_count_is_the_same_to_the_bit(rdrop):
    """tokens= (the non-padding count train_step knows from the host batch, which spares a GPU
    its host sync) changes nothing: loss, NLL and every gradient equal to the bit; a wrong
    count is named (on CPU, where checking it costs no sync)."""
    model = make_model(replace(TINY, dropout=0.3)).train()
    src = pad_after(tokens(3, 6), [6, 3, 5])
    tgt = pad_after(tokens(3, 7, seed=2), [7, 2, 4])
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    count = int((tgt_out != PAD).sum())
    loss = (lambda **kw: rdrop_loss(model, src, tgt_in, tgt_out, 2.0, return_nll=True, **kw)
            ) if rdrop else (lambda **kw: model.loss(src, tgt_in, tgt_out, return_nll=True, **kw))
    params = list(model.parameters())
    results = []
    for kwargs in ({}, {"tokens": count}):
        torch.manual_seed(5)
        value, nll = loss(**kwargs)
        results.append((value, nll, *torch.autograd.grad(1.7 * value, params)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for wrong in (count - 1, count + 1):
        with pytest.raises(ValueError, match=f"tokens={wrong}, but the targets hold {count} "):
            loss(tokens=wrong)


def test_output_vocabulary_is_the_first_rows_of_the_tied_embedding():
    """With output_vocab_size n, the softmax ranges over ids [0, n) and the sources over all:
    logits, loss and gradients are those of the full model with its logits cut to the first n
    (both in float64)."""
    n = 17
    full = make_model(replace(TINY, dropout=0.0)).double()
    model = make_model(replace(TINY, dropout=0.0, output_vocab_size=n)).double()
    model.load_state_dict(full.state_dict())
    src = pad_after(tokens(3, 6), [6, 3, 5])
    assert src.max() >= n  # the sources use pieces outside the output vocabulary
    tgt = pad_after(1 + tokens(3, 6, seed=2) % (n - 1), [6, 2, 4])
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    logits = full(src, tgt_in)[..., :n]
    torch.testing.assert_close(model(src, tgt_in), logits)
    loss = model.loss(src, tgt_in, tgt_out)
    expected = F.cross_entropy(logits.transpose(1, 2), tgt_out, ignore_index=PAD,
                               label_smoothing=0.1)
    torch.testing.assert_close(loss, expected)
    grads = torch.autograd.grad(loss * 1.7, list(model.parameters()))
    expected_grads = torch.autograd.grad(expected * 1.7, list(full.parameters()))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)
    with pytest.raises(ValueError, match=f"target {V - 1} is out of range for {n} classes"):
        model.loss(src, tgt_in, tgt_out.masked_fill(tgt_out == tgt_out.max(), V - 1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_rdrop_loss_is_two_dropout_passes_with_their_symmetric_kl(reduction):
    """R-Drop's loss against the same two passes (one forward of the doubled batch, the same
    dropout masks from the same seed) scored in float64 with torch's cross-entropy and KL."""
    model = make_model(replace(TINY, dropout=0.3)).train()
    src = pad_after(tokens(3, 6), [6, 3, 5])
    tgt = pad_after(tokens(3, 7, seed=2), [7, 2, 4])
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    alpha = 3.0
    torch.manual_seed(5)
    loss, nll = rdrop_loss(model, src, tgt_in, tgt_out, alpha, reduction=reduction,
                                 return_nll=True)
    torch.manual_seed(5)
    logits = model(torch.cat([src, src]), torch.cat([tgt_in, tgt_in])).double()
    real = tgt_out != PAD
    z1, z2 = logits[:3][real], logits[3:][real]
    target = tgt_out[real]
    assert not torch.allclose(z1, z2)  # the two passes differ

    def kl(p, q):  # KL(p||q) per token
        return F.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True,
                        reduction="none").sum(-1)

    per_token = (F.cross_entropy(z1, target, label_smoothing=0.1, reduction="none")
                 + F.cross_entropy(z2, target, label_smoothing=0.1, reduction="none")) / 2
    per_token = per_token + alpha / 4 * (kl(z1, z2) + kl(z2, z1))
    nll_per_token = (F.cross_entropy(z1, target, reduction="none")
                     + F.cross_entropy(z2, target, reduction="none")) / 2
    reduce = torch.sum if reduction == "sum" else torch.mean
    expected = reduce(per_token)
    torch.testing.assert_close(loss.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nll.double(), reduce(nll_per_token).detach(), atol=1e-5, rtol=1e-5)
    assert not nll.requires_grad
    params = list(model.parameters())
    torch.manual_seed(5)
    grads = torch.autograd.grad(1.7 * rdrop_loss(model, src, tgt_in, tgt_out, alpha,
                                                       reduction=reduction), params)
    expected_grads = torch.autograd.grad(1.7 * expected, params)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_rdrop_loss_without_dropout_is_the_loss():
    model = make_model()  # eval: both passes are the same, so the KL term is zero
    src, tgt = tokens(2, 5), tokens(2, 6, seed=2)
    torch.testing.assert_close(rdrop_loss(model, src, tgt[:, :-1], tgt[:, 1:], 5.0),
                               model.loss(src, tgt[:, :-1], tgt[:, 1:]), atol=1e-5, rtol=1e-5)


def test_dropout_only_in_training():
    model = make_model()
    src, tgt = tokens(2, 5), tokens(2, 4, seed=2)
    model.train()
    assert not torch.allclose(model(src, tgt), model(src, tgt))
    model.eval()
    torch.testing.assert_close(model(src, tgt), model(src, tgt), atol=0, rtol=0)


def test_tied_embedding_scaled_by_sqrt_d_model():
    model = make_model(replace(TINY, dropout=0.0))
    ids = tokens(1, 4)
    expected = model.embedding.weight[ids[0]] * 16**0.5 + sinusoids(4, 16)
    torch.testing.assert_close(model.embedding(ids)[0], expected)
    logits = model(ids, ids)
    hidden = model.decode(ids, *model.encode(ids))
    torch.testing.assert_close(logits, hidden @ model.embedding.weight.T)
    assert sum("embedding" in n for n, _ in model.named_parameters()) == 1


def test_sinusoids_match_the_formula_and_extrapolate():
    table = sinusoids(50, 8)
    pos, i = 37, 3
    assert table[pos, 2 * i].item() == pytest.approx(torch.sin(torch.tensor(pos / 1e4 ** (6 / 8),
                                                                  dtype=torch.float64)).item())
    assert table[pos, 2 * i + 1].item() == pytest.approx(
        torch.cos(torch.tensor(pos / 1e4 ** (6 / 8), dtype=torch.float64)).item())
    model = make_model(replace(TINY, max_len=4))
    torch.testing.assert_close(model.embedding.positions(2, 5), sinusoids(7, 16)[2:])


# Table 3 "params ×10^6" and ours with a 37,000-token shared vocabulary (the paper gives ~37k).
# Ours sit a near-constant ~2M below the paper (its exact vocabulary size is not stated).
TABLE3_PARAMS = {
    "base": (65, 63_082_496),
    "big": (213, 214_245_376),
    "table3-B1": (58, 55_990_784),
    "table3-B2": (60, 58_354_688),
    "table3-C1": (36, 33_656_832),
    "table3-C2": (50, 48_369_664),
    "table3-C3": (80, 77_795_328),
    "table3-C4": (28, 26_834_944),
    "table3-C5": (168, 163_889_152),
    "table3-C6": (53, 50_487_296),
    "table3-C7": (90, 88_272_896),
}


@pytest.mark.parametrize("name", TABLE3_PARAMS)
def test_parameter_counts_match_table3(name):
    paper, ours = TABLE3_PARAMS[name]
    with torch.device("meta"):  # counts without allocating
        model = Transformer(replace(PRESETS[name], vocab_size=37000))
    assert model.num_parameters() == ours
    tolerance = 0.05 if name in ("base", "big") else 0.07  # the 5% for base and big
    assert abs(ours / 1e6 - paper) / paper < tolerance


def test_presets_are_the_papers_rows():
    rows = {  # (N, d_model, d_ff, h, d_k, d_v, P_drop, ε_ls, positions) from Tables 3
        "base": (6, 512, 2048, 8, 64, 64, 0.1, 0.1, "sinusoidal"),
        "big": (6, 1024, 4096, 16, 64, 64, 0.3, 0.1, "sinusoidal"),
        "table3-A1": (6, 512, 2048, 1, 512, 512, 0.1, 0.1, "sinusoidal"),
        "table3-A2": (6, 512, 2048, 4, 128, 128, 0.1, 0.1, "sinusoidal"),
        "table3-A3": (6, 512, 2048, 16, 32, 32, 0.1, 0.1, "sinusoidal"),
        "table3-A4": (6, 512, 2048, 32, 16, 16, 0.1, 0.1, "sinusoidal"),
        "table3-B1": (6, 512, 2048, 8, 16, 64, 0.1, 0.1, "sinusoidal"),
        "table3-B2": (6, 512, 2048, 8, 32, 64, 0.1, 0.1, "sinusoidal"),
        "table3-C1": (2, 512, 2048, 8, 64, 64, 0.1, 0.1, "sinusoidal"),
        "table3-C2": (4, 512, 2048, 8, 64, 64, 0.1, 0.1, "sinusoidal"),
        "table3-C3": (8, 512, 2048, 8, 64, 64, 0.1, 0.1, "sinusoidal"),
        "table3-C4": (6, 256, 2048, 8, 32, 32, 0.1, 0.1, "sinusoidal"),
        "table3-C5": (6, 1024, 2048, 8, 128, 128, 0.1, 0.1, "sinusoidal"),
        "table3-C6": (6, 512, 1024, 8, 64, 64, 0.1, 0.1, "sinusoidal"),
        "table3-C7": (6, 512, 4096, 8, 64, 64, 0.1, 0.1, "sinusoidal"),
        "table3-D1": (6, 512, 2048, 8, 64, 64, 0.0, 0.1, "sinusoidal"),
        "table3-D2": (6, 512, 2048, 8, 64, 64, 0.2, 0.1, "sinusoidal"),
        "table3-D3": (6, 512, 2048, 8, 64, 64, 0.1, 0.0, "sinusoidal"),
        "table3-D4": (6, 512, 2048, 8, 64, 64, 0.1, 0.2, "sinusoidal"),
        "table3-E": (6, 512, 2048, 8, 64, 64, 0.1, 0.1, "learned"),
    }
    for name, row in rows.items():
        c = PRESETS[name]
        assert c.encoder_layers == c.decoder_layers and not c.pre_norm, name
        got = (c.encoder_layers, c.d_model, c.d_ff, c.heads, c.key_dim, c.value_dim, c.dropout,
               c.label_smoothing, c.positions)
        assert got == row, name


def test_bad_configuration_and_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="not divisible by heads"):
        TransformerConfig(d_model=100, heads=3)
    with pytest.raises(ValueError, match="positions"):
        TransformerConfig(positions="rotary")
    with pytest.raises(ValueError, match="pad_id"):
        TransformerConfig(vocab_size=10, pad_id=10)
    for size in (0, 11):
        with pytest.raises(ValueError, match=r"output_vocab_size must be in \[1, vocab_size 10\]"):
            TransformerConfig(vocab_size=10, output_vocab_size=size)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        Transformer.from_preset("huge")
    model = make_model()
    with pytest.raises(ValueError, match="LongTensor"):
        model(torch.ones(2, 3), tokens(2, 3))
    with pytest.raises(ValueError, match="same shape"):
        model.loss(tokens(2, 3), tokens(2, 3), tokens(2, 4))
    with pytest.raises(ValueError, match="learned positions"):
        make_model(replace(TINY, positions="learned", max_len=4))(tokens(1, 5), tokens(1, 2))


def test_token_ids_outside_the_vocabulary_name_the_id_its_place_and_the_size():
    """One ValueError, before any embedding lookup (which raised `IndexError: index out of range
    in self`), in training, scoring and decoding (issue 50 item 9)."""
    model = make_model(VARIANTS["output_vocab"])
    src, tgt = tokens(2, 5), tokens(2, 4, seed=2) % 17
    bad_src = src.clone()
    bad_src[1, 3] = 9000
    message = r"source token id 9000 at \(batch 1, position 3\) is outside the vocabulary of 23"
    with pytest.raises(ValueError, match=message):
        model(bad_src, tgt)
    with pytest.raises(ValueError, match=message):
        model.loss(bad_src, tgt, tgt)
    decoder = Decoder(model)
    with pytest.raises(ValueError, match=message):
        decoder.beam_search(bad_src, bos_id=1, eos_id=2, max_len=3)
    with pytest.raises(ValueError, match=message):
        decoder.start(bad_src)
    bad_tgt = tgt.clone()
    bad_tgt[0, 2] = -1
    with pytest.raises(ValueError, match=r"target input token id -1 at \(batch 0, position 2\) "
                                         "is outside the vocabulary of 23"):
        model(src, bad_tgt)
    bad_tgt[0, 2] = 20  # inside the vocabulary, outside the output vocabulary of 17
    with pytest.raises(ValueError, match=r"target 20 is out of range for 17 classes \(the "
                                         r"output vocabulary\), at \(batch 0, position 2\)"):
        model.loss(src, tgt, bad_tgt)
    with pytest.raises(ValueError, match=r"target 20 is out of range for 17 classes"):
        rdrop_loss(model, src, tgt, bad_tgt, alpha=1.0)
    state = decoder.start(src)
    with pytest.raises(ValueError, match="decoder input token id 23 at row 1 is outside the "
                                         "vocabulary of 23"):
        decoder.step(torch.tensor([1, 23]), state)
    decoder.step(torch.tensor([1, 22]), state)  # the last id is in


# float32 runs the attention op (fastattn._C, or the Triton kernels under the interpreter), so
# attention_packed's own backward; float64 runs PyTorch's attention, through the views.
@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32,
                                                               marks=pytest.mark.triton)])
@pytest.mark.parametrize("cfg", [TINY, VARIANTS["d_k_ne_d_v"], replace(TINY, decoder_layers=3)])
def test_the_gpu_forms_equal_the_ops_one_by_one(cfg, dtype, monkeypatch):
    """What a GPU runs to spare launches (fastattn.fused_model, outside its PER_OP_DEVICES),
    forced on the CPU: memory_projections, every decoder layer's kv weights side by side in one
    product, gives the keys and values of one product per layer, and with the feed-forward's
    ReLU in its first product and attention on the packed projections
    (ops.attention.attention_packed, where d_k = d_v: its backward writes q's, k's and v's
    gradients into one buffer) the loss and the gradients of the ops one by one (float64: to
    rounding; float32: to float32's)."""
    model = make_model(replace(cfg, dropout=0.0)).to(dtype).train()
    src, tgt = pad_after(tokens(3, 7), [7, 4, 2]), pad_after(tokens(3, 6, seed=2), [6, 5, 3])
    packed_backward = []  # the backward each attention_packed call's output leads to
    real_attention_packed = fastattn.fused_model.attention_packed

    def attention_packed(*args, **kwargs):
        out = real_attention_packed(*args, **kwargs)
        packed_backward.append(type(out.grad_fn).__name__)
        return out

    monkeypatch.setattr(fastattn.fused_model, "attention_packed", attention_packed)
    results = []
    for per_op in (("cpu",), ()):
        monkeypatch.setattr(fastattn.fused_model, "PER_OP_DEVICES", per_op)
        model.zero_grad(set_to_none=True)
        memory, _ = model.encode(src)
        projections = ([layer.cross_attention.kv(memory) for layer in model.decoder.layers]
                       if per_op else fastattn.fused_model.memory_projections(model, memory))
        kv = [t for p, layer in zip(projections, model.decoder.layers, strict=True)
              for t in layer.cross_attention.split_kv(p)]
        packed_backward.clear()
        loss = model.loss(src, tgt[:, :-1], tgt[:, 1:])
        (loss * 2.5).backward()
        results.append((kv, loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (kv, loss, grads), (kv_one, loss_one, grads_one) = results
    assert len(kv) == 2 * cfg.decoder_layers
    packed = cfg.key_dim == cfg.value_dim  # the GPU forms' loss: every sub-layer's attention
    assert len(packed_backward) == packed * (cfg.encoder_layers + 2 * cfg.decoder_layers)
    if implementation("attention", "cpu", dtype, requires_grad=True) != "torch":
        assert all(name == "_PackedAttentionBackward" for name in packed_backward)
    exact = dtype == torch.float64
    tolerance = dict(rtol=1e-12, atol=1e-12) if exact else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(kv, kv_one, strict=True):
        torch.testing.assert_close(a, b, **tolerance)
    torch.testing.assert_close(loss, loss_one, **tolerance)
    if exact:
        tolerance = dict(rtol=1e-10, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_one[name], msg=name, **tolerance)
