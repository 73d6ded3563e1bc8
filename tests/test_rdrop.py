"""fastattn.rdrop: R-Drop's chunked loss and its gradients against float64 autograd through
materialised logits, on odd shapes, across chunk boundaries, with grad_output != 1."""

import pytest
import torch
import torch.nn.functional as F

from fastattn import rdrop
from fastattn.rdrop import linear_rdrop_loss


def reference(h1, h2, weight, target, smoothing, alpha, logits_dtype=torch.float64):
    """(summed loss, summed mean NLL) by torch's cross-entropy and KL in float64, from logits
    rounded to logits_dtype."""
    z1, z2 = ((h.double() @ weight.double().T).to(logits_dtype).double() for h in (h1, h2))

    def kl(p, q):  # KL(p || q) per row
        return F.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True,
                        reduction="none").sum(-1)

    ce = sum(F.cross_entropy(z, target, label_smoothing=smoothing, reduction="none")
             for z in (z1, z2)) / 2
    nll = sum(F.cross_entropy(z, target, reduction="none") for z in (z1, z2)) / 2
    return (ce + alpha / 4 * (kl(z1, z2) + kl(z2, z1))).sum(), nll.sum()


@pytest.mark.parametrize(("n", "d", "vocab"), [(1, 8, 5), (17, 16, 97), (97, 24, 1023)])
@pytest.mark.parametrize(("smoothing", "alpha"), [(0.0, 5.0), (0.1, 5.0), (0.1, 0.0)])
@pytest.mark.parametrize("chunk_rows", [1, 7, None])
def test_matches_float64_reference(monkeypatch, n, d, vocab, smoothing, alpha, chunk_rows):
    if chunk_rows is not None:
        monkeypatch.setattr(rdrop, "CHUNK_ELEMENTS", chunk_rows * vocab)
    g = torch.Generator().manual_seed(n + vocab)
    h1, h2 = (torch.randn(n, d, generator=g, requires_grad=True) for _ in range(2))
    weight = (torch.randn(vocab, d, generator=g) / d**0.5).requires_grad_()
    target = torch.randint(0, vocab, (n,), generator=g)
    loss, nll = linear_rdrop_loss(h1, h2, weight, target, smoothing=smoothing, alpha=alpha)
    expected, expected_nll = reference(h1, h2, weight, target, smoothing, alpha)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nll.double(), expected_nll.detach(), rtol=1e-5, atol=1e-5)
    assert not nll.requires_grad
    grads = torch.autograd.grad(loss * 1.7, (h1, h2, weight))
    expected_grads = torch.autograd.grad(expected * 1.7, (h1, h2, weight))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_identical_passes_have_no_kl():
    g = torch.Generator().manual_seed(0)
    h, weight = torch.randn(9, 8, generator=g), torch.randn(31, 8, generator=g)
    target = torch.randint(0, 31, (9,), generator=g)
    with_kl, _ = linear_rdrop_loss(h, h, weight, target, smoothing=0.1, alpha=5.0)
    without, _ = linear_rdrop_loss(h, h, weight, target, smoothing=0.1, alpha=0.0)
    torch.testing.assert_close(with_kl, without)


def test_bf16_autocast_rounds_only_the_logits():
    """Under bf16 autocast the projections run in bf16, the rest in float32: the loss is the
    float64 one of the bf16-rounded logits, and the gradients keep their inputs' dtypes."""
    g = torch.Generator().manual_seed(1)
    h1, h2 = (torch.randn(13, 8, generator=g).bfloat16().requires_grad_() for _ in range(2))
    weight = torch.randn(29, 8, generator=g).requires_grad_()
    target = torch.randint(0, 29, (13,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = linear_rdrop_loss(h1, h2, weight, target, smoothing=0.1, alpha=5.0)
    loss.backward()
    assert loss.dtype == torch.float32
    assert h1.grad.dtype == h2.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    expected, _ = reference(h1, h2, weight.bfloat16(), target, 0.1, 5.0, torch.bfloat16)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    expected_grads = torch.autograd.grad(expected, (h1, h2, weight))
    for got, want in zip((h1.grad, h2.grad, weight.grad), expected_grads, strict=True):
        # bf16 gradient matmuls: within a few bf16 ulps of the magnitude
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(
            want.abs().max()))


def test_mismatched_shapes_are_a_clear_error():
    h = torch.randn(4, 8)
    with pytest.raises(ValueError, match="must both be"):
        linear_rdrop_loss(h, h[:3], torch.randn(5, 8), torch.zeros(4, dtype=torch.long),
                          smoothing=0.1, alpha=1.0)
