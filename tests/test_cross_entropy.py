"""fastattn.ops.label_smoothed_cross_entropy and linear_cross_entropy against float64
F.cross_entropy, on both backends."""

import pytest
import torch
import torch.nn.functional as F

from fastattn.backend import implementation
from fastattn.ops import cross_entropy, label_smoothed_cross_entropy, linear_cross_entropy
from fastattn.ops.cross_entropy import REDUCTIONS, cross_entropy_reference

N = 6  # rows: small for the interpreter
# CPU tensors go through Triton's interpreter
INTERPRETED = implementation("label_smoothed_cross_entropy", "cpu",
                             torch.float32) == "triton-interpreter"


def _target(n, vocab, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (n,), generator=g)
    target[1] = ignore_index
    return target


def _grad_output(loss, seed=1):
    """A grad_output != 1: random, per row for reduction="none"."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(loss.shape, generator=g, dtype=torch.float64) + 0.5


def _loss_and_grads(fn, leaves, grad_output=None):
    loss, nll = fn(*leaves)
    grad_output = _grad_output(loss) if grad_output is None else grad_output
    grads = torch.autograd.grad((loss.double() * grad_output).sum(), leaves)
    return [loss, nll, *grads], grad_output


def _assert_within(ours, exact, torch_lowp, floor):
    """Each of ours within 2x PyTorch's own low-precision error (plus a floor) of float64;
    where PyTorch overflows (an fp16 sum), within the floor alone."""
    for o, e, t in zip(ours, exact, torch_lowp, strict=True):
        assert o.shape == e.shape and torch.isfinite(o).all()
        torch_err = (t.double() - e).abs().max().nan_to_num(0.0, posinf=0.0).item()
        err = (o.double() - e).abs().max().item()
        assert err <= 2 * torch_err + floor * max(1.0, e.abs().max().item()), (err, torch_err)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1, 16, 512, 1000, 1023, 4099])
def test_matches_float64_reference(at_every_cpu_isa, vocab, dtype, smoothing, reduction):
    logits = torch.randn(N, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    logits = (logits * 4).to(dtype).double()  # exactly representable in dtype
    target = _target(N, vocab)

    def ours(x):
        return label_smoothed_cross_entropy(
            x, target, smoothing, reduction=reduction, return_nll=True
        )

    def reference(x):
        return cross_entropy_reference(x, target, smoothing, reduction=reduction)

    x = logits.to(dtype).requires_grad_()
    out, grad_output = _loss_and_grads(ours, [x])
    exact, _ = _loss_and_grads(reference, [logits.clone().requires_grad_()], grad_output)
    lowp, _ = _loss_and_grads(reference, [logits.to(dtype).requires_grad_()], grad_output)
    assert out[0].dtype == dtype and out[1].dtype == torch.float32 and out[2].dtype == dtype
    floor = 2e-6 if dtype == torch.float32 else 1e-3
    _assert_within(out, exact, lowp, floor)
    if dtype == torch.float32 and reduction != "none":
        torch.testing.assert_close(  # the loss as F.cross_entropy itself computes it
            out[0], F.cross_entropy(x, target, reduction=reduction, label_smoothing=smoothing),
            atol=floor, rtol=floor,
        )


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_loss_alone_matches_loss_with_nll(dtype, reduction):
    """Without return_nll the PyTorch path takes F.cross_entropy directly: same loss, same grad."""
    logits = (torch.randn(N, 1000) * 4).to(dtype)
    target = _target(N, 1000)
    x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    alone = label_smoothed_cross_entropy(x, target, 0.1, reduction=reduction)
    with_nll, _ = label_smoothed_cross_entropy(y, target, 0.1, reduction=reduction,
                                               return_nll=True)
    grad_output = _grad_output(alone).to(dtype)
    (alone * grad_output).sum().backward()
    (with_nll * grad_output).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-3)
    torch.testing.assert_close(alone, with_nll, **tol)
    torch.testing.assert_close(x.grad, y.grad, **tol)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_ignore_index_is_a_real_class(smoothing):
    """ignore_index=0 (a padding id): rows targeting class 0 are ignored, class 0 still counts
    in other rows' softmax and smoothing."""
    logits = torch.randn(N, 50, dtype=torch.float64)
    target = _target(N, 50, ignore_index=0)
    x = logits.clone().requires_grad_()
    loss = label_smoothed_cross_entropy(x, target, smoothing, ignore_index=0)
    loss.backward()
    exact = logits.clone().requires_grad_()
    F.cross_entropy(exact, target, ignore_index=0, label_smoothing=smoothing).backward()
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, ignore_index=0,
                                                     label_smoothing=smoothing))
    torch.testing.assert_close(x.grad, exact.grad)
    assert (x.grad[target == 0] == 0).all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_is_zero_not_nan(reduction):
    logits = torch.randn(4, 33, requires_grad=True)
    target = torch.full((4,), -100)
    loss, nll = label_smoothed_cross_entropy(
        logits, target, 0.1, reduction=reduction, return_nll=True
    )
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(nll, torch.zeros_like(nll))
    (loss * 3).sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_leaves_the_callers_logits_untouched():
    logits = torch.randn(N, 300, requires_grad=True)
    before = logits.detach().clone()
    label_smoothed_cross_entropy(logits, _target(N, 300), 0.1).backward()
    assert torch.equal(logits.detach(), before)


