"""fastattn.ops.embedding against the float64 PyTorch reference, on both backends, and the model's
use of it (fastattn.fused_model.embed)."""

from dataclasses import replace

import pytest
import torch

import fastattn.fused_model
from fastattn.backend import implementation
from fastattn.model import Transformer, TransformerConfig
from fastattn.ops.embedding import embedding, embedding_reference

# Every test here reaches the op; under FASTATTN_BACKEND=triton the kernels run interpreted.
pytestmark = pytest.mark.triton

INTERPRETED = implementation("embedding", "cpu", torch.float32) == "triton-interpreter"
SHAPES = [  # (B, L, d, vocabulary)
    (1, 1, 16, 37), (3, 17, 24, 37), (1, 97, 16, 1000), (1, 17, 512, 1000), (3, 1, 24, 1000),
]


def _dropout_keep_mask(tokens: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                       dropout_p: float) -> torch.Tensor:
    """The keep mask embedding(tokens, weight, positions, dropout_p=p) draws at the current RNG
    state: the op's own output for one token of ones and zero positions."""
    ones = torch.ones((1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return embedding(torch.zeros_like(tokens), ones, torch.zeros_like(positions),
                     dropout_p=dropout_p) != 0


def _inputs(B, L, d, vocab, seed=0):
    """float64 masters: tokens (B, L) with repeats, weight (vocab, d), positions (L, d)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, L), generator=g)
    tokens[0, : L // 2] = 3  # one token many times: its gradient rows add up
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) * d**-0.5
    positions = torch.randn(L, d, generator=g, dtype=torch.float64)
    return tokens, weight, positions


def _run(tokens, weight, positions, scale, dropout_p, copy_dtype, gy, gc, seed=7):
    """embedding's outputs and weight gradient for upstream gradients gy (of y) and gc (of the
    copy, if any), at torch.manual_seed(seed)."""
    weight = weight.detach().requires_grad_()
    torch.manual_seed(seed)
    out = embedding(tokens, weight, positions, scale, dropout_p, copy_dtype=copy_dtype)
    y, copy = out if copy_dtype else (out, None)
    loss = (y.double() * gy).sum()
    if copy is not None:
        loss = loss + (copy.double() * gc).sum()
    loss.backward()
    return y, copy, weight.grad


@pytest.mark.parametrize("copy_dtype", [None, torch.float16])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference_given_its_mask(shape, dropout_p, copy_dtype):
    tokens, w64, p64 = _inputs(*shape)
    scale = shape[2] ** 0.5
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(*tokens.shape, shape[2], generator=g, dtype=torch.float64) * 3
    gc = torch.randn(gy.shape, generator=g, dtype=torch.float64).half().double()  # exact in fp16
    y, copy, dw = _run(tokens, w64.float(), p64.float(), scale, dropout_p, copy_dtype, gy, gc)
    keep = None
    if dropout_p:
        torch.manual_seed(7)
        keep = _dropout_keep_mask(tokens, w64.float(), p64.float(), dropout_p)
        assert 0 < keep.float().mean() < 1 or keep.numel() < 20
    w = w64.clone().requires_grad_()
    exact = embedding_reference(tokens, w, p64, scale, keep, dropout_p)
    (exact * (gy + (gc if copy_dtype else 0))).sum().backward()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    if copy_dtype:
        assert copy.dtype == copy_dtype and torch.equal(copy, y.to(copy_dtype))
    assert dw.dtype == torch.float32
    torch.testing.assert_close(dw.double(), w.grad, rtol=1e-5, atol=1e-4)


def test_only_the_copy_used_gives_the_gradient_of_the_copy():
    tokens, w64, p64 = _inputs(3, 17, 24, 37)
    w = w64.float().requires_grad_()
    _, copy = embedding(tokens, w, p64.float(), 2.0, copy_dtype=torch.float16)
    copy.double().sum().backward()
    expected = torch.zeros_like(w64).index_add_(0, tokens.flatten(),
                                                torch.full((51, 24), 2.0, dtype=torch.float64))
    torch.testing.assert_close(w.grad.double(), expected)


def test_half_weights_promote_with_float32_positions():
    tokens, w64, p64 = _inputs(3, 17, 24, 37)
    w = w64.half().requires_grad_()
    y = embedding(tokens, w, p64.float(), 1.5)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), embedding_reference(tokens, w64.half().double(), p64,
                                                               1.5), rtol=1e-3, atol=1e-3)
    y.sum().backward()
    assert w.grad.dtype == torch.float16


def test_float64_runs_pytorch_at_float64_precision():
    tokens, w64, p64 = _inputs(3, 17, 24, 37)
    torch.testing.assert_close(embedding(tokens, w64, p64, 3.0),
                               embedding_reference(tokens, w64, p64, 3.0), rtol=0, atol=0)


def test_deterministic_and_reproducible_under_manual_seed():
    """The same seed: the same bits, forward and weight gradient (every row of a repeated token
    summed in the same order); another seed: another mask."""
    tokens, w64, p64 = _inputs(3, 17, 512, 37)
    gy = torch.randn(3, 17, 512, dtype=torch.float64)
    runs = [_run(tokens, w64.float(), p64.float(), 4.0, 0.3, torch.float16, gy, gy, seed=s)
            for s in (5, 5, 6)]
    (y, copy, dw), (y2, copy2, dw2), (y3, _, _) = runs
    assert torch.equal(y, y2) and torch.equal(copy, copy2) and torch.equal(dw, dw2)
    assert not torch.equal(y, y3)


def test_dropout_mask_statistics():
    tokens = torch.zeros(2, 16, dtype=torch.long)
    keep = _dropout_keep_mask(tokens, torch.ones(5, 512), torch.zeros(16, 512), 0.3)
    assert keep.shape == (2, 16, 512)
    assert abs(keep.float().mean().item() - 0.7) < 0.02
    assert not torch.equal(keep, _dropout_keep_mask(tokens, torch.ones(5, 512),
                                                    torch.zeros(16, 512), 0.3))


def test_positions_that_need_a_gradient_get_it():
    tokens, w64, p64 = _inputs(3, 17, 24, 37)
    w, p = w64.float().requires_grad_(), p64.float().requires_grad_()
    embedding(tokens, w, p, 2.0).sum().backward()
    torch.testing.assert_close(p.grad, torch.full((17, 24), 3.0))
    assert w.grad is not None


def test_strided_tokens_and_weight():
    tokens, w64, p64 = _inputs(3, 34, 48, 37)
    tokens, p64 = tokens[:, ::2], p64[::2, ::2]  # tokens (3, 17) and weight (37, 24) strided
    w = w64.float().requires_grad_()
    y = embedding(tokens, w[:, ::2], p64.float(), 2.0)
    y.sum().backward()
    w_exact = w64.clone().requires_grad_()
    exact = embedding_reference(tokens, w_exact[:, ::2], p64, 2.0)
    exact.sum().backward()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w_exact.grad, rtol=1e-5, atol=1e-5)


def test_no_tokens():
    y = embedding(torch.zeros(2, 0, dtype=torch.long), torch.randn(5, 8), torch.zeros(0, 8),
                  dropout_p=0.5)
    assert y.shape == (2, 0, 8)


def test_errors_name_the_problem():
    tokens, w, p = torch.zeros(2, 3, dtype=torch.long), torch.randn(5, 8), torch.randn(3, 8)
    with pytest.raises(TypeError, match="embedding: tokens has dtype float32"):
        embedding(tokens.float(), w, p)
    with pytest.raises(TypeError, match="embedding: weight has dtype int64"):
        embedding(tokens, w.long(), p)
    with pytest.raises(ValueError, match=r"positions must have shape \(3, 8\)"):
        embedding(tokens, w, torch.randn(4, 8))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        embedding(tokens, w[0], p[:, :1])
    with pytest.raises(ValueError, match="dropout_p must be in"):
        embedding(tokens, w, p, dropout_p=1.0)
    for bad in (5, -1):
        with pytest.raises(IndexError):
            embedding(torch.tensor([[0, bad, 1]]), w, p)


def test_registrations():
    tokens, w = torch.randint(0, 37, (51,)), torch.randn(37, 24, requires_grad=True)
    for copy_dtype in (None, torch.float16):
        torch.library.opcheck(
            torch.ops.fastattn.embedding_fwd.default,
            (tokens, w, torch.randn(17, 24), torch.tensor([123]), 2.0, 0.25, copy_dtype),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


def test_compiles_with_fullgraph():
    tokens, w64, p64 = _inputs(3, 17, 24, 37)
    w, p = w64.float().requires_grad_(), p64.float()
    fn = lambda w: embedding(tokens, w, p, 2.0, copy_dtype=torch.float16)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(w)
    for a, e in zip(got, fn(w), strict=True):
        torch.testing.assert_close(a, e)


# The model: fastattn.fused_model.embed is what the stacks start from on a GPU.

CFG = TransformerConfig(vocab_size=53, encoder_layers=1, decoder_layers=1, d_model=32, d_ff=48,
                        heads=4, dropout=0.0)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_model_embedding_fused_equals_the_ops_one_by_one(positions, monkeypatch):
    torch.manual_seed(0)
    model = Transformer(replace(CFG, positions=positions)).train()
    src = torch.randint(1, 53, (3, 7))
    results = []
    for fused in (False, True):  # the plain module, then fastattn.fused_model's form of it
        model.zero_grad(set_to_none=True)
        x = (fastattn.fused_model.embed(model, src, start=2).x if fused
             else model.embedding(src, start=2))
        (x * torch.linspace(-1, 1, 32)).sum().backward()
        results.append((x, [p.grad for p in model.embedding.parameters()]))
    (x, grads), (x_one, grads_one) = results
    torch.testing.assert_close(x, x_one, rtol=1e-6, atol=1e-6)
    assert len(grads) == (2 if positions == "learned" else 1)
    for grad, grad_one in zip(grads, grads_one, strict=True):
        torch.testing.assert_close(grad, grad_one, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_model_stream_carries_the_copy_post_norm_under_autocast(pre_norm, monkeypatch):
    model = Transformer(replace(CFG, dropout=0.1, pre_norm=pre_norm)).train()
    src = torch.randint(1, 53, (2, 5))
    monkeypatch.setattr(fastattn.fused_model, "PER_OP_DEVICES", ())  # a GPU's path, on the CPU
    calls = []
    fused = fastattn.fused_model.fused_embedding
    monkeypatch.setattr(fastattn.fused_model, "fused_embedding",
                        lambda *a, **k: calls.append(k["copy_dtype"]) or fused(*a, **k))
    with torch.autocast("cpu", torch.float16):
        stream = fastattn.fused_model.embed(model, src)
        model.loss(src, src[:, :-1], src[:, 1:])
    assert stream.x.dtype == torch.float32
    if pre_norm:
        assert stream.copy is None and calls == [None] * 3
    else:
        assert torch.equal(stream.copy, stream.x.half())
        assert calls == [torch.float16] * 3  # this call, then encode's and decode's
    assert fastattn.fused_model.embed(model, src).copy is None  # without autocast


@pytest.mark.skipif(not INTERPRETED, reason="the kernels themselves, under the interpreter")
def test_kernels_turn_out_of_range_ids_into_nan_rows_without_touching_memory():
    """A GPU does not range-check training's ids (a sync): the kernels read and write nothing
    out of bounds for an id outside [0, V), give it a NaN row forward and a NaN gradient (to row 0)
    backward, so the loss and the gradient norm's guard report it."""
    from fastattn.kernels import embedding as kernels

    tokens = torch.tensor([2, -1, 37, 5])
    w, p = torch.randn(37, 24), torch.randn(4, 24)
    y, _ = kernels.embedding_forward(tokens, w, p, seed=0, scale=1.0, dropout_p=0.0)
    assert y[[1, 2]].isnan().all() and torch.equal(y[[0, 3]], w[[2, 5]] + p[[0, 3]])
    dw = kernels.embedding_backward(torch.ones(4, 24), None, tokens, seed=0, num_weights=37,
                                    scale=1.0, dropout_p=0.0, dtype=torch.float32)
    assert dw[0].isnan().all() and (dw[[2, 5]] == 1).all()
    assert (dw[1:].nan_to_num(7) != 7).all() and dw[[1, 3, 4, 36]].eq(0).all()
