"""fastattn.ops.layer_norm_residual against the float64 PyTorch reference, on both backends."""

import pytest
import torch

from fastattn.backend import implementation
from fastattn.kernels.layer_norm import MAX_FEATURES, forward_bytes
from fastattn.ops import dropout, layer_norm_residual
from fastattn.ops.layer_norm import layer_norm_residual_reference

NATIVE = implementation("layer_norm_residual", "cpu", torch.float32) == "fastattn._C"
INTERPRETED = implementation("layer_norm_residual", "cpu", torch.float32) == "triton-interpreter"

ROWS = (3, 2)  # leading dims, flattened to 6 rows: small for the interpreter


def _dropout_keep_mask(x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The keep mask layer_norm_residual(x, ...) draws at the current RNG state: the op's own
    returned sum of dropout(ones) and zeros."""
    ones = torch.ones_like(x)
    _, s = layer_norm_residual(
        ones, torch.zeros_like(x), None, None, dropout_p=dropout_p, return_residual=True
    )
    return s != 0


def _inputs(n, dtype, *, residual=True, weight=True, bias=True, residual_dtype=None, seed=0):
    """float64 masters (x, residual, weight, bias), None where absent."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*ROWS, n, generator=g, dtype=torch.float64) * 2 + 0.5
    r = torch.randn(*ROWS, n, generator=g, dtype=torch.float64) if residual else None
    w = torch.randn(n, generator=g, dtype=torch.float64) if weight else None
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    stream = residual_dtype or dtype  # the residual stream's dtype, also the parameters'
    dtypes = (dtype, stream, stream, stream)
    return (x, r, w, b), dtypes


def _run(fn, masters, dtypes, grads, **kw):
    """Forward and backward of fn on copies of masters cast to dtypes; returns outputs, grads."""
    leaves = [
        None if m is None else m.to(d, copy=True).requires_grad_()
        for m, d in zip(masters, dtypes, strict=True)
    ]
    y, s = fn(*leaves, **kw)
    gy, gs = grads
    ((y.double() * gy).sum() + (s.double() * gs).sum()).backward()
    return [y, s], [None if t is None else t.grad for t in leaves]


def _reference(keep=None, dropout_p=0.0):
    def fn(x, r, w, b, eps=1e-5):
        return layer_norm_residual_reference(x, r, w, b, eps, keep, dropout_p)

    return fn


def _ours(x, r, w, b, eps=1e-5, dropout_p=0.0):
    return layer_norm_residual(x, r, w, b, eps, dropout_p=dropout_p, return_residual=True)


def _check(ours, exact, torch_lowp, dtype):
    """ours within 2x PyTorch's own error in dtype (plus a floor), both against float64."""
    for o, e, t in zip(ours, exact, torch_lowp, strict=True):
        assert (o is None) == (e is None)
        if o is None:
            continue
        assert o.dtype == t.dtype and o.shape == e.shape
        assert torch.isfinite(o).all()
        floor = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
        torch_err = (t.double() - e).abs().max().item()
        err = (o.double() - e).abs().max().item()
        assert err <= 2 * torch_err + floor * max(1.0, e.abs().max().item()), (err, torch_err)


def _compare(n, dtype, dropout_p=0.0, seed=0, **input_kw):
    masters, dtypes = _inputs(n, dtype, seed=seed, **input_kw)
    g = torch.Generator().manual_seed(seed + 1)
    grads = (torch.randn(*ROWS, n, generator=g, dtype=torch.float64),
             torch.randn(*ROWS, n, generator=g, dtype=torch.float64))
    torch.manual_seed(seed)
    out, dparams = _run(_ours, masters, dtypes, grads, dropout_p=dropout_p)
    keep = None
    if dropout_p > 0:
        torch.manual_seed(seed)
        keep = _dropout_keep_mask(masters[0].to(dtype), dropout_p)
    reference = _reference(keep, dropout_p)
    exact_out, exact_grads = _run(reference, masters, [torch.float64] * 4, grads)
    lowp_out, lowp_grads = _run(reference, masters, dtypes, grads)
    _check(out, exact_out, lowp_out, dtype)
    _check(dparams, exact_grads, lowp_grads, dtype)
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 16, 512, 1000, 1023, 4099])
def test_matches_float64_reference(at_every_cpu_isa, n, dtype):
    _compare(n, dtype)


