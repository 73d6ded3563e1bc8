"""bf16 decoding's ops (csrc/bf16_linear.h) against float64 products of the bfloat16-rounded
operands (the kernel sums in float32) and against float32 (the rounding error), at every
instruction-set level this CPU runs. The decoder in bf16: tests/test_decoding_precision.py."""

from pathlib import Path

import pytest
import torch

import fastattn.inference.native  # noqa: F401 - loads fastattn._C, which registers the ops
from fastattn._native import set_cpu_isa, supported_cpu_isas
from fastattn.inference.native import NATIVE_BF16

pytestmark = pytest.mark.skipif(not NATIVE_BF16, reason="fastattn._C is not built")
ops = torch.ops.fastattn if NATIVE_BF16 else None
CPU_FLAGS = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])


def case(rows, inputs, outputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inputs, generator=g), torch.randn(outputs, inputs, generator=g),
            torch.randn(outputs, generator=g))


def rounded_product(x, w, bias=None):
    """x · wᵀ of the bfloat16-rounded operands in float64 (+ bias)."""
    y = x.bfloat16().double() @ w.bfloat16().double().T
    return y if bias is None else y + bias.double()


SHAPES = [(1, 17, 33), (5, 64, 16), (6, 97, 100), (13, 1, 17), (37, 128, 97), (256, 512, 2048)]