def test_large_vocabulary():
    vocab = 131072 + 3  # 128k classes and a ragged last chunk
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits = logits.half().double()
    target = torch.tensor([5, vocab - 1])
    ours = lambda x: label_smoothed_cross_entropy(x, target, 0.1, return_nll=True)
    reference = lambda x: cross_entropy_reference(x, target, 0.1)
    out, grad_output = _loss_and_grads(ours, [logits.half().requires_grad_()])
    exact, _ = _loss_and_grads(reference, [logits.clone().requires_grad_()], grad_output)
    lowp, _ = _loss_and_grads(reference, [logits.half().requires_grad_()], grad_output)
    _assert_within(out, exact, lowp, 1e-3)


def test_bfloat16_logits(at_every_cpu_isa):
    logits = torch.randn(N, 1000, dtype=torch.float64) * 3
    target = _target(N, 1000)
    x = logits.bfloat16().requires_grad_()
    loss = label_smoothed_cross_entropy(x, target, 0.1)
    loss.backward()
    exact = logits.bfloat16().double().requires_grad_()
    ref, _ = cross_entropy_reference(exact, target, 0.1)
    ref.backward()
    assert loss.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref.detach(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(x.grad.double(), exact.grad, atol=1e-4, rtol=2e-2)


@pytest.mark.parametrize(
    "logits, target, kw, message",
    [
        (torch.randn(4, 10), torch.tensor([0, 1, 10, 2]), {}, "target 10 is out of range"),
        (torch.randn(4, 10), torch.tensor([0, 1, -3, 2]), {}, "target -3 is out of range"),
        (torch.randn(2, 4, 10), torch.zeros(2, 4, dtype=torch.long), {}, "flatten leading"),
        (torch.randn(4, 10), torch.zeros(3, dtype=torch.long), {}, r"\(N,\) target"),
        (torch.randn(4, 10), torch.zeros(4), {}, "class indices"),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.long), dict(reduction="avg"), "reduct"),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.long), dict(smoothing=1.5), "smoothing"),
    ],
)
def test_bad_input_errors(logits, target, kw, message):
    with pytest.raises(ValueError, match=message):
        label_smoothed_cross_entropy(logits, target, **kw)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 rows of 64 classes, so every call below runs several, the last one ragged."""
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 5 * 64)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.9])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64_reference(small_chunks, bias, smoothing, reduction):
    g = torch.Generator().manual_seed(3)
    rows, features, vocab = 17, 24, 64
    masters = [
        torch.randn(rows, features, generator=g, dtype=torch.float64),
        torch.randn(vocab, features, generator=g, dtype=torch.float64) / 3,
        torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None,
    ]
    target = _target(rows, vocab)
    target[7] = -100  # ignored rows in several chunks

    def ours(h, w, b=None):
        return linear_cross_entropy(
            h, w, target, b, smoothing, reduction=reduction, return_nll=True
        )

    def reference(h, w, b=None):
        return cross_entropy_reference(F.linear(h, w, b), target, smoothing, reduction=reduction)

    leaves = lambda dtype: [
        m.to(dtype, copy=True).requires_grad_() for m in masters if m is not None
    ]
    out, grad_output = _loss_and_grads(ours, leaves(torch.float32))
    exact, _ = _loss_and_grads(reference, leaves(torch.float64), grad_output)
    torch_fp32, _ = _loss_and_grads(reference, leaves(torch.float32), grad_output)
    assert [t.dtype for t in out] == [torch.float32] * len(out)
    _assert_within(out, exact, torch_fp32, 2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 17, 97, 1023])
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: logits spread over hundreds
def test_linear_odd_vocabularies(at_every_cpu_isa, small_chunks, vocab, scale, dtype):
    """Vocabularies that are not a multiple of the CPU kernel's 8-float vectors (vector body and
    scalar tail, float32 and bfloat16 rows), and logits wide enough that exp underflows for most
    classes; within twice PyTorch's own error in the same dtype of float64."""
    g = torch.Generator().manual_seed(vocab)
    rows, features = 13, 16
    masters = [torch.randn(rows, features, generator=g, dtype=torch.float64) * scale,
               torch.randn(vocab, features, generator=g, dtype=torch.float64) / 3]
    target = _target(rows, vocab)
    target[3] = -100

    def ours(h, w):
        return linear_cross_entropy(h, w, target, None, 0.1, return_nll=True)

    def reference(h, w):
        return cross_entropy_reference(F.linear(h, w), target, 0.1)

    leaves = lambda dtype: [m.to(dtype, copy=True).requires_grad_() for m in masters]
    out, grad_output = _loss_and_grads(ours, leaves(dtype))
    exact, _ = _loss_and_grads(reference, leaves(torch.float64), grad_output)
    torch_same_dtype, _ = _loss_and_grads(reference, leaves(dtype), grad_output)
    loss, _, *grads = out
    assert [t.dtype for t in (loss, *grads)] == [dtype] * 3
    _assert_within(out, exact, torch_same_dtype, 2e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_chunk_buffer_alignment_changes_no_bit(dtype, monkeypatch):
    """The chunk buffer's rows are padded to start 64-byte aligned, for the GEMMs' speed: the
    results are those of the same steps on a contiguous (N, V) buffer, to the bit, even when the
    memory handed to the buffer holds NaN (oneDNN's AMX bf16 GEMM reads the padding)."""
    g = torch.Generator().manual_seed(0)
    N, V, D = 23, 97, 48
    hidden = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) / 3).to(dtype)
    target, row_weight = torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g)
    new_full, logits_buffer = torch.Tensor.new_full, cross_entropy._logits_buffer

    def new_empty_of_nan(self, size, **kwargs):  # memory as an earlier tensor may leave it
        return new_full(self, size, float("nan"), **kwargs)

    def buffer_in_nan_memory(*args):
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "new_empty", new_empty_of_nan)
            return logits_buffer(*args)

    monkeypatch.setattr(cross_entropy, "_logits_buffer", buffer_in_nan_memory)
    impl = implementation("linear_cross_entropy", "cpu", dtype, requires_grad=True)
    loss, nll, dh, dw, _ = cross_entropy._linear_cross_entropy_chunks(
        hidden, weight, None, target, 0.1, -100, row_weight, impl)
    logits = hidden @ weight.T
    assert logits.is_contiguous()
    expected = cross_entropy._cross_entropy_grad(logits, target, row_weight, 0.1, -100, impl)
    assert torch.equal(loss, expected[0]) and torch.equal(nll, expected[1])
    assert torch.equal(dh, logits @ weight) and torch.equal(dw, (logits.T @ hidden).float())