@pytest.mark.parametrize(
    "parts",
    [dict(residual=False), dict(weight=False, bias=False), dict(bias=False), dict(weight=False)],
)
@pytest.mark.parametrize("n", [1000, 4099])  # the one-pass and the two-pass (wide) backward
def test_optional_residual_weight_bias(at_every_cpu_isa, parts, n):
    _compare(n, torch.float32, **parts)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_bfloat16(at_every_cpu_isa, dropout_p):
    _compare(1000, torch.bfloat16, dropout_p=dropout_p)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_mixed_dtypes_promote(dtype, dropout_p):
    """A low-precision sub-layer output onto an fp32 residual stream (post-norm under autocast):
    output fp32, grads in input dtypes."""
    _compare(512, dtype, residual_dtype=torch.float32, dropout_p=dropout_p, seed=1)


@pytest.mark.skipif(not NATIVE, reason="needs fastattn._C's CPU kernels")
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("n", [1, 17, 128, 1023])
def test_bfloat16_beside_float32_residual_reads_x_as_it_is(at_every_cpu_isa, dropout_p, n):
    """The CPU kernel reads bfloat16 x itself; its results equal those of a float32 copy of x bit
    for bit, dx rounded to bfloat16 once (what the copy's backward does)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, 7, n, generator=g).bfloat16().requires_grad_()
    r, w, b = (torch.randn(*shape, generator=g).requires_grad_()
               for shape in ((5, 7, n), (n,), (n,)))
    dy = torch.randn(5, 7, n, generator=g)
    results = []
    for x_in in (x, x.float()):
        torch.manual_seed(0)  # the same dropout mask
        y = layer_norm_residual(x_in, r, w, b, 1e-5, dropout_p)
        results.append((y, *torch.autograd.grad(y, (x, r, w, b), dy)))
    assert results[0][0].dtype == torch.float32 and results[0][1].dtype == torch.bfloat16
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_dropout_matches_reference_with_its_mask(at_every_cpu_isa, dropout_p, dtype):
    """Forward and every gradient agree with the reference given the op's own keep mask, so the
    backward regenerated exactly the mask of the forward."""
    keep = _compare(1023, dtype, dropout_p=dropout_p, seed=3)
    assert 0 < keep.sum() < keep.numel()


def test_dropout_mask_statistics():
    x = torch.randn(64, 1024)
    keep = _dropout_keep_mask(x, 0.3)
    assert abs(keep.float().mean().item() - 0.7) < 0.01  # std of the mean here is 0.0018
    assert not torch.equal(keep[0], keep[1])  # rows draw different numbers
    assert not torch.equal(keep, _dropout_keep_mask(x, 0.3))  # each call draws a fresh seed


def test_dropout_mask_has_no_visible_structure():
    """Keep decisions of neighbouring columns and rows are independent, per column and per row
    rates sit at 1 - p: the counter-based hash must not leak its counters into the mask."""
    keep = _dropout_keep_mask(torch.zeros(1024, 128), 0.3).float()
    rate = 0.7
    for a, b in ((keep[:, 1:], keep[:, :-1]), (keep[1:], keep[:-1])):
        assert abs((a * b).mean().item() - rate**2) < 0.007  # independent: P(both) = rate²
    assert (keep.mean(0) - rate).abs().max() < 0.07  # 1024 draws a column: std 0.014
    assert (keep.mean(1) - rate).abs().max() < 0.2  # 128 draws a row: std 0.04
    assert len({tuple(row.tolist()) for row in keep.bool()}) == len(keep)


def test_many_rows_with_dropout_against_float64():
    """Enough rows that the CPU kernel splits them across threads and sums dweight and dbias from
    per-block partials; outputs and all gradients within 2x PyTorch's float32 error. The Triton
    backward runs four programs on CPU tensors (kernels/layer_norm._num_programs), each summing
    a block of rows into its partials: 41 rows give them 11, 11, 11 and 8 (301 rows took a
    minute in the interpreter, one program per row forward)."""
    g = torch.Generator().manual_seed(11)
    # the CPU kernel gives each thread at least 126 rows of 130
    shape = (41 if INTERPRETED else 301, 130)
    masters = [torch.randn(*shape, generator=g, dtype=torch.float64),
               torch.randn(*shape, generator=g, dtype=torch.float64),
               torch.randn(130, generator=g, dtype=torch.float64),
               torch.randn(130, generator=g, dtype=torch.float64)]
    grads = (torch.randn(*shape, generator=g, dtype=torch.float64),
             torch.randn(*shape, generator=g, dtype=torch.float64))
    torch.manual_seed(4)
    out, dparams = _run(_ours, masters, [torch.float32] * 4, grads, dropout_p=0.2)
    torch.manual_seed(4)
    keep = _dropout_keep_mask(masters[0].float(), 0.2)
    exact_out, exact_grads = _run(_reference(keep, 0.2), masters, [torch.float64] * 4, grads)
    lowp_out, lowp_grads = _run(_reference(keep, 0.2), masters, [torch.float32] * 4, grads)
    _check(out, exact_out, lowp_out, torch.float32)
    _check(dparams, exact_grads, lowp_grads, torch.float32)


def test_dropout_reproducible_under_manual_seed():
    x, r = torch.randn(2, 4, 100), torch.randn(2, 4, 100)
    torch.manual_seed(7)
    a = layer_norm_residual(x, r, None, None, dropout_p=0.4)
    torch.manual_seed(7)
    b = layer_norm_residual(x, r, None, None, dropout_p=0.4)
    torch.manual_seed(8)
    c = layer_norm_residual(x, r, None, None, dropout_p=0.4)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_standalone_dropout(at_every_cpu_isa, dtype):
    """ops.dropout (the model's embedding and activation dropout): kept entries scaled by
    1 / (1 - p), the rest zero, about 1 - p kept, gradient = keep / (1 - p) times grad_output."""
    x = (torch.rand(64, 1024) + 1.0).to(dtype).requires_grad_()  # never zero: zeros = dropped
    y = dropout(x, 0.3)
    keep = y != 0
    assert y.dtype == dtype and abs(keep.float().mean().item() - 0.7) < 0.01
    torch.testing.assert_close(y[keep], (x[keep].double() / 0.7).to(dtype))
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    torch.testing.assert_close(x.grad, (grad_out.double() * keep / 0.7).to(dtype))
    assert dropout(x, 0.3, training=False) is x and dropout(x, 0.0) is x
    torch.manual_seed(2)
    again = dropout(x, 0.3)
    torch.manual_seed(2)
    assert torch.equal(again, dropout(x, 0.3))
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), got 1.0"):
        dropout(x, 1.0)


def test_widest_supported_row():
    _compare(MAX_FEATURES, torch.float32, dropout_p=0.1)


def test_rows_beyond_the_kernel_limit():
    x = torch.randn(2, MAX_FEATURES + 1)
    if INTERPRETED:
        with pytest.raises(ValueError, match=f"at most {MAX_FEATURES} features"):
            layer_norm_residual(x, x, None, None)
    else:  # neither fastattn._C's CPU kernel nor PyTorch has a row limit
        exact, _ = layer_norm_residual_reference(x.double(), x.double(), None, None)
        torch.testing.assert_close(layer_norm_residual(x, x, None, None), exact.float())


def test_returns_only_y_by_default_and_keeps_shape():
    x = torch.randn(2, 3, 5, 8)
    y = layer_norm_residual(x, torch.randn_like(x), torch.ones(8), torch.zeros(8))
    assert isinstance(y, torch.Tensor) and y.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("n", [17, 4099])  # the one-pass and the two-pass (wide) backward
def test_x_bias_is_added_before_dropout_and_gets_its_gradient(at_every_cpu_isa, dtype, dropout_p,
                                                              n):
    """x_bias, the bias of the linear map that made x: y = LN(r + dropout(x + x_bias)) and every
    gradient, x_bias's too, against float64 (graded as the other inputs are)."""
    masters, dtypes = _inputs(n, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    masters = (*masters, torch.randn(n, generator=g, dtype=torch.float64))
    dtypes = (*dtypes, dtype)
    grads = (torch.randn(*ROWS, n, generator=g, dtype=torch.float64),
             torch.randn(*ROWS, n, generator=g, dtype=torch.float64))
    keep = None
    if dropout_p > 0:
        torch.manual_seed(5)
        keep = _dropout_keep_mask(masters[0].to(dtype), dropout_p)

    def ours(x, r, w, b, xb):
        return layer_norm_residual(x, r, w, b, dropout_p=dropout_p, return_residual=True,
                                   x_bias=xb)

    def reference(x, r, w, b, xb):
        return layer_norm_residual_reference(x + xb, r, w, b, 1e-5, keep, dropout_p)

    torch.manual_seed(5)
    out, dparams = _run(ours, masters, dtypes, grads)
    exact_out, exact_grads = _run(reference, masters, [torch.float64] * 5, grads)
    lowp_out, lowp_grads = _run(reference, masters, dtypes, grads)
    _check(out, exact_out, lowp_out, dtype)
    _check(dparams, exact_grads, lowp_grads, dtype)


# Triton's interpreter rounds float32 to bfloat16 toward zero (a GPU, like y.to(), to nearest
# even), so there the bfloat16 copy is not y.to(bfloat16): float16 checks the kernels.
COPY_DTYPES = [torch.float16] if INTERPRETED else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("copy_dtype", COPY_DTYPES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("n", [17, 4099])  # the one-pass and the two-pass (wide) backward
@pytest.mark.parametrize("uses", ["both", "copy", "y and the sum"])
def test_copy_is_y_rounded_and_its_gradient_adds_to_ys(copy_dtype, dropout_p, n, uses):
    """(y, copy) from one kernel equal (y, y.to(copy_dtype)) bit for bit, forward and backward,
    under autocast's mixed dtypes (a low-precision x beside a float32 residual)."""
    (x, r, w, b), _ = _inputs(n, torch.float32)
    g = torch.Generator().manual_seed(5)
    gy, gc, gs = (torch.randn(*ROWS, n, generator=g) * 3 for _ in range(3))
    results = []
    for copy in (True, False):
        leaves = [x.to(copy_dtype).requires_grad_(), *(t.float().requires_grad_()
                                                       for t in (r, w, b))]
        torch.manual_seed(7)  # the same dropout mask
        out = layer_norm_residual(*leaves, dropout_p=dropout_p, return_residual=True,
                                  copy_dtype=copy_dtype if copy else None)
        (y, s, c) = out if copy else (*out, out[0].to(copy_dtype))
        loss = {"both": (y * gy).sum() + (c.float() * gc).sum(),
                "copy": (c.float() * gc).sum(),
                "y and the sum": (y * gy).sum() + (s * gs).sum()}[uses]
        results.append([y, s, c, *torch.autograd.grad(loss, leaves)])
    for ours, plain in zip(*results, strict=True):
        assert ours.dtype == plain.dtype and torch.equal(ours, plain)


def test_gradient_through_the_returned_sum_only():
    x, r = torch.randn(4, 33, requires_grad=True), torch.randn(4, 33, requires_grad=True)
    _, s = layer_norm_residual(x, r, None, None, return_residual=True)
    g = torch.randn(4, 33)
    (s * g).sum().backward()
    torch.testing.assert_close(x.grad, g)
    torch.testing.assert_close(r.grad, g)


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(residual=torch.randn(3, 9)), "residual shape"),
        (dict(weight=torch.randn(7)), "weight must have shape"),
        (dict(bias=torch.randn(2, 8)), "bias must have shape"),
        (dict(dropout_p=1.0), "dropout_p must be in"),
    ],
)
def test_bad_input_errors(args, message):
    kw = dict(residual=None, weight=None, bias=None) | args
    with pytest.raises(ValueError, match=message):
        layer_norm_residual(torch.randn(3, 8), kw.pop("residual"), kw.pop("weight"),
                            kw.pop("bias"), **kw)