@pytest.mark.parametrize(("rows", "inputs", "outputs"), SHAPES)
def test_pack_linear_weight_bf16_layout(at_every_cpu_isa, rows, inputs, outputs):
    _, w, _ = case(rows, inputs, outputs)
    panels = ops.pack_linear_weight_bf16(w)
    assert panels.shape == (-(-outputs // 16), -(-inputs // 2), 16, 2)
    assert panels.dtype == torch.bfloat16
    # bf16(w[o, d]) = panels[o // 16, d // 2, o % 16, d % 2], zero past O and D.
    unpacked = panels.permute(0, 2, 1, 3).reshape(panels.shape[0] * 16, -1)
    assert torch.equal(unpacked[:outputs, :inputs], w.bfloat16())
    assert not unpacked[outputs:].float().any() and not unpacked[:, inputs:].float().any()
    read = torch.tensor([0, outputs - 1, outputs // 2])
    assert torch.equal(ops.unpack_rows_bf16(panels, read, inputs), w.bfloat16()[read].float())


@pytest.mark.parametrize(("rows", "inputs", "outputs"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16_matches_the_rounded_product_and_float32(at_every_cpu_isa, rows, inputs,
                                                             outputs, with_bias):
    x, w, bias = case(rows, inputs, outputs)
    bias = bias if with_bias else None
    out = ops.linear_bf16(x, ops.pack_linear_weight_bf16(w), bias, outputs)
    expected = rounded_product(x, w, bias)
    # float32 sums of `inputs` exact products: a few ulps of the sum of magnitudes.
    magnitude = x.bfloat16().double().abs() @ w.bfloat16().double().abs().T
    assert ((out.double() - expected).abs() <= 1e-6 * magnitude + 1e-6).all()
    exact = torch.nn.functional.linear(x.double(), w.double(),
                                       None if bias is None else bias.double())
    # Two roundings to 8 significant bits: under a percent of the largest output.
    assert (out.double() - exact).abs().max() <= 0.01 * exact.abs().max()


@pytest.mark.parametrize(("rows", "outputs"), [(1, 37), (4, 16), (17, 1000), (33, 8000)])
def test_log_softmax_linear_bf16(at_every_cpu_isa, rows, outputs):
    x, w, _ = case(rows, 64, outputs, seed=1)
    out = ops.log_softmax_linear_bf16(x, ops.pack_linear_weight_bf16(w), outputs)
    expected = torch.log_softmax(rounded_product(x, w), -1)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=3e-5)


def test_bf16_edges(at_every_cpu_isa):
    x, w, bias = case(3, 20, 40)
    x[2, 5] = float("nan")
    panels = ops.pack_linear_weight_bf16(w)
    out = ops.linear_bf16(x, panels, bias, 40)
    assert out[2].isnan().all() and not out[:2].isnan().any()
    assert ops.linear_bf16(x[:0], panels, bias, 40).shape == (0, 40)
    with pytest.raises(RuntimeError, match=r"ceil\(D / 2\) = 10"):
        ops.linear_bf16(torch.randn(3, 24), panels, None, 40)
    with pytest.raises(RuntimeError, match="for O = 49"):  # 4 panels, not 3
        ops.linear_bf16(x, panels, None, 49)
    with pytest.raises(RuntimeError, match="row 48 is outside 0..47"):
        ops.unpack_rows_bf16(panels, torch.tensor([48]), 20)


def test_every_level_computes_what_avx512_bf16_computes(at_every_cpu_isa):
    """Below AVX-512 BF16 the AVX2 kernel and the scalar loop sum as vdpbf16ps does; the
    instruction flushes subnormal values to zero and they do not, so the levels agree to float32
    rounding, not bit for bit."""
    x, w, b = case(37, 97, 100)
    panels = ops.pack_linear_weight_bf16(w)
    outs = [ops.linear_bf16(x, panels, b, 100), ops.log_softmax_linear_bf16(x, panels, 100)]
    has_bf16 = "avx512_bf16" in CPU_FLAGS
    expected = {"amx": "amx-bf16", "avx512": "avx512-bf16" if has_bf16 else "avx2",
                "avx2": "avx2", "scalar": "scalar"}
    assert ops.bf16_kernel() == expected[at_every_cpu_isa]
    if at_every_cpu_isa == "amx":
        return  # AMX's sums: test_amx_tiles_sum_within_float32_rounding
    set_cpu_isa("avx512")  # or this CPU's best below it
    assert torch.equal(ops.pack_linear_weight_bf16(w), panels)
    best = [ops.linear_bf16(x, panels, b, 100), ops.log_softmax_linear_bf16(x, panels, 100)]
    for out, best_out in zip(outs, best, strict=True):
        torch.testing.assert_close(out, best_out, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif("avx2" not in supported_cpu_isas(), reason="this CPU has no AVX2")
@pytest.mark.parametrize(("rows", "inputs", "outputs"), SHAPES)
def test_avx2_sums_as_the_scalar_loop_bit_for_bit(rows, inputs, outputs):
    """The AVX2 kernel's fused multiply-adds round as the scalar loop's products and sums do (a
    product of bfloat16s is exact in float32): equal bits, every row-block size and last panel."""
    x, w, bias = case(rows, inputs, outputs, seed=2)
    panels = ops.pack_linear_weight_bf16(w)
    before = ops.cpu_isa()
    outs = {}
    try:
        for level in ("avx2", "scalar"):
            set_cpu_isa(level)
            outs[level] = (ops.linear_bf16(x, panels, bias, outputs),
                           ops.log_softmax_linear_bf16(x, panels, outputs))
    finally:
        set_cpu_isa(before)
    for avx2, scalar in zip(outs["avx2"], outs["scalar"], strict=True):
        assert torch.equal(avx2, scalar)


@pytest.mark.skipif("amx" not in supported_cpu_isas(), reason="this CPU (or FASTATTN_CPU_ISA) "
                    "runs no AMX")
@pytest.mark.parametrize(("rows", "inputs", "outputs"),
                         [(16, 64, 16), (17, 1, 17), (33, 97, 100), (100, 130, 33),
                          (256, 512, 2048)])
def test_amx_tiles_sum_within_float32_rounding(rows, inputs, outputs):
    """From 16 rows the amx level sums the same exact products (two bfloat16s multiply exactly in
    float32) in the tiles' order: each of the two sums of D terms rounds D times at most, so the
    outputs differ by at most D · 2^-23 · Σ_d |bf16(x) · bf16(w)| (log-probabilities by twice a
    row's largest such bound). Fewer rows run vdpbf16ps, bit for bit."""
    x, w, bias = case(rows, inputs, outputs, seed=2)
    panels = ops.pack_linear_weight_bf16(w)
    before = set_cpu_isa("amx")
    try:
        outs = {}
        for level in ("amx", "avx512"):
            set_cpu_isa(level)
            outs[level] = [ops.linear_bf16(x, panels, bias, outputs),
                           ops.log_softmax_linear_bf16(x, panels, outputs),
                           ops.linear_bf16(x[:15], panels, bias, outputs)]
    finally:
        set_cpu_isa(before)
    rounded = [t.bfloat16().double() for t in (x, w)]
    bound = inputs * 2.0 ** -23 * (rounded[0].abs() @ rounded[1].abs().T)
    (linear, log_probs, few), (linear_ref, log_probs_ref, few_ref) = outs["amx"], outs["avx512"]
    assert ((linear - linear_ref).abs() <= bound).all()
    assert ((log_probs - log_probs_ref).abs() <= 2 * bound.amax(1, keepdim=True) + 1e-6).all()
    assert torch.equal(few, few_ref)
