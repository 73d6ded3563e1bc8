"""fastattn._C's decoding ops on CPU: decode_attention (one step's attention, keys read in place or
through per-key cache rows) against the float64 explicit product, the model's step_attention on
either path, and decoder_step's argument checks (its results are tested against the PyTorch path
in test_model's cached-decoding tests)."""

import math
import re
from pathlib import Path

import pytest
import torch

import fastattn.inference.native  # loads fastattn._C, which registers the ops
from fastattn._native import cpu_isa, set_cpu_isa, supported_cpu_isas
from fastattn.inference import Decoder
from fastattn.inference.decoder import step_attention
from fastattn.inference.native import (
    DECODER_LAYER_SLOTS,
    ENCODER_LAYER_SLOTS,
    NATIVE_STEP_ATTENTION,
    convert,
    supports,
)
from fastattn.model import Transformer

pytestmark = pytest.mark.skipif(not NATIVE_STEP_ATTENTION, reason="fastattn._C is not built")


def reference(q, k, v, bias, scale):
    q, k, v = q.double(), k.double(), v.double()
    scores = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.double()[:, None, None, :]
    empty = (scores == -math.inf).all(-1, keepdim=True)
    p = scores.masked_fill(empty, 0.0).softmax(-1).masked_fill(empty, 0.0)
    return p @ v


def inputs(groups, heads, rows, keys, d_k, d_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(groups, heads, rows, d_k, generator=g, dtype=dtype)
    # Keys and values as slices of a larger cache, like the decoder's preallocated ones.
    k = torch.randn(groups, heads, keys + 5, d_k, generator=g, dtype=dtype)[:, :, :keys]
    v = torch.randn(groups, heads, keys + 5, d_v, generator=g, dtype=dtype)[:, :, :keys]
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "groups,heads,rows,keys,d_k,d_v",
    [(1, 1, 1, 1, 8, 8), (3, 4, 1, 17, 32, 32), (2, 2, 4, 97, 16, 24), (5, 1, 3, 1023, 64, 64)],
)
def test_matches_float64_reference(at_every_cpu_isa, groups, heads, rows, keys, d_k, d_v, dtype):
    q, k, v = inputs(groups, heads, rows, keys, d_k, d_v, dtype)
    bias = torch.zeros(groups, keys, dtype=dtype)
    bias[0, keys // 2:] = -math.inf  # padding of the first group's source
    for b in (None, bias):
        out = torch.ops.fastattn.decode_attention(q, k, v, b, 0.3)
        assert out.shape == (groups, heads, rows, d_v) and out.dtype == dtype
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.double(), reference(q, k, v, b, 0.3), **tol)


def test_fully_masked_row_reads_zeros(at_every_cpu_isa):
    q, k, v = inputs(2, 2, 1, 5, 8, 8, torch.float32)
    bias = torch.zeros(2, 5)
    bias[1] = -math.inf
    out = torch.ops.fastattn.decode_attention(q, k, v, bias, 1.0)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("keys", [1, 5, 19])
def test_nan_in_a_query_row_gives_nan_in_that_row(at_every_cpu_isa, dtype, keys):
    """As softmax (and the explicit product) does: the running max skips a NaN score, so a row
    of NaN scores used to read as one with no key, zeros. Fully masked rows still read zeros,
    and a NaN score among finite ones, or beside -inf ones, makes the row NaN too."""
    q, k, v = inputs(2, 2, 3, keys, 8, 8, dtype)
    q[0, 1, 2, 5] = math.nan
    bias = torch.zeros(2, keys, dtype=dtype)
    bias[1] = -math.inf  # group 1 has no key
    out = torch.ops.fastattn.decode_attention(q, k, v, bias, 0.5)
    nan_rows = out.isnan().any(-1)
    assert nan_rows[0, 1, 2] and out[0, 1, 2].isnan().all() and nan_rows.sum() == 1
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    finite = reference(q, k, v, bias, 0.5)
    torch.testing.assert_close(out[0, 0].double(), finite[0, 0], rtol=1e-5, atol=1e-5)
    q, bias = inputs(1, 1, 1, keys, 8, 8, dtype)[0], torch.full((1, keys), -math.inf, dtype=dtype)
    bias[0, -1] = math.nan  # the one score not -inf is NaN
    assert torch.ops.fastattn.decode_attention(q, k[:1, :1], v[:1, :1], bias, 0.5).isnan().all()