def test_forward_bytes():
    fused, unfused = forward_bytes((4, 1024), torch.float16)
    elements, params = 4 * 1024, 2 * 1024 * 2 + 4 * 8
    assert fused == 6 * elements + params  # read x, read residual, write y
    assert unfused == 10 * elements + params  # add: 3 accesses, layer_norm: 2
    fused, unfused = forward_bytes((4, 1024), torch.float16, dropout=True, return_residual=True)
    assert (fused, unfused) == (8 * elements + params, 15 * elements + params)


@pytest.mark.skipif(
    not (INTERPRETED or NATIVE),
    reason="the fastattn::layer_norm_residual_* ops run the Triton kernels or fastattn._C's CPU "
    "kernels: this backend uses neither (FASTATTN_BACKEND=torch without a built fastattn._C)",
)
def test_custom_op_registration():
    x, r = torch.randn(5, 40, requires_grad=True), torch.randn(5, 40, requires_grad=True)
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    seed = torch.tensor([123])
    xb = torch.randn(40, requires_grad=True)
    for copy_dtype, x_bias in ((None, None), (torch.bfloat16, xb)):
        torch.library.opcheck(
            torch.ops.fastattn.layer_norm_residual_fwd.default,
            (x, r, w, b, seed, 1e-5, 0.25, True, copy_dtype, x_bias),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


@pytest.mark.skipif(not NATIVE,
                    reason="fastattn::seeded_dropout runs on CPU float32 with fastattn._C only, "
                    "and not under the Triton interpreter")
def test_seeded_dropout_registration():
    torch.library.opcheck(
        torch.ops.fastattn.seeded_dropout.default,
        (torch.randn(5, 40, requires_grad=True), torch.tensor([9]), 0.25),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_strided_and_transposed_inputs():
    wide = torch.randn(4, 3, 66, dtype=torch.float64)
    x, r = wide[..., ::2], torch.randn(3, 4, 33, dtype=torch.float64).transpose(0, 1)
    w = torch.randn(66, dtype=torch.float64)[::2]
    exact, _ = layer_norm_residual_reference(x, r, w, None)
    y = layer_norm_residual(x.float(), r.float(), w.float(), None)
    torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=1e-5)


def test_float64_at_float64_precision():
    masters, _ = _inputs(1000, torch.float64)
    y, s = layer_norm_residual(*masters, return_residual=True)
    exact, exact_sum = layer_norm_residual_reference(*masters)
    torch.testing.assert_close(y, exact)
    torch.testing.assert_close(s, exact_sum)


def test_compiles_with_fullgraph():
    x, r = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    w, b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    fn = lambda x, r, w, b: layer_norm_residual(x, r, w, b, return_residual=True)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, r, w, b)
    want = fn(x, r, w, b)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("name", ["x", "residual", "weight", "bias"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_non_float_inputs_name_their_dtype(name, dtype):
    """One TypeError naming the tensor, its dtype and the dtypes accepted, on every backend (an
    int x gave a raw NotImplementedError from F.layer_norm, an int weight a RuntimeError on CPU
    and a result under the Triton backend)."""
    tensors = {"x": torch.ones(3, 4), "residual": torch.ones(3, 4), "weight": torch.ones(4),
               "bias": torch.zeros(4)}
    tensors[name] = tensors[name].to(dtype)
    short = str(dtype).removeprefix("torch.")
    with pytest.raises(TypeError, match=f"layer_norm_residual: {name} has dtype {short}; "
                                        "accepted: float16, bfloat16, float32, float64"):
        layer_norm_residual(tensors["x"], tensors["residual"], tensors["weight"], tensors["bias"])


def test_dropout_of_a_non_float_tensor_names_its_dtype():
    with pytest.raises(TypeError, match="dropout: x has dtype int64"):
        dropout(torch.ones(3, 4, dtype=torch.long), 0.5)
    x = torch.ones(3, dtype=torch.long)
    assert dropout(x, 0.5, training=False) is x  # as F.dropout: the identity outside training
