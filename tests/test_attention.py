"""fastattn.ops.attention against the fp64 reference (fastattn/ops/attention.py), on both backends:
FASTATTN_BACKEND=triton TRITON_INTERPRET=1 runs the Triton kernels, FASTATTN_BACKEND=torch the
PyTorch path."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import INTERPRETED, assert_graded_close

from fastattn.backend import implementation
from fastattn.kernels import attention as kernels
from fastattn.ops import attention, seeds
from fastattn.ops.attention import (
    _attention_forward_op,
    _dropout_keep_mask,
    attention_packed,
    attention_reference,
)

LOW_PRECISION = [torch.float16, torch.bfloat16]
NATIVE = implementation("attention", "cpu", torch.float32, requires_grad=True) == "fastattn._C"
# What the op runs on CPU: the Triton interpreter, or fastattn._C (with IMPL as the op's argument).
IMPL = implementation("attention", "cpu", torch.float32, requires_grad=True)
NATIVE_REASON = ("fastattn._C's CPU attention runs under FASTATTN_BACKEND=torch with the extension "
                 "built (the interpreter run tests the Triton kernels instead)")
# (Lq, Lk, D, causal): lengths 1, 17, 33, 65, 129, Lq != Lk both ways under each causal
# alignment, every head dim the issue names (interpreter time bounds the cross product).
CASES = [
    (1, 1, 16, False), (17, 33, 40, False), (65, 65, 80, False), (33, 65, 256, False),
    (129, 17, 96, False),
    (17, 33, 40, True), (129, 33, 96, True), (1, 65, 64, True), (65, 129, 32, True),
    (33, 17, 64, "bottom_right"), (17, 129, 128, "bottom_right"), (65, 1, 40, "bottom_right"),
    (129, 65, 64, "bottom_right"),
]


def _inputs(lq, lk, d, dtype, batch=2, heads=3):
    q = torch.randn(batch, heads, lq, d, dtype=dtype)
    k = torch.randn(batch, heads, lk, d, dtype=dtype)
    v = torch.randn(batch, heads, lk, d, dtype=dtype)
    return q, k, v


def _run(fn, q, k, v, grad_out, **kwargs):
    """fn(q, k, v, **kwargs) and the gradients of <out, grad_out> with respect to q, k, v."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def _check_against_reference(q, k, v, *, atol, dropout_keep=None, grad_out=None, **kwargs):
    """Output and all three gradients (grad_output != 1) against the fp64 reference, graded by
    PyTorch's own error in the inputs' precision (the reference run in that dtype)."""
    if grad_out is None:
        grad_out = torch.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    mask = kwargs.get("attn_mask")
    to64 = lambda x: None if x is None else x.double() if x.is_floating_point() else x
    ours = _run(attention, q, k, v, grad_out, **kwargs)
    exact = _run(attention_reference, *map(to64, (q, k, v)), grad_out.double(),
                 **kwargs | dict(attn_mask=to64(mask)), dropout_keep=dropout_keep)
    torch_own = _run(attention_reference, q, k, v, grad_out, **kwargs, dropout_keep=dropout_keep)
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), ours, exact, torch_own, strict=True):
        assert_graded_close(a, r, b, atol=atol, name=name)
    return ours


@pytest.mark.parametrize("lq,lk,d,causal", CASES)
def test_fp32_matches_reference(seeded, lq, lk, d, causal):
    q, k, v = _inputs(lq, lk, d, torch.float32)
    _check_against_reference(q, k, v, causal=causal, atol=2e-5)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk,d", [(17, 33, 40), (65, 65, 64), (33, 129, 128), (65, 17, 96)])
def test_low_precision_within_pytorch_error(seeded, lq, lk, d, causal, dtype):
    q, k, v = _inputs(lq, lk, d, dtype)
    _check_against_reference(q, k, v, causal=causal, atol=1e-3)


def test_custom_scale(seeded):
    q, k, v = _inputs(33, 17, 64, torch.float32)
    _check_against_reference(q, k, v, scale=0.3, atol=2e-5)


def test_noncontiguous_inputs(seeded):
    """Views of (B, L, H, D) projections, as the attention module passes them."""
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in _inputs(17, 33, 40,
                                                                              torch.float32))
    assert not q.is_contiguous()
    _check_against_reference(q, k, v, causal=True, atol=2e-5)


