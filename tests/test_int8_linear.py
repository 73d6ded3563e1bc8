"""int8 decoding (csrc/int8_linear.h): the quantized linear ops against a PyTorch reference of
the same quantization (exact int32 sums, so agreement to float rounding), against float32
(the quantization error), the scalar fallback against the VNNI kernel bit for bit, and
Transformer.beam_search / decode_step with precision="int8"."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import fastattn.decoding
from fastattn.decoding import NATIVE_INT8
from fastattn.model import Transformer, TransformerConfig

pytestmark = pytest.mark.skipif(not NATIVE_INT8, reason="fastattn._C is not built")
ops = torch.ops.fastattn if NATIVE_INT8 else None


def quantized(x):
    """Symmetric per-row int8 as the kernels quantize: (q float64 in -127..127, scale)."""
    amax = x.abs().amax(1)
    # 127 / amax correctly rounded, as the kernels divide (torch's scalar / tensor multiplies by
    # a reciprocal, which moves a tie or two to the next integer).
    inverse = (torch.full_like(amax, 127) / amax).nan_to_num(0, 0, 0)
    q = torch.round(x * inverse[:, None]).clamp(-127, 127)
    return q.double(), amax / 127


def reference_logits(x, w, bias=None):
    """The int8 product in float64 integers, scaled back in float32 as the kernel does."""
    qx, sx = quantized(x)
    qw, sw = quantized(w)
    y = (qx @ qw.T).float() * (sx[:, None] * sw[None, :])
    return y if bias is None else y + bias


def case(rows, inputs, outputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inputs, generator=g), torch.randn(outputs, inputs, generator=g),
            torch.randn(outputs, generator=g))


SHAPES = [(1, 17, 33), (5, 64, 16), (6, 97, 100), (13, 1, 17), (37, 128, 97), (256, 512, 2048)]


@pytest.mark.parametrize(("rows", "inputs", "outputs"), SHAPES)
def test_quantize_linear_weight_matches_reference(rows, inputs, outputs):
    _, w, _ = case(rows, inputs, outputs)
    w[min(3, outputs - 1)] = 0  # a zero row: scale 0, no NaN
    panels, scales, sums = ops.quantize_linear_weight(w)
    q, scale = quantized(w)
    assert panels.shape == (-(-outputs // 16), -(-inputs // 4), 16, 4)
    assert torch.equal(scales, scale)
    assert torch.equal(sums, q.sum(1).int())
    # The layout: qw[o, d] = panels[o // 16, d // 4, o % 16, d % 4], zero past O and D.
    unpacked = panels.permute(0, 2, 1, 3).reshape(panels.shape[0] * 16, -1)
    assert torch.equal(unpacked[:outputs, :inputs].double(), q)
    assert not unpacked[outputs:].any() and not unpacked[:, inputs:].any()
    rows_read = torch.tensor([0, outputs - 1, outputs // 2])
    assert torch.equal(ops.dequantize_rows(panels, scales, rows_read, inputs),
                       (q[rows_read] * scale[rows_read, None].double()).float())


@pytest.mark.parametrize(("rows", "inputs", "outputs"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_int8_matches_its_reference_and_float32(rows, inputs, outputs, with_bias):
    x, w, bias = case(rows, inputs, outputs)
    bias = bias if with_bias else None
    out = ops.linear_int8(x, *ops.quantize_linear_weight(w), bias)
    torch.testing.assert_close(out, reference_logits(x, w, bias), rtol=1e-6, atol=1e-5)
    exact = torch.nn.functional.linear(x.double(), w.double(),
                                       None if bias is None else bias.double())
    # Two roundings to 1/254 of a row's range: a few percent of the largest output at most.
    assert (out.double() - exact).abs().max() <= 0.05 * exact.abs().max()


@pytest.mark.parametrize(("rows", "outputs"), [(1, 37), (4, 16), (17, 1000), (33, 8000)])
def test_log_softmax_linear_int8(rows, outputs):
    x, w, _ = case(rows, 64, outputs, seed=1)
    out = ops.log_softmax_linear_int8(x, *ops.quantize_linear_weight(w))
    expected = torch.log_softmax(reference_logits(x, w).double(), -1)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=3e-5)


def test_int8_edges():
    x, w, bias = case(3, 20, 40)
    x[1] = 0
    x[2, 5] = float("nan")
    parts = ops.quantize_linear_weight(w)
    out = ops.linear_int8(x, *parts, bias)
    assert torch.equal(out[1], bias)  # a zero row gives the bias exactly
    assert out[2].isnan().all() and not out[:2].isnan().any()
    assert ops.linear_int8(x[:0], *parts, bias).shape == (0, 40)
    with pytest.raises(RuntimeError, match=r"ceil\(D / 4\) = 5"):
        ops.linear_int8(torch.randn(3, 24), *parts, None)
    with pytest.raises(RuntimeError, match="row 40 is outside 0..39"):
        ops.dequantize_rows(parts[0], parts[1], torch.tensor([40]), 20)
    with pytest.raises(RuntimeError, match="float32"):
        ops.quantize_linear_weight(w.double())


SCALAR_RUN = """
import sys, torch, fastattn.decoding
ops = torch.ops.fastattn
x, w, b = torch.load(sys.argv[1])
parts = ops.quantize_linear_weight(w)
outs = [ops.linear_int8(x, *parts, None), ops.linear_int8(x, *parts, b),
        ops.log_softmax_linear_int8(x, *parts)]
