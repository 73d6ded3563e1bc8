"""int8 decoding's ops (csrc/int8_linear.h) against a PyTorch reference of the same
quantization (exact int32 sums, so agreement to float rounding) and against float32 (the
quantization error), at every instruction-set level this CPU runs. The decoder in int8:
tests/test_decoding_precision.py."""

from pathlib import Path

import pytest
import torch

import fastattn.inference.native  # noqa: F401 - loads fastattn._C, which registers the ops
from fastattn._native import set_cpu_isa, supported_cpu_isas
from fastattn.inference.native import NATIVE_INT8

pytestmark = pytest.mark.skipif(not NATIVE_INT8, reason="fastattn._C is not built")
ops = torch.ops.fastattn if NATIVE_INT8 else None
CPU_FLAGS = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])


def quantized(x, levels=127):
    """Symmetric per-row quantization as the kernels do it: (q float64, |q| <= levels; scale)."""
    amax = x.abs().amax(1)
    # levels / amax correctly rounded, as the kernels divide (torch's scalar / tensor multiplies
    # by a reciprocal, which moves a tie or two to the next integer).
    inverse = (torch.full_like(amax, levels) / amax).nan_to_num(0, 0, 0)
    q = torch.round(x * inverse[:, None]).clamp(-levels, levels)
    return q.double(), amax / levels


def row_levels():
    """The levels the kernel in use quantizes rows to: 7 bits on AVX2, whose vpmaddubsw would
    saturate on 8-bit rows; 8 bits elsewhere (weights always 8)."""
    return 63 if ops.int8_kernel() == "avx2" else 127


def reference_logits(x, w, bias=None):
    """The int8 product in float64 integers, scaled back in float32 as the kernel does."""
    qx, sx = quantized(x, row_levels())
    qw, sw = quantized(w)
    y = (qx @ qw.T).float() * (sx[:, None] * sw[None, :])
    return y if bias is None else y + bias


def case(rows, inputs, outputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inputs, generator=g), torch.randn(outputs, inputs, generator=g),
            torch.randn(outputs, generator=g))


# Rows 1 to 4 (one sentence's beam) take four panels at a time, then two, then one: 64, 80 and
# 100 outputs are 4, 5 and 7 panels.
SHAPES = [(1, 17, 33), (1, 33, 64), (3, 128, 80), (4, 65, 100), (5, 64, 16), (6, 97, 100),
          (13, 1, 17), (37, 128, 97), (256, 512, 2048)]


@pytest.mark.parametrize(("rows", "inputs", "outputs"), SHAPES)
def test_quantize_linear_weight_matches_reference(at_every_cpu_isa, rows, inputs, outputs):
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
def test_linear_int8_matches_its_reference_and_float32(at_every_cpu_isa, rows, inputs, outputs,
                                                       with_bias):
    x, w, bias = case(rows, inputs, outputs)
    bias = bias if with_bias else None
    out = ops.linear_int8(x, *ops.quantize_linear_weight(w), bias)
    torch.testing.assert_close(out, reference_logits(x, w, bias), rtol=1e-6, atol=1e-5)
    exact = torch.nn.functional.linear(x.double(), w.double(),
                                       None if bias is None else bias.double())
    # Two roundings to 1/254 of a row's range: a few percent of the largest output at most.
    assert (out.double() - exact).abs().max() <= 0.05 * exact.abs().max()


@pytest.mark.parametrize(("rows", "outputs"), [(1, 37), (4, 16), (17, 1000), (33, 8000)])
def test_log_softmax_linear_int8(at_every_cpu_isa, rows, outputs):
    x, w, _ = case(rows, 64, outputs, seed=1)
    out = ops.log_softmax_linear_int8(x, *ops.quantize_linear_weight(w))
    expected = torch.log_softmax(reference_logits(x, w).double(), -1)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=3e-5)


def test_int8_edges(at_every_cpu_isa):
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


@pytest.mark.parametrize("rows", [37, 3])  # blocks of 12, 6 and 1 rows; a few rows' path
def test_every_level_against_the_best(at_every_cpu_isa, rows):
    """Every level packs the same weight bytes. Levels that quantize rows alike (VNNI and the
    scalar loop: 8 bits) sum the same integers: the float32 scaling after the sums is contracted
    to multiply-adds on AVX2 and AVX-512, not on the baseline, one rounding of each output (2^-24
    of it); log_softmax's exp and log add a few: rtol = atol = 1e-6. AVX2's 7-bit rows differ
    from 8-bit ones by their quantization error: within 5% of the largest output, as against
    float32."""
    x, w, b = case(rows, 97, 100)
    parts = ops.quantize_linear_weight(w)
    outs = [ops.linear_int8(x, *parts, None), ops.linear_int8(x, *parts, b),
            ops.log_softmax_linear_int8(x, *parts)]
    assert ops.int8_kernel() == expected_kernel(at_every_cpu_isa)
    levels = row_levels()
    best = set_cpu_isa(supported_cpu_isas()[-1])
    best_parts = ops.quantize_linear_weight(w)
    for part, best_part in zip(parts, best_parts, strict=True):
        assert torch.equal(part, best_part), best
    best_outs = [ops.linear_int8(x, *parts, None), ops.linear_int8(x, *parts, b),
                 ops.log_softmax_linear_int8(x, *parts)]
    for out, best_out in zip(outs, best_outs, strict=True):
        if levels == row_levels():
            torch.testing.assert_close(out, best_out, rtol=1e-6, atol=1e-6)
        else:
            assert (out - best_out).abs().max() <= 0.05 * best_out.abs().max()


def expected_kernel(level):
    """The int8 dot product each level runs on this CPU."""
    if level == "amx":
        return "amx-int8"
    if level == "avx512" and "avx512_vnni" in CPU_FLAGS:
        return "avx512-vnni"
    return "scalar" if level == "scalar" else "avx2"


@pytest.mark.skipif("amx" not in supported_cpu_isas(), reason="this CPU (or FASTATTN_CPU_ISA) "
                    "runs no AMX")
@pytest.mark.parametrize(("rows", "inputs", "outputs"),
                         [(16, 64, 16), (17, 1, 17), (33, 97, 100), (100, 130, 33),
                          (256, 512, 2048)])
def test_amx_tiles_sum_what_vnni_sums(rows, inputs, outputs):
    """From 16 rows the amx level multiplies in tiles (whole blocks of 16 rows and 16 quads, then
    the rest) and scales back as VNNI does: every output and log-probability the same bits."""
    x, w, bias = case(rows, inputs, outputs, seed=2)
    parts = ops.quantize_linear_weight(w)
    before = set_cpu_isa("amx")
    try:
        outs = {}
        for level in ("amx", "avx512"):
            set_cpu_isa(level)
            outs[level] = [ops.linear_int8(x, *parts, bias), ops.linear_int8(x, *parts, None),
                           ops.log_softmax_linear_int8(x, *parts)]
    finally:
        set_cpu_isa(before)
    for amx, vnni in zip(outs["amx"], outs["avx512"], strict=True):
        assert torch.equal(amx, vnni)