def _masks(batch, heads, lq, lk):
    torch.manual_seed(7)
    key_padding = torch.arange(lk).expand(batch, lk) < torch.tensor([lk, lk // 2])[:, None]
    float_mask = torch.randn(1, heads, lq, lk).masked_fill(torch.rand(1, heads, lq, lk) < 0.3,
                                                           float("-inf"))
    return {
        "bool_full": torch.rand(batch, heads, lq, lk) > 0.3,
        "bool_broadcast": torch.rand(lq, lk) > 0.5,
        "key_padding": key_padding[:, None, None, :],
        "float": float_mask,
        "float_broadcast_heads": torch.randn(batch, 1, lq, lk),
    }


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize(
    "mask_name", ["bool_full", "bool_broadcast", "key_padding", "float", "float_broadcast_heads"])
@pytest.mark.parametrize("lq,lk,d", [(17, 33, 40), (33, 17, 16)])
def test_masks(seeded, lq, lk, d, mask_name, causal):
    q, k, v = _inputs(lq, lk, d, torch.float32)
    mask = _masks(2, 3, lq, lk)[mask_name]
    _check_against_reference(q, k, v, attn_mask=mask, causal=causal, atol=2e-5)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_float_mask_low_precision(seeded, dtype):
    q, k, v = _inputs(33, 65, 64, dtype)
    mask = _masks(2, 3, 33, 65)["float"].to(dtype)
    _check_against_reference(q, k, v, attn_mask=mask, causal=True, atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_a_float_mask_far_below_zero_past_a_ragged_key_tile(seeded, causal):
    """Every score near -100 (the bias), so exp(-lse) overflows float32: a key past Lk in the
    last, partial key tile (33 keys) must still get P = 0 in dQ's pass, not inf * 0 = NaN."""
    q, k, v = _inputs(17, 33, 40, torch.float32)
    mask = torch.full((17, 33), -100.0) + torch.randn(17, 33)
    _check_against_reference(q, k, v, attn_mask=mask, causal=causal, atol=2e-5)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_fully_masked_rows_give_zeros_and_zero_gradients(seeded, mask_dtype):
    q, k, v = _inputs(9, 12, 32, torch.float32)
    allowed = torch.rand(2, 3, 9, 12) > 0.4
    allowed[0, 1, 4] = False  # one row of one head
    allowed[1, :, 7] = False  # one row of every head
    allowed[:, :, :, 0] = True
    allowed[0, 1, 4, 0] = allowed[1, :, 7, 0] = False
    mask = allowed if mask_dtype == torch.bool else torch.zeros(allowed.shape).masked_fill(
        ~allowed, float("-inf"))
    out, dq, dk, dv = _check_against_reference(q, k, v, attn_mask=mask, atol=2e-5)
    for empty in (out[0, 1, 4], out[1, :, 7], dq[0, 1, 4], dq[1, :, 7]):
        assert torch.equal(empty, torch.zeros_like(empty))
    assert out.abs().sum() > 0


def test_bottom_right_rows_before_the_prefix_are_empty(seeded):
    """Lq > Lk with bottom-right alignment: the first Lq - Lk queries see no key."""
    q, k, v = _inputs(20, 7, 16, torch.float32)
    out, dq, _, _ = _check_against_reference(q, k, v, causal="bottom_right", atol=2e-5)
    assert torch.equal(out[:, :, :13], torch.zeros_like(out[:, :, :13]))
    assert torch.equal(dq[:, :, :13], torch.zeros_like(dq[:, :, :13]))
    assert out[:, :, 13:].abs().min() > 0


def test_fp64_gradcheck_with_masks_and_empty_rows(seeded):
    """fp64 runs PyTorch on every backend (the kernels have none): exact gradients, even
    through fully masked rows."""
    q, k, v = (x.requires_grad_() for x in _inputs(5, 7, 8, torch.float64, batch=1, heads=2))
    mask = torch.rand(1, 2, 5, 7) > 0.3
    mask[0, 1, 2] = False
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, attn_mask=mask, causal="bottom_right"), (q, k, v))


def test_causal_true_is_top_left_like_pytorch(seeded):
    q, k, v = _inputs(17, 33, 16, torch.float32)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attention(q, k, v, causal=True), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(attention(q, k, v, causal="top_left"), expected, atol=2e-6,
                               rtol=1e-5)


def test_backward_is_deterministic(seeded):
    q, k, v = _inputs(65, 33, 40, torch.float32)
    grad_out = torch.randn_like(q)
    first = _run(attention, q, k, v, grad_out, causal=True)
    second = _run(attention, q, k, v, grad_out, causal=True)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def _keep_of_the_next_call(q, k, p):
    """The keep-mask the next attention call with dropout p draws (None for p = 0): drawn from
    seed 99, which is set again for that call (so grad_out must be drawn before)."""
    if p == 0:
        return None
    torch.manual_seed(99)
    keep = _dropout_keep_mask(q, k, p)
    torch.manual_seed(99)
    return keep


@pytest.mark.parametrize("causal,mask", [(False, None), ("bottom_right", "key_padding")])
@pytest.mark.parametrize("lq,lk,d", [(17, 33, 40), (33, 17, 64)])
def test_dropout_forward_and_backward_use_one_mask(lq, lk, d, causal, mask):
    """The keep-mask the call draws, recovered from the same RNG state, explains the output and
    every gradient: forward and backward agree on it."""
    p = 0.3
    q, k, v = _inputs(lq, lk, d, torch.float32)
    attn_mask = None if mask is None else _masks(2, 3, lq, lk)[mask]
    grad_out = torch.randn_like(q)
    keep = _keep_of_the_next_call(q, k, p)
    _check_against_reference(q, k, v, causal=causal, attn_mask=attn_mask, dropout_p=p,
                             dropout_keep=keep, grad_out=grad_out, atol=2e-5)


# Each variant with a 16-bit tile of its own on Ampere (kernels.attention.OVERRIDES), with bool
# and float masks (a variant's tile stands for both), at the head dims it has one for.
VARIANT_TILE_CASES = list(dict.fromkeys(
    (kind + o.variant, o.entry[0]) for o in kernels.OVERRIDES
    if o.variant and "sm80" in o.families and o.entry[1] == 2 for kind in ("", "float ")))
MASK_OF_VARIANT = {(kernels.BOOL_MASK, True): "key_padding",
                   (kernels.BOOL_MASK, False): "bool_full", (kernels.FLOAT_MASK, False): "float"}


@pytest.mark.parametrize("variant,d", VARIANT_TILE_CASES)
def test_variant_tiles_in_16_bits(seeded, variant, d):
    """The variants with a tile of their own on Ampere (the interpreter launches Ampere's
    tables) at their head dims in fp16, over more queries and keys than one tile of either
    size."""
    mask_kind, key_mask, causal, dropout = kernels.VARIANTS[variant]
    q, k, v = _inputs(97, 65, d, torch.float16)
    masks = _masks(2, 3, 97, 65)
    if (mask_kind, key_mask) == (kernels.FLOAT_MASK, True):  # key padding as 0 / -inf
        attn_mask = torch.zeros(masks["key_padding"].shape).masked_fill(~masks["key_padding"],
                                                                        float("-inf"))
    else:
        attn_mask = masks[MASK_OF_VARIANT[mask_kind, key_mask]]
    if attn_mask.is_floating_point():
        attn_mask = attn_mask.to(q.dtype)  # the reference in fp16 adds it in q's dtype
    p = 0.2 if dropout else 0.0
    grad_out = torch.randn_like(q)
    keep = _keep_of_the_next_call(q, k, p)
    _check_against_reference(q, k, v, causal=causal, attn_mask=attn_mask, dropout_p=p,
                             dropout_keep=keep, grad_out=grad_out, atol=1e-3)


def test_dropout_keep_rate_and_fresh_mask_per_call(seeded):
    p = 0.25
    q, k, _ = _inputs(64, 64, 16, torch.float32, batch=1, heads=2)
    first, second = _dropout_keep_mask(q, k, p), _dropout_keep_mask(q, k, p)
    n = first.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(first.float().mean().item() - (1 - p)) < 4 * sigma
    assert (first != second).float().mean() > 0.2  # independent masks differ in ~2p(1-p) = 37%
    # The op itself: two calls from different RNG states give different outputs, and the
    # dropout scale 1 / (1 - p) keeps the mean output unbiased (v = 1 gives rows summing to 1).
    v = torch.ones(1, 2, 64, 16)
    out1 = attention(q, k, v, dropout_p=p)
    out2 = attention(q, k, v, dropout_p=p)
    assert not torch.equal(out1, out2)
    assert abs(out1.mean().item() - 1.0) < 0.05


def test_dropout_is_reproducible_from_the_seed():
    q, k, v = _inputs(17, 33, 16, torch.float32)
    torch.manual_seed(5)
    first = attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    assert torch.equal(attention(q, k, v, dropout_p=0.5), first)


@pytest.mark.parametrize("masked,dropout_p", [(True, 0.0), (True, 0.2), (False, 0.2)])
def test_torch_compile_fullgraph(seeded, masked, dropout_p):
    """A function calling the op traces as one graph, forward and backward, its dropout mask drawn
    inside the graph, on every path (aot_eager: no code generation, so this stays cheap on CPU)."""

    def block(q, k, v, mask):
        return attention(q, k, v, attn_mask=mask, causal=True, dropout_p=dropout_p).square().sum()

    q, k, v = _inputs(17, 33, 40, torch.float32)
    mask = _masks(2, 3, 17, 33)["key_padding"] if masked else None
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)
    expected = _run(lambda q, k, v: block(q, k, v, mask), q, k, v, torch.tensor(1.0))
    torch.manual_seed(3)
    got = _run(lambda q, k, v: compiled(q, k, v, mask), q, k, v, torch.tensor(1.0))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not INTERPRETED, reason="the Triton op runs on CPU tensors only under "
                    "FASTATTN_BACKEND=triton TRITON_INTERPRET=1")