def test_step_attention_native_equals_explicit_product(at_every_cpu_isa, monkeypatch):
    """The model's two paths agree (the bias as the decoder keeps it, (G, 1, 1, L)): the native
    op and the explicit product (ops.attention.attention_probabilities) other devices run."""
    q, k, v = inputs(3, 4, 2, 11, 16, 16, torch.float64)
    bias = torch.zeros(3, 1, 1, 11, dtype=torch.float64)
    bias[2, ..., 7:] = -math.inf
    native = step_attention(q, k, v, bias)
    explicit = torch.matmul(
        (torch.matmul(q * 16**-0.5, k.transpose(-2, -1)) + bias).softmax(-1), v)
    torch.testing.assert_close(native, explicit, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(fastattn.inference.native, "NATIVE_STEP_ATTENTION", False)
    torch.testing.assert_close(step_attention(q, k, v, bias), explicit, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, k, v, b: (q[0], k, v, b), "must be 4-D"),
        (lambda q, k, v, b: (q, k[:1], v, b), "must be \\(G, H, R, Dk\\)"),
        (lambda q, k, v, b: (q.half(), k.half(), v.half(), b), "float32 or all float64"),
        (lambda q, k, v, b: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, b),
         "unit stride"),
        (lambda q, k, v, b: (q, k, v, b[:, :3]), "bias must be \\(P, L\\)"),
    ],
)
def test_bad_input_errors(change, message):
    q, k, v = inputs(2, 2, 1, 5, 8, 8, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fastattn.decode_attention(*change(q, k, v, torch.zeros(2, 5)), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keys_read_through_cache_rows(at_every_cpu_isa, dtype):
    """rows[g, j] names the cache row holding key j of group g (beam search's shared prefixes);
    the bias follows the key's row."""
    g = torch.Generator().manual_seed(3)
    cache_rows, groups, keys = 6, 4, 9
    q = torch.randn(groups, 2, 1, 16, generator=g, dtype=dtype)
    k = torch.randn(cache_rows, 2, keys + 3, 16, generator=g, dtype=dtype)
    v = torch.randn(cache_rows, 2, keys + 3, 8, generator=g, dtype=dtype)
    rows = torch.randint(0, cache_rows, (groups, keys), generator=g)
    bias = torch.zeros(cache_rows, keys + 3, dtype=dtype)
    bias[2, 4:] = -math.inf
    positions = torch.arange(keys)
    gathered_k, gathered_v = (c[rows, :, positions].transpose(1, 2) for c in (k, v))
    gathered_bias = bias[rows, positions]
    out = torch.ops.fastattn.decode_attention(q, k, v, bias, 0.25, rows)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.double(), reference(q, gathered_k, gathered_v, gathered_bias,
                                                       0.25), **tol)
    with pytest.raises(RuntimeError, match="rows outside 0..5"):
        torch.ops.fastattn.decode_attention(q, k, v, None, 0.25, rows + cache_rows)


def test_softmax_weights_over_a_wide_range_of_scores(at_every_cpu_isa):
    """Scores from -100 to 0: every weight within float32 rounding of softmax (the vectorised
    exp), and weights below float32's range exactly 0."""
    keys = 200
    scores = torch.linspace(-100, 0, keys)
    out = torch.ops.fastattn.decode_attention(torch.ones(1, 1, 1, 1), scores.view(1, 1, keys, 1),
                                              torch.eye(keys).view(1, 1, keys, keys), None, 1.0)
    expected = scores.double().softmax(0)
    out = out.view(-1).double()
    normal = expected > 1e-36
    torch.testing.assert_close(out[normal], expected[normal], rtol=3e-7, atol=0)
    assert torch.all(out[~normal] < 1e-36)


def test_decoder_step_bad_input_errors():
    model = Transformer.from_preset("tiny", vocab_size=30).eval()
    decoder = Decoder(model)
    state = decoder.start(torch.randint(3, 30, (2, 5)))
    decoder.step(torch.ones(2, dtype=torch.long), state)
    weights = convert(model).weights
    params, panels = weights.decoder, weights.packed
    x = torch.randn(2, model.cfg.d_model)
    history = state.history.clone()
    args = (state.self_k, state.self_v, history, 1, state.memory_k, state.memory_v, None, None,
            panels, 1e-5)
    with pytest.raises(RuntimeError, match=f"need {len(DECODER_LAYER_SLOTS)} parameters"):
        torch.ops.fastattn.decoder_step(x, params[:-1], *args)
    history[0, 0] = 7
    with pytest.raises(RuntimeError, match="history holds rows outside"):
        torch.ops.fastattn.decoder_step(x, params, *args)
    with pytest.raises(RuntimeError, match="float32 or all float64"):
        torch.ops.fastattn.decoder_step(x.double(), params, *args)
    with pytest.raises(RuntimeError, match="packed must be empty or hold 6"):
        torch.ops.fastattn.decoder_step(x, params, *args[:-2], panels[:-1], 1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 17, 32, 33, 97])