def test_linear_nan_logits_propagate(small_chunks):
    hidden = torch.randn(6, 8)
    hidden[2, 0] = float("nan")
    hidden.requires_grad_()
    loss = linear_cross_entropy(hidden, torch.randn(40, 8), torch.arange(6), smoothing=0.1)
    loss.backward()
    assert loss.isnan() and hidden.grad[2].isnan().all()


def test_linear_all_ignored_is_zero_not_nan(small_chunks):
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(64, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((12,), -100), smoothing=0.1)
    loss.backward()
    assert loss.item() == 0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_linear_without_grad_and_under_no_grad(small_chunks):
    hidden, weight = torch.randn(12, 8), torch.randn(64, 8)
    target = _target(12, 64)
    exact, _ = cross_entropy_reference(F.linear(hidden.double(), weight.double()), target, 0.1)
    loss = linear_cross_entropy(hidden, weight, target, smoothing=0.1)
    torch.testing.assert_close(loss.double(), exact, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden.requires_grad_(), weight, target, smoothing=0.1)
    torch.testing.assert_close(loss.double(), exact, atol=1e-5, rtol=1e-5)


def test_linear_under_bfloat16_autocast(small_chunks):
    """The training step's setting on CPU: fp32 parameters, bf16 autocast."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(17, 24, generator=g, requires_grad=True)
    weight = (torch.randn(64, 24, generator=g) / 3).requires_grad_()
    target = _target(17, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, target, smoothing=0.1)
    loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact, _ = cross_entropy_reference(F.linear(h64, w64), target, 0.1)
    exact.backward()
    assert loss.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss.double(), exact.detach(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=3e-3, rtol=3e-2)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=3e-3, rtol=3e-2)


def test_linear_bad_input_errors():
    hidden, target = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(hidden, torch.randn(10, 7), target)
    with pytest.raises(ValueError, match="bias must be"):
        linear_cross_entropy(hidden, torch.randn(10, 8), target, bias=torch.randn(9))
    with pytest.raises(ValueError, match="out of range"):
        linear_cross_entropy(hidden, torch.randn(10, 8), torch.tensor([0, 1, 2, 10]))


def test_compiles_with_fullgraph():
    logits = torch.randn(N, 40, requires_grad=True)
    hidden, weight = torch.randn(N, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    target = _target(N, 40)

    def losses(logits, hidden, weight):
        a = label_smoothed_cross_entropy(logits, target, 0.1)
        return a + linear_cross_entropy(hidden, weight, target, smoothing=0.1)

    compiled = torch.compile(losses, fullgraph=True, backend="aot_eager")
    got = compiled(logits, hidden, weight)
    grads = torch.autograd.grad(got * 2, (logits, hidden, weight))
    want = losses(logits, hidden, weight)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, torch.autograd.grad(want * 2, (logits, hidden, weight)), strict=True):
        torch.testing.assert_close(a, b)


CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_custom_op_registration(reduction):
    hidden, weight = torch.randn(7, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    bias, target = torch.randn(40, requires_grad=True), _target(7, 40)
    torch.library.opcheck(
        torch.ops.fastattn.linear_cross_entropy_fwd.default,
        (hidden, weight, bias, target, 0.1, -100, reduction, True), test_utils=CHECKS,
    )


@pytest.mark.skipif(
    not INTERPRETED,
    reason="fastattn::cross_entropy_fwd runs the Triton kernels, which this backend "
    "(FASTATTN_BACKEND=torch, or auto on CPU) does not use",
)
def test_custom_op_registration():
    logits = torch.randn(7, 40, requires_grad=True)
    torch.library.opcheck(
        torch.ops.fastattn.cross_entropy_fwd.default, (logits, _target(7, 40), 0.1, -100),
        test_utils=CHECKS,
    )


def test_strided_logits():
    logits = torch.randn(N, 80, dtype=torch.float64)[:, ::2]
    target = _target(N, 40)
    exact, _ = cross_entropy_reference(logits, target, 0.1)
    loss = label_smoothed_cross_entropy(logits.float(), target, 0.1)
    torch.testing.assert_close(loss.double(), exact, atol=1e-5, rtol=1e-5)


def test_float64_at_float64_precision():
    logits, target = torch.randn(N, 300, dtype=torch.float64) * 3, _target(N, 300)
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.1, return_nll=True)
    exact, exact_nll = cross_entropy_reference(logits, target, 0.1)
    torch.testing.assert_close(loss, exact)
    torch.testing.assert_close(nll, exact_nll)
    hidden, weight = torch.randn(N, 16, dtype=torch.float64), torch.randn(300, 16).double()
    exact, _ = cross_entropy_reference(F.linear(hidden, weight), target, 0.1)
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, target, smoothing=0.1), exact)


# The dtypes the error message accepts are the dtypes that work (issue 50 item 9): int64 and
# int32 targets, forward and backward, on every path: PyTorch (F.cross_entropy takes int64
# only), the Triton kernels, and linear_cross_entropy's chunk kernels (fastattn._C for fp32 and
# bf16, PyTorch for fp16) with and without a gradient.
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_int32_targets_work_like_int64(dtype, reduction):
    logits = torch.randn(N, 11, dtype=dtype, generator=torch.Generator().manual_seed(3))
    target = _target(N, 11)
    results = []
    for t in (target, target.int()):
        x = logits.clone().requires_grad_()
        loss, nll = label_smoothed_cross_entropy(x, t, 0.1, reduction=reduction,
                                                 return_nll=True)
        loss.sum().backward()
        results.append((loss, nll, x.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_int32_targets_work_like_int64(small_chunks, dtype, grad, reduction):
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(N, 8, generator=g), torch.randn(64 + 3, 8, generator=g)
    bias = torch.randn(64 + 3, generator=g)
    target = _target(N, 64 + 3)
    results = []
    for t in (target, target.int()):
        leaves = [x.to(dtype).requires_grad_(grad) for x in (hidden, weight, bias)]
        loss, nll = linear_cross_entropy(leaves[0], leaves[1], t, bias=leaves[2], smoothing=0.1,
                                         reduction=reduction, return_nll=True)
        grads = torch.autograd.grad(loss.sum(), leaves) if grad else ()
        results.append((loss, nll, *grads))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_non_float_logits_name_their_dtype():
    target = torch.zeros(3, dtype=torch.long)
    accepted = "accepted: float16, bfloat16, float32, float64"
    with pytest.raises(TypeError, match=f"logits has dtype int64; {accepted}"):
        label_smoothed_cross_entropy(torch.ones(3, 4, dtype=torch.long), target)
    with pytest.raises(TypeError, match=f"hidden has dtype int32; {accepted}"):
        linear_cross_entropy(torch.ones(3, 4, dtype=torch.int32), torch.ones(5, 4), target)
    with pytest.raises(TypeError, match="weight has dtype int64"):
        linear_cross_entropy(torch.ones(3, 4), torch.ones(5, 4, dtype=torch.long), target)
    with pytest.raises(ValueError, match="int64 or int32"):
        label_smoothed_cross_entropy(torch.ones(3, 4), target.to(torch.int16))


def test_out_of_range_target_names_its_row():
    with pytest.raises(ValueError, match="target 10 is out of range for 10 classes "
                                         r"\(ignore_index=-100\), first at row 3"):
        label_smoothed_cross_entropy(torch.randn(5, 10), torch.tensor([0, 1, 2, 10, 11]))