def test_registered_op_fake_and_autograd(seeded):
    """torch.library's own checks of the registration (schema, fake tensors, autograd), and a
    fullgraph compile of a function calling the op, with dropout drawn inside the graph."""
    q, k, v = (x.requires_grad_() for x in _inputs(17, 33, 40, torch.float32))
    mask = _masks(2, 3, 17, 33)["float"]
    torch.library.opcheck(_attention_forward_op,
                          (q, k, v, mask, None, "bottom_right", 0.0, 0.2, IMPL))

    def block(q, k, v):
        rng = seeds.draw(2)
        out, _ = _attention_forward_op(q, k, v, mask, rng, "top_left", 0.1, 0.2, IMPL)
        return out.square().sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)
    expected = _run(block, q, k, v, torch.tensor(1.0))
    torch.manual_seed(3)
    got = _run(compiled, q, k, v, torch.tensor(1.0))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not NATIVE, reason=NATIVE_REASON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk,d,causal,mask_name", [
    (1, 1, 16, True, None), (17, 17, 32, True, "key_padding"), (97, 64, 64, True, None),
    (13, 64, 8, "bottom_right", "float"), (64, 33, 12, False, "bool_full"),
    (33, 17, 24, "bottom_right", "bool_broadcast"), (5, 9, 72, False, "float_broadcast_heads"),
])
def test_native_cpu_attention(at_every_cpu_isa, seeded, lq, lk, d, causal, mask_name, dtype):
    """The CPU training path, fastattn._C's kernels, through attention(): head widths that fill
    their 16-float vectors (16, 32, 64) and that are padded to them (8, 12, 24, 72), queries over
    two score tiles (97 > 64), every mask kind."""
    q, k, v = (x.requires_grad_() for x in _inputs(lq, lk, d, dtype))
    mask = None if mask_name is None else _masks(2, 3, lq, lk)[mask_name]
    assert implementation("attention", q.device, q.dtype, requires_grad=True) == "fastattn._C"
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    _check_against_reference(q, k, v, attn_mask=mask, causal=causal,
                             atol=2e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.skipif(not NATIVE, reason=NATIVE_REASON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk,d,causal,mask_name", [
    (17, 33, 32, "bottom_right", "key_padding"), (33, 17, 24, True, "float"),
])
def test_native_cpu_attention_dropout(at_every_cpu_isa, lq, lk, d, causal, mask_name, dtype):
    """fastattn._C's kernels with dropout: the mask they draw (cpu_dropout's, from the same seed)
    explains the output and every gradient, at a head width that fills its vectors (32) and at one
    padded to them (24)."""
    p = 0.3
    q, k, v = (x.requires_grad_() for x in _inputs(lq, lk, d, dtype))
    mask = _masks(2, 3, lq, lk)[mask_name]
    mask = mask.to(dtype) if mask.is_floating_point() else mask
    assert implementation("attention", q.device, q.dtype, requires_grad=True) == "fastattn._C"
    grad_out = torch.randn_like(q)
    torch.manual_seed(7)
    keep = _dropout_keep_mask(q, k, p)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.03
    torch.manual_seed(7)
    _check_against_reference(q, k, v, attn_mask=mask, causal=causal, dropout_p=p,
                             dropout_keep=keep, grad_out=grad_out,
                             atol=2e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.skipif(not (NATIVE or INTERPRETED), reason=NATIVE_REASON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_layout", ["heads-last", "contiguous"])
def test_results_merge_heads_without_a_copy(at_every_cpu_isa, seeded, dtype, grad_layout):
    """fastattn._C and the Triton kernels write out, dq, dk and dv laid out as (B, L, H, D), so
    the (B, L, H·D) the projections read is a view (no copy on a GPU either); a grad_out in
    another layout is read as well (against the reference)."""
    q, k, v = (x.requires_grad_() for x in _inputs(17, 9, 32, dtype))
    mask = _masks(2, 3, 17, 9)["key_padding"]
    grad_out = torch.randn(2, 17, 3, 32, dtype=dtype).transpose(1, 2)
    if grad_layout == "contiguous":
        grad_out = grad_out.contiguous()
    ours = _check_against_reference(q, k, v, attn_mask=mask, causal=True, grad_out=grad_out,
                                    atol=2e-5 if dtype == torch.float32 else 1e-3)
    for name, x in zip(("out", "dq", "dk", "dv"), ours, strict=True):
        assert x.transpose(1, 2).is_contiguous(), name
        merged = x.transpose(1, 2).flatten(2)
        assert merged.data_ptr() == x.data_ptr() and merged._base is not None, name


@pytest.mark.skipif(not NATIVE, reason=NATIVE_REASON)
def test_native_op_registration(seeded):
    q, k, v = (x.requires_grad_() for x in _inputs(17, 33, 40, torch.float32))
    mask = _masks(2, 3, 17, 33)["float"]
    torch.library.opcheck(_attention_forward_op,
                          (q, k, v, mask, None, "bottom_right", 0.0, 0.2, IMPL))
    rng = torch.tensor([12345, 0])  # with dropout: the (seed, offset) input fixes the mask
    torch.library.opcheck(_attention_forward_op,
                          (q, k, v, mask, rng, "bottom_right", 0.3, 0.2, IMPL))


def test_native_cpu_attention_only_where_it_is_faster_and_exact():
    """Masked, causal or fp32 calls that need a gradient run fastattn._C at any length; unmasked
    bf16 (PyTorch's bf16 matrix products are faster), inference (its fused kernel is faster
    without a backward) and dtypes other than fp32/bf16 take the PyTorch path."""
    def native(dtype=torch.float32, grad=True, masked=True):
        return implementation("attention", "cpu", dtype, grad, masked=masked) == "fastattn._C"

    assert native(masked=True) == NATIVE
    assert native(masked=False) == NATIVE
    assert native(dtype=torch.bfloat16, masked=True) == NATIVE
    assert not native(dtype=torch.bfloat16, masked=False)
    assert not native(grad=False, masked=True)
    assert not native(dtype=torch.float16, masked=True)
    assert not native(dtype=torch.float64, masked=True)


@pytest.mark.parametrize("args,kwargs,message", [
    ((torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4)), {}, "must be 4-D"),
    ((torch.ones(1, 1, 3, 8), torch.ones(1, 1, 4, 16), torch.ones(1, 1, 4, 16)), {},
     r"must be \(B, H, Lq, D\)"),
    ((torch.ones(1, 1, 3, 8), torch.ones(1, 1, 4, 8), torch.ones(1, 1, 4, 8, dtype=torch.half)),
     {}, "share one floating dtype"),
    ((torch.ones(1, 1, 3, 8),) * 3, {"causal": "left"}, "causal must be"),
    ((torch.ones(1, 1, 3, 8),) * 3, {"dropout_p": 1.0}, r"dropout_p must be in \[0, 1\)"),
    ((torch.ones(1, 1, 3, 8),) * 3, {"attn_mask": torch.ones(2, 3, dtype=torch.bool)},
     "does not broadcast"),
    ((torch.ones(1, 1, 3, 8),) * 3, {"attn_mask": torch.ones(3, 3, dtype=torch.int64)},
     "must be bool or floating"),
    ((torch.ones(1, 1, 3, 8, dtype=torch.int64),) * 3, {},
     "q has dtype int64; accepted: float16, bfloat16, float32, float64"),
    ((torch.ones(1, 1, 3, 8, dtype=torch.complex64),) * 3, {}, "q has dtype complex64"),
])
def test_bad_input_is_named(args, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        attention(*args, **kwargs)


def test_triton_backend_on_cpu_without_interpreter_raises():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["FASTATTN_BACKEND"] = "triton"
    code = ("import torch, fastattn\n"
            "x = torch.ones(1, 1, 2, 16)\n"
            "fastattn.ops.attention(x, x, x)\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "RuntimeError" in result.stderr and "TRITON_INTERPRET=1" in result.stderr


# ---------------------------------------------------------------------------------------------
# The op contract at its edges (issue 50 item 9): the same on every path, checked against
# PyTorch's own scaled_dot_product_attention.
# ---------------------------------------------------------------------------------------------

# Every path this backend has on CPU: (dtype, needs a gradient, mask kind, key length): without
# a gradient PyTorch's fused kernel (or the Triton kernels), with one fastattn._C (fp32; masked
# bf16), PyTorch's explicit product (unmasked bf16) or, past 512 keys, its fused kernel.
PATHS = [(dtype, grad, mask, lk) for dtype in (torch.float32, torch.bfloat16)
         for grad in (False, True) for mask in (None, "bool", "float", "causal")
         for lk in (6,)] + [(torch.bfloat16, True, None, 600), (torch.float32, False, None, 600)]


def _edge_mask(kind, lq, lk):
    """(attn_mask for the op, causal, the bool (Lq, Lk) allowed keys) for a mask kind."""
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if kind == "causal":
        return None, True, allowed.tril()
    if kind is None:
        return None, False, allowed
    allowed[:, 0] = False  # key 0 hidden from every row
    if kind == "bool":
        return allowed, False, allowed
    return torch.zeros(lq, lk).masked_fill(~allowed, float("-inf")), False, allowed


@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "causal", "bottom_right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,h,lq,lk,d", [(2, 3, 0, 5, 8), (2, 3, 4, 0, 8), (0, 3, 4, 5, 8),
                                         (2, 0, 4, 5, 8), (2, 3, 0, 0, 8), (1, 2, 3, 4, 0)])
@pytest.mark.parametrize("grad", [False, True])
def test_empty_inputs_give_what_sdpa_gives(b, h, lq, lk, d, dtype, mask_kind, grad):
    """Lq, Lk, B, H or D = 0: SDPA's empty output, or zeros for Lk = 0 (every row attends to no
    key), with SDPA's gradients (zeros or empty), on every path: nothing is launched."""
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype, requires_grad=grad) for n in (lq, lk, lk))
    mask = {"bool": torch.ones(lq, lk, dtype=torch.bool),
            "float": torch.zeros(lq, lk, dtype=dtype)}.get(mask_kind)
    causal = {"causal": True, "bottom_right": "bottom_right"}.get(mask_kind, False)
    out = attention(q, k, v, attn_mask=mask, causal=causal, scale=0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal is True, scale=0.5)
    assert out.shape == expected.shape == (b, h, lq, d) and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert out.requires_grad == grad
    if grad:
        grad_out = torch.randn(out.shape, dtype=dtype)
        ours = torch.autograd.grad(out, (q, k, v), grad_out)
        theirs = torch.autograd.grad(expected, (q, k, v), grad_out)
        for a, e in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, e, atol=0, rtol=0)
    if lk == 0 and lq > 0 and b * h * d > 0:  # zeros even for a NaN query: it meets no key
        q = torch.full_like(q.detach(), float("nan"))
        assert attention(q, k.detach(), v.detach()).eq(0).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("dtype,grad,mask_kind,lk", PATHS)
