"""fastattn::transformer_encode (csrc/encoder.cpp), decoding's encoder in one native call: bit for
bit what the Python modules compute (float32, float64; int8 and bf16 against their references in
tests/test_decoding_precision.py), on odd shapes, padding, a sentence of padding only, d_k != d_v
and learned positions; the path decoding takes; its errors."""

from dataclasses import replace

import pytest
import torch

from fastattn.inference import Decoder
from fastattn.inference.decoder import encode
from fastattn.inference.native import NATIVE_ENCODE, convert
from fastattn.model import Transformer, TransformerConfig

pytestmark = pytest.mark.skipif(not NATIVE_ENCODE, reason="fastattn._C is not built")
TINY = TransformerConfig(vocab_size=61, encoder_layers=3, decoder_layers=2, d_model=24, d_ff=40,
                         heads=3, dropout=0.0, pad_id=0)


def make_model(cfg=TINY, dtype=torch.float32):
    torch.manual_seed(0)
    model = Transformer(cfg).eval().to(dtype)
    with torch.no_grad():  # LayerNorms and biases away from their initial 1 and 0
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def source(batch, length, lengths=None, vocab=TINY.vocab_size):
    src = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(2))
    for i, n in enumerate(lengths or []):
        src[i, n:] = 0
    return src


CASES = {
    "one token": (TINY, 1, 1, None),
    "padded": (TINY, 5, 17, [17, 1, 9, 16, 3]),
    "padding only": (TINY, 3, 7, [7, 0, 2]),
    "d_k != d_v": (replace(TINY, d_k=5, d_v=11), 2, 9, [9, 4]),
    "learned positions": (replace(TINY, positions="learned", max_len=128), 2, 97, [97, 50]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(CASES))
def test_native_encoder_equals_the_python_modules_bit_for_bit(at_every_cpu_isa, case, dtype):
    cfg, batch, length, lengths = CASES[case]
    model = make_model(cfg, dtype)
    src = source(batch, length, lengths)
    with torch.inference_mode():
        native = convert(model).encode(src)
        python = encode(model, src)
    for got, expected in zip(native[0] + native[1], python[0] + python[1], strict=True):
        assert got.shape == expected.shape and got.dtype == dtype
        assert torch.equal(got, expected)
    assert torch.equal(native[2], python[2]) and native[2].shape == (batch, 1, 1, length)


def test_decoding_encodes_natively(monkeypatch):
    """On CPU the search encodes through the native op: the Python encoder is never called,
    and the hypotheses are those of the Python encoder."""
    model = make_model()
    src = source(4, 11, [11, 3, 8, 6])
    options = dict(beam_size=3, bos_id=1, eos_id=2, max_len=8)
    expected = Decoder(model).beam_search(src, **options)

    def refuse(*args):
        raise AssertionError("the Python encoder ran")

    monkeypatch.setattr(model.encoder, "forward", refuse)
    got = Decoder(model).beam_search(src, **options)
    assert [[(h.tokens, h.score) for h in hyps] for hyps in got] == \
        [[(h.tokens, h.score) for h in hyps] for hyps in expected]


def test_models_the_native_decoder_refuses_encode_in_python(monkeypatch):
    """A pre-norm model (which the native decoder does not compute) encodes in Python."""
    model = make_model(replace(TINY, pre_norm=True))
    calls = []
    forward = model.encoder.forward
    monkeypatch.setattr(model.encoder, "forward", lambda *a: calls.append(1) or forward(*a))
    Decoder(model).start(source(2, 5))
    assert calls == [1]


def test_transformer_encode_errors():
    model = make_model()
    weights = convert(model).weights
    src = source(2, 5)
    embedding = model.embedding

    def call(src=src, positions=None, params=weights.encoder, packed=weights.encoder_packed,
             memory=weights.memory, memory_packed=weights.memory_packed, weight=None):
        return torch.ops.fastattn.transformer_encode(
            src, embedding.weight.detach() if weight is None else weight,
            embedding.positions(0, src.shape[1]) if positions is None else positions,
            embedding.scale, 0, TINY.heads, TINY.key_dim, params, packed, memory, memory_packed,
            1e-5)

    call()  # the valid call
    with pytest.raises(RuntimeError, match="src must be a \\(B, S\\) int64 tensor with S > 0"):
        call(src=src.int())
    with pytest.raises(RuntimeError, match="src must be a \\(B, S\\) int64 tensor with S > 0"):
        call(src=src[:, :0], positions=embedding.positions(0, 0))
    with pytest.raises(RuntimeError, match="positions \\(S, d\\) must share d, with S src's"):
        call(positions=embedding.positions(0, 4))
    with pytest.raises(RuntimeError, match="need 12 parameters per encoder layer and 2 per"):
        call(params=weights.encoder[:-1])
    with pytest.raises(RuntimeError, match="must be float32 or float64, got Half"):
        call(weight=embedding.weight.detach().half())
    int8 = convert(model, "int8").weights
    with pytest.raises(RuntimeError, match="packed and memory_packed must both be empty or"):
        call(packed=int8.encoder_packed)
    with pytest.raises(RuntimeError, match="packed and memory_packed must both be empty or"):
        call(packed=int8.encoder_packed[:-1], memory_packed=int8.memory_packed)
    call(packed=int8.encoder_packed, memory_packed=int8.memory_packed)
    double = make_model(dtype=torch.float64)
    with pytest.raises(RuntimeError, match="int8 and bf16 weights need a float32 model"):
        torch.ops.fastattn.transformer_encode(
            src, double.embedding.weight.detach(), double.embedding.positions(0, 5),
            double.embedding.scale, 0, TINY.heads, TINY.key_dim,
            convert(double).weights.encoder, int8.encoder_packed,
            convert(double).weights.memory, int8.memory_packed, 1e-5)