@pytest.mark.parametrize("out_features, in_features", [(1, 8), (17, 17), (97, 64), (1023, 128)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_linear_matches_fp64(at_every_cpu_isa, rows, out_features, in_features, with_bias):
    """fastattn::linear through the panels (AVX2 and AVX-512: any rows; the baseline level: up to
    32) and through ATen (the baseline level from 33 rows at these depths)."""
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    out = torch.ops.fastattn.linear(x, weight, torch.ops.fastattn.pack_linear_weight(weight),
                                    bias)
    expected = torch.nn.functional.linear(x.double(), weight.double(),
                                          None if bias is None else bias.double())
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_packed_linear_bad_input_errors():
    weight = torch.randn(20, 8)
    with pytest.raises(RuntimeError, match="weight must be a float32"):
        torch.ops.fastattn.pack_linear_weight(weight.double())
    with pytest.raises(RuntimeError, match="packed must be pack_linear_weight"):
        torch.ops.fastattn.linear(torch.randn(2, 8), weight,
                                  torch.ops.fastattn.pack_linear_weight(weight[:16]), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        torch.ops.fastattn.linear(torch.randn(2, 8), weight,
                                  torch.ops.fastattn.pack_linear_weight(weight), torch.randn(3))



@pytest.mark.parametrize("vocab", [1, 17, 97, 1023, 8000])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_log_softmax_linear_matches_fp64(at_every_cpu_isa, rows, vocab):
    """fastattn::log_softmax_linear (the decoding step's output) against float64: one block of
    rows, several blocks, and a wide range of logits (x through an identity weight)."""
    x = torch.randn(rows, 64)
    weight = torch.randn(vocab, 64) / 4
    expected = torch.log_softmax(x.double() @ weight.double().T, dim=-1)
    out = torch.ops.fastattn.log_softmax_linear(
        x, weight, torch.ops.fastattn.pack_linear_weight(weight))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    logits = torch.randn(rows, vocab) * 30
    identity = torch.eye(vocab)
    out = torch.ops.fastattn.log_softmax_linear(
        logits, identity, torch.ops.fastattn.pack_linear_weight(identity))
    torch.testing.assert_close(out.double(), torch.log_softmax(logits.double(), -1), rtol=2e-6,
                               atol=2e-5)


def test_log_softmax_linear_propagates_nan_and_keeps_other_dtypes(at_every_cpu_isa):
    x, weight = torch.randn(20, 8), torch.randn(50, 8)
    x[1, 3] = float("nan")
    out = torch.ops.fastattn.log_softmax_linear(x, weight,
                                                torch.ops.fastattn.pack_linear_weight(weight))
    assert out[1].isnan().all() and not out[[0, *range(2, 20)]].isnan().any()
    expected = torch.log_softmax(x[:3].double() @ weight.double().T, -1)
    out = torch.ops.fastattn.log_softmax_linear(x[:3].double(), weight.double(), None)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9, equal_nan=True)


VECTOR_ISAS = [level for level in supported_cpu_isas() if level != "scalar"]


@pytest.mark.skipif(len(VECTOR_ISAS) < 2,
                    reason="this CPU (or FASTATTN_CPU_ISA) has one vector level")
@pytest.mark.parametrize("rows", [1, 7, 17, 40])
def test_log_softmax_linear_is_the_same_bits_at_every_vector_level(rows):
    """AVX2's 8-float and AVX-512's 16-float panels sum each output over the inputs in the same
    order with the same multiply-adds, and the log-sum-exp's exponentials are the same lane by
    lane (AVX-512's one 16-lane pass, AVX2's two 8-lane halves): the same bits."""
    x = torch.randn(rows, 128)
    weight = torch.randn(5455, 128) / 4
    packed = torch.ops.fastattn.pack_linear_weight(weight)
    before = cpu_isa()
    try:
        outs = {level: torch.ops.fastattn.log_softmax_linear(x, weight, packed)
                for level in VECTOR_ISAS if set_cpu_isa(level) == level}
    finally:
        set_cpu_isa(before)
    first = next(iter(outs.values()))
    for level, out in outs.items():
        assert torch.equal(out, first), level


@pytest.mark.parametrize("stack", ["decoder", "encoder"])
def test_layer_slots_match_the_native_layout(stack):
    """fastattn.inference.native.DECODER_LAYER_SLOTS and ENCODER_LAYER_SLOTS name
    csrc/layer_slots.h's DecoderLayerSlot and EncoderLayerSlot enums: the same slots, in the
    same order, as many; and each names a layer's tensor."""
    header = (Path(__file__).parents[1] / "csrc" / "layer_slots.h").read_text()
    enum = f"{stack.capitalize()}LayerSlot"
    body = re.search(rf"enum {enum}[^{{]*\{{(.*?)\}};", header, re.S).group(1)
    enumerators = re.findall(r"^\s*(k\w+),", body, re.M)
    assert enumerators[-1] == f"k{enum}s"  # the count, last

    def camel(slot: str) -> str:  # "self_attention.qkv.weight" -> "kSelfQkvWeight"
        words = slot.replace("_attention", "").replace(".norm.", ".").replace("feed_forward",
                                                                               "feedForward")
        return "k" + "".join(w[0].upper() + w[1:] for w in re.split(r"[._]", words))

    slots = DECODER_LAYER_SLOTS if stack == "decoder" else ENCODER_LAYER_SLOTS
    assert [camel(slot) for slot in slots] == enumerators[:-1]
    model = Transformer.from_preset("tiny")
    layer = dict(getattr(model, stack).layers[0].named_parameters())
    # All but the encoder-memory projection, which the encoder's call applies once.
    unused = {"cross_attention.kv.weight", "cross_attention.kv.bias"} if stack == "decoder" \
        else set()
    assert set(layer) - set(slots) == unused
    assert set(slots) <= set(layer)
    # Each weight is followed by its bias (csrc/encoder.cpp reads them in pairs).
    assert all(slots[i + 1] == slots[i].replace(".weight", ".bias")
               for i in range(0, len(slots), 2))


@pytest.mark.parametrize("case", ["pre_norm", "bfloat16"])
def test_models_the_native_decoder_does_not_cover_decode_in_python(case, monkeypatch):
    """A pre-norm model or a dtype other than float32/64: native.supports gives the reason,
    and Decoder.step and beam_search return exactly what the Python path returns."""
    model = Transformer.from_preset("tiny", vocab_size=30, pre_norm=case == "pre_norm").eval()
    if case == "bfloat16":
        model = model.to(torch.bfloat16)
    src = torch.randint(3, 30, (2, 5), generator=torch.Generator().manual_seed(0))
    assert supports(model, model.embedding.weight) is not None

    def decode():
        decoder = Decoder(model)
        state = decoder.start(src)
        steps = [decoder.step(torch.full((2,), t), state) for t in (1, 5, 7)]
        hyps = decoder.beam_search(src, beam_size=2, bos_id=1, eos_id=2, max_len=6)
        return steps, [[(h.tokens, h.score) for h in hs] for hs in hyps]

    chosen = decode()
    monkeypatch.setattr(fastattn.inference.native, "NATIVE_DECODER_STEP", False)
    monkeypatch.setattr(fastattn.inference.native, "NATIVE_BEAM_SEARCH", False)
    python = decode()
    assert all(torch.equal(a, b) for a, b in zip(chosen[0], python[0], strict=True))
    assert chosen[1] == python[1]


def test_the_paper_model_on_cpu_decodes_natively():
    model = Transformer.from_preset("tiny", vocab_size=30).eval()
    assert supports(model, model.embedding.weight) is None
    assert supports(model, model.embedding.weight.double()) is None