def test_nan_in_a_query_row_gives_nan_in_that_row_on_every_path(seeded, dtype, grad, mask_kind,
                                                                 lk):
    """A NaN in query row 2 makes output row 2 NaN and leaves the other rows as they were, as
    softmax (and PyTorch's math path) does; with a gradient, dq's row 2 is NaN, its other rows
    finite, and dk, dv are NaN at every key row 2 may see. PyTorch's fused CPU kernel gave 0.0
    there without a mask, fastattn._C NaN."""
    lq, row = 5, 2
    q, k, v = _inputs(lq, lk, 8, dtype, batch=1, heads=2)
    q[0, 1, row, 3] = float("nan")
    mask, causal, allowed = _edge_mask(mask_kind, lq, lk)
    q, k, v = (x.requires_grad_(grad) for x in (q, k, v))
    out = attention(q, k, v, attn_mask=mask, causal=causal)
    nan_rows = out.isnan().any(-1)
    expected_rows = torch.zeros_like(nan_rows)
    expected_rows[0, 1, row] = True
    assert torch.equal(nan_rows, expected_rows), nan_rows
    assert out[0, 1, row].isnan().all()
    finite = [i for i in range(lq) if i != row]
    reference = attention_reference(*(x.detach().double() for x in (q, k, v)), causal=causal,
                                    attn_mask=None if mask is None else mask.double()
                                    if mask.is_floating_point() else mask)
    torch.testing.assert_close(out[0, 1, finite].double(), reference[0, 1, finite],
                               atol=3e-2, rtol=3e-2)
    if grad:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, dtype=dtype))
        assert dq[0, 1, row].isnan().all() and dq[0, 1, finite].isfinite().all()
        assert dq[0, 0].isfinite().all() and dk[0, 0].isfinite().all()  # the other head
        seen = allowed[row]
        assert dk[0, 1, seen].isnan().all() and dv[0, 1, seen].isnan().all()