torch.save((ops.int8_kernel(), outs), sys.argv[1])
"""


def test_scalar_kernel_computes_what_vnni_computes(tmp_path):
    """ATEN_CPU_CAPABILITY=default selects the scalar loop: the same integers, the same floats,
    bit for bit. (On a CPU without AVX-512 VNNI both sides run the scalar loop.) The inputs
    travel by file: ATen's own kernels, randn's included, round differently under that
    setting."""
    x, w, b = case(37, 97, 100)
    path = tmp_path / "io.pt"
    torch.save((x, w, b), path)
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    subprocess.run([sys.executable, "-c", SCALAR_RUN, str(path)], env=env, check=True)
    kernel, (plain, biased, log_softmax) = torch.load(path)
    assert kernel == "scalar"
    parts = ops.quantize_linear_weight(w)
    assert torch.equal(ops.linear_int8(x, *parts, None), plain)
    assert torch.equal(ops.linear_int8(x, *parts, b), biased)
    assert torch.equal(ops.log_softmax_linear_int8(x, *parts), log_softmax)


# -- the model ------------------------------------------------------------------------------

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


@pytest.mark.parametrize("output_vocab_size", [None, 61])
def test_int8_beam_search_native_equals_search_over_decode_step(output_vocab_size, monkeypatch):
    """The one native int8 search and fastattn.beam_search over int8 decode steps (what an
    ensemble runs) give the same tokens and scores, bit for bit, and int8 is not float32."""
    model = make_model(replace(TINY, output_vocab_size=output_vocab_size))
    options = dict(beam_size=4, nbest=2, bos_id=1, eos_id=2, max_len=10, alpha=0.6)

    def search(**extra):
        return [[(h.tokens, h.score) for h in hyps]
                for hyps in model.beam_search(source(), **options, **extra)]

    native = search(precision="int8")
    fp32 = search()
    monkeypatch.setattr(fastattn.decoding, "NATIVE_BEAM_SEARCH", False)
    assert search(precision="int8") == native
    assert native != fp32  # the int8 path ran: scores differ in their last digits at least
    close = [abs(a[0][1] - b[0][1]) for a, b in zip(native, fp32, strict=True)]
    assert max(close) < 0.5


def test_int8_decode_step_is_close_to_float32():
    model = make_model()
    src = source()
    states = {p: model.start_decoding(src, precision=p) for p in ("fp32", "int8")}
    tokens = torch.full((5,), 1)
    for _ in range(4):
        out = {p: model.decode_step(tokens, s) for p, s in states.items()}
        assert (out["int8"].exp() - out["fp32"].exp()).abs().max() < 0.02
        tokens = out["fp32"].argmax(-1)


def test_int8_weights_are_built_once_and_follow_the_weights():
    model = make_model()
    first = fastattn.decoding.native_decoder_weights(model, "int8")
    assert fastattn.decoding.native_decoder_weights(model, "int8") is first
    assert fastattn.decoding.native_decoder_weights(model, "fp32") is not first
    with torch.no_grad():
        model.decoder.layers[0].feed_forward.w1.weight.mul_(2)
    assert fastattn.decoding.native_decoder_weights(model, "int8") is not first


def test_precision_errors():
    model = make_model()
    with pytest.raises(ValueError, match="precision must be one of fp32, int8, got 'fp16'"):
        model.beam_search(source(), bos_id=1, eos_id=2, max_len=5, precision="fp16")
    pre_norm = make_model(replace(TINY, pre_norm=True))
    with pytest.raises(ValueError, match="precision int8 needs fastattn._C's CPU decoder: "
                                         "pre-norm"):
        pre_norm.start_decoding(source(), precision="int8")
    with pytest.raises(ValueError, match="int8 decoding computes in float32"):
        make_model().double().beam_search(source(), bos_id=1, eos_id=2, max_len=5,
                                          precision="int8")
