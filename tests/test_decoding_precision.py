"""The native decoder in int8 and bf16 (fastattn.inference.native.PRECISIONS): Decoder.beam_search's
one native call against fastattn.beam_search over Decoder.step (what an ensemble runs), the
distributions against float32's, the encoder's maps against references of the same rounding,
the weights built once per precision, and the errors."""

import copy
from dataclasses import replace

import pytest
import torch
from test_bf16_linear import rounded_product
from test_int8_linear import reference_logits
from torch import nn

import fastattn.inference.native
from fastattn.inference import Decoder
from fastattn.inference.decoder import encode
from fastattn.inference.native import NATIVE_BF16, NATIVE_INT8, convert
from fastattn.model import Transformer, TransformerConfig

pytestmark = pytest.mark.skipif(not (NATIVE_INT8 and NATIVE_BF16),
                                reason="fastattn._C is not built")
LOW = ["int8", "bf16"]
TINY = TransformerConfig(vocab_size=97, encoder_layers=2, decoder_layers=2, d_model=32, d_ff=48,
                         heads=4, dropout=0.0, pad_id=0)


def make_model(cfg=TINY):
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def source():
    src = torch.randint(3, TINY.vocab_size, (5, 9), generator=torch.Generator().manual_seed(1))
    for i, n in enumerate([9, 1, 4, 7, 2]):
        src[i, n:] = 0
    return src


@pytest.mark.parametrize("precision", LOW)
@pytest.mark.parametrize("output_vocab_size", [None, 61])
def test_native_search_equals_search_over_decode_step(precision, output_vocab_size,
                                                      monkeypatch):
    """The one native search and fastattn.beam_search over decode steps give the same tokens
    and scores, bit for bit, in int8 and bf16; and the precision really changes the numbers."""
    model = make_model(replace(TINY, output_vocab_size=output_vocab_size))
    options = dict(beam_size=4, nbest=2, bos_id=1, eos_id=2, max_len=10, alpha=0.6)

    def search(**extra):
        return [[(h.tokens, h.score) for h in hyps]
                for hyps in Decoder(model, **extra).beam_search(source(), **options)]

    native = search(precision=precision)
    fp32 = search()
    monkeypatch.setattr(fastattn.inference.native, "NATIVE_BEAM_SEARCH", False)
    assert search(precision=precision) == native
    assert native != fp32  # scores differ in their last digits at least
    assert max(abs(a[0][1] - b[0][1]) for a, b in zip(native, fp32, strict=True)) < 0.5
    assert max(max(h[0]) for hyps in native for h in hyps) < model.cfg.output_size


@pytest.mark.parametrize(("precision", "bound"), [("int8", 0.02), ("bf16", 0.005)])
def test_decode_step_is_close_to_float32(precision, bound):
    model = make_model()
    src = source()
    decoders = {p: Decoder(model, p) for p in ("fp32", precision)}
    states = {p: decoder.start(src) for p, decoder in decoders.items()}
    tokens = torch.full((5,), 1)
    for _ in range(4):
        out = {p: decoders[p].step(tokens, s) for p, s in states.items()}
        assert (out[precision].exp() - out["fp32"].exp()).abs().max() < bound
        tokens = out["fp32"].argmax(-1)


class RoundedLinear(nn.Module):
    """An nn.Linear through the tests' references of the int8 and bf16 products."""

    def __init__(self, linear, precision):
        super().__init__()
        self.linear, self.precision = linear, precision

    def forward(self, x):
        rows, (w, b) = x.reshape(-1, x.shape[-1]), (self.linear.weight, self.linear.bias)
        y = reference_logits(rows, w, b) if self.precision == "int8" else \
            rounded_product(rows, w, b).float()
        return y.view(*x.shape[:-1], -1)


@pytest.mark.parametrize("precision", LOW)
def test_the_encoder_and_memory_projections_compute_what_their_reference_does(precision):
    """Decoding in int8 and bf16 starts with the encoder's linear maps and each decoder layer's
    memory keys and values in that precision: against the float32 model with those maps through
    the references of tests/test_int8_linear.py and tests/test_bf16_linear.py."""
    model, src = make_model(), source()
    reference = copy.deepcopy(model)
    for module in [*reference.encoder.modules(), *reference.decoder.modules()]:
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and (module in reference.encoder.modules()
                                                 or name == "kv"):
                setattr(module, name, RoundedLinear(child, precision))
    with torch.inference_mode():
        got = convert(model, precision).encode(src)
        expected = encode(reference, src)  # the Python modules
        fp32 = encode(model, src)
    for a, b, c in zip(got[0] + got[1], expected[0] + expected[1], fp32[0] + fp32[1],
                       strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.equal(a, c)
        assert (a - c).abs().max() < (0.05 if precision == "int8" else 0.02) * c.abs().max()
    assert torch.equal(got[2], fp32[2])


@pytest.mark.parametrize("precision", LOW)
def test_weights_are_built_once_per_precision_and_follow_the_weights(precision):
    """A Decoder's engine is converted once and again when a weight changed (its version, or
    a new parameter); fused optimisers write the weights without a version bump, so a Decoder
    made after them (as each dev evaluation makes its Translator) converts afresh."""
    model = make_model()
    decoder = Decoder(model, precision)
    first = decoder.engine()
    assert decoder.engine() is first and first.precision == precision
    assert Decoder(model, "fp32").engine() is not first
    for change in (lambda: model.encoder.layers[1].feed_forward.w2.weight.mul_(2),
                   lambda: model.decoder.layers[0].self_attention_norm.norm.bias.add_(1)):
        with torch.no_grad():
            change()
        assert decoder.engine() is not first
        first = decoder.engine()
    model.encoder.layers[0].feed_forward.w1.bias = nn.Parameter(torch.zeros(TINY.d_ff))
    assert decoder.engine() is not first
    first = decoder.engine()
    assert Decoder(model, precision).engine() is not first


def test_precision_errors():
    model = make_model()
    with pytest.raises(ValueError, match="precision must be one of fp32, int8, bf16, got 'fp16'"):
        Decoder(model, "fp16")
    pre_norm = make_model(replace(TINY, pre_norm=True))
    for precision in LOW:
        with pytest.raises(ValueError, match=f"precision {precision} needs fastattn._C's CPU "
                                             "decoder: pre-norm"):
            Decoder(pre_norm, precision).start(source())
    with pytest.raises(ValueError, match="int8 decoding computes in float32"):
        Decoder(make_model().double(), "int8").beam_search(source(), bos_id=1, eos_id=2,
                                                           max_len=5)