@pytest.mark.parametrize("dtype,grad,mask_kind,lk", [
    p for p in PATHS if p[2] in (None, "bool")])
def test_nan_in_a_key_or_value_reaches_every_row_that_sees_it(seeded, dtype, grad, mask_kind,
                                                              lk):
    lq = 5
    for name in ("k", "v"):
        q, k, v = _inputs(lq, lk, 8, dtype, batch=1, heads=1)
        {"k": k, "v": v}[name][0, 0, 3, 1] = float("nan")  # key 3, seen by every row
        mask, causal, _ = _edge_mask(mask_kind, lq, lk)
        q, k, v = (x.requires_grad_(grad) for x in (q, k, v))
        assert attention(q, k, v, attn_mask=mask, causal=causal).isnan().any(-1).all(), name


@pytest.mark.parametrize("dtype,grad,mask_kind,lk", [
    p for p in PATHS if p[2] in ("float", "bool") and p[1]])
@pytest.mark.parametrize("q_grad", [True, False])
def test_masks_never_receive_gradients(seeded, dtype, grad, mask_kind, lk, q_grad):
    """Masks are constants on every path: a float mask that requires grad gets none (PyTorch's
    SDPA would give it one), and alone it does not make the output require grad."""
    del grad
    lq = 5
    q, k, v = _inputs(lq, lk, 8, dtype)
    mask, causal, allowed = _edge_mask(mask_kind, lq, lk)
    if mask_kind == "bool":  # a float mask is the one that can require grad
        mask = torch.zeros(lq, lk, dtype=dtype).masked_fill(~allowed, float("-inf"))
    mask = (mask + 0.1 * torch.randn(lq, lk, dtype=dtype)).requires_grad_()
    q, k, v = (x.requires_grad_(q_grad) for x in (q, k, v))
    out = attention(q, k, v, attn_mask=mask, causal=causal)
    assert out.requires_grad == q_grad
    if q_grad:
        out.sum().backward()
        assert mask.grad is None and q.grad is not None


@pytest.mark.parametrize("d,grad", [(272, False), (272, True), (300, True)])
def test_head_dims_above_256_fall_back_instead_of_raising(seeded, d, grad):
    """The Triton kernels cover heads up to 256 wide: wider ones run what the torch backend runs
    (fastattn._C or PyTorch on CPU, PyTorch on GPUs), as fastattn.backend.implementation says."""
    for device in ("cpu", "cuda"):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            impl = implementation("attention", device, dtype, grad, head_dim=d)
            assert not impl.startswith("triton"), (device, dtype, impl)
    assert implementation("attention", "cuda", torch.float16, grad, head_dim=d) == "torch"
    q, k, v = _inputs(3, 5, d, torch.float32, batch=1, heads=2)
    if grad:
        _check_against_reference(q, k, v, atol=1e-5, causal=True)
    else:
        torch.testing.assert_close(attention(q, k, v), attention_reference(q, k, v))


# The launchers at the hardware's limits. CUDA caps grid axes 1 and 2 at 65,535 programs: every
# launch of a batch of B x H = 65,552 heads must keep within them. The launch is recorded, not
# run (the interpreter would take minutes for 65,552 programs).
class _RecordedLaunch:
    def __init__(self, grids: list) -> None:
        self.grids = grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_launch_grids_keep_within_cuda_limits_for_any_batch_times_heads(monkeypatch):
    from fastattn.kernels import attention as kernels

    grids = []
    for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_dropout_keep_mask_kernel"):
        monkeypatch.setattr(kernels, name, _RecordedLaunch(grids))
    b, h, lq, lk, d = 4097, 16, 1, 3, 64  # 4,097 one-token sentences x 16 heads
    q, k, v = torch.zeros(b, h, lq, d), torch.zeros(b, h, lk, d), torch.zeros(b, h, lk, d)
    mask = torch.ones(b, 1, 1, lk, dtype=torch.bool)
    rng = torch.tensor([1, 2])
    out, lse = kernels.attention_forward(q, k, v, mask, rng, None, 0.1, 0.125)
    kernels.attention_backward(out, q, k, v, out, lse, mask, rng, None, 0.1, 0.125)
    kernels.dropout_keep_mask(b, h, lq, lk, 0.1, rng, q.device)
    assert len(grids) == 4
    for grid in grids:
        assert 1 <= len(grid) <= 3 and grid[0] < 2**31
        assert all(n <= 65_535 for n in grid[1:]), grid
    assert grids[0] == (b * h,)  # one query block per head


@pytest.mark.skipif(not INTERPRETED, reason="runs the Triton kernels themselves, on CPU tensors "
                    "only under the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_offsets_past_2_to_the_31_elements_address_the_right_rows(seeded, dtype):
    """A query and a mask whose row stride times the row index passes 2**31: the kernels compute
    such products in 64 bits (32-bit ones wrap to a wild address). The big buffers are virtual:
    only the rows the views cover are ever written."""
    from fastattn.kernels import attention as kernels

    lq, lk, d, row = 3, 17, 16, 2**30 + 64  # row 2 of q and of the mask lies past 2**31

    def far_apart(compact: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(row * (lq - 1) + compact.shape[-1], dtype=compact.dtype)
        view = buffer.as_strided(compact.shape, (0, 0, row, 1))
        return view.copy_(compact)

    q = torch.randn(1, 1, lq, d, dtype=dtype)
    k, v = torch.randn(2, 1, 1, lk, d, dtype=dtype)
    mask = torch.rand(1, 1, lq, lk) > 0.3
    mask[..., 0] = True
    grad_out = torch.randn(1, 1, lq, d, dtype=dtype)
    for causal in (None, "top_left"):
        expected = kernels.attention_forward(q, k, v, mask, None, causal, 0.0, d**-0.5)
        got = kernels.attention_forward(far_apart(q), k, v, far_apart(mask), None, causal, 0.0,
                                        d**-0.5)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        grads = kernels.attention_backward(grad_out, q, k, v, *expected, mask, None, causal, 0.0,
                                           d**-0.5)
        far_grads = kernels.attention_backward(grad_out, far_apart(q), k, v, *expected,
                                               far_apart(mask), None, causal, 0.0, d**-0.5)
        assert all(torch.equal(a, b) for a, b in zip(far_grads, grads, strict=True))


@pytest.mark.skipif(not INTERPRETED, reason="runs the Triton kernels themselves, on CPU tensors "
                    "only under the interpreter")
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_hopper_dkdv_tile_gives_the_same_gradients(seeded, monkeypatch, causal):
    """The dK/dV pass with the tile Hopper launches at head dim 64 (128 keys per program, so
    that one key block spans several query blocks of the causal diagonal), run here by
    pretending to be sm_90, against the fp64 reference; key lengths past one tile and ragged."""
    from fastattn.kernels import attention as kernels

    monkeypatch.setattr(kernels, "_sm", lambda x: 90)
    q, k, v = _inputs(97, 161, 64, torch.float16)
    mask = torch.rand(2, 1, 1, 161) > 0.2
    mask[..., -1] = True
    _check_against_reference(q, k, v, causal=causal, attn_mask=mask, atol=1e-3)


@pytest.mark.skipif(not INTERPRETED, reason="runs the Triton kernels themselves, on CPU tensors "
                    "only under the interpreter")
@pytest.mark.parametrize("d,causal,dropout", [(64, False, False), (128, False, True),
                                              (128, True, False), (128, True, True)])
def test_hopper_exact_float32_tiles_give_the_reference(seeded, monkeypatch, d, causal, dropout):
    """The forward tiles Hopper launches for float32 with exact products and a float mask per
    query (kernels.attention.OVERRIDES: 64 x 16 at d = 64, 32 x 16 at d = 128), run here
    by pretending to be sm_90, all gradients against the fp64 reference."""
    from fastattn.kernels import attention as kernels

    monkeypatch.setattr(kernels, "_sm", lambda x: 90)
    variant = dict(mask="query", causal=causal, dropout=dropout)
    assert kernels.launch_tile("_attn_fwd", d, torch.float32, 90, **variant,
                               precision="ieee")[:2] == ((64, 16) if d == 64 else (32, 16))
    q, k, v = _inputs(97, 65, d, torch.float32)
    mask = _masks(2, 3, 97, 65)["float"]
    grad_out = torch.randn_like(q)
    p = 0.2 if dropout else 0.0
    keep = _keep_of_the_next_call(q, k, p)
    _check_against_reference(q, k, v, causal=causal, attn_mask=mask, dropout_p=p,
                             dropout_keep=keep, grad_out=grad_out, atol=2e-5)


def _packed_inputs(form, lq, lk, heads, d, dtype, batch=3):
    """attention_packed's inputs: a self-attention's fused projection (B, L, 3·H·D), or queries
    (B, Lq, H·D) and keys and values side by side (B, Lk, 2·H·D)."""
    if form == "self":
        return torch.randn(batch, lq, 3 * heads * d, dtype=dtype), None
    return (torch.randn(batch, lq, heads * d, dtype=dtype),
            torch.randn(batch, lk, 2 * heads * d, dtype=dtype))


def _views(x, kv, heads):
    """q, k, v as the model made them before attention_packed: split, then heads as a view."""
    width = x.shape[-1] if kv is not None else x.shape[-1] // 3
    parts = x.split(width, -1) if kv is None else (x, *kv.split(width, -1))
    return [t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in parts]


def _run_packed(fn, x, kv, grad_out):
    """fn(x, kv), and the gradients of <out, grad_out> with respect to x (and kv)."""
    x = x.detach().requires_grad_()
    kv = None if kv is None else kv.detach().requires_grad_()
    out = fn(x, kv)
    inputs = (x,) if kv is None else (x, kv)
    return (out, *torch.autograd.grad(out, inputs, grad_out))


@pytest.mark.parametrize("form,lq,lk", [("self", 17, 17), ("cross", 17, 9), ("cross", 5, 17)])
@pytest.mark.parametrize("causal,masked", [(True, False), (False, True), (True, True)])
def test_packed_gradients_equal_the_views(seeded, form, lq, lk, causal, masked):
    """attention_packed: the op on views of the packed projection outputs, its backward writing
    dq, dk, dv into one gradient per packed input (no concatenation), gives the values and the
    gradients of attention() on the split views, bit for bit (the same kernels), and matches the
    fp64 reference: odd lengths (17, 9, 5), B = 3, key padding, causal, grad_output != 1."""
    heads, d = 2, 40
    x, kv = _packed_inputs(form, lq, lk, heads, d, torch.float32)
    mask = None
    if masked:  # key padding, a row of every length
        lengths = torch.tensor([lk, lk - 4, 1])
        mask = (torch.arange(lk) < lengths[:, None])[:, None, None, :]
    kwargs = dict(causal=causal, attn_mask=mask)
    grad_out = torch.randn(3, heads, lq, d)

    def packed(x, kv):
        out = attention_packed(x, kv, heads=heads, **kwargs)
        if IMPL != "torch":  # the packed backward, not split's, runs
            assert type(out.grad_fn).__name__ == "_PackedAttentionBackward"
        return out

    ours = _run_packed(packed, x, kv, grad_out)
    views = _run_packed(lambda x, kv: attention(*_views(x, kv, heads), **kwargs), x, kv,
                        grad_out)
    for a, b in zip(ours, views, strict=True):
        assert torch.equal(a, b)

    def reference(x, kv, dtype=torch.float64):
        return attention_reference(*(t.to(dtype) for t in _views(x, kv, heads)), **kwargs)

    exact = _run_packed(reference, x.double(), None if kv is None else kv.double(),
                        grad_out.double())
    torch_own = _run_packed(lambda x, kv: reference(x, kv, torch.float32), x, kv, grad_out)
    for name, a, r, b in zip(("out", "dx", "dkv")[:len(ours)], ours, exact, torch_own,
                             strict=True):
        assert_graded_close(a, r, b, atol=2e-5, name=name)


@pytest.mark.parametrize("form", ["self", "cross"])
def test_packed_dropout_equals_the_views(form):
    """With dropout, attention_packed draws the mask attention() draws from the same seed: the
    same output and gradients, bit for bit."""
    x, kv = _packed_inputs(form, 17, 9, 2, 16, torch.float32)
    grad_out = torch.randn(3, 2, 17, 16)
    results = []
    for fn in (lambda x, kv: attention_packed(x, kv, heads=2, causal=True, dropout_p=0.3),
               lambda x, kv: attention(*_views(x, kv, 2), causal=True, dropout_p=0.3)):
        torch.manual_seed(11)
        results.append(_run_packed(fn, x, kv, grad_out))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_packed_torch_compile_fullgraph(seeded):
    """attention_packed traces as one graph, forward and backward (its backward op writing into
    views of the packed gradient), with dropout drawn inside the graph."""
    x, kv = _packed_inputs("cross", 17, 9, 2, 16, torch.float32)
    mask = (torch.arange(9) < torch.tensor([9, 5, 1])[:, None])[:, None, None, :]

    def block(x, kv):
        return attention_packed(x, kv, heads=2, attn_mask=mask, dropout_p=0.2).square().sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)
    expected = _run_packed(block, x, kv, torch.tensor(1.0))
    torch.manual_seed(3)
    got = _run_packed(compiled, x, kv, torch.tensor(1.0))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("x_shape,kv_shape", [((2, 5, 47), None), ((2, 5, 16), (2, 5, 16)),
                                              ((2, 5), None)])
def test_packed_bad_shapes_are_named(x_shape, kv_shape):
    kv = None if kv_shape is None else torch.randn(kv_shape)
    with pytest.raises(ValueError, match="attention_packed: for 2 heads"):
        attention_packed(torch.randn(x_shape), kv, heads=2)
